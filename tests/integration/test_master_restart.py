"""Issue 18: the run survives its master (virtual network, MockClock).

Three peers train (an all-reduce and a shared-state sync per step); the master is crashed and a fresh
one (empty state) started on the same address. Peers configured with a reconnect window re-register
with it; it rebuilds epoch, ring, revision and a newer generation from them, and training goes on:
identical states on every peer and no lost revision.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import ReduceOp, SharedState, TensorInfo
from pccl.testing import VirtualNetwork, open_test_cluster

from ._traffic import RECONNECTING_PEER as CONFIG

BEFORE = AFTER = 3  # all-reduces every peer completes before the restart, and after it


async def _sync_all(cluster: pccl.testing.TestCluster, states: list[SharedState]) -> None:
    async with trio.open_nursery() as nursery:
        for i, st in enumerate(states):
            nursery.start_soon(cluster.peer(i).sync_shared_state, st)


async def test_master_restart_mid_training(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        n = len(cluster.alive)
        ids = [c.peer_id for c in cluster.peers]
        weights = [np.full(64, float(i), np.float64) for i in range(n)]  # peer 0's wins the first sync
        states = [SharedState([TensorInfo.from_numpy(w, "w")]) for w in weights]
        states[0].revision = 1
        await _sync_all(cluster, states)
        assert all(st.revision == 1 for st in states)
        counts = {"before": [0] * n, "after": [0] * n}
        failed = [0] * n
        phase = ["before"]
        want = np.full(256, float(sum(ids)), np.float32)
        enough = trio.Event()

        async def loop(i: int) -> None:
            comm = cluster.peer(i)
            grad = np.full(256, float(comm.peer_id), np.float32)
            while True:
                out = np.empty_like(grad)
                try:
                    info = await comm.all_reduce(grad, out, op=ReduceOp.SUM)
                except pccl.RankConnectionLostError:
                    failed[i] += 1
                    continue
                assert info.local_world_size == n and out.tobytes() == want.tobytes()
                counts[phase[0]][i] += 1
                if min(counts[phase[0]]) >= (BEFORE if phase[0] == "before" else AFTER):
                    enough.set()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(loop, i)
                await enough.wait()
                enough = trio.Event()
                phase[0] = "after"
                await trio.sleep(0.002)  # land inside an all-reduce
                await cluster.restart_master()
                await enough.wait()
                nursery.cancel_scope.cancel()
        assert all(f <= 1 for f in failed), failed  # the all-reduce the restart landed in, at most
        s = cluster.master.statistics()
        assert s["generation"] == 2 and s["accepted"] == 3 and s["revisions"] == {0: 1}
        assert [c.peer_id for c in cluster.peers] == ids  # every peer kept its id
        assert all(c.statistics()["generation"] == 2 for c in cluster.peers)
        # The rebuilt master knows revision 1: the next sync (revision 2) goes through, identically.
        for st in states:
            st.revision = 2
        weights[0] += 1.0
        await _sync_all(cluster, states)
        assert all(w.tobytes() == weights[0].tobytes() for w in weights)
        assert cluster.master.statistics()["revisions"] == {0: 2}


async def test_without_a_reconnect_window_the_master_loss_ends_the_run(
        autojump_clock: trio.testing.MockClock) -> None:
    config = dataclasses.replace(CONFIG, reconnect_window=0.0)
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=config) as cluster:
        await cluster.restart_master()
        x = np.ones(8, np.float32)
        with pytest.raises(pccl.MasterConnectionError):
            await cluster.peer(0).all_reduce(x)


async def test_a_call_while_reconnecting_waits_then_fails_after_the_window(
        autojump_clock: trio.testing.MockClock) -> None:
    config = dataclasses.replace(CONFIG, reconnect_window=5.0)
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=config) as cluster:
        cluster.kill_master()  # and no master comes back
        await trio.sleep(0.01)
        assert cluster.peer(0).statistics()["reconnecting"]
        t0 = trio.current_time()
        with pytest.raises(pccl.MasterConnectionError, match="reconnect window"):
            await cluster.peer(0).are_peers_pending()
        assert 4.9 <= trio.current_time() - t0 <= 5.1
