"""Collective schedules: which elements each rank sends and receives, step by step (pure: no trio,
no I/O). The ring, recursive halving-doubling and binomial trees, all described in one plan
vocabulary (:class:`Plan`, in :mod:`pccl.collectives.plan`, re-exported here). Each kind of
:mod:`pccl.collectives.kinds` builds its own plans; this module is where they are asked for
(:func:`all_plans`, :func:`plan_ring`, :func:`cached_plan`), cached, and where the connections a
peer opens ahead of its collectives are named (:func:`send_partners`).

Chunks (docs/protocol.md section 4): for world size ``n`` and ``count`` elements, chunk ``c`` holds
``count // n`` elements plus one if ``c < count % n``; chunks are contiguous and in order, and
may be empty.

Ring all-reduce over ranks ``0..n-1`` (rank ``r`` sends to ``r+1`` and receives from ``r-1``,
mod n) runs ``2(n-1)`` steps. At step ``t`` rank ``r`` sends chunk ``(r - t - 1) mod n`` and
receives chunk ``(r - t - 2) mod n``, so the chunk it sends at step ``t+1`` is exactly the chunk
it received (and, in the reduce-scatter half, reduced) at step ``t``:

* steps ``0 .. n-2`` (reduce-scatter): the received partial is combined with this rank's own
  contribution; after step ``n-2`` rank ``r`` holds the full reduction of chunk ``r``
  (so reduce-scatter leaves chunk ``r`` on rank ``r``).
* steps ``n-1 .. 2n-3`` (all-gather): chunk owners' final bits travel around the ring unchanged,
  which is why every peer ends with identical bits.

All-gather (``count`` elements per rank, output ``n * count``, slot ``i`` = rank ``i``'s input)
runs ``n-1`` steps: at step ``t`` rank ``r`` sends slot ``(r - t) mod n`` (step 0: its own input)
and receives slot ``(r - t - 1) mod n``.

Broadcast from ring index ``root`` is a pipelined chain ``root -> root+1 -> ... -> root-1``; reduce to
``root`` the chain ``root+1 -> ... -> root``; all-to-all the ring-ordered pairwise exchange (each
kind's module says more).

Every chunk is cut into blocks of at most ``block_elems`` elements so that reduction of one block
overlaps the arrival of the next, and so that a large operation can stripe its blocks over
several connections. Frames are numbered (``seq``) in the order the sender's plan lists them;
the receiver's plan lists the same frames in the same order, so ``seq`` matches on both sides
without any negotiation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .kinds import KINDS, Kind, get_kind
from .kinds.all_gather import ring_steps as _all_gather_steps
from .kinds.all_reduce import ring_steps as _all_reduce_steps
from .kinds.reduce_scatter import ring_steps as _reduce_scatter_steps
from .plan import (
    SCHEDULES,
    SRC_OUT,
    SRC_SEND,
    Plan,
    RecvFrame,
    SendFrame,
    Step,
    block_ranges,
    check_plan_arguments,
    chunk_bounds,
    chunk_range,
    chunk_sizes,
    plan_exchange,
    tree_children,
    tree_subtree,
)

_RING_STEPS = {"all_reduce": _all_reduce_steps, "reduce_scatter": _reduce_scatter_steps,
               "all_gather": _all_gather_steps}


def ring_steps(kind: str, n: int, rank: int) -> list[Step]:
    """The ring steps of ``kind`` ("all_reduce", "reduce_scatter" or "all_gather") for ``rank``: the
    chunk-stepping kinds (the others' ring plans are chains or exchanges, not steps of chunks).

    Raises:
        ValueError: unknown kind, ``n < 2`` or rank out of range.
    """
    if n < 2 or not 0 <= rank < n:
        raise ValueError(f"bad ring: n={n}, rank={rank}")
    steps = _RING_STEPS.get(kind)
    if steps is None:
        raise ValueError(f"no ring steps for kind {kind!r}")
    return steps(n, rank)


def output_count(kind: str | Kind, n: int, count: int) -> int:
    """Elements of the output array for an input of ``count`` elements."""
    return get_kind(kind).output_count(n, count)


def plan_ring(kind: str | Kind, n: int, rank: int, count: int, block_elems: int, root: int = 0) -> Plan:
    """Build ``rank``'s ring plan for one operation.

    Args:
        kind: a kind of :mod:`pccl.collectives.kinds` (or its name).
        n: world size (>= 2).
        rank: this rank's index in the ring.
        count: elements of the input array (all_gather: per rank).
        block_elems: largest block, in elements (>= 1).
        root: rooted kinds (broadcast, reduce) only: ring index of the root.

    Returns:
        The plan.

    Raises:
        ValueError: bad arguments.
    """
    k = get_kind(kind)
    check_plan_arguments(n, rank, count, block_elems)
    return k.ring_plan(n, rank, count, block_elems, root)


_PLAN_CACHE: OrderedDict[tuple[str, int, int, int, int, int], Plan] = OrderedDict()
_PLAN_CACHE_SIZE = 256
_PLAN_CACHE_MAX_FRAMES = 4096


def cached_plan(
    kind: str | Kind, n: int, rank: int, count: int, block_elems: int, root: int = 0, *,
    exchange: bool = False,
) -> Plan:
    """:func:`plan_ring` (or, with ``exchange``, :func:`plan_exchange`: all_reduce, ``n == 2``)
    behind a small LRU cache (training loops repeat the same shapes).

    Plans with many frames are not cached, so the cache stays small.

    Raises:
        ValueError: bad arguments.
    """
    k = get_kind(kind)
    if exchange and (not k.exchange or n != 2):
        raise ValueError(f"the exchange plan is for all_reduce between 2 ranks, not {k.name} with {n}")
    name = "exchange" if exchange else k.name
    key = (name, n, rank, count, block_elems, root if k.rooted else 0)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        _PLAN_CACHE.move_to_end(key)
        return plan
    if exchange:
        plan = plan_exchange(rank, count, block_elems)
    else:
        plan = plan_ring(k, n, rank, count, block_elems, root)
    if len(plan.sends) + len(plan.recvs) <= _PLAN_CACHE_MAX_FRAMES:
        _PLAN_CACHE[key] = plan
        while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    return plan


def successor(ring: Sequence[int], index: int) -> int:
    """The peer after ``ring[index]``."""
    return ring[(index + 1) % len(ring)]


def predecessor(ring: Sequence[int], index: int) -> int:
    """The peer before ``ring[index]``."""
    return ring[(index - 1) % len(ring)]


def schedule_kinds(schedule: str) -> tuple[str, ...]:
    """The operation kinds ``schedule`` has plans for (halving-doubling has no broadcast or reduce:
    a rooted operation has nothing to halve, the tree is its latency-optimal schedule; all-to-all
    has its one plan, counted as the ring's)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (expected one of {SCHEDULES})")
    return tuple(name for name in KINDS if schedule in get_kind(name).schedules)


_ALL_PLANS_CACHE: OrderedDict[tuple[str, str, int, int, int, int], tuple[Plan, ...]] = OrderedDict()
_ALL_PLANS_CACHE_SIZE = 64
_ALL_PLANS_CACHE_MAX_FRAMES = 1 << 16  # over all ranks: bigger sets are rebuilt, not kept


def all_plans(
    schedule: str, kind: str | Kind, n: int, count: int, block_elems: int, root: int = 0
) -> tuple[Plan, ...]:
    """Every rank's plan of one operation under ``schedule`` (index = rank = ring index).

    Args:
        schedule: "ring", "hd" (recursive halving-doubling) or "tree" (binomial tree).
        kind: a kind (or its name) with plans under ``schedule`` (see :func:`schedule_kinds`).
        n: world size (>= 2).
        count: elements of the input array (all_gather: per rank).
        block_elems: largest frame, in elements (>= 1).
        root: rooted kinds only: the rank at the root.

    Returns:
        ``n`` plans; rank ``r`` executes ``plans[r]``. Cached (small LRU; sets of more than 65536
        frames are not kept): plans are frozen, the tuple is shared.

    Raises:
        ValueError: bad arguments, or a kind the schedule has no plan for.
    """
    k = get_kind(kind)
    schedule_kinds(schedule)  # checks the name
    if schedule not in k.schedules:
        raise ValueError(f"schedule {schedule!r} has no plan for {k.name!r}")
    if n < 2 or count < 0 or block_elems < 1:
        raise ValueError(f"bad plan arguments: n={n} count={count} block_elems={block_elems}")
    key = (schedule, k.name, n, count, block_elems, root if k.rooted else 0)
    got = _ALL_PLANS_CACHE.get(key)
    if got is not None:
        _ALL_PLANS_CACHE.move_to_end(key)
        return got
    plans = k.plans(schedule, n, count, block_elems, root)
    if sum(len(p.sends) + len(p.recvs) for p in plans) <= _ALL_PLANS_CACHE_MAX_FRAMES:
        _ALL_PLANS_CACHE[key] = plans
    while len(_ALL_PLANS_CACHE) > _ALL_PLANS_CACHE_SIZE:
        _ALL_PLANS_CACHE.popitem(last=False)
    return plans


def send_partners(n: int, rank: int, schedules: Sequence[str] = SCHEDULES) -> list[int]:
    """Every rank that ``rank`` may send to under ``schedules``, whatever the kind, size or root:
    the ring successor; halving-doubling's ``rank ^ 2**k`` partners and fold partner; and, for the
    tree, ``rank +- 2**k (mod n)`` (a node's parent and children for any broadcast root: node
    ``v = rank - root`` has parent ``v - lowbit(v)`` and children ``v + 2**j``). A superset is
    fine: these are the connections a peer opens ahead of its collectives (an all-to-all, which
    sends to every rank, opens the others on first use).

    Returns:
        The ranks, sorted, without ``rank``.

    Raises:
        ValueError: ``n < 2``, ``rank`` out of range or an unknown schedule.
    """
    if n < 2 or not 0 <= rank < n:
        raise ValueError(f"bad ring: n={n}, rank={rank}")
    out = set()
    for schedule in schedules:
        schedule_kinds(schedule)  # checks the name
        if schedule == "ring":
            out.add((rank + 1) % n)
        elif schedule == "hd":
            p = 1 << (n.bit_length() - 1)
            if rank >= p:
                out.add(rank - p)
            else:
                out.update(rank ^ (1 << k) for k in range(p.bit_length() - 1))
                if rank < n - p:
                    out.add(rank + p)
        else:
            for k in range(max(1, (n - 1).bit_length())):
                out.update(((rank + (1 << k)) % n, (rank - (1 << k)) % n))
    out.discard(rank)
    return sorted(out)


def plan_schedule(
    schedule: str, kind: str, n: int, rank: int, count: int, block_elems: int, root: int = 0
) -> Plan:
    """Rank ``rank``'s plan under ``schedule`` (see :func:`all_plans`).

    Raises:
        ValueError: bad arguments.
    """
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} out of range for n={n}")
    return all_plans(schedule, kind, n, count, block_elems, root)[rank]


__all__ = [
    "KINDS", "SCHEDULES", "SRC_OUT", "SRC_SEND", "Plan", "RecvFrame", "SendFrame", "Step", "all_plans",
    "block_ranges", "cached_plan", "chunk_bounds", "chunk_range", "chunk_sizes", "output_count",
    "plan_exchange", "plan_ring", "plan_schedule", "predecessor", "ring_steps", "schedule_kinds",
    "send_partners", "successor", "tree_children", "tree_subtree",
]
