"""Issue 18: a member whose link to a LIVE master breaks (pure MasterState and AwayBook, message by message).

The member fails its call and re-registers with the same master; the others never left. The master
fails the others' calls of what it reports abandoned (once each), unless that call already ended for
everybody here; with ``rejoin_grace`` it holds every vote until the member is back or the grace ran out;
and it refuses to take the member back while its group runs an operation without it (docs/concepts.md
"A member's link breaks", pccl/master/away.py, pccl/master/lost.py).
"""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.master.away import NONE, OPEN, RUNNING, AwayBook
from pccl.master.deadlock import find_deadlocks
from pccl.master.lost import REASON
from pccl.master.state import Kick, MasterState
from pccl.wire import messages as m

from ._effects import member_reregister, sends

RING = [1, 2, 3]
EPOCH = 4
TAG = 7
DESC = m.CollectiveDescriptor("all_reduce", 1, 10, 0, -1, 0, 0)
KEY = ("op", 0, TAG)


def rereg(st: MasterState, pid: int, now: float = 0.0, **fields: Any) -> list[Any]:
    assert st.new_connection("127.0.0.1", now, claim=pid) == pid
    fields.setdefault("epoch", EPOCH)
    fields.setdefault("generation", 1)
    msg = member_reregister(st, peer_id=pid, p2p_port=40000 + pid, peer_group=0, ring=list(RING), revision=5,
                       **fields)
    return st.handle(pid, msg, now)


def live(rejoin_grace: float = 0.0) -> MasterState:
    """A master that took the run back and resumed: from now on it is a live master of its members."""
    st = MasterState(rejoin_grace=rejoin_grace)
    for p in RING:
        rereg(st, p)
    assert st.resumed and st.rebuild is None and st.accepted() == RING
    return st


def vote(st: MasterState, pid: int, now: float = 0.0) -> list[Any]:
    return st.handle(pid, m.CollectiveInitiate(tag=TAG, descriptor=DESC), now)


def lost_aborts(effects: list[Any]) -> list[int]:
    out = []
    for p, a in sends(effects, m.CollectiveAbort):
        assert a.code == int(Result.RANK_CONNECTION_LOST) and a.reason == REASON
        out.append(p)
    return out


def commenced(effects: list[Any]) -> list[int]:
    return sorted(p for p, _ in sends(effects, m.CollectiveCommence))


def test_the_votes_wait_for_a_member_whose_link_broke_and_fail_with_its_report() -> None:
    st = live(rejoin_grace=1.0)
    vote(st, 1)
    vote(st, 3)
    st.peer_lost(3, "left (connection closed)", 1.0, broken=True)
    assert not commenced(vote(st, 2, now=1.1))  # held: member 3 may be back in a moment
    assert not st.resumed and st.away.members == {3}
    assert find_deadlocks(st) == [] and st.vote_deadline(0.5) is None  # held: no deadlock, no timeout
    eff = rereg(st, 3, now=1.2, ops_abandoned=[[TAG, -1]])  # its vote was cut: its call failed
    assert sorted(lost_aborts(eff)) == [1, 2]  # the others' calls of it fail alike
    assert st.resumed and st.away.members == set()
    eff = []
    for p in RING:
        eff += vote(st, p, now=1.3)  # the retries (after update_topology(), say)
    assert commenced(eff) == RING


def test_a_member_that_does_not_come_back_is_absent_after_the_grace() -> None:
    st = live(rejoin_grace=1.0)
    vote(st, 1)
    st.peer_lost(3, "left (connection closed)", 2.0, broken=True)
    vote(st, 2, now=2.1)
    assert st.rejoin_deadline() == 3.0
    assert not st.rejoin_overdue(2.9)
    assert commenced(st.rejoin_overdue(3.0)) == [1, 2]  # the survivors go on without it
    assert st.resumed and st.rejoin_deadline() is None


def test_evictions_kicks_and_no_grace_hold_nothing() -> None:
    for grace, broken in ((1.0, False), (0.0, True)):
        st = live(rejoin_grace=grace)
        vote(st, 1)
        vote(st, 2)
        assert commenced(st.peer_lost(3, "evicted: silent", 1.0, broken=broken)) == [1, 2]
    st = live(rejoin_grace=1.0)
    vote(st, 1)
    vote(st, 2)
    assert commenced(st.kick(3, "bad message")) == [1, 2]


def test_a_call_the_master_aborted_for_everybody_is_not_failed_again() -> None:
    st = live(rejoin_grace=1.0)
    eff = []
    for p in RING:
        eff += vote(st, p)
    assert commenced(eff) == RING
    eff = st.peer_lost(3, "left (connection closed)", 1.0, broken=True)  # before its commence arrived
    assert sorted(p for p, _ in sends(eff, m.CollectiveAbort)) == [1, 2]  # aborted for all, as before
    # It never got the commence, so it reports the vote only (op_seq -1): nothing more to fail.
    assert not lost_aborts(rereg(st, 3, now=1.1, ops_abandoned=[[TAG, -1]]))
    eff = []
    for p in RING:
        eff += vote(st, p, now=1.2)
    assert commenced(eff) == RING  # every retry goes through


def test_without_a_hold_a_member_back_before_the_others_voted_fails_them_once() -> None:
    st = live()
    vote(st, 1)
    vote(st, 3)
    assert not commenced(st.peer_lost(3, "left (connection closed)", 1.0, broken=True))  # 2 not voted
    assert lost_aborts(rereg(st, 3, now=1.1, ops_abandoned=[[TAG, -1]])) == [1]  # waiting: fails now
    assert lost_aborts(vote(st, 2, now=1.2)) == [2]  # not voted then: its vote fails once
    assert not sends(vote(st, 2, now=1.3))  # its retry counts
    assert not sends(vote(st, 1, now=1.3))
    assert commenced(vote(st, 3, now=1.3)) == RING


def test_a_member_is_taken_back_only_once_what_its_group_runs_without_it_is_decided() -> None:
    st = live()
    st.peer_lost(3, "left (connection closed)", 1.0, broken=True)
    eff = vote(st, 1) + vote(st, 2)
    assert commenced(eff) == [1, 2]  # no hold: the group runs without it
    seq = sends(eff, m.CollectiveCommence)[0][1].op_seq
    kicks = [e for e in rereg(st, 3, now=1.1) if isinstance(e, Kick)]
    assert [(k.peer_id, k.code) for k in kicks] == [(3, int(Result.MASTER_CONNECTION_FAILED))]  # later
    assert "retry later" in kicks[0].reason
    for p in (1, 2):
        st.handle(p, m.CollectiveDone(tag=TAG, success=True, op_seq=seq), 1.2)
    kicks = [e for e in rereg(st, 3, now=1.3) if isinstance(e, Kick)]
    assert [(k.peer_id, k.code) for k in kicks] == [(3, int(Result.KICKED))]  # it went on: join again


def test_away_book_matches_a_report_with_the_round_at_the_drop() -> None:
    book = AwayBook()
    other = ("op", 0, TAG + 1)
    book.opened(KEY)
    book.dropped(1, 0, {KEY: OPEN})
    assert book.kept_votes(1, KEY, OPEN) is True  # the round open then still waits
    assert book.kept_votes(1, KEY, NONE) is False  # it ended (failed, or went past)
    assert book.kept_votes(1, KEY, RUNNING) is False
    book.opened(KEY)
    assert book.kept_votes(1, KEY, OPEN) is False  # a later round: the one at the drop ended
    book.dropped(2, 0, {KEY: RUNNING})
    assert book.kept_votes(2, KEY, OPEN) is False  # running then: its abort failed everybody
    book.dropped(3, 0, {})
    assert book.kept_votes(3, other, NONE) is True  # nobody voted yet, nor since
    book.opened(other)
    assert book.kept_votes(3, other, OPEN) is True  # the first round since is the call it abandoned
    book.opened(other)
    assert book.kept_votes(3, other, OPEN) is False
    assert book.kept_votes(4, KEY, OPEN) is None  # never dropped here: a rebuilt master's member
    book.forget(3)
    assert book.kept_votes(3, other, OPEN) is None
    assert not book.left(5, 0.0, 0.0) and not book
    assert book.left(5, 1.0, 2.0) and book.deadline() == 3.0
    assert book.overdue(2.9) == [] and book.overdue(3.0) == [5] and not book


def pending_vote(st: MasterState, pid: int, now: float = 0.0) -> list[Any]:
    return st.handle(pid, m.PeersPendingVote(), now)


def answered(effects: list[Any]) -> list[int]:
    return sorted(p for p, _ in sends(effects, m.PeersPendingResult))


def test_a_member_whose_link_broke_in_a_pending_round_is_counted_in_it_at_once() -> None:
    st = live()
    pending_vote(st, 1)
    pending_vote(st, 3)
    st.peer_lost(3, "left (connection closed)", 1.0, broken=True)
    eff = rereg(st, 3, now=1.1, pending=[EPOCH, 0, 1, -1])  # it waits in the round: first at this epoch
    assert not answered(eff) and st.resumed and not st.rounds.undecided  # no doubt: the round is open here
    assert answered(pending_vote(st, 2, now=1.2)) == RING  # one answer for all three, at once


def test_pending_rounds_answered_while_a_topology_round_sets_up_count_at_the_members_epoch() -> None:
    # The async API lets a member call are_peers_pending() while its own update_topology() runs. An
    # answer sent while the round sets up reaches the members before their TopologyResult, at their old
    # epoch: the master counts it there too, so that the members and the master name every round alike.
    st = live()
    eff = []
    for p in RING:
        eff += st.handle(p, m.UpdateTopologyVote(), 0.0)
    (_, establish), *_ = sends(eff, m.EstablishP2P)
    new = establish.epoch
    assert new == EPOCH + 1 and st.epoch == new
    for p in RING:
        eff = pending_vote(st, p)
    assert answered(eff) == RING  # answered during the setup: round 1 of EPOCH, as the members count it
    for p in RING:
        eff = st.handle(p, m.P2PConnectionsDone(epoch=new, success=True), 0.0)
    assert sorted(p for p, r in sends(eff, m.TopologyResult) if r.success) == RING
    # Round 1 of the new epoch: member 3 votes, its link breaks, and it comes back waiting in it.
    pending_vote(st, 3)
    st.peer_lost(3, "left (connection closed)", 1.0, broken=True)
    eff = rereg(st, 3, now=1.1, pending=[new, 0, 1, -1], epoch=new, members_epoch=new)
    assert not answered(eff)  # (counted at the new epoch, the setup's answer would have been its answer)
    pending_vote(st, 1, now=1.2)
    assert answered(pending_vote(st, 2, now=1.2)) == RING


def topo_vote(st: MasterState, pid: int, now: float = 0.0) -> list[Any]:
    return st.handle(pid, m.UpdateTopologyVote(), now)


def test_a_topology_call_its_broken_link_failed_fails_for_every_member_once() -> None:
    st = live(rejoin_grace=1.0)
    topo_vote(st, 1)
    st.peer_lost(3, "left (connection closed)", 1.0, broken=True)  # its vote never arrived
    eff = rereg(st, 3, now=1.1, topology_abandoned=EPOCH)  # its update_topology() failed
    failed = sends(eff, m.TopologyResult)
    assert [(p, r.success, r.code, r.reason) for p, r in failed] == \
        [(1, False, int(Result.UPDATE_TOPOLOGY_FAILED), REASON)]  # the vote waiting here
    (_, r2), = sends(topo_vote(st, 2, now=1.2), m.TopologyResult)  # not voted then: fails once
    assert not r2.success and r2.reason == REASON
    eff = []
    for p in RING:
        eff += topo_vote(st, p, now=1.3)  # the retries go through, with every member
    (_, establish), *_ = sends(eff, m.EstablishP2P)
    assert sorted(p for p, _ in sends(eff, m.EstablishP2P)) == RING and establish.epoch == EPOCH + 1


def test_a_member_is_refused_after_a_topology_round_went_on_without_it() -> None:
    st = live()
    st.peer_lost(3, "left (connection closed)", 1.0, broken=True)
    eff = topo_vote(st, 1) + topo_vote(st, 2)
    assert sorted(p for p, _ in sends(eff, m.EstablishP2P)) == [1, 2]  # no hold: it sets up without 3
    kicks = [e for e in rereg(st, 3, now=1.1, topology_abandoned=EPOCH) if isinstance(e, Kick)]
    assert [(k.peer_id, k.code) for k in kicks] == [(3, int(Result.MASTER_CONNECTION_FAILED))]  # later
    for p in (1, 2):
        eff = st.handle(p, m.P2PConnectionsDone(epoch=EPOCH + 1, success=True), 1.2)
    assert sorted(p for p, r in sends(eff, m.TopologyResult) if r.success) == [1, 2]
    kicks = [e for e in rereg(st, 3, now=1.3, topology_abandoned=EPOCH) if isinstance(e, Kick)]
    assert [(k.peer_id, k.code) for k in kicks] == [(3, int(Result.KICKED))]  # it went on: join again


def test_a_live_master_that_lost_every_members_link_takes_them_back_without_a_rebuild() -> None:
    st = live(rejoin_grace=1.0)
    gen = st.generation
    for p in RING:
        st.peer_lost(p, "left (connection closed)", 1.0, broken=True)
    assert st.accepted() == [] and st.away.members == set(RING)
    for p in RING:
        (who, ok), = sends(rereg(st, p, now=1.1, generation=gen), m.Reregistered)  # it followed this one
        assert who == p and ok.generation == gen
    assert st.rebuild is None and st.generation == gen and st.accepted() == RING and st.resumed
    assert commenced(vote(st, 1) + vote(st, 2) + vote(st, 3)) == RING
