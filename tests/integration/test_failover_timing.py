"""How soon the run finds a restarted master (virtual network, MockClock): the peers' reconnect
backoff bounds the gap across a master kill (docs/benchmarks.md "With master kills")."""

from __future__ import annotations

import dataclasses

import numpy as np
import trio
import trio.testing

from pccl import PeerConfig
from pccl.testing import DEFAULT_PEER_CONFIG, TestCluster, VirtualNetwork, open_test_cluster

CONFIG: PeerConfig = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=30.0)


async def _reconnected_after(cluster: TestCluster, n: int) -> float:
    """Seconds until no peer of ``cluster`` is reconnecting any more."""
    t0 = trio.current_time()
    while any(cluster.peer(i).statistics()["reconnecting"] for i in range(n)):
        await trio.sleep(0.001)
    return trio.current_time() - t0


async def test_peers_find_a_master_restarted_seconds_later_within_a_quarter_second(
        autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        x = np.ones(16, np.float32)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(cluster.peer(i).all_reduce, x, np.empty_like(x))
        # The master is down for 3 s (its connects refused), then listens again: the peers' rounds
        # were 1 s apart by then (0.05 s doubling, capped), so one waited up to a second; with the
        # cap at 0.25 s they find it within one round.
        await cluster.restart_master(delay=3.0)
        took = await _reconnected_after(cluster, 3)
        assert took <= 0.26, took
        out = np.empty_like(x)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(cluster.peer(i).all_reduce, x, out if i == 0 else np.empty_like(x))
        assert out.tolist() == [3.0] * 16
        assert cluster.master.statistics()["generation"] == 2
