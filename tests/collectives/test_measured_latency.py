"""The measured latency in the cost model: the master's link summary with a latency, and the schedule
choice it changes (4 peers, 1 MB: the ring over 0.5 ms links, halving-doubling over 25 ms links)."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from pccl.collectives.cost import DEFAULT_LATENCY, LinkModel, choose, schedule_for
from pccl.peer.communicator import Communicator
from pccl.testing import VirtualNetwork, open_test_cluster

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


async def _all_reduce(comms: list[Communicator], count: int) -> None:
    xs = [np.full(count, i + 1, np.float32) for i in range(len(comms))]
    async with trio.open_nursery() as nursery:
        for c, x in zip(comms, xs, strict=True):
            nursery.start_soon(c.all_reduce, x)
    assert all((x == 10).all() for x in xs)


async def _optimize(comms: list[Communicator]) -> None:
    async with trio.open_nursery() as nursery:
        for c in comms:
            nursery.start_soon(c.optimize_topology)


@pytest.mark.parametrize(("latency", "want"), [(0.0005, "ring"), (0.025, "hd")])
async def test_peers_choose_with_the_latency_the_master_measured(
    autojump_clock: trio.testing.MockClock, latency: float, want: str
) -> None:
    """The live stack on the virtual network (every link ``latency`` one way, 1 Gbit/s):
    optimize_topology measures each link's latency within 2% of the configured one, every member
    gets the same summary, and a 1 MB all-reduce at 4 peers then runs the schedule the measured
    latency makes cheapest (before the measurement, with the default latency, the ring)."""
    net = VirtualNetwork(latency=latency, bandwidth=125e6)
    count = MB // 4
    async with open_test_cluster(4, network=net) as cl:
        comms = cl.peers
        assert all(c._links is None for c in comms)
        await _all_reduce(comms, count)
        assert all(c.statistics().get("schedule_ring_ok", 0) == 1 for c in comms)
        await _optimize(comms)
        state = cl.master.state
        ids = [c.peer_id for c in comms]
        assert sorted(state.latency) == sorted((a, b) for a in ids for b in ids if a != b)
        assert all(latency <= v <= 1.02 * latency for v in state.latency.values()), state.latency
        summary = state.link_summary(ids)
        assert len(summary) == 3 and latency <= summary[2] <= 1.02 * latency
        model = LinkModel.from_summary(summary)
        assert model is not None and all(c._links == model for c in comms)
        assert schedule_for("auto", "all_reduce", 4, MB, links=model) == want
        await _all_reduce(comms, count)
        runs = {"ring": 1, "hd": 0} | {want: 1 + (want == "ring")}
        assert all(c.statistics().get(f"schedule_{s}_ok", 0) == k for c in comms for s, k in runs.items())
