"""The alpha-beta model of the links between ranks (pure: no trio, no I/O, no clock), and the time
primitives the kinds of :mod:`pccl.collectives.kinds` price their schedules with (a ring chain's
bottleneck, halving-doubling rounds, the binomial tree's up, down and steady phases).
:mod:`pccl.collectives.cost` predicts and chooses with them; its docstring has the formulas.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .plan import chunk_sizes, tree_children

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

def heterogeneity(links: LinkModel, n: int) -> float:
    """Fastest over slowest measured link among ranks ``0..n-1`` (``links.spread`` without a matrix:
    1.0 when nothing is measured)."""
    if links.bandwidth is None:
        return links.spread
    vals = [float(v) for i in range(n) for j in range(n) if i != j and (v := links.bandwidth[i][j])]
    return max(vals) / min(vals) if vals else 1.0



def chain_time(lm: LinkModel, edges: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """``(latency, seconds per byte)`` of the slowest of ``edges`` (a ring's or a chain's links)."""
    return max(lm.alpha(i, j) for i, j in edges), max(1.0 / lm.beta(i, j) for i, j in edges)


def pipelined_chain_cost(lm: LinkModel, n: int, first: int, s: float, block_bytes: int) -> float:
    """Time of ``s`` bytes pipelined in blocks of ``block_bytes`` down the chain of ``n`` ranks
    ``first -> first+1 -> ... `` (mod n): n - 1 hops paid once, then the blocks at the slowest edge's rate."""
    a, spb = chain_time(lm, [((first + k) % n, (first + k + 1) % n) for k in range(n - 1)])
    k = min(s, float(block_bytes))
    return (n - 1) * a + (n - 2) * k * spb + s * spb


def hd_time(n: int, s: float, lm: LinkModel, vsize: Sequence[float], *, halving: bool, doubling: bool,
            back: float) -> float:
    """Halving-doubling over ``n`` ranks: the fold (``s`` bytes from each extra rank), ``halving``
    and/or ``doubling`` rounds over the ``p`` virtual chunks of ``vsize`` bytes, and the unfold
    (``back`` bytes to each extra rank). Each round costs its slowest pair."""
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    rounds = p.bit_length() - 1
    total = 0.0
    if extra:  # fold: the extra ranks hand in their input
        total += max(lm.cost(p + i, i, s) for i in range(extra))

    def round_time(d: int, first: Callable[[int], int]) -> float:
        """The slowest pair of a round: rank v sends virtual chunks first(v) .. first(v)+d-1."""
        return max(lm.cost(v, v ^ d, sum(vsize[first(v) : first(v) + d])) for v in range(p))

    if halving:
        for k in range(rounds):  # halving: give away the half without this rank's own chunk
            d = p >> (k + 1)
            total += round_time(d, functools.partial(_give_first, d))
    if doubling:
        for k in range(rounds):  # doubling: send the owned block
            d = 1 << k
            total += round_time(d, functools.partial(_owned_first, d))
    if extra:
        total += max(lm.cost(i, p + i, back) for i in range(extra))
    return total


def hd_folded(n: int, real: Sequence[float]) -> list[float]:
    """Virtual chunk sizes when rank ``p + v``'s part joins rank ``v``'s (``real``: per rank)."""
    p = 1 << (n.bit_length() - 1)
    return [real[v] + (real[p + v] if v < n - p else 0.0) for v in range(p)]

def _give_first(d: int, v: int) -> int:
    """Halving round at distance d: the first virtual chunk rank v gives away."""
    return (v & ~(2 * d - 1)) + (0 if v & d else d)


def _owned_first(d: int, v: int) -> int:
    """Doubling round at distance d: the first virtual chunk of rank v's block."""
    return v & ~(d - 1)


def fractions(n: int) -> list[float]:
    """Each ring chunk's share of the buffer (the plans' ``chunk_range`` layout, at large counts)."""
    sizes = chunk_sizes(1 << 20, n)
    return [c / (1 << 20) for c in sizes]


def tree_up(n: int, lm: LinkModel, rank: Callable[[int], int], size: Callable[[int], float]) -> float:
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


def tree_down(n: int, lm: LinkModel, rank: Callable[[int], int], size: Callable[[int], float]) -> float:
    """Time until the last node has its part: each node sends ``size(child)`` bytes to its
    children one after another, biggest subtree first."""
    have = [0.0] * n
    for v in range(n):
        t = have[v]
        for c in reversed(tree_children(v, n)):
            t += size(c) / lm.beta(rank(v), rank(c))
            have[c] = t + lm.alpha(rank(v), rank(c))
    return max(have)


def tree_steady(
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

