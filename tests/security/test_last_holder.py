"""Issue 33 item 6, the member that stops where it owes nothing: it takes part in every operation, reads
every frame but its last ones (receives that release no send of its plan), so every other participant's
data plane completes, and then it lets the operation stall (its stall watch fails it after
``p2p_stall_timeout``), testifying either that it took everything (the lie: the pairs agree) or the truth
(it took less than its partner sent). No other participant testifies (their data planes completed), so
neither the pair rule nor the plan rule (pccl/master/plan_rule.py) has anything to compare: before this
work it stalled every operation and stayed a member. Now (pccl/master/last_holder.py) its own testimony
against its plan, and its partners' completed reports against theirs, name it: the liar alone (its
testimony says it had nothing left to wait for), the truthful one with the partner whose frames it says it
did not get (a report that cannot be checked: both leave). Virtual network and time."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import trio
import trio.testing

from pccl.collectives.executor import Attempt
from pccl.collectives.kinds import KINDS
from pccl.master.blame import STRIKES
from pccl.master.plan_rule import OpFrames, finished, undelivered
from pccl.master.testimony import StallTestimony
from pccl.peer.communicator import Communicator
from pccl.testing import (
    DEFAULT_MASTER_CONFIG,
    DEFAULT_PEER_CONFIG,
    TestCluster,
    VirtualNetwork,
    open_test_cluster,
)
from pccl.wire.data import unpack_data_header_fields

from ._helpers import claim_took_all, stalled_rounds
from .test_plan_holder import IDS, descriptor, frames_of

STALL = 5.0


def stop_at_the_end(monkeypatch: pytest.MonkeyPatch, cl: TestCluster, evil: Communicator,
                    lie: bool, wait: float = 2 * STALL) -> None:
    """``evil`` reads every frame of an operation except those of its last receives that release no send
    (it leaves them in the link until its operation failed, then reads on); with ``lie`` it testifies it
    took what each partner sent it."""
    assert evil.pool is not None
    plans: dict[int, tuple[Any, list[int]]] = {}
    real_connect = Attempt.connect

    async def connect(self: Attempt, *a: Any, **k: Any) -> None:
        if self.pool is evil.pool:
            plans[self.op_seq] = (self.plan, self.ring)
        await real_connect(self, *a, **k)

    readers = evil.pool.readers
    real_read = type(readers).read_frame

    async def read_frame(self: Any, conn: Any) -> bool:
        if self is readers:
            _, op_seq, seq, _ = unpack_data_header_fields(conn.hdr)
            got = plans.get(op_seq)
            if got is not None:
                plan, ring = got
                tail = len(plan.recvs)
                while tail > 0 and not plan.unlocks[tail - 1]:
                    tail -= 1
                if any(ring[f.peer] == conn.peer_id and f.seq == seq for f in plan.recvs[tail:]):
                    await trio.sleep(wait)  # past its operation's failure: then it reads on
        waited: bool = await real_read(self, conn)
        return waited

    monkeypatch.setattr(Attempt, "connect", connect)
    monkeypatch.setattr(type(readers), "read_frame", read_frame)
    if not lie:
        return
    claim_took_all(monkeypatch, cl, evil)


# the liar's position: one whose plan ends in receives that release no send (a tree's leaf)
@pytest.mark.parametrize(("schedule", "index"), [("ring", 2), ("hd", 2), ("tree", 3)])
async def test_a_liar_that_stops_where_it_owes_nothing_is_removed_alone(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    schedule: str, index: int,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=STALL, schedule=schedule)
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=cfg) as cl:
        evil = cl.peer(index)
        honest = sorted(cl.peer(i).peer_id for i in range(4) if i != index)
        stop_at_the_end(monkeypatch, cl, evil, lie=True)
        t0 = trio.current_time()
        stalls = await stalled_rounds(cl, 1024, STRIKES + 3)
        assert stalls == STRIKES, caplog.text  # then it was gone, and nothing stalled again
        assert sorted(cl.master.state.ring) == honest  # alone: no honest member removed with it
        assert f"peer {evil.peer_id} evicted: its testimony contradicted itself in 2" in caplog.text
        assert "took every frame its plan receives" in caplog.text
        assert trio.current_time() - t0 < STRIKES * (2 * STALL + 2) + 5


async def test_under_auto_the_liar_cannot_choose_the_plans_it_is_judged_by(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default ``"auto"``: only the liar testifies, and it names another schedule than the one that
    ran. The participants that completed reported the schedule "auto" resolved to with their success,
    so the master judges the liar by the plans the majority ran (it picked halving-doubling here)."""
    from pccl.peer.collective_api import CollectiveCalls

    caplog.set_level(logging.WARNING, logger="pccl")
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=STALL)
    assert cfg.schedule == "auto"
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=cfg) as cl:
        evil = cl.peer(2)
        honest = sorted(cl.peer(i).peer_id for i in (0, 1, 3))
        stop_at_the_end(monkeypatch, cl, evil, lie=True)
        real = CollectiveCalls._report_failure

        async def report(self: Any, st: Any, reason: str, *a: Any, **k: Any) -> None:
            if self.peer_id == evil.peer_id and k.get("schedule"):
                assert k["schedule"] == "hd"  # what ran
                k["schedule"] = "tree"
            await real(self, st, reason, *a, **k)

        monkeypatch.setattr(CollectiveCalls, "_report_failure", report)
        stalls = await stalled_rounds(cl, 1024, STRIKES + 3)
        assert stalls == STRIKES, caplog.text
        assert sorted(cl.master.state.ring) == honest
        assert f"peer {evil.peer_id} evicted: its testimony contradicted itself in 2" in caplog.text


async def test_a_member_that_fails_what_it_holds_alone_without_testimony_is_removed(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same member, but its failure reports carry no testimony (it says its data plane moved a
    moment ago): nothing can be compared. It held the operation alone, every other participant
    finished, for ``held_ops.LONE`` or more and names nobody: the failure is its own, struck alone."""
    from pccl.master.held_ops import LONE
    from pccl.peer.collective_api import CollectiveCalls

    caplog.set_level(logging.WARNING, logger="pccl")
    stall = 2 * LONE
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=stall, schedule="ring")
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=cfg) as cl:
        evil = cl.peer(2)
        honest = sorted(cl.peer(i).peer_id for i in (0, 1, 3))
        stop_at_the_end(monkeypatch, cl, evil, lie=True, wait=2 * stall)
        real = CollectiveCalls._testimony

        def none(self: Any, st: Any, attempt: Any) -> Any:
            return [] if self.peer_id == evil.peer_id else real(self, st, attempt)

        monkeypatch.setattr(CollectiveCalls, "_testimony", none)
        stalls = await stalled_rounds(cl, 1024, STRIKES + 3)
        assert stalls == STRIKES, caplog.text
        assert sorted(cl.master.state.ring) == honest
        assert f"peer {evil.peer_id} evicted: its testimony contradicted itself in 2" in caplog.text
        assert "it failed operations it held alone" in caplog.text


async def test_a_member_that_fails_each_operation_soon_after_the_others_finish_is_removed(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same member, failing every operation about ``SOON`` seconds after every other participant
    finished (its stall watch), naming nobody: each hold is under ``held_ops.LONE``, which before this work
    was never counted, so it cost the others that much at every operation and stayed. Now its holds add
    up (pccl/master/lone_holds.py): every ``LONE`` seconds of them is a strike, two remove it."""
    import math

    from pccl.master.held_ops import LONE
    from pccl.peer.collective_api import CollectiveCalls

    caplog.set_level(logging.WARNING, logger="pccl")
    soon = 1.0
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=soon, schedule="ring")
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=cfg) as cl:
        evil = cl.peer(2)
        honest = sorted(cl.peer(i).peer_id for i in (0, 1, 3))
        stop_at_the_end(monkeypatch, cl, evil, lie=True, wait=3 * soon)
        real = CollectiveCalls._testimony

        def none(self: Any, st: Any, attempt: Any) -> Any:
            return [] if self.peer_id == evil.peer_id else real(self, st, attempt)

        monkeypatch.setattr(CollectiveCalls, "_testimony", none)
        bound = STRIKES * math.ceil(LONE / soon)  # each hold is at least its stall watch's time
        stalls = await stalled_rounds(cl, 1024, bound + 3)
        assert stalls <= bound, caplog.text  # then it was gone, and nothing stalled again
        assert sorted(cl.master.state.ring) == honest  # alone: the others stay (and ran exact)
        assert f"peer {evil.peer_id} evicted: its testimony contradicted itself in 2" in caplog.text
        assert "held alone in all within 600s (budget 5s)" in caplog.text
        assert "for 5s or more" not in caplog.text  # no single hold reached LONE
        assert not cl.master._server.court.lone_holds  # type: ignore[attr-defined]  # its ledger left with it


async def test_a_truthful_member_that_stops_where_it_owes_nothing_leaves_with_its_partner(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It says it did not get its partner's last frame, and the partner reported its part complete: one
    of the two lies or their link holds the frame, and the master cannot tell which (a pair report,
    pccl/master/blame.py: both leave at the second)."""
    caplog.set_level(logging.WARNING, logger="pccl")
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=STALL, schedule="ring")
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=cfg) as cl:
        evil = cl.peer(2)
        stop_at_the_end(monkeypatch, cl, evil, lie=False)
        stalls = await stalled_rounds(cl, 1024, STRIKES + 3)
        assert stalls == STRIKES, caplog.text
        assert evil.peer_id not in cl.master.state.ring and len(cl.master.state.ring) == 2
        assert "reported its part complete" in caplog.text


# -- the pure rules, under every kind and schedule: an honest member is never named


Testimony = dict[int, dict[int, tuple[int, int]]]


def standstill_at(frames: OpFrames, liar: int, stop: int, lie: bool) -> tuple[Testimony, set[int]]:
    """Every peer's testimony once the operation stood still with rank ``liar`` completing only its first
    ``stop`` receives (it takes no frame of a later one), and the peers whose data planes completed (they
    report success and do not testify). The others take every frame sent to them and work through their
    receives in plan order. The liar says it took what its partners sent it (``lie``) or the truth."""
    plans, n = frames.plans, len(frames.ids)
    done, sent = [0] * n, [set[int]() for _ in range(n)]
    where = [{(f.peer, f.seq): j for j, f in enumerate(p.sends)} for p in plans]
    moved = True
    while moved:
        moved = False
        for r, plan in enumerate(plans):
            for j in list(plan.initial) + [j for u in plan.unlocks[:done[r]] for j in u]:
                if j not in sent[r]:
                    sent[r].add(j)
                    moved = True
            while done[r] < (stop if r == liar else len(plan.recvs)):
                f = plan.recvs[done[r]]
                if where[f.peer][(r, f.seq)] not in sent[f.peer]:
                    break
                done[r] += 1
                moved = True
    recv_at = [{(f.peer, f.seq) for f in p.recvs[:done[r]]} for r, p in enumerate(plans)]
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for r in range(n):
        rows: dict[int, tuple[int, int]] = {}
        for q in range(n):
            if q == r:
                continue
            to_q = sum(frames.send_bytes[r][j] for j in sent[r] if plans[r].sends[j].peer == q)
            from_q = [(j, frames.send_bytes[q][j]) for j in sent[q] if plans[q].sends[j].peer == r]
            took = sum(b for j, b in from_q if r != liar or lie or (q, plans[q].sends[j].seq) in recv_at[r])
            rows[frames.ids[q]] = (to_q, took)
        out[frames.ids[r]] = rows
    complete = {frames.ids[r] for r in range(n)
                if r != liar and done[r] == len(plans[r].recvs)}
    return out, complete


COMBOS = [(kind, schedule, n) for kind in KINDS for schedule in ("ring", "hd", "tree") for n in (3, 4, 5)]


@pytest.mark.parametrize(("kind", "schedule", "n"), COMBOS)
def test_an_honest_member_is_never_named_and_the_last_holder_always(kind: str, schedule: str, n: int) -> None:
    frames = frames_of(kind, schedule, n)
    caught = 0
    for liar in range(n):
        plan = frames.plans[liar]
        tail = len(plan.recvs)
        while tail > 0 and not plan.unlocks[tail - 1]:
            tail -= 1
        for stop in range(len(plan.recvs) + 1):
            for lie in (True, False):
                testimony, complete = standstill_at(frames, liar, stop, lie)
                for r, peer in enumerate(frames.ids):
                    if r == liar or peer in complete:
                        continue  # the liar, or a peer whose data plane completed: it does not testify
                    assert not finished(frames, peer, testimony[peer]), (liar, stop, peer)
                    assert undelivered(frames, peer, testimony[peer], complete) == [], (liar, stop, peer)
                me = frames.ids[liar]
                if stop < tail or stop == len(plan.recvs):
                    continue  # it holds back sends (the plan rule's case), or it took everything: done
                # stopped where it owes nothing: every other data plane completed, only it testifies
                assert complete == set(frames.ids) - {me}, (liar, stop)
                if lie:
                    assert finished(frames, me, testimony[me]), (liar, stop)
                else:
                    short = undelivered(frames, me, testimony[me], complete)
                    assert short and not finished(frames, me, testimony[me]), (liar, stop)
                    assert all(owed > taken for _, owed, taken in short)
                caught += 1
    # a kind whose every rank's last receive releases a send (none) has no such position
    assert caught or all(not p.recvs or p.unlocks[-1] for p in frames.plans)


def test_the_last_holder_judged_by_the_stall_testimony_store() -> None:
    d = descriptor("all_reduce", "ring")
    ids = IDS[:4]
    t = StallTestimony()
    t.plans.note(3, d, ids)
    frames = frames_of("all_reduce", "ring", 4)
    liar = 2
    plan = frames.plans[liar]
    tail = len(plan.recvs)
    while tail > 0 and not plan.unlocks[tail - 1]:
        tail -= 1
    lying, complete = standstill_at(frames, liar, tail, lie=True)
    me = ids[liar]
    rows = [(p, s, k) for p, (s, k) in lying[me].items()]
    assert t.last_holder(3, me, rows, complete) == (True, [])
    truth, _ = standstill_at(frames, liar, tail, lie=False)
    done, short = t.last_holder(3, me, [(p, s, k) for p, (s, k) in truth[me].items()], complete)
    assert not done and [p for p, _, _ in short] == [ids[liar - 1]]  # its ring predecessor
    # an operation the master did not record, or cannot plan: nothing judged
    assert t.last_holder(4, me, rows, complete) == (False, [])


async def test_a_member_that_never_reports_is_removed_after_the_vote_timeout(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It runs its data plane (every other participant's completes) and then never reports its part,
    neither done nor failed, while it heartbeats: before, the operation stayed open and every other member
    waited in it for ever. Now the one participant every other one waits on is removed once it has held
    the running operation alone for ``vote_timeout`` (remembered as evicted for liveness); the others'
    calls fail and the run goes on exact without it."""
    from pccl.peer.collective_api import CollectiveCalls

    caplog.set_level(logging.WARNING, logger="pccl")
    caplog.set_level(logging.INFO, logger="pccl.master")  # (its kicks are logged at INFO)
    timeout = 60.0
    mcfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, vote_timeout=timeout)
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=DEFAULT_PEER_CONFIG, master_config=mcfg) as cl:
        evil = cl.peer(2)
        honest = sorted(cl.peer(i).peer_id for i in (0, 1, 3))
        real = CollectiveCalls._confirm

        async def silent(self: Any, st: Any, *a: Any, **k: Any) -> None:
            if self.peer_id != evil.peer_id:
                return await real(self, st, *a, **k)
            await st.complete.wait()  # reports nothing; ends when the master aborts or removes it

        monkeypatch.setattr(CollectiveCalls, "_confirm", silent)
        t0 = trio.current_time()
        with trio.move_on_after(20 * timeout) as scope:
            stalls = await stalled_rounds(cl, 1024, 3)
        assert not scope.cancelled_caught, "the others still wait"
        assert stalls == 1 and sorted(cl.master.state.ring) == honest
        assert trio.current_time() - t0 < timeout + 5
        assert f"peer {evil.peer_id} kicked: evicted: held the running collective tag 0" in caplog.text
        assert cl.master.state.offenders.struck_total == 1  # remembered (pccl/master/penalties.py)
