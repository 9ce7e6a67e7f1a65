"""Which schedule to run: an alpha-beta cost model of the ring, halving-doubling and tree plans
(pure: no trio, no I/O, no clock).

Every transfer of ``b`` bytes from rank ``i`` to rank ``j`` costs ``alpha(i, j) + b / beta(i, j)``:
``alpha`` is the one-way latency plus a per-step overhead, ``beta`` the link's bandwidth as the
master measured it (``bw[i][j]``, bytes/s, rows = senders, indices = ring positions), capped by
what one TCP window can carry per round trip. Unmeasured links (``None`` or ``0``) get
``default_bandwidth``. Ranks are ring positions: the ring's edges are ``(i, i + 1)``, so the
ring's cost uses the bottleneck of the (optimized) ring order, while halving-doubling and trees
use the links between the rank pairs they exchange over.

Formulas (``S`` bytes per rank's input, ``n`` ranks, ``p`` the largest power of two ``<= n``,
``D`` the binomial tree's depth, ``a``/``B`` the latency / bandwidth of the links involved;
see docs/topology.md for the derivation and when each wins):

* ring all_reduce: ``2(n-1) a + 2(n-1)/n S / B_ring``; reduce_scatter and all_gather half of that
  (all_gather: ``(n-1)(a + S/B)``); broadcast and reduce, a pipelined chain of blocks ``k``:
  ``(n-1) a + (n-2) k / B + S / B``; all_to_all, the busiest sender's ``a + (n-1) S/n / B``.
* halving-doubling: a sum over its rounds of the slowest pair's ``a + bytes / B``; non-powers of
  two add a fold (``S``) and an unfold round.
Each kind's formulas live in its module of :mod:`pccl.collectives.kinds` (this module asks the kind).

* tree: an up phase (reduce or gather) and a down phase (broadcast or scatter) over the binomial
  tree, each node sending to its children one after another; ``S`` larger than a block pipelines,
  limited by the busiest node's link time per byte.

:func:`choose` picks the schedule with the smallest prediction, keeping the ring unless another
schedule is faster by more than ``margin``: the ring is the schedule whose order the master
optimizes for the measured bandwidth. :func:`schedule_for` turns a requested schedule ("auto" or a
fixed one) into the one the executor runs for one operation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .kinds import Kind, get_kind
from .linkmodel import (
    DEFAULT_BANDWIDTH,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_LATENCY,
    DEFAULT_MARGIN,
    HETEROGENEOUS_RATIO,
    SAME_HOST,
    SAME_HOST_BANDWIDTH,
    SAME_HOST_FRAME_CPU,
    SAME_HOST_LATENCY,
    LinkModel,
    heterogeneity,
    same_host,
)
from .schedule import SCHEDULES, all_plans

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_LATENCY",
    "DEFAULT_MARGIN",
    "HETEROGENEOUS_RATIO",
    "SAME_HOST",
    "SAME_HOST_BANDWIDTH",
    "SAME_HOST_FRAME_CPU",
    "SAME_HOST_LATENCY",
    "SCHEDULE_REQUESTS",
    "Choice",
    "LinkModel",
    "choose",
    "frames",
    "heterogeneity",
    "predict",
    "same_host",
    "schedule_for",
]


@dataclass(frozen=True)
class Choice:
    """The schedule :func:`choose` picked, and every prediction it compared (seconds)."""

    schedule: str
    predictions: dict[str, float] = field(default_factory=dict)


@functools.lru_cache(maxsize=256)
def frames(schedule: str, kind: str, n: int, nbytes: int, block_bytes: int = DEFAULT_BLOCK_BYTES,
           root: int = 0) -> int:
    """How many frames one operation sends, all ranks together (from the plans themselves, byte
    for element: the same chunking as any dtype's up to rounding).

    Raises:
        ValueError: bad arguments, or a kind the schedule has no plan for.
    """
    count = get_kind(kind).plannable_count(n, int(nbytes))
    plans = all_plans(schedule, kind, n, count, max(1, block_bytes), root)
    return sum(len(p.sends) for p in plans)


def _check(kind: str, n: int, nbytes: float) -> Kind:
    k = get_kind(kind)
    if n < 2 or nbytes < 0:
        raise ValueError(f"bad cost arguments: n={n}, nbytes={nbytes}")
    return k


def predict(
    schedule: str,
    kind: str,
    n: int,
    nbytes: float,
    links: LinkModel | None = None,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    root: int = 0,
) -> float:
    """Predicted seconds of one operation's data plane (no control-plane round trips).

    Args:
        schedule: "ring", "hd" or "tree".
        kind: a kind of :mod:`pccl.collectives.kinds` by name.
        n: world size (>= 2).
        nbytes: bytes of each rank's input (all_gather: per rank; the output is ``n`` times that).
        links: the link parameters (default: :class:`LinkModel` defaults everywhere).
        block_bytes: the executor's pipelining block.
        root: rooted kinds (broadcast, reduce) only: the root's ring position.

    Returns:
        Seconds; ``inf`` if the schedule has no plan for ``kind``.

    Raises:
        ValueError: bad arguments or an unknown schedule.
    """
    k = _check(kind, n, nbytes)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (expected one of {SCHEDULES})")
    if schedule not in k.schedules:
        return math.inf
    lm = links or LinkModel()
    t = k.cost(schedule, n, nbytes, lm, block_bytes, root)
    if 0 < lm.cores < n and lm.frame_cpu > 0:
        # more ranks than cores on one host: every frame's CPU comes out of the same cores
        t += lm.frame_cpu * frames(schedule, kind, n, int(nbytes), block_bytes, root) / lm.cores
    return t


def choose(
    kind: str,
    n: int,
    nbytes: float,
    links: LinkModel | None = None,
    *,
    schedules: Sequence[str] = SCHEDULES,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    margin: float = DEFAULT_MARGIN,
    root: int = 0,
) -> Choice:
    """The schedule to run for one operation.

    The ring (when it is among ``schedules``) is kept

    * when the measured links are heterogeneous (fastest / slowest > :data:`HETEROGENEOUS_RATIO`)
      and the ring's predicted time is mostly bandwidth (its bandwidth term at least its latency
      term): the ring's order is the one the master optimizes around slow links, and pairwise
      measurements cannot see a bottleneck that many of the other schedules' simultaneous
      transfers share (one WAN pipe between two sites);
    * unless another schedule's prediction is below ``(1 - margin)`` times the ring's.

    Otherwise the lowest prediction wins (ties: the order of ``schedules``).

    Args:
        kind: the operation kind.
        n: world size (>= 2).
        nbytes: bytes of each rank's input.
        links: the link parameters.
        schedules: the candidates.
        block_bytes: the executor's pipelining block.
        margin: how much faster than the ring another schedule must be predicted to be.
        root: rooted kinds (broadcast, reduce) only: the root's ring position.

    Returns:
        The choice, with every candidate's prediction.

    Raises:
        ValueError: bad arguments, no candidate, or an unknown schedule.
    """
    if not schedules:
        raise ValueError("no schedule to choose from")
    preds = {s: predict(s, kind, n, nbytes, links, block_bytes=block_bytes, root=root) for s in schedules}
    best = min(schedules, key=lambda s: preds[s])
    if "ring" in preds and best != "ring":
        lm = links or LinkModel()
        latency_part = predict("ring", kind, n, 0, lm, block_bytes=block_bytes, root=root)
        bandwidth_bound = preds["ring"] - latency_part >= latency_part
        if (heterogeneity(lm, n) > HETEROGENEOUS_RATIO and bandwidth_bound) or not (
            preds[best] < (1.0 - margin) * preds["ring"]
        ):
            best = "ring"
    return Choice(best, preds)


SCHEDULE_REQUESTS = ("auto", *SCHEDULES)
"""What a peer may ask for (``PeerConfig.schedule``): "auto" (the cost model's choice) or one schedule."""


def schedule_for(
    requested: str,
    kind: str,
    n: int,
    nbytes: int,
    *,
    quantized: bool = False,
    links: LinkModel | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    root: int = 0,
) -> str:
    """The schedule one operation runs: the same on every participant as long as the arguments are.

    Pass only data identical on every participant (the descriptor's kind, size and dtype, the
    group size, a link model the master distributed), never a local measurement: peers that chose
    differently would wait for frames that never come.

    * quantized operations run the ring (its forwarding rule keeps the quantized bits identical);
    * a fixed request runs as asked, except where the kind has no plan under it
      (:meth:`Kind.run_schedule <pccl.collectives.kinds.base.Kind.run_schedule>`: a halving-doubling
      broadcast or reduce runs the tree, an all-to-all always its one plan);
    * "auto" keeps the ring (with its one-step exchange) between two peers, and otherwise takes
      :func:`choose`'s pick.

    Args:
        requested: "auto", "ring", "hd" or "tree".
        kind: the operation kind.
        n: the group size (>= 2).
        nbytes: bytes of each rank's input.
        quantized: whether the operation is quantized.
        links: the link model (None: :class:`LinkModel` defaults).
        block_bytes: the executor's pipelining block.
        root: rooted kinds (broadcast, reduce) only: the root's ring position.

    Returns:
        "ring", "hd" or "tree".

    Raises:
        ValueError: an unknown request or kind, or bad sizes.
    """
    if requested not in SCHEDULE_REQUESTS:
        raise ValueError(f"unknown schedule {requested!r} (expected one of {', '.join(SCHEDULE_REQUESTS)})")
    k = _check(kind, n, nbytes)
    if quantized:
        return "ring"
    if requested != "auto":
        return k.run_schedule(requested)
    if n == 2:
        return "ring"
    if links is None or (links.bandwidth is None and isinstance(links.latency, (int, float))):
        return _auto(kind, n, nbytes, block_bytes, root, links)
    return choose(kind, n, nbytes, links, block_bytes=block_bytes, root=root).schedule


@functools.lru_cache(maxsize=1024)
def _auto(kind: str, n: int, nbytes: int, block_bytes: int, root: int, links: LinkModel | None) -> str:
    """:func:`choose` under a model without matrices (hashable; cached: training loops repeat
    their shapes)."""
    return choose(kind, n, nbytes, links, block_bytes=block_bytes, root=root).schedule
