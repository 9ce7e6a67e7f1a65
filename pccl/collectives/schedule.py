"""Ring schedules: which elements each rank sends and receives, step by step (pure: no trio, no I/O).

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

Broadcast from ring index ``root`` is a pipelined chain ``root -> root+1 -> ... -> root-1``.

Every chunk is cut into blocks of at most ``block_elems`` elements so that reduction of one block
overlaps the arrival of the next, and so that a large operation can stripe its blocks over
several connections. Frames are numbered (``seq``) in the order the sender's plan lists them;
the receiver's plan lists the same frames in the same order, so ``seq`` matches on both sides
without any negotiation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")

# Where a send frame reads its bytes from.
SRC_SEND = 0  # the caller's input array
SRC_OUT = 1  # the output array (partial sums, received data being forwarded)


def chunk_sizes(count: int, n: int) -> list[int]:
    """Element count of each of the ``n`` chunks of a ``count``-element buffer."""
    if n < 1 or count < 0:
        raise ValueError(f"bad chunking: count={count}, n={n}")
    q, rem = divmod(count, n)
    return [q + (1 if c < rem else 0) for c in range(n)]


def chunk_range(count: int, n: int, c: int) -> tuple[int, int]:
    """``(start, end)`` element offsets of chunk ``c`` (``0 <= c < n``)."""
    if not 0 <= c < n or count < 0:
        raise ValueError(f"chunk {c} out of range for n={n} (count={count})")
    q, rem = divmod(count, n)
    start = c * q + min(c, rem)
    return start, start + q + (1 if c < rem else 0)


def chunk_bounds(count: int, n: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every chunk, in order (``chunk_bounds(count, n)[r]`` is rank r's)."""
    return [chunk_range(count, n, c) for c in range(n)]


@dataclass(frozen=True, slots=True)
class Step:
    """One ring step for one rank: the chunk it sends, the chunk it receives, and whether the
    received data is reduced with the rank's own contribution (reduce-scatter steps)."""

    send_chunk: int
    recv_chunk: int
    reduce: bool


def ring_steps(kind: str, n: int, rank: int) -> list[Step]:
    """The ring steps of ``kind`` ("all_reduce", "reduce_scatter" or "all_gather") for ``rank``.

    Raises:
        ValueError: unknown kind, ``n < 2`` or rank out of range.
    """
    if n < 2 or not 0 <= rank < n:
        raise ValueError(f"bad ring: n={n}, rank={rank}")
    if kind == "all_reduce":
        return [Step((rank - t - 1) % n, (rank - t - 2) % n, t <= n - 2) for t in range(2 * (n - 1))]
    if kind == "reduce_scatter":
        return [Step((rank - t - 1) % n, (rank - t - 2) % n, True) for t in range(n - 1)]
    if kind == "all_gather":
        return [Step((rank - t) % n, (rank - t - 1) % n, False) for t in range(n - 1)]
    raise ValueError(f"no ring steps for kind {kind!r}")


def block_ranges(start: int, end: int, block_elems: int) -> list[tuple[int, int]]:
    """Cut ``[start, end)`` into consecutive blocks of at most ``block_elems`` (none if empty)."""
    if block_elems < 1:
        raise ValueError("block_elems must be >= 1")
    return [(s, min(end, s + block_elems)) for s in range(start, end, block_elems)]


@dataclass(frozen=True, slots=True)
class SendFrame:
    """One frame this rank sends to its ring successor.

    Attributes:
        seq: frame number within the operation (matches the successor's RecvFrame.seq).
        source: SRC_SEND or SRC_OUT.
        start: first element in ``source``.
        end: one past the last element.
        after: index into ``Plan.recvs`` of the receive that must complete (and be reduced)
            before this frame may be sent; -1 if it can be sent at once.
        lane: which of the pool's connections to prefer, before adding the tag (blocks of one
            step take consecutive lanes so large operations stripe over every connection).
        step: the ring step (0-based) the frame belongs to; when several frames are ready on one
            connection, earlier steps go first (then ``seq`` order), so the all-gather never
            overtakes the reduce-scatter and leaves the link idle at the end of the operation.
    """

    seq: int
    source: int
    start: int
    end: int
    after: int
    lane: int
    step: int = 0


@dataclass(frozen=True, slots=True)
class RecvFrame:
    """One frame this rank receives from its ring predecessor, straight into ``out[start:end]``.

    Attributes:
        seq: frame number within the operation.
        start: first element in the output array.
        end: one past the last element.
        reduce: combine ``out[start:end]`` with this rank's input over the same range afterwards.
        to_scratch: land in a scratch buffer instead; afterwards ``out[start:end] =
            op(out[start:end], received)`` (``out`` holds this rank's input there: the plan's
            ``local_copy``). The exchange plan uses it so both ranks compute ``op(x0, x1)``.
    """

    seq: int
    start: int
    end: int
    reduce: bool
    to_scratch: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one rank does in one operation.

    Attributes:
        sends: frames to send to the successor, in ``seq`` order.
        recvs: frames to receive from the predecessor, in ``seq`` order (also the order in which
            they are awaited).
        local_copy: ``(src_start, src_end, out_start)``: elements of the input copied into the
            output before the ring starts, or None.
        owned: ``(start, end)`` of the output range that is meaningful for reduce_scatter (the
            whole output for the other kinds).
        initial: indices into ``sends`` of the frames that can go at once, in order.
        unlocks: for each receive, the indices of the sends it releases.
        send_elems: elements sent in total.
        recv_elems: elements received in total.
    """

    sends: tuple[SendFrame, ...]
    recvs: tuple[RecvFrame, ...]
    local_copy: tuple[int, int, int] | None
    owned: tuple[int, int]
    initial: tuple[int, ...] = ()
    unlocks: tuple[tuple[int, ...], ...] = ()
    send_elems: int = 0
    recv_elems: int = 0


def _finish(sends: list[SendFrame], recvs: list[RecvFrame], local_copy: tuple[int, int, int] | None,
            owned: tuple[int, int]) -> Plan:
    initial: list[int] = []
    unlocks: list[list[int]] = [[] for _ in recvs]
    for i, f in enumerate(sends):
        if f.after < 0:
            initial.append(i)
        else:
            unlocks[f.after].append(i)
    return Plan(
        tuple(sends),
        tuple(recvs),
        local_copy,
        owned,
        tuple(initial),
        tuple(tuple(u) for u in unlocks),
        sum(f.end - f.start for f in sends),
        sum(f.end - f.start for f in recvs),
    )


def output_count(kind: str, n: int, count: int) -> int:
    """Elements of the output array for an input of ``count`` elements."""
    return n * count if kind == "all_gather" else count


def plan_ring(kind: str, n: int, rank: int, count: int, block_elems: int, root: int = 0) -> Plan:
    """Build ``rank``'s plan for one operation.

    Args:
        kind: "all_reduce", "reduce_scatter", "all_gather" or "broadcast".
        n: world size (>= 2).
        rank: this rank's index in the ring.
        count: elements of the input array (all_gather: per rank).
        block_elems: largest block, in elements (>= 1).
        root: broadcast only: ring index of the rank whose input everyone receives.

    Returns:
        The plan.

    Raises:
        ValueError: bad arguments.
    """
    if n < 2 or not 0 <= rank < n or count < 0 or block_elems < 1:
        raise ValueError(f"bad plan arguments: n={n} rank={rank} count={count} block_elems={block_elems}")
    if kind == "broadcast":
        return _plan_broadcast(n, rank, count, block_elems, root)
    steps = ring_steps(kind, n, rank)
    if kind == "all_gather":
        bounds = [(c * count, (c + 1) * count) for c in range(n)]
    else:
        bounds = chunk_bounds(count, n)
    sends: list[SendFrame] = []
    recvs: list[RecvFrame] = []
    # blocks received at the previous step, in order: the next step sends exactly these.
    prev_recv_idx: list[int] = []
    for t, step in enumerate(steps):
        s0, s1 = bounds[step.send_chunk]
        send_blocks = block_ranges(s0, s1, block_elems)
        for b, (a, e) in enumerate(send_blocks):
            if t == 0:
                if kind == "all_gather":
                    # step 0 sends this rank's own input, read from the input array (offsets 0..count)
                    sends.append(SendFrame(len(sends), SRC_SEND, a - s0, e - s0, -1, b, t))
                else:
                    sends.append(SendFrame(len(sends), SRC_SEND, a, e, -1, b, t))
            else:
                sends.append(SendFrame(len(sends), SRC_OUT, a, e, prev_recv_idx[b], b, t))
        r0, r1 = bounds[step.recv_chunk]
        prev_recv_idx = []
        for a, e in block_ranges(r0, r1, block_elems):
            prev_recv_idx.append(len(recvs))
            recvs.append(RecvFrame(len(recvs), a, e, step.reduce))
    if kind == "all_gather":
        local_copy: tuple[int, int, int] | None = (0, count, rank * count) if count else None
        owned = (0, n * count)
    elif kind == "reduce_scatter":
        local_copy = None
        # n >= 2 means at least one reduce step, whose last receive + reduce writes chunk ``rank``
        owned = bounds[rank]
    else:
        local_copy = None
        owned = (0, count)
    return _finish(sends, recvs, local_copy, owned)


def plan_exchange(rank: int, count: int, block_elems: int) -> Plan:
    """All-reduce between two ranks in one step: each sends its whole input to the other and
    reduces the two inputs itself, instead of the ring's two dependent steps (reduce-scatter, then
    all-gather) of half the input each. The same bytes cross the wire, but a small operation waits
    for one arrival instead of two; each rank reduces the whole buffer instead of half, so it is
    only worth it for small buffers (see ``ring.EXCHANGE_MAX_BYTES``).

    Both ranks compute ``op(x0, x1)`` with rank 0's input as the first operand - rank 1 reduces
    the received ``x0`` with its own input as usual, rank 0 starts from a copy of its input and
    reduces the received ``x1`` into it - so the results are bit-identical even where ``op`` is
    not bitwise commutative (NaN payloads, MIN/MAX of -0.0 and 0.0).

    Raises:
        ValueError: bad arguments.
    """
    if rank not in (0, 1) or count < 0 or block_elems < 1:
        raise ValueError(f"bad exchange plan: rank={rank} count={count} block_elems={block_elems}")
    blocks = block_ranges(0, count, block_elems)
    sends = [SendFrame(i, SRC_SEND, a, e, -1, i) for i, (a, e) in enumerate(blocks)]
    recvs = [RecvFrame(i, a, e, True, to_scratch=rank == 0) for i, (a, e) in enumerate(blocks)]
    local_copy = (0, count, 0) if rank == 0 and count else None
    return _finish(sends, recvs, local_copy, (0, count))


def _plan_broadcast(n: int, rank: int, count: int, block_elems: int, root: int) -> Plan:
    if not 0 <= root < n:
        raise ValueError(f"broadcast root {root} out of range for n={n}")
    pos = (rank - root) % n  # distance from the root along the ring
    blocks = block_ranges(0, count, block_elems)
    sends: list[SendFrame] = []
    recvs: list[RecvFrame] = []
    if pos == 0:
        sends = [SendFrame(i, SRC_SEND, a, e, -1, i) for i, (a, e) in enumerate(blocks)]
        return _finish(sends, [], (0, count, 0) if count else None, (0, count))
    recvs = [RecvFrame(i, a, e, False) for i, (a, e) in enumerate(blocks)]
    if pos < n - 1:
        # forward each block as soon as it has arrived: the chain is pipelined block by block
        sends = [SendFrame(i, SRC_OUT, a, e, i, i, 1) for i, (a, e) in enumerate(blocks)]
    return _finish(sends, recvs, None, (0, count))


_PLAN_CACHE: OrderedDict[tuple[str, int, int, int, int, int], Plan] = OrderedDict()
_PLAN_CACHE_SIZE = 256
_PLAN_CACHE_MAX_FRAMES = 4096


def cached_plan(
    kind: str, n: int, rank: int, count: int, block_elems: int, root: int = 0, *, exchange: bool = False
) -> Plan:
    """:func:`plan_ring` (or, with ``exchange``, :func:`plan_exchange`: all_reduce, ``n == 2``)
    behind a small LRU cache (training loops repeat the same shapes).

    Plans with many frames are not cached, so the cache stays small.

    Raises:
        ValueError: bad arguments.
    """
    if exchange and (kind != "all_reduce" or n != 2):
        raise ValueError(f"the exchange plan is for all_reduce between 2 ranks, not {kind} with {n}")
    name = "exchange" if exchange else kind
    key = (name, n, rank, count, block_elems, root if kind == "broadcast" else 0)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        _PLAN_CACHE.move_to_end(key)
        return plan
    if exchange:
        plan = plan_exchange(rank, count, block_elems)
    else:
        plan = plan_ring(kind, n, rank, count, block_elems, root)
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
