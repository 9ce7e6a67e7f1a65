"""Issue 18: a live member that re-registers after a restarted master's roll call ended (virtual
network, MockClock).

Three peers train with the recipe's loop (sync the shared state, all-reduce the gradient, retried
after a lost peer, then admit pending peers). The master is killed and restarted; peer 2's link to the
master is cut meanwhile, so it comes back only after the roll call gave up on it and the other two went
on without it. It must be refused cleanly (KICKED: join again), never taken back into another call than
the others' (a deadlock) or with a diverged state: the others finish, and every revision a peer synced
holds the same bytes everywhere (docs/concepts.md "Surviving the master", roll call). Killed while peer 2
enters each call of the loop, with the roll call ended by its grace and by its quiet period.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import MasterConfig, PeerConfig, ReduceOp, SharedState, TensorInfo
from pccl.peer.communicator import Communicator
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, MASTER, VirtualNetwork, open_test_cluster

CONFIG: PeerConfig = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=60.0)
STEPS = 40


class Phases:
    """Where each peer's loop is; ``at(rank, phase)`` is set once that peer enters ``phase`` at step 10
    or later."""

    def __init__(self) -> None:
        self.events: dict[tuple[int, str], trio.Event] = {}

    def at(self, rank: int, phase: str) -> trio.Event:
        return self.events.setdefault((rank, phase), trio.Event())

    def enter(self, rank: int, phase: str, revision: int) -> None:
        if revision >= 10:
            self.at(rank, phase).set()


async def train(comm: Communicator, rank: int, synced: dict[int, str], out: dict[str, object],
                phases: Phases) -> None:
    """The recipe's loop; ``synced``: revision -> hash of the weights this peer synced at it."""
    w = np.zeros(8, np.float32)
    state = SharedState([TensorInfo.from_numpy(w, "w")], revision=0)
    try:
        while state.revision < STEPS:
            phases.enter(rank, "sync", state.revision)
            while True:
                try:
                    await comm.sync_shared_state(state)
                    break
                except pccl.RankConnectionLostError:
                    continue
            synced[state.revision] = hashlib.sha256(w.tobytes()).hexdigest()
            g = np.full(8, float(rank + state.revision % 5), np.float32)
            phases.enter(rank, "all_reduce", state.revision)
            while True:
                try:
                    await comm.all_reduce(g, g, op=ReduceOp.AVG)
                    break
                except pccl.RankConnectionLostError:
                    continue
            w -= 0.01 * g
            state.revision += 1
            phases.enter(rank, "compute", state.revision)
            await trio.sleep(0.02)  # compute
            phases.enter(rank, "are_peers_pending", state.revision)
            while True:
                try:
                    if await comm.are_peers_pending():
                        await comm.update_topology()
                    break
                except (pccl.RankConnectionLostError, pccl.UpdateTopologyFailedError):
                    continue
        out["done"] = state.revision
    except pccl.MasterConnectionError as exc:
        out["error"] = exc


@pytest.mark.parametrize("phase", ["sync", "all_reduce", "compute", "are_peers_pending"])
@pytest.mark.parametrize("quiet", [None, MasterConfig().rebuild_quiet], ids=["grace", "quiet"])
async def test_a_member_back_after_the_roll_call_is_refused_cleanly(
        autojump_clock: trio.testing.MockClock, quiet: float | None, phase: str) -> None:
    master_config: MasterConfig = dataclasses.replace(DEFAULT_MASTER_CONFIG, rebuild_grace=1.0,
                                                      rebuild_quiet=quiet)
    net = VirtualNetwork(latency=0.001)
    async with open_test_cluster(3, network=net, config=CONFIG, master_config=master_config) as cluster:
        synced: list[dict[int, str]] = [{}, {}, {}]
        outs: list[dict[str, object]] = [{}, {}, {}]
        with trio.fail_after(300):
            phases = Phases()
            for i in range(3):
                cluster.start_soon(i, train, cluster.peer(i), i, synced[i], outs[i], phases)
            await phases.at(2, phase).wait()  # the master dies while peer 2 enters that call
            cluster.partition(2, MASTER)  # peer 2 cannot reach the master (its connects time out)
            await cluster.restart_master(delay=0.5)
            start = len(synced[0])
            while len(synced[0]) < start + 5:  # the others went on without peer 2
                await trio.sleep(0.01)
            assert cluster.master.state.accepted() == [cluster.peer(0).peer_id, cluster.peer(1).peer_id]
            cluster.heal(2, MASTER)
            while not all(outs):  # a deadlock: fail_after
                await trio.sleep(0.05)
        assert outs[0] == outs[1] == {"done": STEPS}
        # Refused cleanly (KICKED: its group completed operations without it), wherever its loop was
        # when the master died; its loop ends with MASTER_CONNECTION_FAILED. (Before, it was taken back
        # and the master's deadlock watch failed every call with INVALID_USAGE.)
        late = outs[2].get("error")
        assert isinstance(late, pccl.MasterConnectionError) and "join again" in late.message, outs[2]
        assert cluster.master.state.accepted() == [cluster.peer(0).peer_id, cluster.peer(1).peer_id]
        for rev, h in synced[2].items():  # whatever it synced is what the others synced
            assert synced[0][rev] == h, rev
        assert synced[0] == synced[1]
