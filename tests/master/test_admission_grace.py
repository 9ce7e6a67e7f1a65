"""Issue 33 item 6: a newcomer that never takes part (it only answered ``P2PConnectionsDone``, or calls
nothing after ``connect``) is evicted once the others have waited ``admission_grace`` seconds on it in a
vote, with the reason logged; before, it held every vote of its group until ``vote_timeout`` (1800 s).
A newcomer that took part in a collective once is a member like the others (``vote_timeout`` alone)."""

from __future__ import annotations

from pccl.master.state import Event, Kick
from pccl.master.timers import MasterTimers, TimerConfig
from pccl.wire import messages as m

from ._effects import sends
from .test_liveness import DESC, Harness, _three_accepted

GRACE = 60.0


def test_a_newcomer_that_never_votes_is_evicted_after_the_grace_and_the_vote_completes() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)  # c was admitted by a vote at t=0
    assert hs.st.admission_deadline(GRACE) is None  # nobody waits on it yet
    hs.now = 100.0  # the members compute; c heartbeats, calls nothing
    hs.h(c, m.Heartbeat())
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=DESC))
    hs.now = 101.0
    hs.h(b, m.CollectiveInitiate(tag=0, descriptor=DESC))
    assert hs.st.admission_deadline(GRACE) == 100.0 + GRACE  # from the vote's first ballot
    assert hs.st.admission_overdue(100.0 + GRACE - 0.01, GRACE) == []
    hs.now = 100.0 + GRACE
    eff = hs.st.admission_overdue(hs.now, GRACE)
    (kick,) = [e for e in eff if isinstance(e, Kick)]
    assert kick.peer_id == c and "taken part in no collective" in kick.reason
    assert "admission_grace 60s" in kick.reason and f"{[a, b]} waited 60.0s" in kick.reason
    assert any(isinstance(e, Event) and f"peer {c} kicked" in e.text for e in eff)  # logged
    assert {p for p, _ in sends(eff, m.CollectiveCommence)} == {a, b}  # the vote goes on without it
    assert hs.st.accepted() == [a, b]


def test_the_grace_counts_from_admission_when_the_vote_is_older() -> None:
    hs = Harness()
    a, b = hs.join(), hs.join()
    epoch, _ = hs.vote([a])
    for p in (a, b):
        hs.h(p, m.P2PConnectionsDone(epoch=epoch, success=True))
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=DESC))  # a waits on b from t=0 ...
    hs.now = 30.0
    hs.h(a, m.Heartbeat())
    hs.h(b, m.Heartbeat())
    assert hs.st.admission_deadline(GRACE) == GRACE  # ... b admitted at 0 as well
    c = hs.join()
    hs.now = 40.0
    epoch, _ = hs.vote([a, b])  # the running vote of tag 0 stays open: c admitted at 40
    for p in (a, b, c):
        hs.h(p, m.P2PConnectionsDone(epoch=epoch, success=True))
    hs.h(b, m.CollectiveInitiate(tag=0, descriptor=DESC))
    assert hs.st.accepted() == [a, b, c]
    assert hs.st.admission_deadline(GRACE) == 40.0 + GRACE


def test_a_newcomer_that_took_part_once_is_left_to_the_vote_timeout() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)
    eff = []
    for p in (a, b, c):
        eff += hs.h(p, m.CollectiveInitiate(tag=0, descriptor=DESC))
    (_, commence), *_ = sends(eff, m.CollectiveCommence)
    for p in (a, b, c):
        hs.h(p, m.CollectiveDone(tag=0, op_seq=commence.op_seq, success=True))
    hs.now = 10.0
    for p in (a, b):
        hs.h(p, m.CollectiveInitiate(tag=1, descriptor=DESC))
    assert hs.st.admission_deadline(GRACE) is None
    assert hs.st.admission_overdue(10.0 + 10 * GRACE, GRACE) == []
    assert hs.st.accepted() == [a, b, c]


def test_a_newcomer_that_votes_in_time_is_not_evicted_and_the_timers_arm_the_grace() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)
    timers = MasterTimers(hs.st, TimerConfig(heartbeat_interval=0.5, heartbeat_timeout=1e9,
                                             p2p_setup_timeout=15.0, admission_grace=GRACE))
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=DESC))
    assert timers.next_deadline() == GRACE
    hs.now = GRACE - 1.0
    eff = hs.h(c, m.CollectiveInitiate(tag=0, descriptor=DESC))
    eff += hs.h(b, m.CollectiveInitiate(tag=0, descriptor=DESC))
    assert {p for p, _ in sends(eff, m.CollectiveCommence)} == {a, b, c}
    assert hs.st.admission_deadline(GRACE) is None  # nothing waits on it now
    assert [e for batch in timers.tick(10 * GRACE) for e in batch if isinstance(e, Kick)] == []
