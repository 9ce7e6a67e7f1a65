"""A restarted master batches the P2P credential rows of the members back while it is held (rebuilding,
its roll call: MasterConfig.credentials_batch_delay, pccl/master/issued.py) and sends the batch before the
votes resume: a rebuild of N members costs one batch instead of a message per holder per return, and
P2P connections dialled anew right after the rebuild authenticate on both ends. Virtual network,
MockClock."""

from __future__ import annotations

import itertools

import numpy as np
import trio
import trio.testing

import pccl
from pccl import ReduceOp
from pccl.testing import VirtualNetwork, open_test_cluster

from ._traffic import RECONNECTING_PEER as CONFIG

N = 6


async def test_a_rebuild_sends_one_batch_and_new_p2p_connections_authenticate(
        autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(N, network=VirtualNetwork(latency=0.0005), config=CONFIG) as cluster:
        net = cluster.network
        assert net is not None
        ids = [c.peer_id for c in cluster.peers]
        x = [np.full(32, float(p), np.float32) for p in ids]
        want = np.full(32, float(sum(ids)), np.float32)
        await cluster.restart_master()
        with trio.fail_after(10):
            while not (cluster.master.statistics()["accepted"] == N
                       and not cluster.master.statistics()["held"]):
                await trio.sleep(0.0001)
        # The rows of the five back after the first went out in one message to each holder, before
        # the votes resumed (and long before the 10 ms delay: everyone was back within it).
        assert cluster.master.statistics()["credential_batches"] == 1
        # Every P2P link is reset: the next all-reduce dials anew, under the new master's set, at once.
        for a, b in itertools.combinations(range(N), 2):
            net.reset(cluster.host(a), cluster.host(b))
        outs = [np.empty_like(v) for v in x]
        failed = [0] * N

        async def one(i: int) -> None:
            while True:
                try:
                    await cluster.peer(i).all_reduce(x[i], outs[i], op=ReduceOp.SUM)
                    return
                except pccl.RankConnectionLostError:  # an attempt on the reset links; the retry dials anew
                    failed[i] += 1

        t0 = trio.current_time()
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for i in range(N):
                    nursery.start_soon(one, i)
        assert all(o.tobytes() == want.tobytes() for o in outs)
        assert all(f <= 1 for f in failed), failed
        # No connection waited for a row (a listener waits up to connect_timeout / 2 = 1 s for one).
        assert trio.current_time() - t0 < 0.5
        assert cluster.master.statistics()["credential_batches"] == 1
        assert all(c.statistics()["generation"] == 2 for c in cluster.peers)
