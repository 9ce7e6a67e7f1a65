"""An operation that has to open a connection to a partner of its plan first (the ring's successor,
or a halving-doubling or tree partner), after a failed operation closed them.

* It rides out a partitioned link while connecting, as its data plane does while sending: the
  connect is tried again until the link heals (within ``p2p_stall_timeout``), and the operation
  succeeds for everybody.
* When it still cannot connect, it fails before its data plane, and closes its connections with
  every partner of its plan as a failed data plane does: the retry then opens fresh ones instead of
  writing into one that a partner gave up.

Virtual network, MockClock.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import trio
import trio.testing

import pccl
from pccl.collectives.schedule import send_partners
from pccl.peer.communicator import Communicator
from pccl.testing import DEFAULT_PEER_CONFIG, TestCluster, VirtualNetwork, open_test_cluster, wait_until

HD = dataclasses.replace(DEFAULT_PEER_CONFIG, schedule="hd")


def _index(cluster: TestCluster, peer_id: int) -> int:
    return next(i for i in cluster.alive if cluster.peer(i).peer_id == peer_id)


async def _all_reduce(
    cluster: TestCluster, indexes: list[int]
) -> dict[int, pccl.ReduceInfo | pccl.PCCLError]:
    """An int64 SUM over ``indexes`` (each peer contributes its own id); results by index."""
    outs = {i: np.full(256, -1, np.int64) for i in indexes}

    async def one(i: int, comm: Communicator) -> pccl.ReduceInfo:
        return await comm.all_reduce(np.full(256, comm.peer_id, np.int64), outs[i])

    results = await cluster.run_all(one, indexes=indexes)
    got = dict(zip(indexes, results, strict=True))
    ids = [cluster.peer(i).peer_id for i in indexes]
    for i, r in got.items():
        if isinstance(r, pccl.ReduceInfo):
            assert outs[i].tolist() == [sum(ids)] * 256, (i, outs[i][:4])
        else:
            assert outs[i].tolist() == [-1] * 256  # a failed operation leaves the buffer as it was
    return got


async def test_reconnect_rides_out_a_partition(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(4, network=VirtualNetwork(latency=0.0005), config=HD) as cluster:
        got = await _all_reduce(cluster, cluster.alive)
        assert all(isinstance(r, pccl.ReduceInfo) for r in got.values()), got
        ring = cluster.peer(0).group_ring
        a, c = _index(cluster, ring[0]), _index(cluster, ring[2])  # rank 0 sends to rank 2
        # a's outgoing connection to c closes (cleanly, as when a retires it): a must open it again
        closed = cluster.peer(c).pool.statistics()["connections_closed_by_peer"]
        assert await cluster.peer(a).pool.retire(set(ring) - {ring[2]}) == [ring[2]]
        # c sees the close first (never under an operation, as retire requires)
        await wait_until(lambda: cluster.peer(c).pool.statistics()["connections_closed_by_peer"] > closed,
                         timeout=1.0)
        cluster.partition(a, c)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                got.clear()
                got.update(await _all_reduce(cluster, cluster.alive))

            nursery.start_soon(run)
            await trio.sleep(8.0)  # a partition of 8 s: several connect timeouts, no eviction
            assert not got and all(cluster.is_member(i) for i in cluster.alive)
            cluster.heal(a, c)
        assert all(isinstance(r, pccl.ReduceInfo) for r in got.values()), got
        assert trio.current_time() - t0 < DEFAULT_PEER_CONFIG.p2p_stall_timeout


async def test_failed_partner_connect_closes_the_other_partners_too(
        autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(4, network=VirtualNetwork(latency=0.0005), config=HD) as cluster:
        got = await _all_reduce(cluster, cluster.alive)
        assert all(isinstance(r, pccl.ReduceInfo) for r in got.values()), got
        ring = cluster.peer(0).group_ring
        a, b, c = (_index(cluster, ring[r]) for r in (0, 1, 2))  # rank 0 sends to ranks 1 and 2
        assert {ring[r] for r in send_partners(4, 0, ["hd"])} == {ring[1], ring[2]}
        # a must open its connection to c again, and cannot: the link between them is cut (both
        # still reach the master, so nobody is evicted)
        await cluster.peer(a).pool.disconnect(ring[2])
        cluster.partition(a, c)
        got = await _all_reduce(cluster, cluster.alive)
        assert all(isinstance(r, pccl.PCCLError) for r in got.values()), got
        assert isinstance(got[a], pccl.RankConnectionLostError), got[a]
        # b's data plane failed and closed its connections with a; a closed its own with b as well
        assert not cluster.peer(a).pool.is_connected(ring[1])
        assert not cluster.peer(b).pool.is_connected(ring[0])
        cluster.heal(a, c)
        got = await _all_reduce(cluster, cluster.alive)
        assert all(isinstance(r, pccl.ReduceInfo) for r in got.values()), got
