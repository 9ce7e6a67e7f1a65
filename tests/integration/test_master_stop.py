"""A master that stops decides nothing on its way down.

When the master is stopped (cancelled: ``MasterNode.interrupt()``, the end of ``open_master``), each of
its connections closes. The departures these closes look like must not complete a vote: a pending
query or topology round still waiting for a member that is not in it would otherwise be answered to
its voters over connections that had not closed yet, and a peer would take "nobody pending" from a
master that is gone (seen once in CI, tests/blocking/test_master_loss.py). Over loopback TCP, where
the master writes control messages straight into the socket.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

import pccl
from pccl.testing import DEFAULT_PEER_CONFIG, open_test_cluster

CONFIG = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=0)


@pytest.mark.parametrize("call", ["are_peers_pending", "update_topology"])
async def test_stopping_master_answers_no_vote(call: str) -> None:
    async with open_test_cluster(3, config=CONFIG) as cluster:
        inside = cluster.peers[:2]  # the third never votes: the round waits for it
        results: list[object] = [None, None]

        async def vote(i: int) -> None:
            try:
                results[i] = await getattr(inside[i], call)()
            except pccl.PCCLError as exc:
                results[i] = exc

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(vote, i)
                key = "pending_votes" if call == "are_peers_pending" else "topology_votes"
                while cluster.master.statistics()[key] < 2:  # both votes are at the master
                    await trio.sleep(0.001)
                master = cluster.master
                cluster.kill_master()
        for r in results:
            assert isinstance(r, pccl.MasterConnectionError), r
        await trio.testing.wait_all_tasks_blocked()
        # The master recorded no departure while it stopped: all three are still its members.
        assert master.statistics()["accepted"] == 3
