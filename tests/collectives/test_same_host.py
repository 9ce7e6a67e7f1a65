"""Peers of one host, nothing measured: the schedule choice prices their links with
``cost.SAME_HOST`` (no wire: per-step software cost, copy-speed bytes) instead of the LAN defaults,
on every member alike, from the operation's table."""

from __future__ import annotations

import numpy as np
import pytest
import trio.testing

import pccl
from pccl.collectives.cost import SAME_HOST, predict, schedule_for
from pccl.collectives.schedule import SCHEDULES
from pccl.testing import VirtualNetwork
from pccl.testing.pytest_plugin import ClusterFactory

KB, MB = 1 << 10, 1 << 20


def test_same_host_choices() -> None:
    """Where the LAN defaults keep the ring, one host's model takes the tree or halving-doubling
    (what a 2-vCPU VM measured fastest: docs/topology.md "Peers on one host"); big operations and
    two peers keep the ring."""
    assert schedule_for("auto", "all_reduce", 3, 64 * KB) == "ring"
    assert schedule_for("auto", "all_reduce", 3, 64 * KB, links=SAME_HOST) == "tree"
    assert schedule_for("auto", "all_reduce", 4, MB) == "ring"
    assert schedule_for("auto", "all_reduce", 4, MB, links=SAME_HOST) == "hd"
    assert schedule_for("auto", "all_reduce", 3, 16 * MB, links=SAME_HOST) == "ring"
    assert schedule_for("auto", "all_reduce", 2, 64 * KB, links=SAME_HOST) == "ring"
    # every prediction is cheaper than over a LAN: no wire, and bytes at copy speed
    for s in SCHEDULES:
        assert predict(s, "all_reduce", 4, MB, SAME_HOST) < predict(s, "all_reduce", 4, MB)


@pytest.mark.parametrize(("loopback", "want"), [(True, "tree"), (False, "ring")])
async def test_one_host_runs_the_same_host_choice(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, loopback: bool, want: str
) -> None:
    """Three peers, a 64 KB all-reduce, nothing measured: on one host (every address 127.0.0.1)
    each peer runs the tree, on three hosts the ring, and the results are exact either way."""
    n, count = 3, 16 * KB  # float32: 64 KB
    cluster = await pccl_cluster(n, network=VirtualNetwork(latency=0.0002, bandwidth=1e9, loopback=loopback))
    assert all(cluster.peer(i)._links is None for i in cluster.alive)  # nothing measured
    xs = {i: np.full(count, i + 1, np.float32) for i in cluster.alive}
    infos = await cluster.run_all(lambda i, c: c.all_reduce(xs[i]))
    assert all(isinstance(r, pccl.ReduceInfo) for r in infos), infos
    for i in cluster.alive:
        assert (xs[i] == 6).all()
        stats = cluster.peer(i).statistics()
        assert {s: stats.get(f"schedule_{s}_ok", 0) for s in SCHEDULES} == {
            s: int(s == want) for s in SCHEDULES
        }
