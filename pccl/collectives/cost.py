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
  (all_gather: ``(n-1)(a + S/B)``); broadcast, a pipelined chain of blocks ``k``:
  ``(n-1) a + (n-2) k / B + S / B``.
* halving-doubling: a sum over its rounds of the slowest pair's ``a + bytes / B``; non-powers of
  two add a fold (``S``) and an unfold round.
* tree: an up phase (reduce or gather) and a down phase (broadcast or scatter) over the binomial
  tree, each node sending to its children one after another; ``S`` larger than a block pipelines,
  limited by the busiest node's link time per byte.

:func:`choose` picks the schedule with the smallest prediction, keeping the ring unless another
schedule is faster by more than ``margin``: the ring is the schedule whose order the master
optimizes for the measured bandwidth. :func:`schedule_for` turns a requested schedule ("auto" or a
fixed one) into the one the executor runs for one operation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .schedule import KINDS, SCHEDULES, all_plans, chunk_sizes, schedule_kinds, tree_children, tree_subtree

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

DEFAULT_LATENCY = 0.5e-3
"""Seconds per dependent step when nothing better is known: a LAN's one-way latency plus the
per-frame software cost (scheduling, wake-ups)."""

DEFAULT_BANDWIDTH = 125e6
"""Bytes/s of an unmeasured link (1 Gbit/s)."""

SAME_HOST_LATENCY = 0.2e-3
"""Seconds per dependent step between peers of one host (every address in the group the same)
when nothing was measured: no wire to cross, so what a step costs is this implementation's
per-frame work and the wake-ups between the processes (measured on a 2-vCPU VM; docs/topology.md
"Peers on one host")."""

SAME_HOST_BANDWIDTH = 1e9
"""Bytes/s between peers of one host when nothing was measured: what the executor moves through
loopback TCP including its copies and reductions (the 4 MB ring all-reduce at 3 peers on that VM),
not the loopback's raw rate."""

SAME_HOST_FRAME_CPU = 60e-6
"""CPU seconds one frame costs its sender and receiver together on one host (framing, the socket
calls, the wake-ups): with more peers than cores, every frame of an operation comes out of the same
few cores, so an operation takes at least ``frames x SAME_HOST_FRAME_CPU / cores`` however its steps
overlap (calibrated on a 2-vCPU VM: four peers there ran the 6-frame tree faster than the
halving-doubling, then 24 frames (16 since a round's adjacent chunks go as one), up to 256 KB although
the latter has fewer bytes per step; docs/topology.md "Peers on one host")."""

DEFAULT_BLOCK_BYTES = 4 << 20
"""The executor's pipelining block (``pccl.collectives.ring.DEFAULT_BLOCK_BYTES``; repeated here so
this module stays free of the trio executor)."""

DEFAULT_MARGIN = 0.1
"""Another schedule replaces the ring only if its prediction is lower by more than this fraction."""

HETEROGENEOUS_RATIO = 2.0
"""Measured links whose fastest and slowest differ by more than this factor are heterogeneous:
there, operations whose ring time is mostly bandwidth keep the (optimized) ring."""

Matrix = Sequence[Sequence[float | None]]


@dataclass(frozen=True)
class LinkModel:
    """The alpha-beta parameters of the links between ranks (indices are ring positions).

    Attributes:
        latency: seconds per transfer on top of the bytes (one-way latency plus per-step
            overhead): one number for every link, or a matrix ``latency[i][j]`` (``None`` entries
            fall back to ``default_latency``).
        bandwidth: the measured bandwidth matrix ``bw[i][j]`` (bytes/s, sender ``i``), or None when
            nothing was measured; ``None`` or ``0`` entries fall back to ``default_bandwidth``.
        default_latency: see ``latency``.
        default_bandwidth: see ``bandwidth``.
        window: bytes one connection may have in flight (the TCP window), times the connections a
            transfer stripes over; a link then carries at most ``window`` per round trip
            (``min(bw, window / (2 alpha))``). None: unlimited.
        spread: fastest over slowest measured link, for a model without a ``bandwidth`` matrix
            (the master's summary, :meth:`from_summary`); see :func:`heterogeneity`.
        cores: the cores the ranks share when they all run on one host (0: not known to share
            any). With more ranks than cores, :func:`predict` adds ``frame_cpu`` per frame of the
            whole operation, divided by ``cores``.
        frame_cpu: CPU seconds per frame on a shared host (see ``cores``).
    """

    latency: float | Matrix = DEFAULT_LATENCY
    bandwidth: Matrix | None = None
    default_latency: float = DEFAULT_LATENCY
    default_bandwidth: float = DEFAULT_BANDWIDTH
    window: float | None = None
    spread: float = 1.0
    cores: int = 0
    frame_cpu: float = 0.0

    @classmethod
    def from_summary(cls, links: Sequence[float]) -> LinkModel | None:
        """The model of the master's link summary (``EstablishP2P.links``).

        Args:
            links: ``[slowest bytes/s, fastest / slowest]`` or ``[slowest bytes/s, fastest /
                slowest, slowest one-way latency in seconds]``.

        Returns:
            Every link at the slowest measured bandwidth and (when the summary has one) the slowest
            measured latency, :data:`DEFAULT_LATENCY` otherwise; the spread kept for the
            heterogeneity rule of :func:`choose`. None for an empty or malformed summary (the
            defaults then).
        """
        if len(links) not in (2, 3) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in links
        ):
            return None
        lo, spread = float(links[0]), float(links[1])
        if lo <= 0 or spread < 1:
            return None
        if len(links) == 2:
            return cls(default_bandwidth=lo, spread=spread)
        latency = float(links[2])
        if latency < 0:
            return None
        return cls(latency=latency, default_bandwidth=lo, spread=spread)

    def alpha(self, i: int, j: int) -> float:
        """Latency term of a transfer ``i -> j``, seconds."""
        if isinstance(self.latency, (int, float)):
            return float(self.latency)
        v = self.latency[i][j]
        return self.default_latency if v is None else float(v)

    def beta(self, i: int, j: int) -> float:
        """Bandwidth of ``i -> j`` in bytes/s (window-capped)."""
        bw = self.default_bandwidth
        if self.bandwidth is not None:
            v = self.bandwidth[i][j]
            if v:
                bw = float(v)
        if self.window is not None and self.window > 0:
            # at most one window in flight per round trip
            rtt = 2.0 * self.alpha(i, j)
            if rtt > 0:
                bw = min(bw, self.window / rtt)
        return bw

    def cost(self, i: int, j: int, nbytes: float) -> float:
        """Seconds for one transfer of ``nbytes`` from ``i`` to ``j``."""
        return self.alpha(i, j) + nbytes / self.beta(i, j)


@dataclass(frozen=True)
class Choice:
    """The schedule :func:`choose` picked, and every prediction it compared (seconds)."""

    schedule: str
    predictions: dict[str, float] = field(default_factory=dict)


SAME_HOST = LinkModel(
    latency=SAME_HOST_LATENCY, default_latency=SAME_HOST_LATENCY, default_bandwidth=SAME_HOST_BANDWIDTH
)
"""The model of an unmeasured group whose peers all run on one host (see
:func:`pccl.collectives.cost.schedule_for`'s callers): the LAN defaults would price every byte ten
times too high there and keep the ring where a tree or halving-doubling is faster. Without the
host's core count; :func:`same_host` adds it."""


def same_host(cores: int) -> LinkModel:
    """:data:`SAME_HOST` on a host of ``cores`` cores (``os.cpu_count()``: equal for every peer of
    the host, so their choices agree): with more peers than cores the frames' CPU is priced too
    (:data:`SAME_HOST_FRAME_CPU`).

    Raises:
        ValueError: ``cores`` < 1.
    """
    if cores < 1:
        raise ValueError(f"cores must be at least 1, got {cores}")
    return dataclasses.replace(SAME_HOST, cores=cores, frame_cpu=SAME_HOST_FRAME_CPU)


@functools.lru_cache(maxsize=256)
def frames(schedule: str, kind: str, n: int, nbytes: int, block_bytes: int = DEFAULT_BLOCK_BYTES,
           root: int = 0) -> int:
    """How many frames one operation sends, all ranks together (from the plans themselves, byte
    for element: the same chunking as any dtype's up to rounding).

    Raises:
        ValueError: bad arguments, or a kind the schedule has no plan for.
    """
    plans = all_plans(schedule, kind, n, int(nbytes), max(1, block_bytes), root)
    return sum(len(p.sends) for p in plans)


def _check(kind: str, n: int, nbytes: float) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}")
    if n < 2 or nbytes < 0:
        raise ValueError(f"bad cost arguments: n={n}, nbytes={nbytes}")


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
        kind: "all_reduce", "reduce_scatter", "all_gather" or "broadcast".
        n: world size (>= 2).
        nbytes: bytes of each rank's input (all_gather: per rank; the output is ``n`` times that).
        links: the link parameters (default: :class:`LinkModel` defaults everywhere).
        block_bytes: the executor's pipelining block.
        root: broadcast only: the root's ring position.

    Returns:
        Seconds; ``inf`` if the schedule has no plan for ``kind``.

    Raises:
        ValueError: bad arguments or an unknown schedule.
    """
    _check(kind, n, nbytes)
    if kind not in schedule_kinds(schedule):
        return math.inf
    lm = links or LinkModel()
    if schedule == "ring":
        t = _ring(kind, n, nbytes, lm, block_bytes, root)
    elif schedule == "hd":
        t = _hd(kind, n, nbytes, lm)
    else:
        t = _tree(kind, n, nbytes, lm, block_bytes, root)
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
        root: broadcast only: the root's ring position.

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


def heterogeneity(links: LinkModel, n: int) -> float:
    """Fastest over slowest measured link among ranks ``0..n-1`` (``links.spread`` without a matrix:
    1.0 when nothing is measured)."""
    if links.bandwidth is None:
        return links.spread
    vals = [float(v) for i in range(n) for j in range(n) if i != j and (v := links.bandwidth[i][j])]
    return max(vals) / min(vals) if vals else 1.0


# ------------------------------------------------------------------------------------------------
# ring


def _ring(kind: str, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
    edges = [(i, (i + 1) % n) for i in range(n)]
    a = max(lm.alpha(i, j) for i, j in edges)
    spb = max(1.0 / lm.beta(i, j) for i, j in edges)  # seconds per byte of the bottleneck
    if kind == "all_reduce":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * s * spb
    if kind == "reduce_scatter":
        return (n - 1) * a + (n - 1) / n * s * spb
    if kind == "all_gather":
        return (n - 1) * (a + s * spb)
    # broadcast: a chain from root, pipelined in blocks; the chain does not use the edge into root
    chain = [((root + k) % n, (root + k + 1) % n) for k in range(n - 1)]
    a = max(lm.alpha(i, j) for i, j in chain)
    spb = max(1.0 / lm.beta(i, j) for i, j in chain)
    k = min(s, float(block_bytes))
    return (n - 1) * a + (n - 2) * k * spb + s * spb


# ------------------------------------------------------------------------------------------------
# halving-doubling


def _hd(kind: str, n: int, s: float, lm: LinkModel) -> float:
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    rounds = p.bit_length() - 1
    if kind == "all_reduce":
        vsize = [s * c for c in _fractions(p)]
    else:
        real = [s * c for c in _fractions(n)] if kind == "reduce_scatter" else [s] * n
        vsize = [real[v] + (real[p + v] if v < extra else 0.0) for v in range(p)]
    total = 0.0
    if extra:  # fold: the extra ranks hand in their input
        total += max(lm.cost(p + i, i, s) for i in range(extra))

    def round_time(d: int, first: Callable[[int], int]) -> float:
        """The slowest pair of a round: rank v sends virtual chunks first(v) .. first(v)+d-1."""
        return max(lm.cost(v, v ^ d, sum(vsize[first(v) : first(v) + d])) for v in range(p))

    if kind != "all_gather":
        for k in range(rounds):  # halving: give away the half without this rank's own chunk
            d = p >> (k + 1)
            total += round_time(d, functools.partial(_give_first, d))
    if kind != "reduce_scatter":
        for k in range(rounds):  # doubling: send the owned block
            d = 1 << k
            total += round_time(d, functools.partial(_owned_first, d))
    if extra:
        if kind == "all_reduce":
            back = s
        elif kind == "reduce_scatter":
            back = max(s * c for c in _fractions(n)[p:])
        else:
            back = (n - 1) * s
        total += max(lm.cost(i, p + i, back) for i in range(extra))
    return total


def _give_first(d: int, v: int) -> int:
    """Halving round at distance d: the first virtual chunk rank v gives away."""
    return (v & ~(2 * d - 1)) + (0 if v & d else d)


def _owned_first(d: int, v: int) -> int:
    """Doubling round at distance d: the first virtual chunk of rank v's block."""
    return v & ~(d - 1)


def _fractions(n: int) -> list[float]:
    """Each ring chunk's share of the buffer (the plans' ``chunk_range`` layout, at large counts)."""
    sizes = chunk_sizes(1 << 20, n)
    return [c / (1 << 20) for c in sizes]


# ------------------------------------------------------------------------------------------------
# tree


def _tree(kind: str, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
    shift = root if kind == "broadcast" else 0

    def rank(v: int) -> int:
        return (v + shift) % n

    k = min(s, float(block_bytes))
    if kind == "broadcast":
        return _down(n, lm, rank, lambda c: k) + _steady(n, lm, rank, s - k, down=True, up=False)
    if kind == "all_reduce":
        # blocks go down while later blocks still go up: a node's interface carries both
        steady = _steady(n, lm, rank, s - k, down=True, up=True)
        return _up(n, lm, rank, lambda c: k) + _down(n, lm, rank, lambda c: k) + steady
    frac = _fractions(n)
    if kind == "reduce_scatter":
        up = _up(n, lm, rank, lambda c: k) + _steady(n, lm, rank, s - k, down=False, up=True)

        def share(c: int) -> float:
            first, end = tree_subtree(c, n)
            return s * sum(frac[first:end])

        return up + _down(n, lm, rank, share)

    def below(c: int) -> float:
        first, end = tree_subtree(c, n)
        return s * (end - first)

    return _up(n, lm, rank, below) + _down(n, lm, rank, lambda c: s * n - below(c))


def _up(n: int, lm: LinkModel, rank: Callable[[int], int], size: Callable[[int], float]) -> float:
    """Time until the root has everything: each node waits for its children (received one after
    another on its link), then sends ``size(node)`` bytes to its parent."""
    ready = [0.0] * n
    for v in range(n - 1, -1, -1):
        kids = tree_children(v, n)
        if not kids:
            continue
        arrive = max(ready[c] + lm.alpha(rank(c), rank(v)) for c in kids)
        ready[v] = arrive + sum(size(c) / lm.beta(rank(c), rank(v)) for c in kids)
    return ready[0]


def _down(n: int, lm: LinkModel, rank: Callable[[int], int], size: Callable[[int], float]) -> float:
    """Time until the last node has its part: each node sends ``size(child)`` bytes to its
    children one after another, biggest subtree first."""
    have = [0.0] * n
    for v in range(n):
        t = have[v]
        for c in reversed(tree_children(v, n)):
            t += size(c) / lm.beta(rank(v), rank(c))
            have[c] = t + lm.alpha(rank(v), rank(c))
    return max(have)


def _steady(
    n: int, lm: LinkModel, rank: Callable[[int], int], rest: float, *, down: bool, up: bool
) -> float:
    """Extra time for ``rest`` bytes beyond the first block once the tree pipeline is full: the
    busiest interface's time per byte. In the down phase a node sends every block to each child
    and receives it from its parent; in the up phase it receives from each child and sends to its
    parent; egress and ingress are separate (full duplex)."""
    if rest <= 0:
        return 0.0
    busiest = 0.0
    for v in range(n):
        kids = tree_children(v, n)
        parent = v - (v & -v) if v else None
        egress = ingress = 0.0
        if down:
            egress += sum(1.0 / lm.beta(rank(v), rank(c)) for c in kids)
            if parent is not None:
                ingress += 1.0 / lm.beta(rank(parent), rank(v))
        if up:
            ingress += sum(1.0 / lm.beta(rank(c), rank(v)) for c in kids)
            if parent is not None:
                egress += 1.0 / lm.beta(rank(v), rank(parent))
        busiest = max(busiest, egress, ingress)
    return rest * busiest


# ------------------------------------------------------------------------------------------------
# the schedule of one live operation

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
    * a fixed request runs as asked, except a halving-doubling broadcast, which runs the tree
      (halving-doubling has nothing to halve in a broadcast);
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
        root: broadcast only: the root's ring position.

    Returns:
        "ring", "hd" or "tree".

    Raises:
        ValueError: an unknown request or kind, or bad sizes.
    """
    if requested not in SCHEDULE_REQUESTS:
        raise ValueError(f"unknown schedule {requested!r} (expected one of {', '.join(SCHEDULE_REQUESTS)})")
    _check(kind, n, nbytes)
    if quantized:
        return "ring"
    if requested != "auto":
        return "tree" if requested == "hd" and kind == "broadcast" else requested
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
