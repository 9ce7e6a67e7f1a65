"""The measured latency in the cost model: the master's link summary with a latency, and the schedule
choice it changes (4 peers, 1 MB: the ring over 0.5 ms links, halving-doubling over 25 ms links)."""

from __future__ import annotations

import pytest

from pccl.collectives.cost import DEFAULT_LATENCY, LinkModel, choose, schedule_for

MB = 1 << 20


def test_a_summary_with_a_latency_sets_the_model_latency() -> None:
    lm = LinkModel.from_summary([125e6, 2.0, 0.025])
    assert lm == LinkModel(latency=0.025, default_bandwidth=125e6, spread=2.0)
    assert lm.alpha(0, 1) == 0.025
    old = LinkModel.from_summary([125e6, 2.0])  # a summary without a latency: the default
    assert old is not None and old.alpha(0, 1) == DEFAULT_LATENCY
    assert LinkModel.from_summary([125e6, 1.0, 0.0]) == LinkModel(latency=0.0, default_bandwidth=125e6)
    for bad in ([125e6, 2.0, -1e-3], [125e6, 2.0, float("inf")], [125e6, 2.0, True], [1.0, 1.0, 1.0, 1.0]):
        assert LinkModel.from_summary(bad) is None


@pytest.mark.parametrize(("latency", "want"), [(0.0005, "ring"), (0.025, "hd")])
def test_the_measured_latency_changes_the_choice(latency: float, want: str) -> None:
    """4 peers, 1 MB all-reduce over 1 Gbit/s links: 6 ring steps against 4 halving-doubling rounds
    move the same bytes; at 25 ms the two saved steps are 50 ms of ~160, at 0.5 ms 1 ms of ~16
    (under the ring's 10% margin)."""
    links = LinkModel.from_summary([125e6, 1.0, latency])
    assert links is not None
    assert schedule_for("auto", "all_reduce", 4, MB, links=links) == want
    preds = choose("all_reduce", 4, MB, links).predictions
    assert preds["ring"] == pytest.approx(6 * latency + 1.5 * MB / 125e6)
    # without a measurement the fixed default keeps 1 MB at 4 peers on the ring, whatever the links
    assert schedule_for("auto", "all_reduce", 4, MB, links=LinkModel.from_summary([125e6, 1.0])) == "ring"
