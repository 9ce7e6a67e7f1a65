"""Tests for the pure ring-topology solver (pccl.master.topology).

Every search runs on a deterministic step clock, so results do not depend on machine speed.
"""

from __future__ import annotations

import ast
import itertools
import math
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl import PCCLError, Result
from pccl._errors import InvalidArgumentError
from pccl.master import topology
from pccl.master.topology import (
    NoRingError,
    RingSolution,
    improve_ring,
    predicted_allreduce_time,
    ring_bottleneck,
    ring_cost,
    solve_ring,
)

Matrix = list[list[float | None]]


class StepClock:
    """A clock that advances by ``step`` seconds every time it is read."""

    def __init__(self, step: float = 1e-3) -> None:
        self.now = 0.0
        self.step = step
        self.reads = 0

    def __call__(self) -> float:
        self.now += self.step
        self.reads += 1
        return self.now


def rand_matrix(n: int, rng: random.Random, p_unreachable: float = 0.0) -> Matrix:
    return [
        [None if i == j or rng.random() < p_unreachable else rng.uniform(1e8, 1e10) for j in range(n)]
        for i in range(n)
    ]


def edges(order: list[int]) -> list[tuple[int, int]]:
    n = len(order)
    return [(order[k], order[(k + 1) % n]) for k in range(n)]


def assert_valid(sol: RingSolution, bw: Matrix) -> None:
    n = len(bw)
    assert sorted(sol.order) == list(range(n))
    assert sol.order[0] == 0
    for a, b in edges(sol.order):
        assert bw[a][b], f"ring uses unreachable edge {a}->{b}"
    assert sol.bottleneck == ring_bottleneck(sol.order, bw)
    assert sol.cost == pytest.approx(ring_cost(sol.order, bw), rel=1e-12)
    assert sol.bottleneck <= sol.bottleneck_bound


def brute_force(bw: Matrix, tolerance: float) -> tuple[float, float] | None:
    """(optimal bottleneck B, min cost over rings with bottleneck >= B*(1-tol)); None if no ring."""
    n = len(bw)
    best_b = 0.0
    rings = []
    for perm in itertools.permutations(range(1, n)):
        ring = [0, *perm]
        ws = [bw[a][b] for a, b in edges(ring)]
        if not all(ws):
            continue
        b = min(w for w in ws if w is not None)
        c = sum(1.0 / w for w in ws if w is not None)
        rings.append((b, c))
        best_b = max(best_b, b)
    if not rings:
        return None
    threshold = best_b * (1.0 - tolerance)
    return best_b, min(c for b, c in rings if b >= threshold)


def check_against_brute_force(bw: Matrix, tolerance: float) -> None:
    expected = brute_force(bw, tolerance)
    if expected is None:
        with pytest.raises(NoRingError):
            solve_ring(bw, tolerance=tolerance, clock=StepClock())
        return
    best_b, best_c = expected
    sol = solve_ring(bw, tolerance=tolerance, clock=StepClock())
    assert sol.exact
    assert_valid(sol, bw)
    assert sol.bottleneck_bound == best_b
    assert sol.bottleneck >= best_b * (1.0 - tolerance)
    if tolerance == 0.0:
        assert sol.bottleneck == best_b
    assert sol.cost == pytest.approx(best_c, rel=1e-9)


# ------------------------------------------------------------------------------------------------
# Exact solver vs brute force


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("tolerance", [0.0, 0.05])
def test_exact_matches_brute_force(n: int, tolerance: float) -> None:
    for seed in range(6):
        rng = random.Random(1000 * n + seed)
        # A third of the instances have unreachable links (some of them have no ring at all).
        bw = rand_matrix(n, rng, p_unreachable=0.35 if seed % 3 == 0 else 0.0)
        check_against_brute_force(bw, tolerance)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    st.integers(min_value=3, max_value=6).flatmap(
        lambda n: st.lists(
            st.lists(st.sampled_from([None, 1.0, 2.0, 3.0, 4.0]), min_size=n, max_size=n),
            min_size=n,
            max_size=n,
        )
    ),
    st.sampled_from([0.0, 0.3]),
)
def test_exact_matches_brute_force_with_ties(bw: Matrix, tolerance: float) -> None:
    # Few distinct values: many rings share the bottleneck, so the cost tie-break decides.
    check_against_brute_force(bw, tolerance)


# ------------------------------------------------------------------------------------------------
# Heuristic quality


def test_heuristic_bottleneck_gap_n10_to_12() -> None:
    """Stated bound: the heuristic's bottleneck is >= 0.95 of the optimum on every instance.

    Measured: it is exactly optimal on all 20 of these instances (and on 100/100 in a wider run);
    the cost is within 5% of the exact tie-break optimum.
    """
    ratios = []
    for k in range(20):
        n = 10 + k % 3
        bw = rand_matrix(n, random.Random(7000 + k))
        exact = solve_ring(bw, tolerance=0.0, clock=StepClock())
        heur = solve_ring(bw, tolerance=0.0, exact_limit=0, clock=StepClock(1e-4), seed=k)
        assert exact.exact and not heur.exact
        assert_valid(heur, bw)
        # The polynomial bound is a true upper bound on the optimum.
        assert heur.bottleneck_bound >= exact.bottleneck
        ratio = heur.bottleneck / exact.bottleneck
        ratios.append(ratio)
        assert ratio >= 0.95, (k, ratio)
        if ratio == 1.0:
            assert heur.cost <= exact.cost * 1.05
    assert sum(r == 1.0 for r in ratios) >= 18, ratios


def _neighbours(t: list[int]) -> list[list[int]]:
    """The moves the local search claims to exhaust, enumerated independently."""
    n = len(t)
    out = []
    # 2-opt: reverse any segment that does not contain position 0.
    for a in range(1, n):
        for b in range(a + 1, n):
            out.append(t[:a] + t[a : b + 1][::-1] + t[b + 1 :])
    # or-opt: move any (cyclic) segment of 1-3 peers anywhere else, forwards or reversed.
    for s in range(n):
        u = t[s:] + t[:s]
        for seg_len in (1, 2, 3):
            if n - seg_len < 2:
                continue
            seg, rest = u[:seg_len], u[seg_len:]
            for k in range(1, len(rest)):
                out.append(rest[:k] + seg + rest[k:])
                out.append(rest[:k] + seg[::-1] + rest[k:])
    return out


def test_local_search_reaches_a_true_local_optimum() -> None:
    """White-box: the O(1) move deltas (asymmetric reversal included) agree with re-evaluation."""
    for k in range(60):
        rng = random.Random(k)
        n = 5 + k % 6
        bw = rand_matrix(n, rng, p_unreachable=0.2)
        w = topology._matrix(bw)
        search = topology._Search(w, rng, StepClock())
        positive = sorted(x for row in w for x in row if x > 0.0)
        search.set_target(positive[rng.randrange(len(positive))])
        tour = list(range(n))
        rng.shuffle(tour)
        before = search.evaluate(tour)
        search.descend(tour, None, stop_at_zero=False)
        after = search.evaluate(tour)
        assert sorted(tour) == list(range(n))
        assert not search.better(before, after)
        for other in _neighbours(tour):
            assert not search.better(search.evaluate(other), after), (k, tour, other)


def test_n64_returns_valid_ring_without_unreachable_edges() -> None:
    n = 64
    bw = rand_matrix(n, random.Random(64), p_unreachable=0.1)
    clock = StepClock(1e-3)
    sol = solve_ring(bw, time_budget=0.5, clock=clock)
    assert not sol.exact
    assert_valid(sol, bw)
    # The budget was respected in clock time (each read advances the clock by 1 ms).
    assert clock.reads < 2000
    # Local search must beat a naive ring.
    naive = ring_bottleneck(list(range(n)), bw)
    assert sol.bottleneck > naive


def test_heuristic_is_deterministic_for_a_seed() -> None:
    bw = rand_matrix(30, random.Random(3), p_unreachable=0.1)
    a = solve_ring(bw, seed=5, time_budget=0.2, clock=StepClock(1e-3))
    b = solve_ring(bw, seed=5, time_budget=0.2, clock=StepClock(1e-3))
    assert a == b


# ------------------------------------------------------------------------------------------------
# Structure of the answer


def two_datacenters(n: int, seed: int) -> tuple[Matrix, set[int]]:
    """Interleaved membership; ~10 GB/s inside a DC, ~100 MB/s (noisy, asymmetric) between DCs."""
    rng = random.Random(seed)
    dc_a = set(range(0, n, 2))
    bw: Matrix = [
        [
            None
            if i == j
            else (rng.uniform(8e9, 12e9) if (i in dc_a) == (j in dc_a) else rng.uniform(0.9e8, 1.1e8))
            for j in range(n)
        ]
        for i in range(n)
    ]
    return bw, dc_a


@pytest.mark.parametrize(("n", "exact_limit"), [(8, 12), (12, 12), (24, 12), (24, 0)])
def test_two_datacenters_cross_exactly_twice(n: int, exact_limit: int) -> None:
    bw, dc_a = two_datacenters(n, seed=n)
    sol = solve_ring(bw, exact_limit=exact_limit, clock=StepClock(1e-4))
    assert_valid(sol, bw)
    crossings = sum((a in dc_a) != (b in dc_a) for a, b in edges(sol.order))
    assert crossings == 2
    # Predicted time is set by the slow WAN link.
    assert sol.bottleneck < 2e8


@pytest.mark.parametrize("exact_limit", [12, 0])
def test_unreachable_edges_are_avoided_even_when_fastest(exact_limit: int) -> None:
    n = 10
    rng = random.Random(11)
    bw = rand_matrix(n, rng)
    # Make the would-be best ring's edges the fastest links of all, then cut half of them.
    for k in range(n):
        a, b = k, (k + 1) % n
        bw[a][b] = 1e12
    for k in range(0, n, 2):
        bw[k][(k + 1) % n] = None
    bw[3][4] = 0.0  # 0 means unreachable too
    sol = solve_ring(bw, exact_limit=exact_limit, clock=StepClock(1e-4))
    assert_valid(sol, bw)
    assert all(bw[a][b] not in (None, 0.0) for a, b in edges(sol.order))


def test_single_hidden_ring_is_found_by_heuristic() -> None:
    n = 40
    rng = random.Random(40)
    perm = list(range(n))
    rng.shuffle(perm)
    bw: Matrix = [[None] * n for _ in range(n)]
    for k in range(n):
        bw[perm[k]][perm[(k + 1) % n]] = rng.uniform(1e8, 1e9)
    sol = solve_ring(bw, time_budget=0.1, clock=StepClock(1e-3))
    assert_valid(sol, bw)
    start = perm.index(0)
    assert sol.order == perm[start:] + perm[:start]


# ------------------------------------------------------------------------------------------------
# No ring


@pytest.mark.parametrize("n", [5, 20])
def test_peer_that_nobody_reaches_is_reported_isolated(n: int) -> None:
    bw = rand_matrix(n, random.Random(n))
    for i in range(n):
        bw[i][3] = None  # nobody can send to peer 3
    with pytest.raises(NoRingError) as info:
        solve_ring(bw, clock=StepClock())
    err = info.value
    assert err.isolated == [3]
    assert isinstance(err, PCCLError)
    assert err.result == Result.TOPOLOGY_OPTIMIZATION_FAILED
    assert sorted(map(len, err.components)) == [1, n - 1]


def test_peer_that_reaches_nobody_is_reported_isolated() -> None:
    bw = rand_matrix(6, random.Random(6))
    bw[2] = [None] * 6
    bw[5] = [0.0] * 6
    with pytest.raises(NoRingError) as info:
        solve_ring(bw, clock=StepClock())
    assert info.value.isolated == [2, 5]


def test_two_islands_have_no_isolated_peer_but_two_components() -> None:
    # 0,1,2 and 3,4,5 are complete inside; links go only from the first island to the second.
    bw: Matrix = [[None] * 6 for _ in range(6)]
    for i in range(6):
        for j in range(6):
            if i != j and ((i < 3) == (j < 3) or i < 3):
                bw[i][j] = 1e9
    with pytest.raises(NoRingError) as info:
        solve_ring(bw, clock=StepClock())
    assert info.value.isolated == []
    assert info.value.components == [[0, 1, 2], [3, 4, 5]]


def test_strongly_connected_but_no_ring() -> None:
    # A "bowtie": two triangles sharing peer 0. Strongly connected, yet any ring must pass 0 twice.
    bw: Matrix = [[None] * 5 for _ in range(5)]
    for a, b in [(0, 1), (1, 2), (2, 0), (0, 3), (3, 4), (4, 0)]:
        bw[a][b] = 1e9
    with pytest.raises(NoRingError) as info:
        solve_ring(bw, clock=StepClock())
    assert info.value.isolated == []
    assert info.value.components == [[0, 1, 2, 3, 4]]
    with pytest.raises(NoRingError):
        solve_ring(bw, exact_limit=0, clock=StepClock())


def test_two_peers_with_one_dead_direction() -> None:
    with pytest.raises(NoRingError) as info:
        solve_ring([[None, 5.0], [None, None]], clock=time.perf_counter)
    assert info.value.isolated == [0, 1]


# ------------------------------------------------------------------------------------------------
# Trivial sizes, budget fallback


def test_one_peer() -> None:
    sol = solve_ring([[None]], clock=time.perf_counter)
    assert sol == RingSolution(order=[0], bottleneck=math.inf, cost=0.0, exact=True)
    assert predicted_allreduce_time([0], [[None]], 1e9) == 0.0


def test_two_peers() -> None:
    sol = solve_ring([[0.0, 4.0], [2.0, 0.0]], clock=time.perf_counter)
    assert sol.order == [0, 1]
    assert sol.bottleneck == 2.0
    assert sol.cost == pytest.approx(0.75)
    assert sol.exact


def test_three_peers_picks_direction() -> None:
    bw: Matrix = [[None, 9.0, 1.0], [1.0, None, 9.0], [9.0, 1.0, None]]
    sol = solve_ring(bw, exact_limit=0, clock=time.perf_counter)
    assert sol.order == [0, 1, 2]
    assert sol.bottleneck == 9.0
    assert sol.exact


def test_exact_over_budget_falls_back_but_keeps_exact_bottleneck() -> None:
    n = 10
    bw = rand_matrix(n, random.Random(10))
    reference = solve_ring(bw, tolerance=0.0, clock=time.perf_counter)

    # solve_ring reads the clock once, then the bottleneck DP once per subset size (n - 2 reads);
    # the budget runs out at the first read of the cost DP.
    reads = 0

    def clock() -> float:
        nonlocal reads
        reads += 1
        return 0.0 if reads <= 1 + (n - 2) else 100.0 + reads

    sol = solve_ring(bw, tolerance=0.0, time_budget=1.0, clock=clock)
    assert not sol.exact
    assert_valid(sol, bw)
    assert sol.bottleneck == reference.bottleneck
    assert sol.bottleneck_bound == reference.bottleneck


def test_zero_budget_still_returns_a_ring() -> None:
    bw = rand_matrix(12, random.Random(12), p_unreachable=0.2)
    sol = solve_ring(bw, time_budget=0.0, clock=StepClock())
    assert not sol.exact
    assert_valid(sol, bw)


# ------------------------------------------------------------------------------------------------
# Background improvement


def test_improve_ring_never_lowers_the_bottleneck() -> None:
    n = 30
    bw = rand_matrix(n, random.Random(30))
    ring = list(range(n))
    prev_b = ring_bottleneck(ring, bw)
    prev_c = ring_cost(ring, bw)
    for seed in range(4):
        sol = improve_ring(ring, bw, tolerance=0.2, time_budget=0.05, seed=seed, clock=StepClock(1e-3))
        assert_valid(sol, bw)
        assert sol.bottleneck >= prev_b
        if sol.bottleneck == prev_b:
            assert sol.cost <= prev_c * (1 + 1e-12)
        ring, prev_b, prev_c = sol.order, sol.bottleneck, sol.cost
    assert prev_b > ring_bottleneck(list(range(n)), bw)


def test_improve_ring_does_not_trade_bottleneck_within_tolerance() -> None:
    # Ring A = 0-1-2-3 has the best bottleneck (10); ring B = 0-2-1-3 is within the 20% tolerance
    # (bottleneck 9) and much cheaper, so solve_ring prefers B. Improving A must not drift to B,
    # or repeated background improvement would walk the bottleneck down 20% at a time.
    bw: Matrix = [[None if i == j else 1.0 for j in range(4)] for i in range(4)]
    for a, b in [(0, 1), (1, 2), (2, 3), (3, 0)]:
        bw[a][b] = 10.0
    bw[0][2], bw[2][1], bw[1][3] = 9.0, 1000.0, 1000.0
    assert solve_ring(bw, tolerance=0.2, clock=time.perf_counter).order == [0, 2, 1, 3]
    assert solve_ring(bw, tolerance=0.0, clock=time.perf_counter).order == [0, 1, 2, 3]
    kept = improve_ring([0, 1, 2, 3], bw, tolerance=0.2, clock=StepClock())
    assert kept.order == [0, 1, 2, 3]
    assert improve_ring([0, 3, 2, 1], bw, tolerance=0.2, clock=StepClock()).order == [0, 2, 1, 3]


def test_improve_ring_routes_around_a_dead_link() -> None:
    n = 16
    bw = rand_matrix(n, random.Random(16))
    sol = solve_ring(bw, exact_limit=0, time_budget=0.05, clock=StepClock(1e-3))
    a, b = sol.order[3], sol.order[4]
    bw[a][b] = None
    better = improve_ring(sol.order, bw, time_budget=0.05, clock=StepClock(1e-3))
    assert_valid(better, bw)
    assert (a, b) not in edges(better.order)


def test_improve_ring_accepts_any_rotation_and_small_worlds() -> None:
    bw: Matrix = [[None, 9.0, 1.0], [1.0, None, 9.0], [9.0, 1.0, None]]
    sol = improve_ring([2, 1, 0], bw, clock=time.perf_counter)
    assert sol.order == [0, 1, 2]
    with pytest.raises(InvalidArgumentError):
        improve_ring([0, 1, 1], bw, clock=time.perf_counter)


# ------------------------------------------------------------------------------------------------
# Cost model helpers


def test_predicted_allreduce_time_formula() -> None:
    bw: Matrix = [[None, 2e9, 1e9, 1e9], [1e9, None, 4e9, 1e9], [1e9, 1e9, None, 1e9], [3e9, 1e9, 1e9, None]]
    order = [0, 1, 2, 3]
    assert ring_bottleneck(order, bw) == 1e9
    assert ring_cost(order, bw) == pytest.approx(1 / 2e9 + 1 / 4e9 + 1 / 1e9 + 1 / 3e9)
    # 2(n-1)/n * S / B = 1.5 * 1e9 / 1e9
    assert predicted_allreduce_time(order, bw, 1e9) == pytest.approx(1.5)
    assert predicted_allreduce_time(order, bw, 1e9, latency=1e-3) == pytest.approx(1.5 + 6e-3)
    bw[1][2] = None
    assert ring_bottleneck(order, bw) == 0.0
    assert predicted_allreduce_time(order, bw, 1e9) == math.inf
    assert ring_cost(order, bw) == math.inf


def test_solution_minimizes_predicted_time_against_brute_force() -> None:
    bw = rand_matrix(7, random.Random(77))
    sol = solve_ring(bw, tolerance=0.0, clock=time.perf_counter)
    best = min(predicted_allreduce_time([0, *p], bw, 1 << 26) for p in itertools.permutations(range(1, 7)))
    assert predicted_allreduce_time(sol.order, bw, 1 << 26) == pytest.approx(best, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# Validation and purity


@pytest.mark.parametrize(
    "bw",
    [
        [],
        [[None, 1.0]],
        [[None, 1.0], [1.0]],
        [[None, -1.0], [1.0, None]],
        [[None, math.nan], [1.0, None]],
        [[None, math.inf], [1.0, None]],
        [[None, "fast"], [1.0, None]],
    ],
)
def test_bad_matrix_is_rejected(bw: Matrix) -> None:
    with pytest.raises(InvalidArgumentError):
        solve_ring(bw, clock=time.perf_counter)


def test_bad_parameters_are_rejected() -> None:
    bw: Matrix = [[None, 1.0], [1.0, None]]
    with pytest.raises(InvalidArgumentError):
        solve_ring(bw, exact_limit=topology.MAX_EXACT_LIMIT + 1, clock=time.perf_counter)
    with pytest.raises(InvalidArgumentError):
        solve_ring(bw, time_budget=-1.0, clock=time.perf_counter)
    with pytest.raises(InvalidArgumentError):
        solve_ring(bw, tolerance=1.0, clock=time.perf_counter)
    with pytest.raises(InvalidArgumentError):
        ring_bottleneck([0, 2], bw)
    with pytest.raises(InvalidArgumentError):
        predicted_allreduce_time([0, 1], bw, -1)


def test_diagonal_is_ignored() -> None:
    bw: Matrix = [[1e30, 1.0, 2.0], [2.0, -5.0, 1.0], [1.0, 2.0, math.nan]]
    assert solve_ring(bw, clock=time.perf_counter).bottleneck == 2.0


def test_module_is_pure() -> None:
    tree = ast.parse(Path(topology.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & {"trio", "socket", "asyncio", "threading", "selectors"}
