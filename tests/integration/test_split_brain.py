"""Issue 18 item 3: no split brain with two reachable masters (virtual network, MockClock).

Five peers train with a master and a standby (``open_communicator([m1, m2])``, a reconnect window).
The network splits: three peers keep only the standby, two keep only the old master (which stays
alive), and the two halves cannot reach each other. The majority fails over to the standby, which
rebuilds the run (a majority of the epoch's members came back) and goes on. The old master holds
a minority of its epoch: it completes nothing, and after its hold timeout it gives the run up, so
its two peers look for a newer master. After healing they are taken back by the standby: one run,
identical shared states. Without the rule (``quorum="off"``) the minority completes collectives of
its own (the control test), which is the split brain the rule prevents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import MasterConfig, PeerConfig, ReduceOp, SharedState, TensorInfo
from pccl.master.server import MasterHandle, open_master
from pccl.peer.communicator import Communicator, open_communicator
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualHost, VirtualNetwork

N = 5
MAJORITY, MINORITY = [0, 1, 2], [3, 4]
STEPS = 3  # steps the majority completes while partitioned
HOLD = 10.0  # the old master's quorum_hold_timeout (virtual seconds)
PEER_CFG: PeerConfig = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=120.0)


def master_config(quorum: str) -> MasterConfig:
    return MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, quorum=quorum,
                        quorum_hold_timeout=HOLD)


class Run:
    """Two masters (``m1`` serving, ``m2`` standby) and N peers, each on its own virtual host."""

    def __init__(self, net: VirtualNetwork, nursery: trio.Nursery) -> None:
        self.net = net
        self.nursery = nursery
        self.masters: list[MasterHandle] = []
        self.comms: list[Communicator] = []
        self.hosts: list[VirtualHost] = []
        self.stop = trio.Event()

    async def start_master(self, name: str, config: MasterConfig) -> None:
        host = self.net.host(name)

        async def serve(task_status: trio.TaskStatus[MasterHandle] = trio.TASK_STATUS_IGNORED) -> None:
            async with open_master(f"{host.address}:0", config=config, transport=host) as handle:
                task_status.started(handle)
                await trio.sleep_forever()

        self.masters.append(await self.nursery.start(serve))

    async def start_peers(self) -> None:
        addresses: list[str | tuple[str, int]] = [m.connect_address for m in self.masters]
        boxes: list[Communicator | None] = [None] * N
        self.hosts = [self.net.host(f"peer{i}") for i in range(N)]

        async def peer(i: int) -> None:
            host = self.hosts[i]
            config = dataclasses.replace(PEER_CFG, p2p_listen_host=host.address)
            async with open_communicator(addresses, config=config, transport=host) as comm:
                boxes[i] = comm
                await self.stop.wait()

        self.nursery.start_soon(peer, 0)
        while boxes[0] is None:
            await trio.sleep(0.01)
        for i in range(1, N):
            self.nursery.start_soon(peer, i)
        while len(self.masters[0].state.registered()) < N - 1:
            await trio.sleep(0.01)
        first = boxes[0]
        await first.update_topology()  # admits the other four in one round
        while any(b is None for b in boxes):
            await trio.sleep(0.01)
        self.comms = [b for b in boxes if b is not None]

    def split(self) -> None:
        """Majority <-> standby only, minority <-> old master only, and no traffic between the halves."""
        m1, m2 = self.net.host("m1"), self.net.host("m2")
        self.net.partition(m1, m2)
        for i in MAJORITY:
            self.net.partition(self.hosts[i], m1)
            for j in MINORITY:
                self.net.partition(self.hosts[i], self.hosts[j])
        for j in MINORITY:
            self.net.partition(self.hosts[j], m2)


@asynccontextmanager
async def open_run(old_master_quorum: str) -> AsyncIterator[Run]:
    net = VirtualNetwork(latency=0.001)
    async with trio.open_nursery() as nursery:
        run = Run(net, nursery)
        await run.start_master("m1", master_config(old_master_quorum))
        await run.start_master("m2", master_config("auto"))
        await run.start_peers()
        yield run
        run.stop.set()
        nursery.cancel_scope.cancel()


def grad_of(comm: Communicator) -> np.ndarray:
    return np.full(64, float(comm.peer_id), np.float32)


async def step(comm: Communicator, w: np.ndarray, state: SharedState, done: Callable[[int], None]) -> None:
    """One training step: all-reduce the gradient (retried while the master fails over), apply it,
    sync the shared state at the next revision (retried likewise). ``done(world)`` per all-reduce."""
    grad = grad_of(comm)
    while True:
        out = np.empty_like(grad)
        try:
            info = await comm.all_reduce(grad, out, op=ReduceOp.SUM)
            break
        except pccl.RankConnectionLostError:
            continue
    done(info.local_world_size)
    w += out
    state.revision += 1
    while True:
        try:
            await comm.sync_shared_state(state)
            return
        except pccl.RankConnectionLostError:
            continue


async def test_no_split_brain_with_a_live_old_master(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(600):
        async with open_run("auto") as run:
            old, standby = run.masters
            comms = run.comms
            weights = [np.full(64, float(i), np.float32) for i in range(N)]
            states = [SharedState([TensorInfo.from_numpy(w, "w")]) for w in weights]
            states[0].revision = 1  # peer 0's content wins the first sync
            async with trio.open_nursery() as nursery:
                for i in range(N):
                    nursery.start_soon(comms[i].sync_shared_state, states[i])
            assert old.state.enforced  # the peers said they can fail over

            # two lockstep steps of the whole run, then the split
            worlds: dict[str, list[int]] = {"before": [], "majority": [], "minority": [], "after": []}
            for _ in range(2):
                async with trio.open_nursery() as nursery:
                    for i in range(N):
                        nursery.start_soon(step, comms[i], weights[i], states[i], worlds["before"].append)
            assert worlds["before"] == [N] * (2 * N)
            run.split()

            minority_errors: list[pccl.PCCLError] = []

            async def minority(i: int) -> None:
                grad = grad_of(comms[i])
                out = np.empty_like(grad)
                try:
                    info = await comms[i].all_reduce(grad, out, op=ReduceOp.SUM)
                except pccl.PCCLError as exc:
                    minority_errors.append(exc)
                else:
                    worlds["minority"].append(info.local_world_size)

            async def majority(i: int) -> None:
                for _ in range(STEPS):
                    await step(comms[i], weights[i], states[i], worlds["majority"].append)

            async with trio.open_nursery() as nursery:
                for i in MINORITY:
                    nursery.start_soon(minority, i)
                for i in MAJORITY:
                    nursery.start_soon(majority, i)
            # The majority went on with the standby; the old master completed nothing for its two.
            assert worlds["majority"] == [len(MAJORITY)] * (STEPS * len(MAJORITY))
            assert worlds["minority"] == []
            assert len(minority_errors) == len(MINORITY)
            assert all(isinstance(e, pccl.RankConnectionLostError) and "newer master" in e.message
                       for e in minority_errors), minority_errors
            s_old, s_new = old.statistics(), standby.statistics()
            assert s_old["accepted"] == 0 and s_new["accepted"] == len(MAJORITY)
            assert s_new["generation"] == 2 and s_new["revisions"] == {0: 3 + STEPS}

            # heal: the minority is refused by the old master and taken back by the standby
            run.net.heal()
            while standby.statistics()["accepted"] < N:
                await trio.sleep(0.05)
            async with trio.open_nursery() as nursery:
                for i in range(N):
                    nursery.start_soon(step, comms[i], weights[i], states[i], worlds["after"].append)
            assert worlds["after"] == [N] * N
            assert all(w.tobytes() == weights[0].tobytes() for w in weights)
            assert {st.revision for st in states} == {4 + STEPS}
            assert all(c.statistics()["generation"] == 2 for c in comms)
            assert old.statistics()["accepted"] == 0


async def test_control_without_the_rule_the_minority_goes_on_alone(
        autojump_clock: trio.testing.MockClock) -> None:
    """The same split with ``quorum="off"`` on the old master: both halves complete all-reduces
    (the split brain the rule prevents; this is what the test above would see without it)."""
    with trio.fail_after(600):
        async with open_run("off") as run:
            comms = run.comms
            run.split()
            worlds: list[int] = []

            async def one(i: int) -> None:
                grad = grad_of(comms[i])
                while True:
                    out = np.empty_like(grad)
                    try:
                        info = await comms[i].all_reduce(grad, out, op=ReduceOp.SUM)
                    except pccl.RankConnectionLostError:
                        continue
                    worlds.append(info.local_world_size)
                    return

            async with trio.open_nursery() as nursery:
                for i in range(N):
                    nursery.start_soon(one, i)
            assert sorted(worlds) == [2, 2, 3, 3, 3]


def test_master_config_checks_the_quorum_settings() -> None:
    with pytest.raises(ValueError, match="quorum must be"):
        MasterConfig(quorum="majority")
    with pytest.raises(ValueError, match="quorum_hold_timeout"):
        MasterConfig(quorum_hold_timeout=0.0)
    assert MasterConfig().quorum == "auto"
    assert MasterConfig(quorum_hold_timeout=None).quorum_hold_timeout is None
