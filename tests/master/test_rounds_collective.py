"""The collective vote alone (pccl/master/rounds/collective.py): message by message through a small
stand-in for the master (its membership, op_seq numbers and books), without a MasterState."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pccl import Result
from pccl.master.effects import FastStart, Send
from pccl.master.rounds.base import Expel
from pccl.master.rounds.collective import RESERVATIONS_PER_GROUP, CollectiveVotes, Reservations
from pccl.wire import messages as m

DESC = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)


@dataclass
class Master:
    """The CollectiveContext: groups of accepted peers, connected peers, a counter, the settled ops."""

    groups: dict[int, list[int]] = field(default_factory=lambda: {0: [1, 2, 3]})
    epoch: int = 1
    now: float = 0.0
    seq: int = 100
    gone: set[int] = field(default_factory=set)
    waiting: dict[int, list[int]] = field(default_factory=dict)
    settled: list[tuple[int, int, int, bool]] = field(default_factory=list)

    def group_size(self, group: int) -> int:
        return len(self.groups.get(group, []))

    def accepted(self, group: int | None = None) -> list[int]:
        assert group is not None
        return list(self.groups.get(group, []))

    def table(self, ids: list[int]) -> list[m.PeerRow]:
        return [m.PeerRow(p, "127.0.0.1", 40000 + p, 0) for p in ids]

    def known(self, peer_id: int) -> bool:
        return peer_id not in self.gone

    def registered_in(self, group: int) -> list[int]:
        return self.waiting.get(group, [])

    def next_op_seq(self) -> int:
        self.seq += 1
        return self.seq

    def op_settled(self, group: int, tag: int, seq: int, committed: bool) -> None:
        self.settled.append((group, tag, seq, committed))

    def collective_started(self, group: int, voters: list[int]) -> None:
        pass

    def left_out(self, group: int, kind: str) -> frozenset[int]:
        return frozenset()  # no live heals here (tests/master/test_live_heal.py)

    def lose(self, peer_id: int) -> None:
        self.gone.add(peer_id)
        for members in self.groups.values():
            if peer_id in members:
                members.remove(peer_id)


def sends(effects: list[Any], cls: type | None = None) -> list[tuple[int, Any]]:
    return [(e.peer_id, e.message) for e in effects
            if isinstance(e, Send) and (cls is None or isinstance(e.message, cls))]


def vote(votes: CollectiveVotes, ctx: Master, pid: int, tag: int = 7, desc: m.CollectiveDescriptor = DESC,
         op_seq: int = -1) -> list[Any]:
    op, _ = votes.open(0, tag, ctx.now)
    assert op.refusal(pid, op_seq) is None
    op.vote(pid, desc, op_seq)
    return votes.check((0, tag), ctx)


def done(votes: CollectiveVotes, ctx: Master, pid: int, tag: int = 7, op_seq: int = -1,
         success: bool = True, reason: str = "") -> list[Any] | Expel:
    msg = m.CollectiveDone(tag=tag, success=success, op_seq=op_seq, reason=reason)
    return votes.report(pid, (0, tag), msg, ctx)


def run_slow(votes: CollectiveVotes, ctx: Master, tag: int = 7) -> int:
    """One op of every member on the slow path; returns the op_seq reserved for the tag's next op."""
    for p in ctx.groups[0][:-1]:
        assert vote(votes, ctx, p, tag) == []
    commence = sends(vote(votes, ctx, ctx.groups[0][-1], tag), m.CollectiveCommence)
    seq = commence[0][1].op_seq
    out: list[Any] = []
    for p in ctx.groups[0]:
        got = done(votes, ctx, p, tag, seq)
        assert isinstance(got, list)
        out += got
    complete = sends(out, m.CollectiveComplete)
    assert [p for p, _ in complete] == ctx.groups[0]
    return int(complete[0][1].next_op_seq)


def test_the_vote_opens_at_the_first_ballot_and_commences_with_the_table_at_the_last() -> None:
    votes, ctx = CollectiveVotes(), Master()
    ctx.now = 3.0
    assert vote(votes, ctx, 1) == [] and vote(votes, ctx, 2) == []
    op = votes.get((0, 7))
    assert op is not None and op.opened == 3.0 and op.voting and set(op.ballots) == {1, 2}
    assert op.waits({1, 2, 3}) == ("collective tag 7 (group 0) vote", {3}, "; voted [1, 2]")
    assert [p for p, _ in op.vote_waits()] == [1, 2] and op.busy([1, 2, 3]) == set()
    # a second ballot of a voter is refused, the vote unaffected
    refusal = op.refusal(1, -1)
    assert refusal is not None and refusal.code == int(Result.INVALID_USAGE)
    assert "in this group" in refusal.reason
    eff = vote(votes, ctx, 3)
    commence = sends(eff, m.CollectiveCommence)
    assert [p for p, _ in commence] == [1, 2, 3] and commence[0][1].op_seq == 101
    assert [r.peer_id for r in commence[0][1].peers] == [1, 2, 3]
    assert not op.voting and op.busy([]) == {1, 2, 3} and op.vote_waits() == []
    later = op.refusal(4, -1)
    assert later is not None and "without this peer" in later.reason


def test_the_run_completes_at_the_last_report_and_reserves_the_next_number() -> None:
    votes, ctx = CollectiveVotes(), Master()
    nxt = run_slow(votes, ctx)
    assert nxt == 102 and ctx.settled == [(0, 7, 101, True)]
    assert votes.get((0, 7)) is None and len(votes.reserved) == 1
    # a late or duplicate report of an op that ended is harmless
    assert done(votes, ctx, 1, 7, 101) == []


def test_a_duplicate_report_expels_its_sender() -> None:
    votes, ctx = CollectiveVotes(), Master()
    for p in (1, 2, 3):
        vote(votes, ctx, p)
    assert done(votes, ctx, 1, op_seq=101) == []
    assert done(votes, ctx, 1, op_seq=101) == Expel("duplicate CollectiveDone for tag 7")


def test_descriptors_that_differ_abort_every_voter() -> None:
    votes, ctx = CollectiveVotes(), Master()
    vote(votes, ctx, 1)
    vote(votes, ctx, 2, desc=DESC._replace(element_count=5))
    aborts = sends(vote(votes, ctx, 3), m.CollectiveAbort)
    assert [p for p, _ in aborts] == [1, 2, 3]
    assert {a.code for _, a in aborts} == {int(Result.INVALID_ARGUMENT)} and "count" in aborts[0][1].reason
    assert votes.get((0, 7)) is None


def test_a_peer_alone_in_its_group_gets_too_few_peers_naming_who_waits() -> None:
    votes, ctx = CollectiveVotes(), Master(groups={0: [1]}, waiting={0: [5]})
    aborts = sends(vote(votes, ctx, 1), m.CollectiveAbort)
    assert aborts[0][1].code == int(Result.TOO_FEW_PEERS) and "5" in aborts[0][1].reason


def test_the_speculative_start_holds_on_the_reserved_number() -> None:
    votes, ctx = CollectiveVotes(), Master()
    r = run_slow(votes, ctx)
    vote(votes, ctx, 1, op_seq=r)
    vote(votes, ctx, 2, op_seq=r)
    eff = vote(votes, ctx, 3)  # 3 missed the number: it gets the table
    assert eff[0] == FastStart(0, 7, r) and votes.fast_starts == 1
    commences = dict(sends(eff, m.CollectiveCommence))
    assert commences[1].peers == [] and commences[2].peers == [] and len(commences[3].peers) == 3
    assert {c.op_seq for c in commences.values()} == {r}


def test_a_speculative_start_on_another_epoch_is_not_confirmed() -> None:
    votes, ctx = CollectiveVotes(), Master()
    r = run_slow(votes, ctx)
    ctx.epoch = 2
    for p in (1, 2):
        vote(votes, ctx, p, op_seq=r)
    aborts = sends(vote(votes, ctx, 3, op_seq=r), m.CollectiveAbort)
    assert [p for p, _ in aborts] == [1, 2, 3]
    assert "reserved in epoch 1, the run is at epoch 2" in aborts[0][1].reason
    assert aborts[0][1].forget == [r] and aborts[0][1].op_seq == r


def test_an_early_failure_of_a_speculative_attempt_fails_the_op_once_voted() -> None:
    votes, ctx = CollectiveVotes(), Master()
    r = run_slow(votes, ctx)
    vote(votes, ctx, 1, op_seq=r)
    assert done(votes, ctx, 1, op_seq=r, success=False, reason="boom") == []  # waits for the vote
    vote(votes, ctx, 2, op_seq=r)
    aborts = sends(vote(votes, ctx, 3, op_seq=r), m.CollectiveAbort)
    assert len(aborts) == 3 and aborts[0][1].reason == "peer 1 failed: boom"


def test_an_early_success_counts_once_the_vote_confirms_the_number() -> None:
    votes, ctx = CollectiveVotes(), Master()
    r = run_slow(votes, ctx)
    for p in (1, 2):
        vote(votes, ctx, p, op_seq=r)
        assert done(votes, ctx, p, op_seq=r) == []
    vote(votes, ctx, 3, op_seq=r)
    got = done(votes, ctx, 3, op_seq=r)
    assert isinstance(got, list) and len(sends(got, m.CollectiveComplete)) == 3


def test_a_withdrawal_while_voting_aborts_the_voters() -> None:
    votes, ctx = CollectiveVotes(), Master()
    vote(votes, ctx, 1)
    vote(votes, ctx, 2)
    got = done(votes, ctx, 2, success=False, reason="cancelled")
    assert isinstance(got, list) and [p for p, _ in sends(got, m.CollectiveAbort)] == [1, 2]
    assert votes.get((0, 7)) is None


def test_a_participant_lost_while_it_runs_aborts_the_others() -> None:
    votes, ctx = CollectiveVotes(), Master()
    for p in (1, 2, 3):
        vote(votes, ctx, p)
    ctx.lose(2)
    eff = votes.peer_lost((0, 7), 2, ctx, resumed=True)
    aborts = sends(eff, m.CollectiveAbort)
    assert [p for p, _ in aborts] == [1, 3] and aborts[0][1].op_seq == 101
    assert ctx.settled == [(0, 7, 101, False)]


def test_a_voter_lost_leaves_the_vote_and_the_others_complete() -> None:
    votes, ctx = CollectiveVotes(), Master()
    vote(votes, ctx, 1)
    vote(votes, ctx, 2)
    ctx.lose(3)  # the one missing
    assert votes.peer_lost((0, 7), 3, ctx, resumed=False) == []  # held: nothing completes
    eff = votes.peer_lost((0, 7), 3, ctx, resumed=True)
    assert [p for p, _ in sends(eff, m.CollectiveCommence)] == [1, 2]


def test_withdraw_fails_only_the_named_voters_and_voids_their_number() -> None:
    votes, ctx = CollectiveVotes(), Master()
    r = run_slow(votes, ctx)
    vote(votes, ctx, 1, op_seq=r)
    vote(votes, ctx, 2)
    eff = votes.withdraw((0, 7), {1, 9}, "deadlock", Result.INVALID_USAGE)
    assert [(p, a.op_seq, a.forget) for p, a in sends(eff, m.CollectiveAbort)] == [(1, r, [r])]
    assert len(votes.reserved) == 0  # it never runs again
    op = votes.get((0, 7))
    assert op is not None and set(op.votes) == {2}
    votes.withdraw((0, 7), {2}, "deadlock", Result.INVALID_USAGE)
    assert votes.get((0, 7)) is None


def test_fail_lost_aborts_the_owing_voters_once() -> None:
    votes, ctx = CollectiveVotes(), Master()
    vote(votes, ctx, 1)
    vote(votes, ctx, 2)
    eff = votes.fail_lost((0, 7), lambda p: p == 2)
    aborts = sends(eff, m.CollectiveAbort)
    assert [p for p, _ in aborts] == [2] and aborts[0][1].code == int(Result.RANK_CONNECTION_LOST)
    op = votes.get((0, 7))
    assert op is not None and set(op.votes) == {1}


def test_the_held_back_commence_goes_at_its_delay_to_who_has_not_reported() -> None:
    votes, ctx = CollectiveVotes(go_delay=0.5), Master()
    r = run_slow(votes, ctx)
    for p in (1, 2, 3):
        eff = vote(votes, ctx, p, op_seq=r)
    assert eff == [FastStart(0, 7, r)]  # no commence yet
    assert votes.go_waiting and votes.go_deadline() == 0.5
    done(votes, ctx, 1, op_seq=r)
    assert votes.go_overdue(0.4) == []
    assert [p for p, _ in sends(votes.go_overdue(0.5), m.CollectiveCommence)] == [2, 3]
    assert not votes.go_waiting and votes.go_held == 0


def test_an_op_that_ends_before_its_delay_needs_no_commence() -> None:
    votes, ctx = CollectiveVotes(go_delay=0.5), Master()
    r = run_slow(votes, ctx)
    for p in (1, 2, 3):
        vote(votes, ctx, p, op_seq=r)
    for p in (1, 2, 3):
        done(votes, ctx, p, op_seq=r)
    assert votes.go_held == 1 and not votes.go_waiting


def test_reservations_keep_the_newest_per_group_and_a_revoke_drops_them() -> None:
    book = Reservations()
    for tag in range(RESERVATIONS_PER_GROUP + 1):
        book.reserve(0, tag, tag, 1, [1, 2])
    assert len(book) == RESERVATIONS_PER_GROUP and book.take((0, 0)) is None
    got = book.take((0, 5))
    assert got is not None and got.seq == 5 and book.take((0, 5)) is None
    assert book.revoke(0) and not book.revoke(0) and len(book) == 0
