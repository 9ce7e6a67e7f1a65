"""Ring topology solver: the ring order that makes ring all-reduce fastest (pure, no I/O).

The master measures an asymmetric bandwidth matrix ``bw[i][j]`` (bytes/s from peer ``i`` to
peer ``j``; ``0`` or ``None`` means unreachable or unmeasured) and asks this module for a ring.

Cost model (see ``docs/topology.md``): a ring all-reduce of ``S`` bytes over ``n`` peers pushes
``2(n-1)/n * S`` bytes across *every* ring edge in lock-step, so its time is set by the slowest edge::

    T ~= 2(n-1)/n * S / min_edge_bw  (+ 2(n-1) * per-step latency)

The objective is therefore lexicographic:

1. maximize the bottleneck (the minimum edge bandwidth of the ring): bottleneck ATSP;
2. among rings whose bottleneck is within ``tolerance`` of the best one (``>= B * (1 - tolerance)``),
   minimize ``sum(1 / bw)`` over the ring edges (total transfer time per byte, a proxy for headroom
   and latency).

Small worlds (``n <= exact_limit``) are solved exactly with two Held-Karp bitmask dynamic programs
(a max-min one for the bottleneck, then a min-sum one restricted to edges ``>= B * (1 - tolerance)``),
vectorized with numpy. Larger worlds use an iterated local search (nearest-neighbour construction,
asymmetric 2-opt and or-opt descent, double-bridge kicks) that first raises the bottleneck by a
binary search over the distinct bandwidth values and then minimizes the cost. A polynomial upper
bound on the bottleneck (perfect matching plus strong connectivity of the thresholded graph) tells
how far from optimal the heuristic can be.

No trio, no sockets, no clock of its own: time is only read through the ``clock`` callable the
caller passes (the master server passes ``time.perf_counter``).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import InvalidArgumentError, TopologyOptimizationFailedError

__all__ = [
    "DEFAULT_TOLERANCE",
    "MAX_EXACT_LIMIT",
    "NoRingError",
    "RingSolution",
    "improve_ring",
    "predicted_allreduce_time",
    "ring_bottleneck",
    "ring_cost",
    "solve_ring",
]

DEFAULT_TOLERANCE = 0.02
"""Rings whose bottleneck is within 2% of the best are considered tied (measurement noise is larger)."""

MAX_EXACT_LIMIT = 18
"""Largest world solved exactly: the DP holds ``2^(n-1) * (n-1)`` floats plus per-layer temporaries
(n = 18: ~18 MB + ~60 MB, ~3 s on a 2-core machine; n = 16: ~0.2-0.4 s; n = 12: ~10 ms)."""

# Fraction of the heuristic's budget spent raising the bottleneck; the rest lowers the cost.
_PHASE_A_SHARE = 0.6
# Fraction of solve_ring's budget the exact search may use before the heuristic takes over.
_EXACT_SHARE = 0.5


class NoRingError(TopologyOptimizationFailedError):
    """No ring through every peer exists using reachable links only.

    Attributes:
        isolated: peers without a reachable in-link or without a reachable out-link (indices into
            the matrix). They can be in no ring and should be removed; removing them is necessary
            but may not be sufficient (see ``components``).
        components: the strongly connected components of the reachable-link graph, largest first
            (each sorted). A ring can only exist inside one component, so when there are several the
            master may keep the largest. A single component means the graph is strongly connected
            but has no ring through everyone (or, for the heuristic, none was found).
    """

    def __init__(
        self,
        message: str,
        *,
        isolated: Sequence[int] = (),
        components: Sequence[Sequence[int]] = (),
    ) -> None:
        super().__init__(message)
        self.isolated: list[int] = list(isolated)
        self.components: list[list[int]] = [list(c) for c in components]


@dataclass(frozen=True)
class RingSolution:
    """A ring order and its quality.

    Attributes:
        order: the ring as a permutation of ``range(n)`` rotated to start at peer 0; peer
            ``order[k]`` sends to ``order[(k + 1) % n]``.
        bottleneck: the slowest edge bandwidth of the ring (``inf`` for ``n == 1``).
        cost: ``sum(1 / bw)`` over the ring edges (``0.0`` for ``n == 1``).
        exact: True when the ring is proven optimal for the objective (see module docstring).
        bottleneck_bound: an upper bound on the best achievable bottleneck (the optimum itself
            when the bottleneck was solved exactly); ``bottleneck / bottleneck_bound`` bounds the gap.
    """

    order: list[int]
    bottleneck: float
    cost: float
    exact: bool
    bottleneck_bound: float = math.inf


# --------------------------------------------------------------------------------------------------
# Validation and evaluation helpers


def _matrix(bw: Sequence[Sequence[float | None]]) -> list[list[float]]:
    """Copy ``bw`` to a square list-of-lists of floats, unreachable (and diagonal) as 0.0."""
    try:
        n = len(bw)
    except TypeError as exc:
        raise InvalidArgumentError("bw must be a square matrix (sequence of rows)") from exc
    if n == 0:
        raise InvalidArgumentError("bw must have at least one row")
    rows: list[list[float]] = []
    for i, row in enumerate(bw):
        try:
            if len(row) != n:
                raise InvalidArgumentError(f"bw must be square: row {i} has {len(row)} entries, expected {n}")
        except TypeError as exc:
            raise InvalidArgumentError(f"bw row {i} is not a sequence") from exc
        out: list[float] = []
        for j, x in enumerate(row):
            if i == j or x is None:
                # The diagonal is meaningless (a peer never sends to itself on the ring).
                out.append(0.0)
                continue
            try:
                v = float(x)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"bw[{i}][{j}] is not a number: {x!r}") from exc
            if not math.isfinite(v) or v < 0.0:
                raise InvalidArgumentError(f"bw[{i}][{j}] must be finite and >= 0, got {v!r}")
            out.append(v)
        rows.append(out)
    return rows


def _check_order(order: Sequence[int], n: int) -> list[int]:
    try:
        ring = [int(x) for x in order]
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"order must be a sequence of ints, got {order!r}") from exc
    if sorted(ring) != list(range(n)):
        raise InvalidArgumentError(f"order must be a permutation of range({n}), got {ring!r}")
    return ring


def _check_budget(time_budget: float, tolerance: float) -> None:
    if not (isinstance(time_budget, int | float) and math.isfinite(time_budget) and time_budget >= 0):
        raise InvalidArgumentError(f"time_budget must be a finite number >= 0, got {time_budget!r}")
    if not (isinstance(tolerance, int | float) and 0.0 <= tolerance < 1.0):
        raise InvalidArgumentError(f"tolerance must be in [0, 1), got {tolerance!r}")


def _bottleneck(t: Sequence[int], w: list[list[float]]) -> float:
    n = len(t)
    if n < 2:
        return math.inf
    return min(w[t[k]][t[(k + 1) % n]] for k in range(n))


def _cost(t: Sequence[int], w: list[list[float]]) -> float:
    n = len(t)
    total = 0.0
    for k in range(n if n >= 2 else 0):
        x = w[t[k]][t[(k + 1) % n]]
        if x <= 0.0:
            return math.inf
        total += 1.0 / x
    return total


def _rotate_to_zero(t: list[int]) -> list[int]:
    k = t.index(0)
    return t[k:] + t[:k]


def _solution(t: list[int], w: list[list[float]], exact: bool, bound: float) -> RingSolution:
    order = _rotate_to_zero(list(t))
    return RingSolution(
        order=order,
        bottleneck=_bottleneck(order, w),
        cost=_cost(order, w),
        exact=exact,
        bottleneck_bound=bound,
    )


def ring_bottleneck(order: Sequence[int], bw: Sequence[Sequence[float | None]]) -> float:
    """The slowest edge bandwidth of a ring.

    Args:
        order: a permutation of ``range(len(bw))``; ``order[k]`` sends to ``order[k + 1]`` (cyclic).
        bw: bandwidth matrix in bytes/s; ``0``/``None`` is unreachable.

    Returns:
        ``min(bw[a][b])`` over the ring edges; ``0.0`` if the ring uses an unreachable edge and
        ``inf`` for a single peer.

    Raises:
        InvalidArgumentError: ``bw`` is not a valid matrix or ``order`` is not a permutation.
    """
    w = _matrix(bw)
    return _bottleneck(_check_order(order, len(w)), w)


def ring_cost(order: Sequence[int], bw: Sequence[Sequence[float | None]]) -> float:
    """The secondary objective of a ring: ``sum(1 / bw)`` over its edges (seconds per byte).

    Args:
        order: a permutation of ``range(len(bw))``.
        bw: bandwidth matrix in bytes/s; ``0``/``None`` is unreachable.

    Returns:
        The sum, ``inf`` if the ring uses an unreachable edge, ``0.0`` for a single peer.

    Raises:
        InvalidArgumentError: ``bw`` is not a valid matrix or ``order`` is not a permutation.
    """
    w = _matrix(bw)
    return _cost(_check_order(order, len(w)), w)


def predicted_allreduce_time(
    order: Sequence[int],
    bw: Sequence[Sequence[float | None]],
    nbytes: float,
    *,
    latency: float = 0.0,
) -> float:
    """Predicted wall time of a ring all-reduce of ``nbytes`` bytes over ``order``.

    ``T = 2(n-1)/n * nbytes / bottleneck + 2(n-1) * latency``: each of the ``2(n-1)`` lock-step
    steps moves ``nbytes / n`` over every edge at once, so every step waits for the slowest edge.

    Args:
        order: a permutation of ``range(len(bw))``.
        bw: bandwidth matrix in bytes/s; ``0``/``None`` is unreachable.
        nbytes: size of the reduced buffer in bytes.
        latency: per-step fixed cost in seconds (round trip / scheduling), 0 by default.

    Returns:
        Seconds; ``0.0`` for a single peer, ``inf`` if the ring uses an unreachable edge.

    Raises:
        InvalidArgumentError: bad matrix, order, ``nbytes < 0`` or ``latency < 0``.
    """
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise InvalidArgumentError(f"nbytes must be finite and >= 0, got {nbytes!r}")
    if not (math.isfinite(latency) and latency >= 0):
        raise InvalidArgumentError(f"latency must be finite and >= 0, got {latency!r}")
    w = _matrix(bw)
    ring = _check_order(order, len(w))
    n = len(ring)
    if n < 2:
        return 0.0
    b = _bottleneck(ring, w)
    if b <= 0.0:
        return math.inf
    steps = 2 * (n - 1)
    return steps / n * nbytes / b + steps * latency


# --------------------------------------------------------------------------------------------------
# Feasibility diagnosis (proofs that no ring exists)


def _sccs(w: list[list[float]]) -> list[list[int]]:
    """Strongly connected components of the reachable-edge graph (iterative Kosaraju)."""
    n = len(w)
    adj = [[j for j in range(n) if w[i][j] > 0.0] for i in range(n)]
    radj: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for j in adj[i]:
            radj[j].append(i)
    seen = [False] * n
    finish: list[int] = []
    for root in range(n):
        if seen[root]:
            continue
        seen[root] = True
        stack: list[tuple[int, int]] = [(root, 0)]
        while stack:
            v, k = stack[-1]
            if k < len(adj[v]):
                stack[-1] = (v, k + 1)
                u = adj[v][k]
                if not seen[u]:
                    seen[u] = True
                    stack.append((u, 0))
            else:
                stack.pop()
                finish.append(v)
    comp = [-1] * n
    comps: list[list[int]] = []
    for root in reversed(finish):
        if comp[root] >= 0:
            continue
        cid = len(comps)
        members = [root]
        comp[root] = cid
        todo = [root]
        while todo:
            v = todo.pop()
            for u in radj[v]:
                if comp[u] < 0:
                    comp[u] = cid
                    members.append(u)
                    todo.append(u)
        comps.append(sorted(members))
    comps.sort(key=lambda c: (-len(c), c[0]))
    return comps


def _isolated(w: list[list[float]]) -> list[int]:
    """Peers without a reachable out-link or without a reachable in-link: they can be in no ring."""
    n = len(w)
    return [
        v
        for v in range(n)
        if not any(w[v][u] > 0.0 for u in range(n)) or not any(w[u][v] > 0.0 for u in range(n))
    ]


def _diagnose(w: list[list[float]]) -> None:
    """Raise NoRingError when the reachable-edge graph provably has no ring through every peer."""
    n = len(w)
    comps = _sccs(w)
    if len(comps) == 1:
        return
    isolated = _isolated(w)
    raise NoRingError(
        f"no ring through all {n} peers over reachable links: the link graph has {len(comps)} strongly "
        f"connected components {comps}; peers without a reachable in- or out-link: {isolated}",
        isolated=isolated,
        components=comps,
    )


# --------------------------------------------------------------------------------------------------
# Exact solver: Held-Karp over subsets, vectorized per subset size


class _BudgetExceeded(Exception):
    """Internal: the exact search ran out of time; carries what it already knows."""

    def __init__(self, tour: list[int] | None, bottleneck: float | None) -> None:
        super().__init__("exact search exceeded its time budget")
        self.tour = tour
        self.bottleneck = bottleneck


def _layers(m: int) -> list[np.ndarray]:
    """Subset masks over ``m`` bits, grouped by popcount (index = popcount)."""
    masks = np.arange(1 << m, dtype=np.int64)
    pc = np.zeros(1 << m, dtype=np.int64)
    for b in range(m):
        pc += (masks >> b) & 1
    order = np.argsort(pc, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(pc, minlength=m + 1))))
    return [order[bounds[k] : bounds[k + 1]] for k in range(m + 1)]


def _reconstruct(par: np.ndarray, full: int, last: int) -> list[int]:
    path = [last]
    mask, u = full, last
    while mask & (mask - 1):
        v = int(par[mask, u])
        mask ^= 1 << u
        u = v
        path.append(u)
    path.reverse()
    return [0] + [x + 1 for x in path]


def _held_karp(
    weight: np.ndarray,
    *,
    maximize_min: bool,
    layers: list[np.ndarray],
    check_time: Callable[[], None],
) -> tuple[float, list[int] | None]:
    """One Held-Karp DP over tours starting and ending at vertex 0.

    With ``maximize_min`` the path value is the min edge weight and tours maximize it (0 = no
    path); otherwise the value is the sum and tours minimize it (inf = no path).

    Returns:
        (best value, tour) with tour None when no tour exists.
    """
    n = weight.shape[0]
    m = n - 1
    size = 1 << m
    bits = np.left_shift(np.int64(1), np.arange(m, dtype=np.int64))
    neutral = 0.0 if maximize_min else math.inf
    # dp[mask, u]: best path 0 -> (vertices of mask) ending at u+1; neutral when u is not in mask,
    # which also makes the "u not in mask" lanes of the vectorized update harmless.
    dp = np.full((size, m), neutral)
    par = np.zeros((size, m), dtype=np.int8)
    dp[bits, np.arange(m)] = weight[0, 1:]
    wt = weight[1:, 1:].T  # wt[u, v] = weight(v+1 -> u+1)
    for k in range(2, m + 1):
        check_time()
        layer = layers[k]
        prev = layer[:, None] ^ bits[None, :]  # mask without u (or with u, for u not in mask)
        if maximize_min:
            cand = np.minimum(dp[prev], wt[None, :, :])
            arg = cand.argmax(axis=2)
        else:
            cand = dp[prev] + wt[None, :, :]
            arg = cand.argmin(axis=2)
        best = np.take_along_axis(cand, arg[..., None], axis=2)[..., 0]
        inmask = (layer[:, None] & bits[None, :]) != 0
        dp[layer] = np.where(inmask, best, neutral)
        par[layer] = arg
    full = size - 1
    if maximize_min:
        closing = np.minimum(dp[full], weight[1:, 0])
        last = int(closing.argmax())
        value = float(closing[last])
        ok = value > 0.0
    else:
        closing = dp[full] + weight[1:, 0]
        last = int(closing.argmin())
        value = float(closing[last])
        ok = math.isfinite(value)
    if not ok:
        return value, None
    return value, _reconstruct(par, full, last)


def _exact(
    w: list[list[float]],
    tolerance: float,
    floor: float,
    check_time: Callable[[], None],
) -> tuple[list[int], float]:
    """Optimal ring: max bottleneck B, then min cost over edges >= max(B*(1-tol), floor).

    Returns:
        (tour, B).

    Raises:
        NoRingError: no ring over reachable edges exists (proven).
        _BudgetExceeded: ``check_time`` raised it; carries the bottleneck-optimal tour if known.
    """
    n = len(w)
    wa = np.array(w, dtype=np.float64)
    layers = _layers(n - 1)
    best_b, tour_b = _held_karp(wa, maximize_min=True, layers=layers, check_time=check_time)
    if tour_b is None:
        raise NoRingError(
            f"no ring through all {n} peers over reachable links exists (exact search)",
            isolated=[],
            components=[list(range(n))],
        )
    threshold = max(best_b * (1.0 - tolerance), floor)
    with np.errstate(divide="ignore"):
        cost = np.where((wa >= threshold) & (wa > 0.0), 1.0 / np.where(wa > 0.0, wa, 1.0), math.inf)

    def check_time_b() -> None:
        try:
            check_time()
        except _BudgetExceeded as exc:
            raise _BudgetExceeded(tour_b, best_b) from exc

    _, tour = _held_karp(cost, maximize_min=False, layers=layers, check_time=check_time_b)
    # tour_b itself is admissible, so a min-cost tour always exists here.
    assert tour is not None
    return tour, best_b


def _enumerate_small(w: list[list[float]], tolerance: float, floor: float) -> tuple[list[int], float]:
    """n <= 3 by enumeration (at most two rings)."""
    n = len(w)
    tours = [[0, 1]] if n == 2 else [[0, 1, 2], [0, 2, 1]]
    best_b = max(_bottleneck(t, w) for t in tours)
    if best_b <= 0.0:
        raise NoRingError(
            f"no ring through all {n} peers over reachable links exists",
            isolated=[],
            components=[list(range(n))],
        )
    threshold = max(best_b * (1.0 - tolerance), floor)
    ok = [t for t in tours if _bottleneck(t, w) >= threshold]
    return min(ok, key=lambda t: _cost(t, w)), best_b


# --------------------------------------------------------------------------------------------------
# Upper bound on the bottleneck (polynomial relaxation)


def _cycle_cover_exists(w: list[list[float]], threshold: float) -> bool:
    """Every ring is a strongly connected cycle cover, so both are necessary for bottleneck >= threshold."""
    n = len(w)
    adj = [[j for j in range(n) if w[i][j] >= threshold and w[i][j] > 0.0] for i in range(n)]
    if any(not a for a in adj):
        return False
    radj: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for j in adj[i]:
            radj[j].append(i)
    if any(not r for r in radj):
        return False
    for graph in (adj, radj):
        seen = [False] * n
        seen[0] = True
        todo = [0]
        while todo:
            v = todo.pop()
            for u in graph[v]:
                if not seen[u]:
                    seen[u] = True
                    todo.append(u)
        if not all(seen):
            return False
    # Perfect bipartite matching out-side -> in-side (a cycle cover), greedy start + BFS augmentation.
    match_l = [-1] * n
    match_r = [-1] * n
    for i in range(n):
        for j in adj[i]:
            if match_r[j] < 0:
                match_r[j] = i
                match_l[i] = j
                break
    for root in range(n):
        if match_l[root] >= 0:
            continue
        reached_from = [-1] * n
        queue = [root]
        found = -1
        qi = 0
        while qi < len(queue) and found < 0:
            left = queue[qi]
            qi += 1
            for j in adj[left]:
                if reached_from[j] >= 0:
                    continue
                reached_from[j] = left
                if match_r[j] < 0:
                    found = j
                    break
                queue.append(match_r[j])
        if found < 0:
            return False
        j = found
        while j >= 0:
            left = reached_from[j]
            nxt = match_l[left]
            match_l[left] = j
            match_r[j] = left
            j = nxt
    return True


def _bottleneck_upper_bound(w: list[list[float]], vals: list[float]) -> float:
    """Largest threshold whose thresholded graph still has a strongly connected cycle cover."""
    lo, hi = 0, len(vals) - 1
    if not _cycle_cover_exists(w, vals[0]):
        return vals[0]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _cycle_cover_exists(w, vals[mid]):
            lo = mid
        else:
            hi = mid - 1
    return vals[lo]


# --------------------------------------------------------------------------------------------------
# Heuristic: iterated local search on (penalty, cost)


class _Search:
    """Local search over tours (lists of peers, cyclic), minimizing (penalty, cost) lexicographically.

    ``penalty`` counts edges below the current target bandwidth (unreachable edges weigh ``n + 1``,
    more than all merely-slow edges together, so they go first); ``cost`` is ``sum(1/bw)``.
    """

    def __init__(self, w: list[list[float]], rng: random.Random, clock: Callable[[], float]) -> None:
        self.w = w
        self.n = len(w)
        self.rng = rng
        self.clock = clock
        # Unreachable edges get cost 0: the penalty already dominates them, and a finite value keeps
        # the prefix sums exact.
        self.c = [[(1.0 / x if x > 0.0 else 0.0) for x in row] for row in w]
        self.ct = [list(col) for col in zip(*self.c, strict=True)]
        self.p: list[list[int]] = []
        self.pt: list[list[int]] = []

    def set_target(self, threshold: float) -> None:
        big = self.n + 1
        self.p = [
            [(0 if x >= threshold and x > 0.0 else (1 if x > 0.0 else big)) for x in row] for row in self.w
        ]
        for i in range(self.n):
            self.p[i][i] = big
        self.pt = [list(col) for col in zip(*self.p, strict=True)]

    def evaluate(self, t: list[int]) -> tuple[int, float]:
        n = len(t)
        p, c = self.p, self.c
        pen = 0
        cost = 0.0
        for k in range(n):
            a, b = t[k], t[(k + 1) % n]
            pen += p[a][b]
            cost += c[a][b]
        return pen, cost

    @staticmethod
    def better(a: tuple[int, float], b: tuple[int, float]) -> bool:
        return a[0] < b[0] or (a[0] == b[0] and a[1] < b[1] - 1e-9 * abs(b[1]))

    # -- neighbourhoods --------------------------------------------------------------------------

    def _two_opt(self, t: list[int], deadline: float | None) -> bool:
        """Asymmetric 2-opt: reversing t[i+1..j] also reverses every edge inside the segment.

        Prefix sums of forward and backward edge weights along the tour make each move O(1).
        """
        n = len(t)
        p, c = self.p, self.c
        improved = False
        i = 0
        while i < n - 2:
            if deadline is not None and self.clock() > deadline:
                break
            fp = [0] * (n + 1)
            rp = [0] * (n + 1)
            fc = [0.0] * (n + 1)
            rc = [0.0] * (n + 1)
            for k in range(n):
                a, b = t[k], t[(k + 1) % n]
                fp[k + 1] = fp[k] + p[a][b]
                rp[k + 1] = rp[k] + p[b][a]
                fc[k + 1] = fc[k] + c[a][b]
                rc[k + 1] = rc[k] + c[b][a]
            eps = 1e-9 * fc[n]
            moved = False
            while i < n - 2 and not moved:
                a, b = t[i], t[i + 1]
                pa, pb, ca, cb = p[a], p[b], c[a], c[b]
                base_p = -pa[b] + fp[i + 1] - rp[i + 1]
                base_c = -ca[b] + fc[i + 1] - rc[i + 1]
                for j in range(i + 2, n):
                    x = t[j]
                    d = t[j + 1] if j + 1 < n else t[0]
                    dpen = base_p + pa[x] + pb[d] - p[x][d] + rp[j] - fp[j]
                    if dpen > 0:
                        continue
                    if dpen == 0:
                        dcost = base_c + ca[x] + cb[d] - c[x][d] + rc[j] - fc[j]
                        if dcost >= -eps:
                            continue
                    t[i + 1 : j + 1] = t[i + 1 : j + 1][::-1]
                    moved = improved = True
                    break
                if not moved:
                    i += 1
        return improved

    def _or_opt(self, t: list[int], deadline: float | None) -> bool:
        """Move a segment of 1-3 peers elsewhere, forwards or reversed."""
        n = len(t)
        p, c, pt, ct = self.p, self.c, self.pt, self.ct
        # Costs only decrease during a descent, so one tolerance per call is enough to ignore
        # rounding noise (it stops cycling between equal-cost tours).
        eps = 1e-9 * sum(c[t[k]][t[(k + 1) % n]] for k in range(n))
        improved = False
        s = 0
        while s < n:
            if deadline is not None and self.clock() > deadline:
                break
            moved = False
            for seg_len in (1, 2, 3):
                if n - seg_len < 2:
                    break
                # View the tour rotated so that the segment is u[0:seg_len]; prev = u[-1].
                u = t[s:] + t[:s]
                first, last, prev, nxt = u[0], u[seg_len - 1], u[-1], u[seg_len]
                rem_p = p[prev][nxt] - p[prev][first] - p[last][nxt]
                rem_c = c[prev][nxt] - c[prev][first] - c[last][nxt]
                rev_p = 0
                rev_c = 0.0
                for k in range(seg_len - 1):
                    a, b = u[k], u[k + 1]
                    rev_p += p[b][a] - p[a][b]
                    rev_c += c[b][a] - c[a][b]
                to_first_p, to_first_c = pt[first], ct[first]
                from_last_p, from_last_c = p[last], c[last]
                to_last_p, to_last_c = pt[last], ct[last]
                from_first_p, from_first_c = p[first], c[first]
                for j in range(seg_len, n - 1):
                    x, y = u[j], u[j + 1]
                    base_p = rem_p - p[x][y]
                    base_c = rem_c - c[x][y]
                    # Forward insertion: x -> first ... last -> y.
                    dpen = base_p + to_first_p[x] + from_last_p[y]
                    reverse = False
                    if dpen > 0 or (dpen == 0 and base_c + to_first_c[x] + from_last_c[y] >= -eps):
                        if seg_len == 1:
                            continue
                        # Reversed insertion: x -> last ... first -> y, inner edges flipped.
                        dpen = base_p + to_last_p[x] + from_first_p[y] + rev_p
                        if dpen > 0 or (
                            dpen == 0 and base_c + to_last_c[x] + from_first_c[y] + rev_c >= -eps
                        ):
                            continue
                        reverse = True
                    seg = u[:seg_len]
                    if reverse:
                        seg.reverse()
                    t[:] = u[seg_len : j + 1] + seg + u[j + 1 :]
                    moved = improved = True
                    break
                if moved:
                    break
            if not moved:
                s += 1
        return improved

    def descend(self, t: list[int], deadline: float | None, stop_at_zero: bool) -> None:
        """Run both neighbourhoods to a joint local optimum (or the deadline)."""
        while True:
            if stop_at_zero and self.evaluate(t)[0] == 0:
                return
            a = self._two_opt(t, deadline)
            b = self._or_opt(t, deadline)
            if not (a or b):
                return
            if deadline is not None and self.clock() > deadline:
                return

    def kick(self, t: list[int]) -> list[int]:
        """Double bridge (A B C D -> A C B D): keeps every segment's orientation, good for ATSP."""
        n = len(t)
        p1, p2, p3 = sorted(self.rng.sample(range(1, n), 3))
        return t[:p1] + t[p2:p3] + t[p1:p2] + t[p3:]

    def ils(
        self, start: list[int], deadline: float, stall_limit: int, stop_at_zero: bool
    ) -> tuple[list[int], tuple[int, float]]:
        """Iterated local search from ``start`` (already a local optimum or not)."""
        best = list(start)
        self.descend(best, deadline, stop_at_zero)
        best_key = self.evaluate(best)
        stalls = 0
        while stalls < stall_limit and self.clock() < deadline:
            if stop_at_zero and best_key[0] == 0:
                break
            cand = self.kick(best)
            self.descend(cand, deadline, stop_at_zero)
            key = self.evaluate(cand)
            if self.better(key, best_key):
                best, best_key = cand, key
                stalls = 0
            else:
                stalls += 1
                if not self.better(best_key, key):
                    best = cand  # equal quality: drift across the plateau
        return best, best_key


def _nearest_neighbour(w: list[list[float]], start: int) -> list[int]:
    """Greedy: always continue over the fastest link to a peer not yet on the ring."""
    n = len(w)
    seen = [False] * n
    seen[start] = True
    t = [start]
    cur = start
    for _ in range(n - 1):
        row = w[cur]
        best, best_v = -1, -1.0
        for j in range(n):
            if not seen[j] and row[j] > best_v:
                best, best_v = j, row[j]
        seen[best] = True
        t.append(best)
        cur = best
    return t


class _PathSearch:
    """The state of one backtracking search for a ring (:func:`_hamiltonian_dfs`): the path so far from
    ``start``, and for every unvisited peer how many usable predecessors (unvisited, or the path end) and
    successors (unvisited, or the start) it has left."""

    def __init__(self, w: list[list[float]], start: int, rng: random.Random | None) -> None:
        n = len(w)
        self.w = w
        self.succ = [[j for j in range(n) if j != i and w[i][j] > 0.0] for i in range(n)]
        self.pred: list[list[int]] = [[] for _ in range(n)]
        for i in range(n):
            for j in self.succ[i]:
                self.pred[j].append(i)
        self.visited = [False] * n
        self.visited[start] = True
        self.noise = [rng.random() for _ in range(n)] if rng is not None else [0.0] * n
        self.avail_in = [len(self.pred[u]) for u in range(n)]
        self.avail_out = [len(self.succ[u]) for u in range(n)]
        self.path = [start]

    def candidates(self, v: int) -> list[int]:
        """The successors of ``v`` to try, the next one last (a stack): a forced one alone, none when two
        are forced, else by fewest usable successors, then noise, then the fastest link."""
        visited, avail_in, avail_out = self.visited, self.avail_in, self.avail_out
        noise, wv = self.noise, self.w[v]
        cand = [u for u in self.succ[v] if not visited[u]]
        forced = [u for u in cand if avail_in[u] == 1]
        if len(forced) > 1:
            return []
        if forced:
            return forced
        # The stack pops from the end: fewest usable successors (then fastest link) last.
        cand.sort(key=lambda u: (-avail_out[u], noise[u], wv[u]))
        return cand

    def append(self, v: int) -> tuple[tuple[int, list[int], list[int]], bool]:
        """Append ``v`` to the path: what to undo, and whether a peer is left without a usable
        predecessor or successor (a dead end)."""
        visited, avail_in, avail_out = self.visited, self.avail_in, self.avail_out
        end = self.path[-1]
        visited[v] = True
        self.path.append(v)
        # ``end`` stops being a usable predecessor, ``v`` stops being a usable successor.
        dec_in = [u for u in self.succ[end] if not visited[u]]
        dec_out = [u for u in self.pred[v] if not visited[u]]
        dead = False
        for u in dec_in:
            avail_in[u] -= 1
            dead = dead or avail_in[u] == 0
        for u in dec_out:
            avail_out[u] -= 1
            dead = dead or avail_out[u] == 0
        return (v, dec_in, dec_out), dead

    def revert(self, rec: tuple[int, list[int], list[int]]) -> None:
        """Undo one :meth:`append`."""
        v, dec_in, dec_out = rec
        for u in dec_in:
            self.avail_in[u] += 1
        for u in dec_out:
            self.avail_out[u] += 1
        self.visited[v] = False
        self.path.pop()


def _hamiltonian_dfs(
    w: list[list[float]],
    clock: Callable[[], float],
    deadline: float,
    max_steps: int,
    start: int = 0,
    rng: random.Random | None = None,
) -> list[int] | None:
    """Backtracking search for any ring over reachable edges.

    Local search struggles on sparse link graphs (long plateaus of penalty), where a depth-first
    search with pruning finds rings quickly. Every unvisited peer keeps a count of predecessors
    still usable (unvisited, or the current path end) and of successors still usable (unvisited, or
    the start); a zero count is a dead end, and a peer whose only usable predecessor is the path end
    must come next. Among free choices the peer with the fewest usable successors goes first
    (Warnsdorff's rule), ties broken at random when ``rng`` is given. Stops after ``max_steps``
    expansions or at ``deadline``.
    """
    n = len(w)
    search = _PathSearch(w, start, rng)
    path = search.path
    frames = [search.candidates(start)]  # frames[k]: untried successors of path[k]
    undo: list[tuple[int, list[int], list[int]]] = []  # undo[k]: what appending path[k + 1] changed
    steps = 0
    while frames:
        steps += 1
        if steps > max_steps or (steps % 256 == 0 and clock() > deadline):
            return None
        cands = frames[-1]
        if not cands:
            frames.pop()
            if undo:
                search.revert(undo.pop())
            continue
        v = cands.pop()
        rec, dead = search.append(v)
        if len(path) == n:
            if w[v][start] > 0.0:
                return list(path)
            search.revert(rec)
            continue
        if dead:
            search.revert(rec)
            continue
        undo.append(rec)
        frames.append(search.candidates(v))
    return None


def _heuristic(
    w: list[list[float]],
    *,
    initial: list[int] | None,
    known_bottleneck: float | None,
    tolerance: float,
    floor: float,
    rng: random.Random,
    clock: Callable[[], float],
    start: float,
    deadline: float,
) -> tuple[list[int], float]:
    """Iterated local search for (max bottleneck, then min cost). Returns (tour, upper bound)."""
    n = len(w)
    search = _Search(w, rng, clock)
    vals = sorted({x for row in w for x in row if x > 0.0})
    # Stall limits keep small instances deterministic (they stop long before the budget) and stop
    # a hopeless target early so that the binary search can move on.
    stall_a = 20 + n
    stall_b = 12 + n // 2

    # 1. Construction, or the caller's ring.
    search.set_target(vals[0])
    if initial is not None:
        tour = list(initial)
    else:
        starts = rng.sample(range(n), min(n, 8))
        tours = [_nearest_neighbour(w, s) for s in starts]
        tour = min(tours, key=lambda t: (search.evaluate(t)[0], -_bottleneck(t, w), _cost(t, w)))
    # 2. Feasibility: get rid of unreachable edges.
    tour = _feasible(w, tour, search, rng, clock, deadline, max(stall_a, 4 * n))

    # 3. Raise the bottleneck: binary search over the distinct bandwidths between what we have and
    # a proven upper bound.
    if known_bottleneck is not None:
        bound = known_bottleneck
    else:
        # Polynomial (milliseconds at n = 64) and worth it even on a spent budget: it tells the
        # caller how far from optimal the ring can be.
        bound = _bottleneck_upper_bound(w, vals)
    phase_a_end = start + _PHASE_A_SHARE * (deadline - start)
    tour = _raise_bottleneck(w, tour, search, vals, bound, clock, phase_a_end, stall_a)
    best_b = _bottleneck(tour, w)

    # 4. Lower the cost among rings within tolerance of the bottleneck found.
    threshold = max(best_b * (1.0 - tolerance), floor)
    search.set_target(threshold)
    tour, _ = search.ils(tour, deadline, stall_b, stop_at_zero=False)
    return tour, bound


def _feasible(
    w: list[list[float]], tour: list[int], search: _Search, rng: random.Random, clock: Callable[[], float],
    deadline: float, stall: int,
) -> list[int]:
    """Step 2 of :func:`_heuristic`: ``tour`` rid of unreachable edges (raises :class:`NoRingError` when
    no ring is found). The first descent ignores the deadline so a tiny budget still yields a usable
    ring when one is easy to find; then backtracking from random peers, then the local search."""
    n = len(w)
    if search.evaluate(tour)[0] > 0:
        search.descend(tour, None, stop_at_zero=True)
    if search.evaluate(tour)[0] == 0:
        return tour
    # Restarts from random peers with random tie-breaks and growing step limits: one unlucky
    # early choice can trap a single long backtracking run for its whole budget.
    found = None
    limit = 20 * n
    dfs_end = clock() + 0.5 * max(0.0, deadline - clock())
    tries = 0
    while found is None and (tries < 4 or clock() < dfs_end):
        found = _hamiltonian_dfs(
            w, clock, dfs_end, limit, start=rng.randrange(n), rng=rng if tries else None
        )
        limit = limit * 3 // 2
        tries += 1
    if found is not None:
        tour = found
    else:
        tour, _ = search.ils(tour, deadline, stall, stop_at_zero=True)
    if search.evaluate(tour)[0] > 0:
        raise NoRingError(
            f"heuristic search found no ring through all {n} peers over reachable links "
            "(none may exist; not proven)",
            isolated=[],
            components=[list(range(n))],
        )
    return tour


def _raise_bottleneck(
    w: list[list[float]], tour: list[int], search: _Search, vals: list[float], bound: float,
    clock: Callable[[], float], end: float, stall: int,
) -> list[int]:
    """Step 3 of :func:`_heuristic`: binary search over the distinct bandwidths ``vals`` between
    ``tour``'s bottleneck and ``bound``, until ``end``. Each probe asks the local search for a ring with
    no edge below it."""
    lo = bisect.bisect_left(vals, _bottleneck(tour, w))
    hi = bisect.bisect_right(vals, bound) - 1
    while lo < hi:
        now = clock()
        if now >= end:
            break
        mid = (lo + hi + 1) // 2
        probes_left = max(1, math.ceil(math.log2(hi - lo + 1)))
        probe_end = now + (end - now) / probes_left
        search.set_target(vals[mid])
        cand, key = search.ils(tour, probe_end, stall, stop_at_zero=True)
        if key[0] == 0:
            tour = cand
            lo = bisect.bisect_left(vals, _bottleneck(tour, w))
        else:
            hi = mid - 1
    return tour


# --------------------------------------------------------------------------------------------------
# Public entry points


def solve_ring(
    bw: Sequence[Sequence[float | None]],
    *,
    exact_limit: int = 12,
    time_budget: float = 1.0,
    seed: int = 0,
    clock: Callable[[], float],
    tolerance: float = DEFAULT_TOLERANCE,
) -> RingSolution:
    """Find the ring order that makes ring all-reduce fastest.

    Objective: maximize the bottleneck ``B`` (slowest ring edge); among rings with bottleneck
    ``>= B * (1 - tolerance)`` minimize ``sum(1 / bw)``. Unreachable edges (``0``/``None``) are never
    used.

    Worlds with ``n <= exact_limit`` (and always ``n <= 3``) are solved exactly by Held-Karp DP;
    if that exceeds half of ``time_budget`` the heuristic takes over for the other half (seeded
    with the bottleneck-optimal ring when the first DP finished) and ``exact`` is False. Larger
    worlds use the heuristic.

    ``time_budget`` is soft: the heuristic always completes its construction and one descent to a
    ring without unreachable edges, so a zero budget still returns a usable ring. Results are
    deterministic for a given ``seed`` whenever the search stops on its own (small worlds) or the
    ``clock`` is deterministic; when the budget binds they depend on how fast ``clock`` advances.

    Args:
        bw: square matrix, ``bw[i][j]`` = bytes/s from peer ``i`` to peer ``j``; ``0`` or ``None``
            means unreachable; the diagonal is ignored.
        exact_limit: largest world solved exactly (at most ``MAX_EXACT_LIMIT``).
        time_budget: seconds (as measured by ``clock``) the search may take.
        seed: seed of the heuristic's random choices.
        clock: monotonic time source (required: this module reads no clock itself).
        tolerance: relative bottleneck slack within which rings are tied and the cost decides.

    Returns:
        The ring, rotated to start at peer 0.

    Raises:
        NoRingError: no ring over reachable links exists (or, for the heuristic, none was found);
            ``isolated`` lists the peers that can be in no ring.
        InvalidArgumentError: malformed matrix or parameters.
    """
    if not isinstance(exact_limit, int) or not 0 <= exact_limit <= MAX_EXACT_LIMIT:
        raise InvalidArgumentError(
            f"exact_limit must be an int in [0, {MAX_EXACT_LIMIT}], got {exact_limit!r}"
        )
    _check_budget(time_budget, tolerance)
    w = _matrix(bw)
    n = len(w)
    if n == 1:
        return RingSolution(order=[0], bottleneck=math.inf, cost=0.0, exact=True)
    start = clock()
    deadline = start + time_budget
    _diagnose(w)
    if n <= 3:
        tour, best_b = _enumerate_small(w, tolerance, 0.0)
        return _solution(tour, w, True, best_b)

    initial: list[int] | None = None
    known: float | None = None
    if n <= exact_limit:
        # The exact search may use half the budget, so that a fallback still has time to search.
        exact = _exact_within(w, tolerance, clock, start + _EXACT_SHARE * time_budget)
        if isinstance(exact, RingSolution):
            return exact
        initial, known = exact

    tour, bound = _heuristic(
        w,
        initial=initial,
        known_bottleneck=known,
        tolerance=tolerance,
        floor=0.0,
        rng=random.Random(seed),
        clock=clock,
        start=start,
        deadline=deadline,
    )
    return _solution(tour, w, False, bound)


def _exact_within(
    w: list[list[float]], tolerance: float, clock: Callable[[], float], deadline: float
) -> RingSolution | tuple[list[int] | None, float | None]:
    """The exact (Held-Karp) solution if found by ``deadline``; else what the search knew when it ran
    out: the bottleneck-optimal ring and its bottleneck, when its first DP finished (None otherwise),
    to seed the heuristic."""

    def check_time() -> None:
        if clock() > deadline:
            raise _BudgetExceeded(None, None)

    try:
        tour, best_b = _exact(w, tolerance, 0.0, check_time)
        return _solution(tour, w, True, best_b)
    except _BudgetExceeded as exc:
        return exc.tour, exc.bottleneck


def improve_ring(
    order: Sequence[int],
    bw: Sequence[Sequence[float | None]],
    *,
    time_budget: float = 1.0,
    seed: int = 0,
    clock: Callable[[], float],
    tolerance: float = DEFAULT_TOLERANCE,
) -> RingSolution:
    """Continue the local search from an existing ring (background improvement, off the hot path).

    The result is never worse than ``order``: its bottleneck is ``>=`` the input's (so repeated
    calls cannot ratchet the bottleneck down through the tolerance), and when it is not higher
    the cost is not higher either. Unreachable edges in ``order`` (a link that died) are removed
    if possible.

    Args:
        order: the current ring, a permutation of ``range(len(bw))`` (any rotation).
        bw: bandwidth matrix as for :func:`solve_ring` (possibly updated since ``order`` was chosen).
        time_budget: seconds (as measured by ``clock``) the search may take (soft, see solve_ring).
        seed: seed of the random choices.
        clock: monotonic time source (required: this module reads no clock itself).
        tolerance: relative bottleneck slack within which the cost decides (relative to the best
            bottleneck found, never below the input ring's bottleneck).

    Returns:
        The improved ring, rotated to start at peer 0; ``exact`` only for ``n <= 3``.

    Raises:
        NoRingError: no ring over reachable links exists (or none was found).
        InvalidArgumentError: malformed matrix, order or parameters.
    """
    _check_budget(time_budget, tolerance)
    w = _matrix(bw)
    n = len(w)
    ring = _check_order(order, n)
    if n == 1:
        return RingSolution(order=[0], bottleneck=math.inf, cost=0.0, exact=True)
    start = clock()
    _diagnose(w)
    floor = _bottleneck(ring, w)
    if n <= 3:
        tour, best_b = _enumerate_small(w, tolerance, floor)
        return _solution(tour, w, True, best_b)
    tour, bound = _heuristic(
        w,
        initial=ring,
        known_bottleneck=None,
        tolerance=tolerance,
        floor=floor,
        rng=random.Random(seed),
        clock=clock,
        start=start,
        deadline=start + time_budget,
    )
    # Phase A can trade cost for a higher bottleneck and phase B may then give that bottleneck back
    # down to the floor: never hand back a ring that is worse than the one we were given.
    new_b = _bottleneck(tour, w)
    if new_b < floor or (new_b == floor and _cost(tour, w) > _cost(ring, w)):
        tour = ring
    return _solution(tour, w, False, bound)
