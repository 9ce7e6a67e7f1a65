"""A master that stops decides nothing on its way down; a bug on one message does not stop it.

When the master is stopped (cancelled: ``MasterNode.interrupt()``, the end of ``open_master``), each of
its connections closes. The departures these closes look like must not complete a vote: a pending
query or topology round still waiting for a member that is not in it would otherwise be answered to
its voters over connections that had not closed yet, and a peer would take "nobody pending" from a
master that is gone (seen once in CI, tests/blocking/test_master_loss.py). Over loopback TCP, where
the master writes control messages straight into the socket.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl.master.state import MasterState
from pccl.testing import DEFAULT_PEER_CONFIG, open_test_cluster
from pccl.wire import messages as m

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


async def test_a_bug_of_the_master_on_one_message_refuses_its_sender_only(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An exception of the master's core while handling a message (a bug) is logged with its traceback
    and refuses that message's sender (code INTERNAL_ERROR, with the reason); the master serves on and
    the other members' collectives complete, exactly."""

    def broken(state: MasterState, rec: object, msg: m.Message) -> list[object]:
        raise RuntimeError("a bug in the handler")

    monkeypatch.setitem(MasterState._HANDLERS, m.PeersPendingVote, broken)
    async with open_test_cluster(3, config=CONFIG) as cluster:
        with trio.fail_after(30):
            with pytest.raises(pccl.PCCLError) as info:
                await cluster.peer(0).are_peers_pending()
            # The peer is removed (its calls fail as the master's loss does) and told why.
            assert info.value.result == pccl.Result.MASTER_CONNECTION_FAILED, info.value
            assert "internal error of the master handling its PeersPendingVote" in str(info.value)
            while cluster.master.statistics()["accepted"] != 2:
                await trio.sleep(0.001)
            survivors = cluster.peers[1:]
            async with trio.open_nursery() as nursery:
                for c in survivors:
                    nursery.start_soon(c.update_topology)
            outs = [np.empty(8, np.float64) for _ in survivors]
            async with trio.open_nursery() as nursery:
                for c, out in zip(survivors, outs, strict=True):
                    nursery.start_soon(functools.partial(c.all_reduce, np.full(8, float(c.peer_id)), out,
                                                         op=pccl.ReduceOp.SUM))
        want = float(sum(c.peer_id for c in survivors))
        assert all((out == want).all() for out in outs)
    assert "internal error handling a PeersPendingVote" in caplog.text
    assert "a bug in the handler" in caplog.text  # the traceback is in the log
