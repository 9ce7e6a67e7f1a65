"""Issue 18: membership rounds in doubt across a master crash (virtual network, MockClock).

Three members train (per step: a membership call, a shared-state sync, an all-reduce) and a newcomer
registers at step ``CRASH_STEP``, where the members call ``update_topology()`` to admit it (or first
``are_peers_pending()``). A traffic hook on the master's connections lets the first ``deliver`` answers
of one kind through and crashes the master exactly at the next one (each connection it writes to from
then on is reset before the bytes); a fresh master then starts on the same address. Every crash point
of the round is covered: before any ``EstablishP2P``, between them, after every setup was confirmed but
before any ``Accepted`` / ``TopologyResult``, between those, and between the ``PeersPendingResult``s.

Without one decision for all, some members would be at the new epoch (they committed the round and go on
to the sync) while the others retry the round: a deadlock, or members at different epochs. With it, the
rebuilt master commits the round for everybody or fails it for everybody (retryably, tables unchanged),
the newcomer joins consistently or, refused, joins again, and every step's all-reduce is exact on every
member that ran it, with identical states at the end.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import ReduceOp, SharedState, TensorInfo
from pccl.testing import (
    MASTER,
    HookAction,
    Reset,
    TestCluster,
    TrafficEvent,
    VirtualNetwork,
    open_test_cluster,
)
from pccl.wire import messages as m

from ._traffic import RECONNECTING_PEER as CONFIG
from ._traffic import ControlFrames, array_sum, grad

STEPS = 6
CRASH_STEP = 2
WORDS = 16
T = TypeVar("T")


class CrashAt:
    """Traffic hook on the master's connections: once armed, the first ``deliver`` messages of the
    ``kinds`` leave the master; at the next one, and for everything after it, each connection the master
    writes to is reset right before the bytes (a crash at that instant, as the peers see it), and
    ``fired`` is set so that the test crashes the master. Frames are parsed per connection, so a message
    is cut exactly at its first byte."""

    def __init__(self, master: str, kinds: tuple[type[m.Message], ...], deliver: int) -> None:
        self.master, self.kinds, self.deliver = master, kinds, deliver
        self.armed = False
        self.fired = trio.Event()
        self.delivered: list[m.Message] = []
        self._frames = ControlFrames()

    def __call__(self, ev: TrafficEvent) -> HookAction | None:
        if ev.src != self.master:
            return None
        if self.fired.is_set():
            return Reset(0)
        for start, _end, msg in self._frames.messages(ev.connection, ev.data):
            if self.armed and isinstance(msg, self.kinds):
                if len(self.delivered) >= self.deliver:
                    self.fired.set()
                    return Reset(max(0, start))
                self.delivered.append(msg)
        return None


async def retry(call: Callable[[], Awaitable[T]], *errors: type[pccl.PCCLError], log: list[str],
                what: str) -> T:
    """``call()`` until it succeeds, logging each of ``errors`` it fails with (others propagate)."""
    while True:
        try:
            return await call()
        except errors as exc:
            log.append(f"{what}: {type(exc).__name__}: {exc}")
            assert len(log) < 100, log[-3:]  # a call that keeps failing: the run does not go on


class Run:
    """The training loop of the members and of the newcomer, and what each of them saw."""

    def __init__(self, cluster: TestCluster, hook: CrashAt, at: str) -> None:
        self.cluster, self.hook, self.at = cluster, hook, at
        self.ran: dict[int, dict[int, bytes]] = {}  # peer id -> step -> the committed SUM
        self.weights: dict[int, np.ndarray] = {}
        self.failures: dict[int, list[str]] = {}
        self.newcomer_started = False
        self.newcomer_refused = 0  # how often the newcomer's join failed (the crash) and it joined again
        self.newcomer_id: int | None = None
        self.done = trio.Event()  # the newcomer finished its steps

    async def reduce(self, comm: pccl.AsyncCommunicator, state: SharedState, w: np.ndarray,
                     step: int) -> None:
        """The all-reduce of ``step`` (retried; a failed one leaves its output as it was)."""
        pid = comm.peer_id
        g, out = grad(pid, step, WORDS), np.zeros(WORDS, np.int64)

        async def once() -> object:
            try:
                return await comm.all_reduce(g, out, op=ReduceOp.SUM)
            except pccl.RankConnectionLostError:
                assert not out.any()
                raise

        await retry(once, pccl.RankConnectionLostError, log=self.failures.setdefault(pid, []),
                    what=f"{step} all_reduce")
        self.ran.setdefault(pid, {})[step] = out.tobytes()
        w += out
        state.revision += 1

    async def sync(self, comm: pccl.AsyncCommunicator, state: SharedState, what: str) -> None:
        await retry(lambda: comm.sync_shared_state(state), pccl.RankConnectionLostError,
                    log=self.failures.setdefault(comm.peer_id, []), what=what)

    async def membership(self, comm: pccl.AsyncCommunicator, step: int) -> None:
        log = self.failures.setdefault(comm.peer_id, [])
        if step == CRASH_STEP and not self.newcomer_started:
            self.newcomer_started = True
            self.cluster._nursery.start_soon(self.newcomer)
        if step >= CRASH_STEP and self.newcomer_id is None:
            while not self.cluster.master.state.registered() and self.newcomer_id is None:
                await trio.sleep(0.01)  # it (or its second try) registers: the round admits it
        if step == CRASH_STEP:
            self.hook.armed = True
        if step != CRASH_STEP or self.at == "pending":
            pending = await retry(comm.are_peers_pending, pccl.RankConnectionLostError, log=log,
                                  what=f"{step} are_peers_pending")
            if not pending:
                return
        await retry(comm.update_topology, pccl.UpdateTopologyFailedError, pccl.RankConnectionLostError,
                    log=log, what=f"{step} update_topology")

    async def member(self, i: int) -> None:
        comm = self.cluster.peer(i)
        w = np.zeros(WORDS, np.int64)
        state = SharedState([TensorInfo.from_numpy(w, "w")])
        for step in range(STEPS):
            await self.membership(comm, step)
            await self.sync(comm, state, f"{step} sync")
            assert state.revision == step
            await self.reduce(comm, state, w, step)
        self.weights[comm.peer_id] = w

    async def newcomer(self) -> None:
        while True:
            try:
                index = await self.cluster.add_peer(admit=False)
                break
            except pccl.MasterConnectionError as exc:
                # Not accepted when the master crashed: the loss is final for it; it joins again.
                self.newcomer_refused += 1
                assert self.newcomer_refused < 50, f"the newcomer cannot join: {exc}"
                await trio.sleep(0.2)
        comm = self.cluster.peer(index)
        self.newcomer_id = comm.peer_id
        w = np.zeros(WORDS, np.int64)
        state = SharedState([TensorInfo.from_numpy(w, "w")])
        # Its first sync is the members' sync of the step it was admitted at: the run's state and step.
        await self.sync(comm, state, "first sync")
        first = state.revision
        await self.reduce(comm, state, w, first)
        for step in range(first + 1, STEPS):
            await self.membership(comm, step)
            await self.sync(comm, state, f"{step} sync")
            assert state.revision == step
            await self.reduce(comm, state, w, step)
        self.weights[comm.peer_id] = w
        self.done.set()

    def check(self) -> None:
        """Every step's all-reduce is the exact SUM of exactly the peers that ran it, on each of them;
        every member ran every step; every peer ends with the same weights."""
        members = [c.peer_id for c in [self.cluster.peer(i) for i in range(3)]]
        for p in members:
            assert sorted(self.ran[p]) == list(range(STEPS)), (p, sorted(self.ran[p]))
        for step in range(STEPS):
            who = sorted(p for p, steps in self.ran.items() if step in steps)
            want = array_sum(grad(p, step, WORDS) for p in who)
            for p in who:
                got = np.frombuffer(self.ran[p][step], np.int64)
                assert got.tobytes() == want.tobytes(), \
                    f"step {step}: peer {p} got the SUM of {bin(int(got[0]))}, the step ran on {who}"
        assert self.newcomer_id is not None and self.newcomer_id in self.weights  # it joined, in the end
        assert len({w.tobytes() for w in self.weights.values()}) == 1, "the peers' states differ"


async def run(at: str, kinds: tuple[type[m.Message], ...], deliver: int) -> Run:
    network = VirtualNetwork(latency=0.001)
    async with open_test_cluster(3, network=network, config=CONFIG) as cluster:
        hook = CrashAt(cluster.host(MASTER).name, kinds, deliver)
        network.add_hook(hook)
        r = Run(cluster, hook, at)

        async def crash_when_fired() -> None:
            await hook.fired.wait()
            cluster.kill_master()
            network.remove_hook(hook)
            await cluster.restart_master()

        with trio.fail_after(300):  # no call hangs
            async with trio.open_nursery() as nursery:
                nursery.start_soon(crash_when_fired)
                async with trio.open_nursery() as peers:
                    for i in range(3):
                        peers.start_soon(r.member, i)
                await r.done.wait()
                nursery.cancel_scope.cancel()
        assert hook.fired.is_set(), "the crash never happened"
        stats = cluster.master.statistics()
        assert stats["generation"] == 2 and stats["in_doubt"] == 0
        assert not cluster.master.state.rounds.undecided
        r.check()
        return r


def split_round_failures(r: Run, members: list[int], call: str) -> list[int]:
    """The members whose ``call`` at the crash step failed (and was retried)."""
    return [p for p in members if any(f.startswith(f"{CRASH_STEP} {call}") for f in r.failures.get(p, []))]


ANSWERS = (m.Accepted, m.TopologyResult)


@pytest.mark.parametrize("deliver", [0, 1, 2])
async def test_crash_between_the_establish_p2p_of_one_round(autojump_clock: trio.testing.MockClock,
                                                          deliver: int) -> None:
    """Before any EstablishP2P (0) or between them: no member can have committed, so everyone's call
    fails (the ones that confirmed their setup are told so by the rebuilt master) and they retry;
    the newcomer, not accepted, joins again."""
    r = await run("update", (m.EstablishP2P,), deliver)
    members = [c.peer_id for c in [r.cluster.peer(i) for i in range(3)]]
    assert split_round_failures(r, members, "update_topology") == members
    assert r.newcomer_refused == 1


async def test_crash_after_every_setup_before_any_answer(autojump_clock: trio.testing.MockClock) -> None:
    """Every member confirmed its setup, nobody got an answer: the newcomer may have been accepted, so
    the rebuilt master waits for it; it never comes back (its join failed), and after the timeout the
    round is aborted for every member, who retry; the newcomer joins again."""
    r = await run("update", ANSWERS, 0)
    members = [c.peer_id for c in [r.cluster.peer(i) for i in range(3)]]
    assert split_round_failures(r, members, "update_topology") == members
    for p in members:  # each was told by the rebuilt master: the call waited for its decision
        (first, *_) = [f for f in r.failures[p] if f.startswith(f"{CRASH_STEP} update_topology")]
        assert "UpdateTopologyFailedError" in first and "in doubt" in first, first
    assert r.newcomer_refused == 1


@pytest.mark.parametrize("deliver", [1, 2, 3])
async def test_crash_between_the_answers_of_one_round(autojump_clock: trio.testing.MockClock,
                                                      deliver: int) -> None:
    """The newcomer's Accepted, then some members' TopologyResults, arrived: the round committed; the
    rebuilt master commits it for the members in doubt too, and nobody's update_topology fails."""
    r = await run("update", ANSWERS, deliver)
    members = [c.peer_id for c in [r.cluster.peer(i) for i in range(3)]]
    assert split_round_failures(r, members, "update_topology") == []
    if isinstance(r.hook.delivered[0], m.Accepted):
        assert r.newcomer_refused == 0  # accepted before the crash: it stayed a member throughout


@pytest.mark.parametrize("deliver", [0, 1, 2])
async def test_crash_between_the_answers_of_are_peers_pending(autojump_clock: trio.testing.MockClock,
                                                              deliver: int) -> None:
    """The members' are_peers_pending is split: those in doubt get the answer the others got (True), or,
    nobody having one, the round runs at the rebuilt master; nobody's call fails, every member then
    agrees on whether to call update_topology."""
    r = await run("pending", (m.PeersPendingResult,), deliver)
    members = [c.peer_id for c in [r.cluster.peer(i) for i in range(3)]]
    assert split_round_failures(r, members, "are_peers_pending") == []
