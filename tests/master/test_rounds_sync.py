"""The shared-state sync round alone (pccl/master/rounds/sync.py): message by message through a small
stand-in for the master, without a MasterState."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pccl import Result
from pccl.master import election
from pccl.master.effects import Send
from pccl.master.rounds.base import Expel
from pccl.master.rounds.sync import SyncVotes
from pccl.wire import messages as m


@dataclass
class Master:
    """The SyncContext: one group of accepted peers, connected peers, a counter, the settled syncs."""

    members: list[int] = field(default_factory=lambda: [1, 2, 3])
    now: float = 0.0
    seq: int = 10
    last: int | None = None
    gone: set[int] = field(default_factory=set)
    settled: list[tuple[int, int, bool, int]] = field(default_factory=list)

    def group_size(self, group: int) -> int:
        return len(self.members)

    def accepted(self, group: int | None = None) -> list[int]:
        return list(self.members)

    def table(self, ids: list[int]) -> list[m.PeerRow]:
        return [m.PeerRow(p, "127.0.0.1", 40000 + p, 0) for p in ids]

    def known(self, peer_id: int) -> bool:
        return peer_id not in self.gone

    def revision_of(self, group: int) -> int | None:
        return self.last

    def next_sync_seq(self) -> int:
        self.seq += 1
        return self.seq

    def sync_settled(self, group: int, seq: int, committed: bool, revision: int) -> None:
        self.settled.append((group, seq, committed, revision))

    def left_out(self, group: int, kind: str) -> frozenset[int]:
        return frozenset()  # no live heals here (tests/master/test_live_heal.py)

    def may_go_live(self, rows_of: dict[int, list[list[Any]]], group: int = 0,
                    content: dict[str, int] | None = None) -> bool:
        return False

    def go_live(self, group: int, seq: int, revision: int, rows_of: dict[int, list[list[Any]]],
                table: list[m.PeerRow], note: str, progress: Any) -> list[Any]:
        raise AssertionError("no live heals here")

    def synced(self, peers: Any) -> None:
        pass

    def lose(self, peer_id: int) -> None:
        self.gone.add(peer_id)
        self.members.remove(peer_id)


def ballot(revision: int, content: int = 7) -> election.SyncVote:
    vote = election.vote_from_wire(revision=revision, strategy=0,
                                   entries=[["w", 7, [8], 64, content, False]])
    assert isinstance(vote, election.SyncVote)
    return vote


def sends(effects: list[Any], cls: type | None = None) -> list[tuple[int, Any]]:
    return [(e.peer_id, e.message) for e in effects
            if isinstance(e, Send) and (cls is None or isinstance(e.message, cls))]


def vote_all(syncs: SyncVotes, ctx: Master, revisions: dict[int, int],
             contents: dict[int, int] | None = None) -> list[Any]:
    eff: list[Any] = []
    for p, rev in revisions.items():
        syncs.vote(p, 0, ballot(rev, (contents or {}).get(p, 7)), ctx.now)
        eff += syncs.check(0, ctx)
    return eff


def done(syncs: SyncVotes, ctx: Master, pid: int, seq: int, success: bool = True) -> list[Any] | Expel:
    msg = m.SharedStateDone(sync_seq=seq, success=success, reason="" if success else "x")
    return syncs.report(pid, 0, msg, ctx)


def test_the_vote_opens_at_the_first_ballot_and_plans_at_the_last() -> None:
    syncs, ctx = SyncVotes(), Master()
    ctx.now = 4.0
    assert syncs.vote(1, 0, ballot(1), ctx.now) and not syncs.vote(2, 0, ballot(1), 5.0)
    rnd = syncs.get(0)
    assert rnd is not None and rnd.opened == 4.0 and rnd.voting and set(rnd.ballots) == {1, 2}
    assert not rnd.takes_ballot_from(1) and rnd.takes_ballot_from(3)
    assert syncs.check(0, ctx) == []
    assert rnd.waits({1, 2, 3}) == ("shared-state sync vote (group 0)", {3}, "; voted [1, 2]")
    assert [p for p, _ in rnd.vote_waits()] == [1, 2]
    syncs.vote(3, 0, ballot(1), 6.0)
    plans = sends(syncs.check(0, ctx), m.SharedStatePlan)
    assert [p for p, _ in plans] == [1, 2, 3] and {pl.sync_seq for _, pl in plans} == {11}
    assert not rnd.voting and rnd.busy([]) == {1, 2, 3} and rnd.vote_waits() == []
    assert rnd.waits(set()) == ("shared-state sync (group 0)", {1, 2, 3}, "")


def test_the_run_completes_at_the_last_report_and_commits_the_revision() -> None:
    syncs, ctx = SyncVotes(), Master()
    vote_all(syncs, ctx, {1: 1, 2: 1, 3: 1})
    assert done(syncs, ctx, 1, 11) == [] and done(syncs, ctx, 2, 11) == []
    assert done(syncs, ctx, 2, 11) == Expel("duplicate SharedStateDone")
    assert done(syncs, ctx, 3, 99) == []  # another sync's report: dropped
    last = done(syncs, ctx, 3, 11)
    assert isinstance(last, list)
    results = sends(last, m.SharedStateResult)
    assert [p for p, _ in results] == [1, 2, 3] and all(r.success and r.revision == 1 for _, r in results)
    assert ctx.settled == [(0, 11, True, 1)] and syncs.get(0) is None


def test_a_failed_report_fails_the_sync_for_every_participant() -> None:
    syncs, ctx = SyncVotes(), Master()
    vote_all(syncs, ctx, {1: 1, 2: 1, 3: 1})
    got = done(syncs, ctx, 2, 11, success=False)
    assert isinstance(got, list)
    results = sends(got, m.SharedStateResult)
    assert [p for p, _ in results] == [1, 2, 3]
    assert {r.code for _, r in results} == {int(Result.SHARED_STATE_SYNC_FAILED)}
    assert ctx.settled == [(0, 11, False, 1)]


def test_an_outdated_peer_fetches_and_losing_its_donor_leaves_it_to_the_other_holders() -> None:
    syncs, ctx = SyncVotes(), Master()
    plans = dict(sends(vote_all(syncs, ctx, {1: 2, 2: 2, 3: 1}, {3: 5}), m.SharedStatePlan))
    assert plans[3].fetch and not plans[1].fetch and plans[3].revision == 2
    rnd = syncs.get(0)
    assert rnd is not None and rnd.fetchers == {3}
    ctx.lose(1)
    eff = syncs.peer_lost(0, 1, ctx, resumed=True)
    assert sends(eff) == [] and rnd.participants == {2, 3}  # a donor only: the sync goes on
    ctx.lose(3)
    failed = sends(syncs.peer_lost(0, 3, ctx, resumed=True), m.SharedStateResult)
    assert [p for p, _ in failed] == [2] and failed[0][1].code == int(Result.RANK_CONNECTION_LOST)


def test_a_voter_lost_leaves_the_vote_and_the_others_complete() -> None:
    syncs, ctx = SyncVotes(), Master()
    vote_all(syncs, ctx, {1: 1, 2: 1})
    syncs.vote(3, 0, ballot(1), 0.0)
    ctx.lose(3)
    assert syncs.peer_lost(0, 3, ctx, resumed=False) == []  # held: nothing completes
    assert [p for p, _ in sends(syncs.check(0, ctx), m.SharedStatePlan)] == [1, 2]


def test_withdraw_and_fail_lost_answer_only_their_voters_and_drop_an_empty_vote() -> None:
    syncs, ctx = SyncVotes(), Master()
    vote_all(syncs, ctx, {1: 1, 2: 3})
    eff = syncs.withdraw(0, {2, 9}, "deadlock", Result.INVALID_USAGE)
    assert [(p, r.revision, r.code) for p, r in sends(eff)] == [(2, 3, int(Result.INVALID_USAGE))]
    lost = sends(syncs.fail_lost(0, lambda p: p == 1))
    assert [(p, r.code) for p, r in lost] == [(1, int(Result.RANK_CONNECTION_LOST))]
    assert syncs.get(0) is None


def test_progress_is_recorded_for_participants_only() -> None:
    syncs, ctx = SyncVotes(), Master()
    vote_all(syncs, ctx, {1: 2, 2: 2, 3: 1}, {3: 5})
    report = m.SharedStateProgress(sync_seq=11, rx_bytes=32, total_bytes=64)
    assert syncs.progress(3, 0, report, 1.0) is None
    assert syncs.progress(3, 0, m.SharedStateProgress(sync_seq=12, rx_bytes=1, total_bytes=64), 1.0) is None
    rows = syncs.transfer_progress(2.0)
    assert [r["group"] for r in rows] == [0] and rows[0]["sync_seq"] == 11
    ctx.members.append(4)
    outsider = syncs.progress(4, 0, report, 1.0)
    assert outsider == Expel("SharedStateProgress for sync 11, which it takes no part in")
