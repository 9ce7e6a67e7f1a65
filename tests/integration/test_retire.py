"""After every topology change a peer closes its outgoing ring connections to the peers no plan of the
new ring sends to (P2PPool.retire): a run whose members join one at a time does not leave each peer
holding a connection to every peer it ever sent to, and nothing counts as a lost connection. Virtual
network, MockClock."""

from __future__ import annotations

import numpy as np
import trio
import trio.testing

from pccl.collectives.schedule import send_partners
from pccl.testing import TestCluster, VirtualNetwork, open_test_cluster


async def _all_reduce(cluster: TestCluster) -> None:
    alive = list(cluster.alive)
    ids = [cluster.peer(i).peer_id for i in alive]
    want = np.full(64, float(sum(ids)), np.float32)
    outs = {i: np.empty(64, np.float32) for i in alive}
    async with trio.open_nursery() as nursery:
        for i in alive:
            x = np.full(64, float(cluster.peer(i).peer_id), np.float32)
            nursery.start_soon(cluster.peer(i).all_reduce, x, outs[i])
    assert all(o.tobytes() == want.tobytes() for o in outs.values())


async def test_joins_one_at_a_time_leave_each_peer_only_its_partners(
        autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(4, network=VirtualNetwork(latency=0.0005)) as cluster:
        await _all_reduce(cluster)
        for _ in range(8):
            await cluster.add_peer()
            await _all_reduce(cluster)
        ring = cluster.master.state.accepted()  # ring order: every peer's group rows
        n = len(ring)
        assert n == 12
        retired = 0
        for i in cluster.alive:
            comm = cluster.peer(i)
            rank = ring.index(comm.peer_id)
            partners = {ring[r] for r in send_partners(n, rank)}
            s = comm.pool.statistics()
            assert set(s["outgoing"]) <= partners, (comm.peer_id, sorted(s["outgoing"]), sorted(partners))
            assert s["connections_lost"] == 0
            retired += s["connections_retired"]
        assert retired > 0  # ranks moved with the joins: partners changed, and old ones were retired
