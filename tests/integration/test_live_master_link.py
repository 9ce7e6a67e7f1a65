"""Issue 18: a member whose link to a LIVE master breaks (virtual network, MockClock).

The master stays up; one member's master connection is reset (a middlebox drops it) at one point of an
all-reduce or a shared-state sync: before its vote reaches the master, right after it, after the
master's commence, during the data plane, before the master's ``CollectiveComplete`` / result. The member
fails its call (or, its part finished, keeps it in doubt) and re-registers with the same master; the
others are still connected. Every member runs the loop that recovers through its membership phase: on a
retryable failure, ``update_topology()``, then the retry. Without a common failure the cut member votes
for a topology round while the others wait in the operation (a deadlock, which the deadlock watch ends
with INVALID_USAGE, or a hang); with it (docs/concepts.md "A member's link breaks") every member's call
of that operation fails the same way, and every step completes exactly on every member.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import MasterConfig, ReduceOp, SharedState, TensorInfo
from pccl.master.state import Phase
from pccl.testing import (
    DEFAULT_MASTER_CONFIG,
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

HOLD: MasterConfig = dataclasses.replace(DEFAULT_MASTER_CONFIG, rejoin_grace=1.0)


def master_config(point: str, hold: bool) -> MasterConfig:
    """The master's config for a cut at ``point``: with the hold (``rejoin_grace``) or without. The cut
    point "after_commence" of a speculative step is the tableless commence, which the master holds back
    (``speculative_go_delay``) past the end of an operation as short as these: there it goes at once."""
    base = HOLD if hold else DEFAULT_MASTER_CONFIG
    return dataclasses.replace(base, speculative_go_delay=0.0) if point == "after_commence" else base
STEPS = 5
WORDS = 32
CUT = 2  # the index of the member whose master link breaks

RETRYABLE = (pccl.RankConnectionLostError, pccl.UpdateTopologyFailedError)


class CutAt:
    """Traffic hook: once armed, the first frame of type ``kind`` on the master link of host ``peer``
    (in the direction that message travels) resets that connection, right ``before`` the frame (it never
    arrives) or right after it (it arrives, then the reset). Frames are parsed per connection direction.
    """

    def __init__(self, peer: str, master: str, kind: type[m.Message], before: bool) -> None:
        self.peer, self.master, self.kind, self.before = peer, master, kind, before
        self.armed = False
        self.fired = trio.Event()
        self._frames = ControlFrames()

    def __call__(self, ev: TrafficEvent) -> HookAction | None:
        if {ev.src, ev.dst} != {self.peer, self.master} or self.fired.is_set():
            return None
        for start, end, msg in self._frames.messages((ev.connection, ev.src), ev.data):
            if self.armed and isinstance(msg, self.kind):
                self.fired.set()
                return Reset(max(0, start if self.before else end))
        return None


class DataPlane:
    """Traffic hook: once armed, the first P2P data the cut member sends sets ``started``."""

    def __init__(self, peer: str, master: str) -> None:
        self.peer, self.master = peer, master
        self.armed = False
        self.started = trio.Event()

    def __call__(self, ev: TrafficEvent) -> HookAction | None:
        if self.armed and ev.src == self.peer and ev.dst != self.master:
            self.started.set()
        return None


# (where, call, message type, before): where the cut member's master link breaks.
POINTS = {
    "before_vote": ("all_reduce", m.CollectiveInitiate, True),
    "after_vote": ("all_reduce", m.CollectiveInitiate, False),
    "after_commence": ("all_reduce", m.CollectiveCommence, False),
    "data_plane": ("all_reduce", None, False),
    "before_complete": ("all_reduce", m.CollectiveComplete, True),
    "sync_before_vote": ("sync", m.SharedStateSync, True),
    "sync_after_vote": ("sync", m.SharedStateSync, False),
    "sync_before_result": ("sync", m.SharedStateResult, True),
    "pending_before_vote": ("pending", m.PeersPendingVote, True),
    "pending_after_vote": ("pending", m.PeersPendingVote, False),
    "pending_before_result": ("pending", m.PeersPendingResult, True),
    "topology_before_vote": ("topology", m.UpdateTopologyVote, True),
    "topology_after_vote": ("topology", m.UpdateTopologyVote, False),
    "topology_after_establish": ("topology", m.EstablishP2P, False),
    "topology_before_result": ("topology", m.TopologyResult, True),
}


@dataclasses.dataclass
class Run:
    """What every member's loop did: per step its committed all-reduce result, the revision after each
    sync, the retryable failures ``(step, call)`` (step -1: a membership retry), and the error that
    ended its loop (None: it ran every step)."""

    ids: list[int]
    results: list[list[bytes]]
    synced: list[list[int]]
    weights: list[np.ndarray]
    failures: list[list[tuple[int, str]]]
    ended: list[BaseException | None]


async def train(cluster: TestCluster, point: str, cut_step: int, *, late: int | None = None) -> Run:
    """Every member: per step a sync, then an all-reduce; a retryable failure is followed by
    ``update_topology()`` (itself retried) and the retry. Member ``CUT``'s master link breaks at
    ``point`` of step ``cut_step``. ``late``: that member makes the cut call of that step only once
    the cut member is back at the master (it re-registered before the others' vote completed)."""
    call, kind, before = POINTS[point]
    net = cluster.network
    assert net is not None
    peer, master = cluster.host(CUT).name, cluster.host(MASTER).name
    cutter: CutAt | DataPlane = (CutAt(peer, master, kind, before) if kind is not None
                                 else DataPlane(peer, master))
    net.add_hook(cutter)
    n = len(cluster.peers)
    ids = [c.peer_id for c in cluster.peers]
    weights = [np.zeros(WORDS, np.int64) for _ in ids]
    states = [SharedState([TensorInfo.from_numpy(w, "w")]) for w in weights]
    run = Run(ids, [[] for _ in ids], [[] for _ in ids], weights, [[] for _ in ids], [None] * n)
    back = trio.Event()

    async def membership(i: int) -> None:
        while True:
            try:
                await cluster.peer(i).update_topology()
                return
            except RETRYABLE:
                run.failures[i].append((-1, "update_topology"))

    async def retried(i: int, step: int, what: str, fn: Callable[[], Awaitable[object]]) -> None:
        while True:
            before_call = (weights[i].tobytes(), states[i].revision)
            try:
                await fn()
                return
            except RETRYABLE:
                assert (weights[i].tobytes(), states[i].revision) == before_call  # nothing changed
                run.failures[i].append((step, what))
            await membership(i)  # the loop goes back to its membership phase first

    async def pending(i: int) -> None:
        if await cluster.peer(i).are_peers_pending():
            await cluster.peer(i).update_topology()

    async def loop(i: int) -> None:
        comm = cluster.peer(i)
        for step in range(STEPS):
            if step == cut_step and call == "pending":
                if i == CUT:
                    cutter.armed = True
                elif i == late:
                    await back.wait()
            await retried(i, step, "pending", lambda: pending(i))  # the membership phase
            if step == cut_step and call == "topology":
                if i == CUT:
                    cutter.armed = True
                elif i == late:
                    await back.wait()
                await retried(i, step, "topology", comm.update_topology)
            if step == cut_step and call == "sync":
                if i == CUT:
                    cutter.armed = True
                elif i == late:
                    await back.wait()
            await retried(i, step, "sync", lambda: comm.sync_shared_state(states[i]))
            run.synced[i].append(states[i].revision)
            if step == cut_step and call == "all_reduce":
                if i == CUT:
                    cutter.armed = True
                elif i == late:
                    await back.wait()
            g, out = grad(comm.peer_id, step), np.zeros(WORDS, np.int64)
            await retried(i, step, "all_reduce", lambda: comm.all_reduce(g, out, op=ReduceOp.SUM))
            run.results[i].append(out.tobytes())
            weights[i] += out
            states[i].revision += 1

    async def member(i: int) -> None:
        try:
            await loop(i)
        except pccl.MasterConnectionError as exc:
            run.ended[i] = exc  # refused for good ("join again"): asserted by the caller

    async def watch() -> None:
        # Until the cut member is back: a new connection of its id is an accepted member again.
        state = cluster.master.state
        first = state.peers[ids[CUT]]
        if isinstance(cutter, DataPlane):
            await cutter.started.wait()
            assert cluster.cut_master_link(CUT) == 1
        while (rec := state.peers.get(ids[CUT])) is None or rec is first or rec.phase is not Phase.ACCEPTED:
            await trio.sleep(0.0005)
        back.set()

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for i in range(n):
                nursery.start_soon(member, i)
            # (watch never ends when the cut member is refused: the loops' end ends the test)
            while not all(len(run.synced[i]) == STEPS or run.ended[i] is not None for i in range(n)) \
                    or not all(len(run.results[i]) == STEPS or run.ended[i] is not None for i in range(n)):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert cutter.fired.is_set() if isinstance(cutter, CutAt) else cutter.started.is_set()
    return run


def assert_every_step_exact(run: Run) -> None:
    """Every member ran every step with every member: the SUM of all, the syncs' revisions in order."""
    want = [array_sum(grad(p, s) for p in run.ids).tobytes() for s in range(STEPS)]
    for i in range(len(run.ids)):
        assert run.ended[i] is None, (i, run.ended[i])
        assert run.results[i] == want, f"peer {i}: the committed all-reduces are not every member's SUM"
        assert run.synced[i] == list(range(STEPS)), f"peer {i}: revisions after the syncs: {run.synced[i]}"
        assert run.weights[i].tobytes() == run.weights[0].tobytes()


def assert_failed_alike(run: Run, point: str, cut_step: int) -> None:
    """Only the cut step's call failed (and the membership calls retried after it), on every member."""
    call = POINTS[point][0]
    for i in range(len(run.ids)):
        assert {s for s, w in run.failures[i] if w != "update_topology"} <= {cut_step}, (i, run.failures)
        assert all(w in (call, "update_topology") for s, w in run.failures[i] if s == cut_step), \
            (i, run.failures)


@pytest.mark.parametrize("cut_step", [0, 2])
@pytest.mark.parametrize("point", list(POINTS))
async def test_a_member_whose_master_link_breaks_fails_with_every_member(
        autojump_clock: trio.testing.MockClock, point: str, cut_step: int) -> None:
    # Step 0's all-reduce has no reserved op_seq (the voters wait for the commence); step 2's starts
    # speculatively under the reserved one. The master holds the votes while the member is away
    # (rejoin_grace): it re-registers within a few round trips, and every member's calls go on.
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG,
                                 master_config=master_config(point, hold=True)) as cluster:
        run = await train(cluster, point, cut_step)
        assert cluster.master.statistics()["accepted"] == 3
    assert_every_step_exact(run)
    assert_failed_alike(run, point, cut_step)


@pytest.mark.parametrize("point", ["before_vote", "after_vote", "sync_before_vote", "sync_after_vote"])
async def test_a_member_back_before_the_others_voted_fails_with_them(
        autojump_clock: trio.testing.MockClock, point: str) -> None:
    # No hold (the default): the member re-registers while one member has not voted yet. It reports
    # the call it abandoned; the vote already waiting fails at once and the late member's vote fails
    # once, so all three run update_topology() and the retry. (Before, the returning member voted for
    # a topology round while the others waited in the operation: the deadlock watch's INVALID_USAGE.)
    async with open_test_cluster(4, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        run = await train(cluster, point, 2, late=1)
        assert cluster.master.statistics()["accepted"] == 4
    assert_every_step_exact(run)
    assert_failed_alike(run, point, 2)
    assert any(w == POINTS[point][0] for _, w in run.failures[1])  # the late member's call failed too


@pytest.mark.parametrize("point", list(POINTS))
async def test_without_a_hold_the_group_goes_on_and_refuses_the_member_loudly(
        autojump_clock: trio.testing.MockClock, point: str) -> None:
    # No hold: the others' votes complete without the member while it reconnects. It is then refused
    # for good with a clear error (it must join again), never left in another call than theirs; the
    # others go on with exact results.
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG,
                                 master_config=master_config(point, hold=False)) as cluster:
        run = await train(cluster, point, 2)
    others = [i for i in range(3) if i != CUT]
    for i in others:
        assert run.ended[i] is None, (i, run.ended[i])
        assert run.synced[i] == list(range(STEPS))
        assert run.results[i] == run.results[others[0]]
        assert run.weights[i].tobytes() == run.weights[others[0]].tobytes()
    everyone = [array_sum(grad(p, s) for p in run.ids).tobytes() for s in range(STEPS)]
    without = [array_sum(grad(run.ids[p], s) for p in others).tobytes() for s in range(STEPS)]
    assert all(r in (everyone[s], without[s]) for s, r in enumerate(run.results[others[0]]))
    if run.ended[CUT] is not None:
        assert "join again" in str(run.ended[CUT])
    else:
        assert run.results[CUT] == everyone


async def test_a_pending_round_answered_during_a_topology_setup_counts_alike(
        autojump_clock: trio.testing.MockClock) -> None:
    # The async API: each member calls are_peers_pending() while its own update_topology() sets up its
    # P2P connections (the master moved to the round's epoch, the members move at its TopologyResult).
    # The answer reaches them at their old epoch; the master counts it there too. Then member CUT's
    # link breaks right after its vote of the next pending round: it comes back waiting in that round,
    # and the master counts its vote in it, instead of answering it with the setup's round (which it
    # would have named round 1 of the new epoch): every member gets the same answer and goes on.
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        state = cluster.master.state

        async def both(i: int) -> None:
            comm = cluster.peer(i)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(comm.update_topology)
                while not any("P2P setup" in what for what, _, _ in state.pending_rounds()):
                    await trio.sleep(0.0005)
                assert not await comm.are_peers_pending()
                assert comm.statistics()["topology_call_waiting"]  # answered during the setup

        epoch = state.epoch
        await cluster.run_all(lambda i, comm: both(i))
        assert state.epoch == epoch + 1
        cutter = CutAt(cluster.host(CUT).name, cluster.host(MASTER).name, m.PeersPendingVote, before=False)
        assert cluster.network is not None
        cluster.network.add_hook(cutter)
        cutter.armed = True
        first = state.peers[cluster.peer(CUT).peer_id]

        async def query(i: int) -> bool:
            if i != CUT:  # the others vote once the cut member is back, waiting in the round
                while (rec := state.peers.get(cluster.peer(CUT).peer_id)) is None or rec is first \
                        or rec.phase is not Phase.ACCEPTED:
                    await trio.sleep(0.0005)
            return await cluster.peer(i).are_peers_pending()

        got = await cluster.run_all(lambda i, comm: query(i))
        assert got == [False, False, False] and cutter.fired.is_set()
        x = [np.full(WORDS, 1 << c.peer_id, np.int64) for c in cluster.peers]
        done = await cluster.run_all(lambda i, comm: comm.all_reduce(x[i], op=ReduceOp.SUM))
        assert not [r for r in done if isinstance(r, pccl.PCCLError)], done
        assert all(int(v[0]) == sum(1 << c.peer_id for c in cluster.peers) for v in x)


@pytest.mark.parametrize(("seed", "gap", "hold"), [(s, 0.05, True) for s in range(4)]
                         + [(s, 0.002, True) for s in range(3)] + [(s, 0.05, False) for s in range(3)])
async def test_links_that_break_at_random_points_never_split_the_run(
        autojump_clock: trio.testing.MockClock, seed: int, gap: float, hold: bool) -> None:
    # Four members loop the recovery recipe (are_peers_pending, sync, all-reduce; update_topology() and
    # the retry after a failure) for 12 steps while a driver resets a random member's master link at
    # random instants (seeded), at least ``gap`` apart. A member reconnects within a few round trips:
    # cut 50 ms apart or more, every member is back within the hold, and runs every step, exact. Cut a
    # few ms apart, a member may be cut again and again while it reconnects, past the hold: then its
    # group goes on and it is refused (join again); never a hang or a deadlock, and the others agree.
    # Without the hold, members are refused one after the other (or, left alone while the other one is
    # away, fail with TOO_FEW_PEERS), but never left in another call than the others'.
    rng = random.Random(seed)
    n, steps = 4, 12
    async with open_test_cluster(n, network=VirtualNetwork(latency=0.001), config=CONFIG,
                                 master_config=HOLD if hold else DEFAULT_MASTER_CONFIG) as cluster:
        ids = [c.peer_id for c in cluster.peers]
        weights = [np.zeros(WORDS, np.int64) for _ in ids]
        states = [SharedState([TensorInfo.from_numpy(w, "w")]) for w in weights]
        results: list[list[bytes]] = [[] for _ in ids]
        ended: list[BaseException | None] = [None] * n
        finished = [False] * n
        cuts = 0

        async def retried(i: int, fn: Callable[[], Awaitable[object]]) -> None:
            comm = cluster.peer(i)
            while True:
                try:
                    await fn()
                    return
                except RETRYABLE:
                    pass
                while True:
                    try:
                        await comm.update_topology()
                        break
                    except RETRYABLE:
                        pass

        async def loop(i: int) -> None:
            comm = cluster.peer(i)
            try:
                for step in range(steps):
                    await retried(i, comm.are_peers_pending)
                    await retried(i, lambda: comm.sync_shared_state(states[i]))
                    g, out = grad(comm.peer_id, step), np.zeros(WORDS, np.int64)
                    await retried(i, lambda: comm.all_reduce(g, out, op=ReduceOp.SUM))
                    results[i].append(out.tobytes())
                    weights[i] += out
                    states[i].revision += 1
            except (pccl.MasterConnectionError, pccl.TooFewPeersError) as exc:
                ended[i] = exc
            finally:
                finished[i] = True

        async def driver() -> None:
            nonlocal cuts
            while not all(finished):
                await trio.sleep(rng.uniform(gap, 0.03 + gap))
                cuts += cluster.cut_master_link(rng.randrange(n))

        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(driver)
                for i in range(n):
                    nursery.start_soon(loop, i)
        assert cuts >= (3 if hold else 1)
    done = [i for i in range(n) if ended[i] is None]
    alone = [i for i in range(n) if isinstance(ended[i], pccl.TooFewPeersError)]
    for i in range(n):
        if ended[i] is not None and i not in alone:
            assert "join again" in str(ended[i]), ended[i]  # refused loudly, for good
    assert len(done) != 1  # a member runs its steps only with another one
    for i in done:  # the members that ran every step ran the same ones
        assert results[i] == results[done[0]] and weights[i].tobytes() == weights[done[0]].tobytes()
        assert states[i].revision == steps
    if hold and gap >= 0.05:
        want = [array_sum(grad(p, s) for p in ids).tobytes() for s in range(steps)]
        assert done == list(range(n)) and results[0] == want, "not every member's SUM at every step"
