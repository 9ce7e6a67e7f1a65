"""Issue 18: a rebuilt master's roll call, its end, and the members that come back after it.

The pure MasterState driven message by message (pccl/master/ops_in_doubt.py, docs/concepts.md "Surviving the
master", roll call). The roll call holds every vote until the last epoch's members are back, for at most
``rebuild_grace`` after the first re-registration; once a majority is back it also ends when nobody came
back for ``rebuild_quiet``. A member the roll call gave up on that comes back after its group went on is
refused (``KICKED``: join again), as a member a live master dropped is; before that, it is taken back.
"""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.master.state import Event, MasterState
from pccl.wire import messages as m

from ._effects import kicks, sends

RING = [1, 2, 3, 4, 5]  # the last epoch's members
EPOCH = 4
TAG = 7
DESC = m.CollectiveDescriptor("all_reduce", 1, 10, 0, -1, 0, 0)


def events(effects: list[Any]) -> list[str]:
    return [e.text for e in effects if isinstance(e, Event)]


def rereg(st: MasterState, pid: int, now: float, ring: list[int] = RING, **fields: Any) -> list[Any]:
    got = st.new_connection("127.0.0.1", now, claim=pid)
    assert got == pid
    msg = m.Reregister(peer_id=pid, p2p_port=40000 + pid, peer_group=0, epoch=EPOCH, ring=list(ring),
                       revision=5, generation=1, **fields)
    return st.handle(pid, msg, now)


def all_reduce(st: MasterState, peers: list[int], now: float) -> None:
    """``peers`` run one all-reduce to completion."""
    eff: list[Any] = []
    for p in peers:
        eff += st.handle(p, m.CollectiveInitiate(tag=TAG, descriptor=DESC), now)
    assert sorted(p for p, _ in sends(eff, m.CollectiveCommence)) == sorted(peers)
    eff = []
    for p in peers:
        eff += st.handle(p, m.CollectiveDone(tag=TAG, success=True), now)
    assert sorted(p for p, _ in sends(eff, m.CollectiveComplete)) == sorted(peers)


def test_the_roll_call_ends_a_quiet_period_after_the_last_return_once_a_majority_is_back() -> None:
    st = MasterState(rebuild_grace=1.0, rebuild_quiet=0.25)
    for p, t in ((1, 10.0), (2, 10.0), (3, 10.125)):  # the third is the majority of five
        rereg(st, p, t)
    assert st.doubts.missing == {4, 5} and not st.resumed
    assert st.doubt_deadline(3.0) == 10.375  # 0.25 s after the last return, before the grace (11.0)
    eff = rereg(st, 4, 10.25)  # back within the quiet period: it restarts
    assert not kicks(eff) and st.doubt_deadline(3.0) == 10.5
    assert not st.doubts_overdue(10.49, 3.0) and not st.resumed
    eff = st.doubts_overdue(10.5, 3.0)
    assert st.resumed and st.doubts.missing == set()
    assert "roll call over (nobody came back for 0.25s): absent [5]" in events(eff)


def test_the_quiet_period_starts_only_with_a_majority_and_the_grace_still_bounds_it() -> None:
    st = MasterState(rebuild_grace=1.0, rebuild_quiet=0.25)
    rereg(st, 1, 10.0)
    rereg(st, 2, 10.25)
    assert st.doubt_deadline(3.0) == 11.0  # two of five: no quiet end yet, only the grace
    assert not st.doubts_overdue(10.9, 3.0)
    for p, t in ((3, 10.5), (4, 10.875)):  # the majority, and one more just before the grace
        rereg(st, p, t)
    assert st.doubt_deadline(3.0) == 11.0  # the grace comes before 10.875 + 0.25
    eff = st.doubts_overdue(11.0, 3.0)
    assert st.resumed and "roll call over (its grace of 1s ran out): absent [5]" in events(eff)


def test_a_run_that_can_fail_over_gets_at_least_the_failover_quiet_period() -> None:
    """Members that give a hung master up for a standby do so at their own heartbeat silence, up to a
    heartbeat interval apart: the quiet period is then at least ``failover_quiet``."""
    st = MasterState(rebuild_grace=2.0, rebuild_quiet=0.25, failover_quiet=0.75)
    rereg(st, 1, 10.0)
    st.handle(1, m.Standbys(count=1), 10.0)
    for p in (2, 3):
        rereg(st, p, 10.0)
    assert st.enforced and st.doubt_deadline(3.0) == 10.75
    eff = st.doubts_overdue(10.75, 3.0)
    assert st.resumed and "roll call over (nobody came back for 0.75s): absent [4, 5]" in events(eff)


def test_without_a_quiet_period_the_roll_call_waits_its_whole_grace() -> None:
    st = MasterState(rebuild_grace=1.0)
    for p in (1, 2, 3, 4):
        rereg(st, p, 10.0)
    assert st.doubt_deadline(3.0) == 11.0 and not st.doubts_overdue(10.99, 3.0) and not st.resumed
    assert st.doubts_overdue(11.0, 3.0) is not None and st.resumed


def test_every_member_back_ends_the_roll_call_at_once() -> None:
    st = MasterState(rebuild_grace=1.0, rebuild_quiet=0.3)
    for p in RING[:-1]:
        rereg(st, p, 10.0)
    eff = rereg(st, 5, 10.1)
    assert st.resumed and "roll call over: every member is back" in events(eff)


def test_a_member_absent_at_the_roll_calls_end_is_refused_once_its_group_went_on() -> None:
    """Before: taken back, it retried its failed call while the others were past it (a deadlock:
    tests/integration/test_late_member.py)."""
    st = MasterState(rebuild_grace=1.0)
    for p in (1, 2, 3, 4):
        rereg(st, p, 10.0)
    st.doubts_overdue(11.0, 3.0)  # the grace ends the roll call: member 5 is absent
    all_reduce(st, [1, 2, 3, 4], 11.1)
    eff = rereg(st, 5, 11.2)
    (kick,) = kicks(eff)
    assert kick.code == int(Result.KICKED) and "went on without this peer" in kick.reason
    assert not sends(eff, m.Reregistered) and st.accepted() == [1, 2, 3, 4]


def test_a_member_absent_at_the_roll_calls_end_is_taken_back_while_nothing_moved_on() -> None:
    st = MasterState(rebuild_grace=1.0)
    for p in (1, 2, 3, 4):
        rereg(st, p, 10.0)
    st.doubts_overdue(11.0, 3.0)
    eff = rereg(st, 5, 11.2)  # the others have completed nothing since: it makes their next call
    assert not kicks(eff) and sends(eff, m.Reregistered) and st.accepted() == RING
    all_reduce(st, RING, 11.3)


def test_with_a_standby_a_member_absent_at_the_roll_call_is_taken_back_as_before() -> None:
    """A run whose peers can fail over (the live quorum rule applies): an absent member may be a
    minority that followed the other master, which the standby takes back (docs/concepts.md "No split
    brain", tests/integration/test_split_brain.py)."""
    st = MasterState(rebuild_grace=1.0)
    for p in (1, 2, 3, 4):
        rereg(st, p, 10.0)
        st.handle(p, m.Standbys(count=1), 10.0)
    assert st.enforced
    st.doubts_overdue(11.0, 3.0)
    all_reduce(st, [1, 2, 3, 4], 11.1)
    eff = rereg(st, 5, 11.2)
    assert not kicks(eff) and sends(eff, m.Reregistered)


def test_a_member_back_waiting_in_a_pending_round_the_run_went_past_is_refused() -> None:
    """The run answered the are_peers_pending round member 5 waits in without it, then the next one: given
    that round's answer, it would make the call after it while the others are further on (before: a
    wait until vote_timeout). KICKED at once instead."""
    st = MasterState(rebuild_grace=1.0)
    for p in (1, 2, 3, 4):
        rereg(st, p, 10.0, pending=[EPOCH, 2, 1, 0])  # all wait in round (EPOCH, 3)
    eff = st.doubts_overdue(11.0, 3.0)  # the round runs here without member 5
    assert sorted(p for p, _ in sends(eff, m.PeersPendingResult)) == [1, 2, 3, 4]
    eff = []
    for p in (1, 2, 3, 4):  # round (EPOCH, 4): only membership rounds, no operation completed
        eff += st.handle(p, m.PeersPendingVote(), 11.1)
    assert len(sends(eff, m.PeersPendingResult)) == 4
    eff = rereg(st, 5, 11.2, pending=[EPOCH, 2, 1, 0])
    (kick,) = kicks(eff)
    assert kick.code == int(Result.KICKED) and "are_peers_pending round" in kick.reason
    assert not sends(eff, m.PeersPendingResult)


def test_a_member_back_waiting_in_the_pending_round_just_answered_gets_its_answer() -> None:
    st = MasterState(rebuild_grace=1.0)
    for p in (1, 2, 3, 4):
        rereg(st, p, 10.0, pending=[EPOCH, 2, 1, 0])
    st.doubts_overdue(11.0, 3.0)  # round (EPOCH, 3) answered here: nobody pending
    eff = rereg(st, 5, 11.2, pending=[EPOCH, 2, 1, 0])  # the others have done nothing since
    assert not kicks(eff) and sends(eff, m.PeersPendingResult) == [(5, m.PeersPendingResult(pending=False))]
