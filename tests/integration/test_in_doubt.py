"""Issue 18: operations in doubt across a master crash (virtual network, MockClock).

The master is crashed exactly between the answers of one operation: the first participant's
``CollectiveComplete`` (or ``SharedStateResult``) is delivered, the others' are not (a traffic hook on the
master's connections stalls them, then the master host crashes and a fresh master starts on the same
address). Without a common decision the first peer would be a step ahead of the others (it committed,
they retry), and a training loop that syncs its shared state every step would deadlock (one peer in the
sync, the others in the all-reduce). With it, the rebuilt master commits the operation for everybody (or
aborts it for everybody), and the loop goes on with identical states and no lost or duplicated revision.
"""

from __future__ import annotations

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

STEPS = 8
CRASH_STEP = 3  # the step whose all-reduce (or sync) is split by the crash
WORDS = 32


class SplitAnswer:
    """Traffic hook on the master's connections: once armed, the first peer that gets the master's
    answer of the next operation of type ``kind`` gets it; from the next such answer on, nothing more
    leaves the master: each connection it writes to is reset right before the bytes (what a crash at
    that instant looks like to the peers), and ``fired`` is set, so that the test crashes the master.

    Frames are parsed per connection (a length prefix, then a message), so an answer is cut exactly
    at its first byte, wherever the chunks of the stream begin.
    """

    def __init__(self, master: str, kind: type[m.Message]) -> None:
        self.master, self.kind = master, kind
        self.armed = False
        self.fired = trio.Event()
        self.delivered_to: int | None = None  # the connection that got the one answer
        self.answer: m.Message | None = None
        self._frames = ControlFrames()

    def _is_answer(self, msg: m.Message) -> bool:
        if not isinstance(msg, self.kind):
            return False
        return not isinstance(msg, m.SharedStateResult) or (msg.success and msg.sync_seq >= 0)

    def __call__(self, ev: TrafficEvent) -> HookAction | None:
        if ev.src != self.master:
            return None
        if self.fired.is_set():
            return Reset(0)  # the master is crashing: nothing else leaves it
        for start, _end, msg in self._frames.messages(ev.connection, ev.data):
            if self.armed and self._is_answer(msg):
                if self.delivered_to is None:
                    self.delivered_to, self.answer = ev.connection, msg
                elif ev.connection != self.delivered_to:
                    self.fired.set()
                    return Reset(max(0, start))
        return None


async def crash_and_restart(cluster: TestCluster, splitter: SplitAnswer) -> None:
    """Crash the master (what it still held back is lost), then start a fresh one on its address."""
    cluster.kill_master()
    assert cluster.network is not None
    cluster.network.remove_hook(splitter)
    await cluster.restart_master()


async def train(cluster: TestCluster, splitter: SplitAnswer, at: str) -> dict[str, object]:
    """Every peer: per step a sync_shared_state, then an all-reduce of its gradient (both retried on
    RANK_CONNECTION_LOST). The splitter is armed inside step ``CRASH_STEP``'s ``at`` ("sync" or
    "all_reduce"), and the master restarted when it fires."""
    n = len(cluster.alive)
    ids = [c.peer_id for c in cluster.peers]
    weights = [np.zeros(WORDS, np.int64) for _ in range(n)]
    states = [SharedState([TensorInfo.from_numpy(w, "w")]) for w in weights]
    results: list[list[bytes]] = [[] for _ in range(n)]  # per peer, per step: the committed SUM
    synced: list[list[int]] = [[] for _ in range(n)]  # per peer: the revision after each successful sync
    failures: list[list[tuple[int, str]]] = [[] for _ in range(n)]  # per peer: (step, call) that failed

    async def loop(i: int) -> None:
        comm = cluster.peer(i)
        for step in range(STEPS):
            if step == CRASH_STEP and at == "sync":
                splitter.armed = True
            while True:
                before = (weights[i].tobytes(), states[i].revision)
                try:
                    await comm.sync_shared_state(states[i])
                    break
                except pccl.RankConnectionLostError:
                    # a failed sync changed nothing
                    assert (weights[i].tobytes(), states[i].revision) == before
                    failures[i].append((step, "sync"))
            synced[i].append(states[i].revision)
            if step == CRASH_STEP and at == "all_reduce":
                splitter.armed = True
            g, out = grad(comm.peer_id, step), np.zeros(WORDS, np.int64)
            while True:
                try:
                    await comm.all_reduce(g, out, op=ReduceOp.SUM)
                    break
                except pccl.RankConnectionLostError:
                    assert not out.any()  # a failed all-reduce left its output as it was
                    failures[i].append((step, "all_reduce"))
            results[i].append(out.tobytes())
            weights[i] += out
            states[i].revision += 1

    async def crash_when_split() -> None:
        await splitter.fired.wait()
        await crash_and_restart(cluster, splitter)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(crash_when_split)
            async with trio.open_nursery() as peers:
                for i in range(n):
                    peers.start_soon(loop, i)
            nursery.cancel_scope.cancel()
    assert splitter.fired.is_set(), "the crash never happened"
    want = [array_sum(grad(p, s) for p in ids).tobytes() for s in range(STEPS)]
    for i in range(n):
        assert results[i] == want, f"peer {i}: the committed all-reduces are not every peer's SUM"
        assert synced[i] == list(range(STEPS)), f"peer {i}: revisions after the syncs: {synced[i]}"
        assert weights[i].tobytes() == weights[0].tobytes()
    return {"failures": failures, "master": cluster.master.statistics()}


@pytest.mark.parametrize("at", ["all_reduce", "sync"])
async def test_master_crash_between_the_answers_of_one_operation(
        autojump_clock: trio.testing.MockClock, at: str) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        kind: type[m.Message] = m.CollectiveComplete if at == "all_reduce" else m.SharedStateResult
        splitter = SplitAnswer(cluster.host(MASTER).name, kind)
        assert cluster.network is not None
        cluster.network.add_hook(splitter)
        out = await train(cluster, splitter, at)
        stats = out["master"]
        assert isinstance(stats, dict)
        assert stats["generation"] == 2 and stats["accepted"] == 3 and stats["in_doubt"] == 0
        # The peer that had the answer committed; the others were in doubt and were told to commit
        # too: nobody had to retry the split operation itself. Only the committed peer's next call,
        # in flight at the crash, may have failed (and was retried).
        failures = out["failures"]
        assert isinstance(failures, list)
        assert all((CRASH_STEP, at) not in f and len(f) <= 1 for f in failures), failures


async def test_nobody_answered_every_participant_done_commits(autojump_clock: trio.testing.MockClock) -> None:
    """The crash lands before any answer left the master: every participant is in doubt, every part
    is finished, so the rebuilt master commits the op for all of them."""
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        splitter = SplitAnswer(cluster.host(MASTER).name, m.CollectiveComplete)
        splitter.delivered_to = -1  # no connection has id -1: the first answer already fires
        assert cluster.network is not None
        cluster.network.add_hook(splitter)
        out = await train(cluster, splitter, "all_reduce")
        assert out["failures"] == [[], [], []], out  # nobody had moved on, nobody retried


async def test_a_participant_lost_with_the_master_aborts_for_the_others(
        autojump_clock: trio.testing.MockClock) -> None:
    """The crash splits an all-reduce and the one peer that committed dies with the master: nothing
    tells the others whether it committed, so when the roll call gives up on it the op is aborted
    for both (their buffers unchanged), and they retry it as a world of 2, identically."""
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        splitter = SplitAnswer(cluster.host(MASTER).name, m.CollectiveComplete)
        assert cluster.network is not None
        cluster.network.add_hook(splitter)
        x = [np.full(WORDS, 1 << c.peer_id, np.int64) for c in cluster.peers]
        outs = [np.zeros(WORDS, np.int64) for _ in x]
        errors: list[BaseException | None] = [None] * 3
        first_commit = trio.Event()
        splitter.armed = True

        async def one(i: int) -> None:
            try:
                await cluster.peer(i).all_reduce(x[i], outs[i])
                first_commit.set()
            except pccl.PCCLError as exc:
                errors[i] = exc

        async def crash() -> None:
            await splitter.fired.wait()
            await first_commit.wait()  # the one answer that left the master arrived
            # The peer that got it (it committed) dies with the master.
            committed = next(i for i in range(3) if outs[i].any())
            cluster.kill(committed)
            await crash_and_restart(cluster, splitter)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(crash)
                for i in range(3):
                    nursery.start_soon(one, i)
        committed = [i for i in range(3) if errors[i] is None]
        assert len(committed) == 1
        others = [i for i in range(3) if i not in committed]
        for i in others:
            assert isinstance(errors[i], pccl.RankConnectionLostError), errors[i]
            assert "in doubt" in str(errors[i])
            assert not outs[i].any()  # aborted: the buffer holds what it held
        # They agree: the retry runs with the two of them.
        async with trio.open_nursery() as nursery:
            for i in others:
                nursery.start_soon(one, i)
        want = array_sum(x[i] for i in others)
        assert all(outs[i].tobytes() == want.tobytes() for i in others)
