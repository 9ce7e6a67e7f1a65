"""The alpha-beta cost model (pccl.collectives.cost): its predictions against the plans' own timing
model, the ring baseline measured on the virtual network, and which schedule it picks when."""

from __future__ import annotations

import math

import pytest

from pccl.collectives.cost import (
    DEFAULT_BANDWIDTH,
    LinkModel,
    choose,
    heterogeneity,
    predict,
)
from pccl.collectives.schedule import SCHEDULES, all_plans, schedule_kinds
from pccl.testing.plans import plan_times

BLOCK = 4 << 20


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize(("latency", "bandwidth"), [(0.025, 125e6), (0.0005, 1.25e9)])
def test_model_tracks_the_plans_timing_model(n: int, latency: float, bandwidth: float) -> None:
    """Closed forms against an event-driven timing of the very plans (uniform links): small
    operations within a dependent step or so, large ones within a factor of two (the closed forms
    sum rounds and phases that the plans partly overlap; the timing model sends frames in release
    order, which can leave an interface idle that the closed forms count as busy)."""
    lm = LinkModel(latency=latency, default_bandwidth=bandwidth)
    for size in (4096, 1 << 20, 64 << 20):
        for schedule in SCHEDULES:
            for kind in schedule_kinds(schedule):
                count = max(1, size // 4 // (n if kind == "all_gather" else 1))
                if kind == "all_to_all":  # n equal blocks
                    count = n * max(1, size // 4 // n)
                model = predict(schedule, kind, n, count * 4, lm)
                plans = all_plans(schedule, kind, n, count, BLOCK // 4)
                timed = max(plan_times(plans, 4, lambda a, b: latency, lambda a, b: bandwidth))
                # (the timing model books the sends released at one instant rank after rank, so an
                # all-to-all, whose every send is released at once, queues at the receivers' interfaces
                # in that order: timed up to twice the busiest interface's time, the closed form)
                low = 0.5 if kind == "all_to_all" else 0.55
                assert low * timed <= model <= 2.05 * timed, (schedule, kind, n, size, model, timed)
                if size == 4096 and n & (n - 1) == 0:
                    # latency-bound and no fold: the step counts agree
                    assert model == pytest.approx(timed, rel=0.35, abs=latency * 1.01), (schedule, kind, n)


def test_ring_prediction_matches_the_virtual_network_baseline() -> None:
    """Measured on the virtual network (issue 21): a 4 KB ring all-reduce over 25 ms links at
    1 Gbit/s takes 250 / 850 / 3250 ms at 4 / 16 / 64 peers, two master round trips (100 ms)
    included."""
    lm = LinkModel(latency=0.025, default_bandwidth=125e6)
    for n, measured in ((4, 0.250), (16, 0.850), (64, 3.250)):
        assert predict("ring", "all_reduce", n, 4096, lm) + 0.1 == pytest.approx(measured, rel=0.01)


def test_small_operations_take_the_latency_optimal_schedules() -> None:
    lm = LinkModel(latency=0.025, default_bandwidth=125e6)
    assert choose("all_reduce", 64, 4096, lm).schedule == "hd"
    assert choose("reduce_scatter", 16, 4096, lm).schedule == "hd"
    assert choose("all_gather", 16, 256, lm).schedule == "hd"
    assert choose("broadcast", 64, 4096, lm).schedule == "tree"
    # 64 peers, 25 ms: 12 dependent steps instead of 126
    assert predict("hd", "all_reduce", 64, 4096, lm) == pytest.approx(12 * 0.025, rel=0.01)
    assert choose("all_reduce", 64, 4096, lm).predictions["ring"] == pytest.approx(126 * 0.025, rel=0.01)


def test_large_broadcasts_keep_the_pipelined_chain() -> None:
    lm = LinkModel(latency=0.0005, default_bandwidth=1.25e9)
    assert choose("broadcast", 16, 64 << 20, lm).schedule == "ring"
    assert choose("broadcast", 16, 4096, lm).schedule == "tree"


def test_two_peers_gain_nothing_from_another_schedule() -> None:
    """At two peers the ring, halving-doubling and the tree take the same number of steps:
    the margin keeps the ring."""
    for size in (4096, 1 << 20, 64 << 20):
        assert choose("all_reduce", 2, size).schedule == "ring"


def _two_sites(n: int, fast: float, slow: float) -> list[list[float | None]]:
    """Ranks 0..n/2-1 in one site, the rest in the other (the optimized ring crosses twice)."""
    half = n // 2
    return [
        [None if i == j else (fast if (i < half) == (j < half) else slow) for j in range(n)] for i in range(n)
    ]


def test_heterogeneous_links_keep_the_ring_for_large_operations() -> None:
    n = 16
    lm = LinkModel(latency=0.0005, bandwidth=_two_sites(n, 1.25e9, 12.5e6))
    assert heterogeneity(lm, n) == pytest.approx(100.0)
    assert choose("all_reduce", n, 64 << 20, lm).schedule == "ring"
    assert choose("all_reduce", n, 1 << 20, lm).schedule == "ring"
    # a small operation is latency-bound even across the slow link: fewer steps win
    assert choose("all_reduce", n, 4096, lm).schedule == "hd"
    # the same sizes on uniform measured links do not trigger the rule
    uniform = LinkModel(latency=0.0005, bandwidth=_two_sites(n, 1.25e9, 1.25e9))
    assert heterogeneity(uniform, n) == 1.0
    assert choose("all_reduce", n, 1 << 20, uniform).schedule == "hd"


def test_slow_pairs_the_ring_avoids_make_halving_doubling_slower() -> None:
    """A slow link between ranks 0 and 4, which the ring order does not use, costs the ring nothing
    and halving-doubling its whole first round (0 and 4 are partners at distance 4)."""
    n = 8
    bw: list[list[float | None]] = [[None if i == j else 1.25e9 for j in range(n)] for i in range(n)]
    bw[0][4] = bw[4][0] = 1e6  # ring edges are (i, i+1): 0 and 4 are not neighbours
    lm = LinkModel(latency=0.0005, bandwidth=bw)
    uniform = LinkModel(latency=0.0005, default_bandwidth=1.25e9)
    size = 16 << 20
    ring_uniform = predict("ring", "all_reduce", n, size, uniform)
    assert predict("ring", "all_reduce", n, size, lm) == pytest.approx(ring_uniform)
    assert predict("hd", "all_reduce", n, size, lm) > 100 * predict("hd", "all_reduce", n, size, uniform)
    assert choose("all_reduce", n, size, lm).schedule == "ring"


def test_unmeasured_links_use_defaults_and_the_window_caps_bandwidth() -> None:
    bw: list[list[float | None]] = [[None, 0.0], [None, None]]
    lm = LinkModel(latency=0.01, bandwidth=bw)
    assert lm.beta(0, 1) == DEFAULT_BANDWIDTH and lm.beta(1, 0) == DEFAULT_BANDWIDTH
    capped = LinkModel(latency=0.025, default_bandwidth=1.25e9, window=4 << 20)
    # one 4 MiB window per 50 ms round trip: about 80 MB/s, not 1.25 GB/s
    assert 75e6 < capped.beta(0, 1) < 85e6
    mat = LinkModel(latency=[[None, 0.002], [0.003, None]], default_latency=0.001)
    assert mat.alpha(0, 1) == 0.002 and mat.alpha(1, 0) == 0.003 and mat.alpha(0, 0) == 0.001


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        predict("ring", "bogus", 4, 10)
    with pytest.raises(ValueError):
        predict("ring", "all_reduce", 1, 10)
    with pytest.raises(ValueError):
        predict("bogus", "all_reduce", 4, 10)
    with pytest.raises(ValueError):
        choose("all_reduce", 4, 10, schedules=())
    assert math.isinf(predict("hd", "broadcast", 4, 10))
    assert choose("broadcast", 4, 10).predictions["hd"] == math.inf
