"""Issue 18: operations in doubt across a master's loss, decided the same way for every peer.

The pure MasterState driven message by message (pccl/master/ops_in_doubt.py, docs/concepts.md "Operations in
doubt"): a master lost between the CollectiveComplete (or SharedStateResult) messages of one operation
leaves some participants committed and the others waiting; their re-registrations say which, and the
master answers each waiting peer with the old operation's commit or abort before any vote resumes.
"""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.master.state import MasterState
from pccl.wire import messages as m

from ._effects import kicks, member_reregister, sends

RING = [1, 2, 3]
EPOCH = 4
TAG = 7
OP = 42  # the old master's op_seq of the split operation
SYNC = 9  # the old master's sync_seq of a split sync
DESC = m.CollectiveDescriptor("all_reduce", 1, 10, 0, -1, 0, 0)


def rereg(st: MasterState, pid: int, now: float = 0.0, **fields: Any) -> list[Any]:
    got = st.new_connection("127.0.0.1", now, claim=pid)
    assert got == pid
    msg = member_reregister(st, peer_id=pid, p2p_port=40000 + pid, peer_group=0, epoch=EPOCH, ring=list(RING),
                       revision=fields.pop("revision", 5), generation=1, **fields)
    return st.handle(pid, msg, now)


def in_doubt(tag: int = TAG, seq: int = OP, participants: list[int] = RING) -> dict[str, Any]:
    return {"ops_in_doubt": [[tag, seq, list(participants)]]}


def test_a_peer_that_committed_makes_the_op_commit_for_the_peers_in_doubt() -> None:
    st = MasterState()
    eff = rereg(st, 2, **in_doubt())
    assert not sends(eff, m.CollectiveComplete) and st.statistics()["in_doubt"] == 1
    eff = rereg(st, 1, ops_committed=[[TAG, OP]])  # it got its CollectiveComplete before the crash
    assert sends(eff, m.CollectiveComplete) == [(2, m.CollectiveComplete(tag=TAG, op_seq=OP))]
    # The answer follows the peer's own Reregistered (here: peer 1's; peer 2 had its own before).
    kinds = [type(msg) for _, msg in sends(eff)]
    assert kinds.index(m.Reregistered) < kinds.index(m.CollectiveComplete)
    assert st.statistics()["in_doubt"] == 0
    # A participant that comes back later in doubt is told at once, right after its Reregistered.
    eff = rereg(st, 3, **in_doubt())
    kinds = [type(msg) for _, msg in sends(eff) if isinstance(msg, (m.Reregistered, m.CollectiveComplete))]
    # (annotated: mypy joins the two classes into a constructor signature neither matches)
    want: list[type[m.Message]] = [m.Reregistered, m.CollectiveComplete]
    assert kinds == want  # (its P2P credentials may come between)
    assert sends(eff, m.CollectiveComplete) == [(3, m.CollectiveComplete(tag=TAG, op_seq=OP))]


def test_every_participant_in_doubt_commits() -> None:
    st = MasterState()
    assert not sends(rereg(st, 1, **in_doubt()), m.CollectiveComplete)
    assert not sends(rereg(st, 2, **in_doubt()), m.CollectiveComplete)  # a majority, still undecided
    eff = rereg(st, 3, **in_doubt())
    got = sends(eff, m.CollectiveComplete)
    assert sorted(p for p, _ in got) == [1, 2, 3]
    assert all(msg == m.CollectiveComplete(tag=TAG, op_seq=OP) for _, msg in got)


def test_a_participant_that_abandoned_the_op_aborts_it_for_everybody() -> None:
    st = MasterState()
    rereg(st, 1, **in_doubt())
    eff = rereg(st, 2, ops_abandoned=[[TAG, OP]])  # its ring was cut by the loss: nobody committed
    (who, abort), = sends(eff, m.CollectiveAbort)
    assert who == 1 and abort.tag == TAG and abort.op_seq == OP
    assert abort.code == int(Result.RANK_CONNECTION_LOST) and "in doubt" in abort.reason
    eff = rereg(st, 3, **in_doubt())
    assert [(p, type(x)) for p, x in sends(eff, m.CollectiveAbort)] == [(3, m.CollectiveAbort)]
    assert not sends(eff, m.CollectiveComplete)


def test_votes_wait_for_the_decision_and_resume_after_it() -> None:
    st = MasterState()
    rereg(st, 1, ops_committed=[[TAG, OP]])
    # Peer 3 is in doubt about an op of peers 2 and 3 (peer 2 is not back yet).
    rereg(st, 3, **in_doubt(tag=8, seq=OP + 1, participants=[2, 3]))
    assert not st.statistics()["rebuilding"] and not st.resumed  # a majority, but a decision is open
    assert not sends(st.handle(1, m.PeersPendingVote(), 0.0), m.PeersPendingResult)
    eff = rereg(st, 2, **in_doubt(tag=8, seq=OP + 1, participants=[2, 3]))
    assert sorted(p for p, _ in sends(eff, m.CollectiveComplete)) == [2, 3]
    assert st.resumed
    assert not sends(eff, m.PeersPendingResult)  # resumed: the vote now waits for 2 and 3 only
    st.handle(2, m.PeersPendingVote(), 0.0)
    answered = sends(st.handle(3, m.PeersPendingVote(), 0.0), m.PeersPendingResult)
    assert sorted(p for p, _ in answered) == [1, 2, 3]


def test_undecided_after_the_timeout_aborts_and_resumes() -> None:
    st = MasterState()
    rereg(st, 1, now=10.0, **in_doubt())
    rereg(st, 2, now=10.5, **in_doubt())  # peer 3 died with the master: nothing says it committed
    assert st.doubt_deadline(3.0) == 13.0
    st.handle(1, m.CollectiveInitiate(tag=1, descriptor=DESC), 11.0)
    st.handle(2, m.CollectiveInitiate(tag=1, descriptor=DESC), 11.0)
    assert not sends(st.doubts_overdue(12.9, 3.0))  # not yet
    eff = st.doubts_overdue(13.1, 3.0)
    aborts = sends(eff, m.CollectiveAbort)
    assert sorted(p for p, _ in aborts) == [1, 2] and all(a.op_seq == OP for _, a in aborts)
    # and the votes held meanwhile complete now, with the two of them
    assert sorted(p for p, _ in sends(eff, m.CollectiveCommence)) == [1, 2]
    # Peer 3 comes back claiming it committed the aborted op: it is a step ahead, refused.
    eff = rereg(st, 3, now=14.0, ops_committed=[[TAG, OP]])
    (kick,) = kicks(eff)
    assert kick.peer_id == 3 and kick.code == int(Result.MASTER_CONNECTION_FAILED)
    assert "step ahead" in kick.reason and 3 not in st.accepted()


def test_a_sync_in_doubt_commits_its_revision_once() -> None:
    st = MasterState()
    doubt: dict[str, Any] = {"sync_in_doubt": [SYNC, 6, list(RING)]}
    rereg(st, 2, revision=5, **doubt)
    eff = rereg(st, 1, revision=6, sync_committed=SYNC)  # applied revision 6 before the crash
    ok = m.SharedStateResult(sync_seq=SYNC, success=True, revision=6)
    assert sends(eff, m.SharedStateResult) == [(2, ok)]
    eff = rereg(st, 3, revision=5, **doubt)
    assert sends(eff, m.SharedStateResult) == [(3, ok)]
    assert st.statistics()["revisions"] == {0: 6}  # not lost, not counted twice


def test_a_sync_abandoned_by_a_member_aborts_for_the_others() -> None:
    st = MasterState()
    rereg(st, 1, sync_in_doubt=[SYNC, 6, list(RING)])
    eff = rereg(st, 2, sync_abandoned=SYNC)
    (who, res), = sends(eff, m.SharedStateResult)
    assert who == 1 and res.sync_seq == SYNC and not res.success
    assert res.code == int(Result.RANK_CONNECTION_LOST)
    assert st.statistics()["revisions"] == {0: 5}


def _live_master_with_op() -> tuple[MasterState, int]:
    """A live master (generation 1) whose three accepted peers run one all-reduce."""
    st = MasterState()
    for _ in RING:
        pid = st.new_connection("127.0.0.1", 0.0)
        st.handle(pid, m.Register(p2p_port=40000 + pid), 0.0)
    assert st.accepted() == [1]  # the first one alone; it admits the others
    eff: list[Any] = st.handle(1, m.UpdateTopologyVote(), 0.0)
    for pid, msg in sends(eff, m.EstablishP2P):
        st.handle(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True), 0.0)
    assert st.accepted() == RING
    eff = []
    for p in RING:
        eff += st.handle(p, m.CollectiveInitiate(tag=TAG, descriptor=DESC), 0.0)
    (_, commence), *_ = sends(eff, m.CollectiveCommence)
    return st, commence.op_seq


def test_live_master_tells_a_peer_that_missed_its_complete_to_commit() -> None:
    st, seq = _live_master_with_op()
    eff: list[Any] = []
    for p in RING:
        eff += st.handle(p, m.CollectiveDone(tag=TAG, success=True), 0.0)
    assert len(sends(eff, m.CollectiveComplete)) == 3
    st.peer_lost(2, "connection closed")  # before its CollectiveComplete reached it
    got = st.new_connection("127.0.0.1", 0.0, claim=2)
    eff = st.handle(got, member_reregister(st,
        peer_id=2, p2p_port=40002, peer_group=0, epoch=st.epoch, ring=RING,
                                      revision=-1, generation=1, ops_in_doubt=[[TAG, seq, RING]]), 0.0)
    assert sends(eff, m.CollectiveComplete) == [(2, m.CollectiveComplete(tag=TAG, op_seq=seq))]


def test_live_master_aborts_its_own_op_it_did_not_complete() -> None:
    st, seq = _live_master_with_op()
    st.handle(1, m.CollectiveDone(tag=TAG, success=True), 0.0)
    st.handle(2, m.CollectiveDone(tag=TAG, success=True), 0.0)
    eff = st.peer_lost(2, "connection closed")  # the op is aborted for the others
    assert sorted(p for p, _ in sends(eff, m.CollectiveAbort)) == [1, 3]
    got = st.new_connection("127.0.0.1", 0.0, claim=2)
    eff = st.handle(got, member_reregister(st,
        peer_id=2, p2p_port=40002, peer_group=0, epoch=st.epoch, ring=RING,
                                      revision=-1, generation=1, ops_in_doubt=[[TAG, seq, RING]]), 0.0)
    (who, abort), = sends(eff, m.CollectiveAbort)
    assert who == 2 and abort.op_seq == seq and st.resumed


def test_the_roll_call_holds_votes_for_the_members_not_back_yet() -> None:
    st = MasterState(rebuild_grace=2.0)
    rereg(st, 1, now=10.0)
    rereg(st, 2, now=10.1)  # a majority: the rebuild ends, but member 3 has not said what it holds
    assert not st.statistics()["rebuilding"] and not st.resumed and st.doubts.missing == {3}
    st.handle(1, m.PeersPendingVote(), 10.2)
    assert not sends(st.handle(2, m.PeersPendingVote(), 10.2), m.PeersPendingResult)
    eff = rereg(st, 3, now=10.4)  # the last one: the votes resume at once
    assert st.resumed and not sends(eff, m.PeersPendingResult)  # now they wait for 3's vote too
    answered = sends(st.handle(3, m.PeersPendingVote(), 10.5), m.PeersPendingResult)
    assert sorted(p for p, _ in answered) == [1, 2, 3]


def test_the_roll_call_ends_after_the_grace() -> None:
    st = MasterState(rebuild_grace=2.0)
    rereg(st, 1, now=10.0)
    rereg(st, 2, now=10.1)
    st.handle(1, m.PeersPendingVote(), 10.2)
    st.handle(2, m.PeersPendingVote(), 10.2)
    assert st.doubt_deadline(3.0) == 12.0
    assert not sends(st.doubts_overdue(11.9, 3.0), m.PeersPendingResult)
    answered = sends(st.doubts_overdue(12.0, 3.0), m.PeersPendingResult)  # member 3 is simply absent
    assert sorted(p for p, _ in answered) == [1, 2] and st.resumed


def test_a_member_the_group_went_on_without_is_refused_for_good() -> None:
    st, seq = _live_master_with_op()
    st.peer_lost(3, "evicted: silent")  # aborts the op for 1 and 2
    eff: list[Any] = []
    for p in (1, 2):  # they retry and complete it without peer 3
        eff += st.handle(p, m.CollectiveInitiate(tag=TAG, descriptor=DESC), 1.0)
    assert sorted(p for p, _ in sends(eff, m.CollectiveCommence)) == [1, 2]
    for p in (1, 2):
        st.handle(p, m.CollectiveDone(tag=TAG, success=True), 1.0)
    got = st.new_connection("127.0.0.1", 2.0, claim=3)
    eff = st.handle(got, member_reregister(st,
        peer_id=3, p2p_port=40003, peer_group=0, epoch=st.epoch, ring=RING,
                                      revision=-1, generation=1, ops_abandoned=[[TAG, seq]]), 2.0)
    (kick,) = kicks(eff)
    assert kick.code == int(Result.KICKED) and "went on without" in kick.reason
    assert st.accepted() == [1, 2]


def test_a_dropped_member_is_taken_back_when_nothing_moved_on() -> None:
    st, seq = _live_master_with_op()
    st.peer_lost(3, "connection closed")
    got = st.new_connection("127.0.0.1", 2.0, claim=3)
    eff = st.handle(got, member_reregister(st,
        peer_id=3, p2p_port=40003, peer_group=0, epoch=st.epoch, ring=RING,
                                      revision=-1, generation=1, ops_abandoned=[[TAG, seq]]), 2.0)
    assert not kicks(eff) and sends(eff, m.Reregistered) and sorted(st.accepted()) == [1, 2, 3]


def test_the_roll_call_waits_only_for_members_every_returned_peer_lists() -> None:
    """Peer 1 still lists peer 4 (dead, of another group: its table drops only its own group's dead);
    peer 2 does not. Whoever comes first, the roll call ends once 1, 2 and 3 are back."""
    for order in ([1, 2, 3], [2, 1, 3]):
        st = MasterState(rebuild_grace=2.0)
        for pid in order:
            ring = [1, 2, 3, 4] if pid == 1 else [1, 2, 3]
            got = st.new_connection("127.0.0.1", 0.0, claim=pid)
            msg = member_reregister(st,
                peer_id=pid, p2p_port=40000 + pid, peer_group=0, epoch=EPOCH, ring=ring,
                               revision=5, generation=1)
            st.handle(got, msg, 0.0)
        assert st.resumed, order


def test_a_member_in_doubt_on_an_op_its_group_went_past_is_refused_for_good() -> None:
    """Found by the chaos test: a member cut off while its op waited for the master's answer came back
    after the others had committed that op and later ones of the tag at the rebuilt master. Taken back,
    its op was aborted by the timeout (nobody else reports it any more) and it retried a step the others
    were past: a deadlock. It is refused instead (KICKED: join again)."""
    st = MasterState()
    for p in (1, 2):
        rereg(st, p, ops_committed=[[TAG, OP]])
    st.doubts.settle(("op", 0, TAG), OP + 5, True)  # the group's later ops of the tag committed here
    got = st.new_connection("127.0.0.1", 0.0, claim=3)
    eff = st.handle(got, member_reregister(st,
        peer_id=3, p2p_port=40003, peer_group=0, epoch=EPOCH, ring=list(RING),
                                      revision=5, generation=1, **in_doubt()), 0.0)
    (k,) = kicks(eff)
    assert k.code == int(Result.KICKED) and "went on without it" in k.reason
    assert 3 not in st.accepted()


def test_the_roll_calls_grace_aborts_the_doubts_without_waiting_for_the_timeout() -> None:
    """Peer 3 died with the master: the roll call waits its grace for it, and when the grace runs out
    the doubt it was a participant of is aborted at once (3 is absent), not a heartbeat timeout
    after the doubt opened."""
    st = MasterState(rebuild_grace=1.0)
    rereg(st, 1, now=10.0, **in_doubt())
    rereg(st, 2, now=10.1, **in_doubt())
    st.handle(1, m.CollectiveInitiate(tag=1, descriptor=DESC), 10.2)
    st.handle(2, m.CollectiveInitiate(tag=1, descriptor=DESC), 10.2)
    assert st.doubt_deadline(3.0) == 11.0  # the roll call's end, before the doubt's 13.0
    assert not sends(st.doubts_overdue(10.9, 3.0))
    eff = st.doubts_overdue(11.0, 3.0)
    aborts = sends(eff, m.CollectiveAbort)
    assert sorted(p for p, _ in aborts) == [1, 2] and all(a.op_seq == OP for _, a in aborts)
    assert sorted(p for p, _ in sends(eff, m.CollectiveCommence)) == [1, 2]
    assert st.resumed and st.doubts.open_doubts() == []


def test_the_last_member_back_aborts_a_doubt_whose_participant_is_no_member() -> None:
    """Participant 4 was dropped from every table before the crash (it is no member the roll call
    waits for): once members 1-3 are back, nothing will ever report for it, so the doubt is aborted
    at once instead of after the timeout."""
    st = MasterState(rebuild_grace=2.0)
    doubt = in_doubt(participants=[1, 2, 4])
    rereg(st, 1, now=10.0, **doubt)
    rereg(st, 2, now=10.1, **doubt)
    assert not st.resumed and len(st.doubts.open_doubts()) == 1
    eff = rereg(st, 3, now=10.2)
    aborts = sends(eff, m.CollectiveAbort)
    assert sorted(p for p, _ in aborts) == [1, 2] and st.resumed and st.doubts.open_doubts() == []


def test_every_participant_in_doubt_still_commits_when_the_roll_call_completes() -> None:
    st = MasterState(rebuild_grace=2.0)
    rereg(st, 1, now=10.0, **in_doubt())
    rereg(st, 2, now=10.1, **in_doubt())
    eff = rereg(st, 3, now=10.2, **in_doubt())
    assert sorted(p for p, _ in sends(eff, m.CollectiveComplete)) == [1, 2, 3]
    assert not sends(eff, m.CollectiveAbort) and st.resumed


def test_a_member_in_doubt_on_op_k_learns_that_k_committed_when_the_others_lost_k_plus_1() -> None:
    """Found by `benchmarks/recovery.py --faults master` (about 1 trial in 15 on a quiet host): peers 1 and
    2 committed op k and had voted for op k + 1 when the master died; peer 3 was still waiting for op k's
    CollectiveComplete. Both reports of 1 and 2 (committed k, abandoned k + 1) left the tag's last outcome
    at "k + 1 aborted", and peer 3's doubt on k was aborted when it came back last: it retried op k while
    the others retried k + 1 (different inputs: diverged states, or a deadlock when they run
    update_topology() first). Op k is committed for peer 3."""
    st = MasterState(rebuild_grace=1.0)
    for p in (1, 2):
        rereg(st, p, now=10.0, ops_committed=[[TAG, OP]], ops_abandoned=[[TAG, OP + 1]])
    eff = rereg(st, 3, now=10.1, ops_committed=[[TAG, OP - 1]], **in_doubt())
    assert [(p, c.op_seq) for p, c in sends(eff, m.CollectiveComplete)] == [(3, OP)]
    assert not sends(eff, m.CollectiveAbort) and st.resumed


def test_a_doubt_opened_before_the_member_that_committed_it_returns_commits_too() -> None:
    st = MasterState(rebuild_grace=1.0)
    rereg(st, 3, now=10.0, ops_committed=[[TAG, OP - 1]], **in_doubt())
    eff = rereg(st, 2, now=10.05, ops_abandoned=[[TAG, OP + 1]], ops_committed=[[TAG, OP]])
    assert [(p, c.op_seq) for p, c in sends(eff, m.CollectiveComplete)] == [(3, OP)]
    eff = rereg(st, 1, now=10.1, ops_committed=[[TAG, OP]], ops_abandoned=[[TAG, OP + 1]])
    assert not sends(eff, m.CollectiveAbort) and not st.doubts.open_doubts() and st.resumed
