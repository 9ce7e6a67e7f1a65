"""Issue 18 item 3: a newcomer that reaches a restarted master before the run's members (virtual
network, MockClock).

The members are cut off from the master while it restarts, so a newcomer registers first and, the
master holding no run, is accepted alone. When the members get through they re-register and win:
the newcomer is told to join again (``KICKED``), the master rebuilds the run (generation 2, the
members' ids, epoch and revision), and the newcomer, joining again, is admitted by the members'
``update_topology`` and receives the run's shared state. Before the fix the members were refused
("epoch moved on") and the run was over.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import PeerConfig, SharedState, TensorInfo
from pccl.testing import DEFAULT_PEER_CONFIG, MASTER, VirtualNetwork, open_test_cluster

CONFIG: PeerConfig = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=60.0)


async def test_members_win_over_a_newcomer_that_reached_the_restarted_master_first(
        autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(300):
        async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
            ids = [c.peer_id for c in cluster.peers]
            weights = [np.full(16, float(i + 1), np.float32) for i in range(3)]
            states = [SharedState([TensorInfo.from_numpy(w, "w")]) for w in weights]
            for st in states:
                st.revision = 1
            states[0].revision = 2
            await cluster.run_all(lambda i, comm: comm.sync_shared_state(states[i]))
            assert all(w.tobytes() == weights[0].tobytes() for w in weights)

            for i in range(3):
                cluster.partition(i, MASTER)
            await cluster.restart_master()
            idx = await cluster.add_peer(admit=False)  # the master holds no run: accepted alone
            newcomer = cluster.peer(idx)
            assert cluster.master.state.accepted() == [newcomer.peer_id]

            cluster.heal()
            while cluster.master.statistics()["accepted"] < 3 or cluster.master.statistics()["rebuilding"]:
                await trio.sleep(0.05)
            s = cluster.master.statistics()
            assert s["generation"] == 2 and s["revisions"] == {0: 2}
            assert sorted(cluster.master.state.accepted()) == sorted(ids)
            assert [cluster.peer(i).peer_id for i in range(3)] == ids  # every member kept its id
            with pytest.raises(pccl.KickedError, match="join again"):
                await newcomer.all_reduce(np.ones(4, np.float32))
            cluster.kill(idx)

            # joining again, it is admitted by the members' vote and gets the run's state
            again = await cluster.add_peer()
            joined = np.zeros(16, np.float32)
            weights.append(joined)
            states.append(SharedState([TensorInfo.from_numpy(joined, "w")]))
            for st in states:
                st.revision = 3
            states[-1].revision = 0  # it has nothing: outdated
            members = [0, 1, 2, again]
            await cluster.run_all(lambda k, comm: comm.sync_shared_state(states[members.index(k)]),
                                  indexes=members)
            assert all(w.tobytes() == weights[0].tobytes() for w in weights)
            assert {st.revision for st in states} == {3}
            x = [np.full(4, 1.0, np.float32) for _ in members]
            infos = await cluster.run_all(lambda k, comm: comm.all_reduce(x[members.index(k)]),
                                          indexes=members)
            assert all(not isinstance(i, pccl.PCCLError) and i.local_world_size == 4 for i in infos), infos
