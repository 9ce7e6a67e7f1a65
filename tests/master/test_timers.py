"""The master's clock interface (pccl/master/timers.py): ``next_deadline()`` names the earliest timer,
``tick(now)`` runs the due ones in order, one batch of effects per step."""

from __future__ import annotations

from pccl.master.deadlock import DeadlockWatch
from pccl.master.effects import Drop, Kick
from pccl.master.state import MasterState
from pccl.master.timers import MasterTimers, TimerConfig
from pccl.wire import messages as m

from ._effects import sends

CFG = TimerConfig(heartbeat_interval=0.5, heartbeat_timeout=3.0, p2p_setup_timeout=15.0)


def _flat(timers: MasterTimers, now: float) -> list[object]:
    return [e for batch in timers.tick(now) for e in batch]


def test_a_silent_peer_is_due_at_its_heartbeat_deadline_and_dropped_at_once() -> None:
    st = MasterState()
    timers = MasterTimers(st, CFG)
    assert timers.next_deadline() is None  # nothing armed
    assert timers.recheck_at(10.0) == 10.5
    pid = st.new_connection("127.0.0.1", 1.0)
    st.handle(pid, m.Register(p2p_port=4000), 1.0)
    assert timers.next_deadline() == 4.0
    _flat(timers, 2.0)
    assert timers.deadline_after_tick() == 4.0  # what the monitor sleeps until
    assert not [e for e in _flat(timers, 4.0) if isinstance(e, Drop)]  # not past it yet
    effects = _flat(timers, 4.01)
    assert Drop(pid) in effects and pid not in st.peers
    assert timers.next_deadline() is None


def test_every_step_is_its_own_batch_in_order() -> None:
    st = MasterState()
    cfg = TimerConfig(heartbeat_interval=0.5, heartbeat_timeout=3.0, p2p_setup_timeout=15.0,
                      vote_timeout=60.0, quorum_hold_timeout=30.0)
    timers = MasterTimers(st, cfg, DeadlockWatch(1.0))
    # setup, doubts, rejoin, credentials, votes, hold, deadlocks: one batch each, none due
    assert [b for b in timers.tick(0.0)] == [[]] * 7
    assert timers.urgent() == (None, None, None)


def test_vote_timeout_deadline_and_kick() -> None:
    st = MasterState()
    cfg = TimerConfig(heartbeat_interval=0.5, heartbeat_timeout=1e9, p2p_setup_timeout=15.0, vote_timeout=5.0)
    timers = MasterTimers(st, cfg)
    ids = []
    for _ in range(2):
        pid = st.new_connection("127.0.0.1", 0.0)
        st.handle(pid, m.Register(p2p_port=4000 + pid), 0.0)
        ids.append(pid)
    eff = []
    for p in st.accepted():
        eff += st.handle(p, m.UpdateTopologyVote(), 0.0)
    for pid, msg in sends(eff, m.EstablishP2P):
        st.handle(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True), 0.0)
    assert sorted(st.accepted()) == ids
    desc = m.CollectiveDescriptor("all_reduce", 1, 10, 0, -1, 0, 0)
    st.handle(ids[0], m.CollectiveInitiate(tag=0, descriptor=desc), 1.0)
    assert timers.next_deadline() == 6.0  # the vote's first ballot + vote_timeout
    kicked = [e for e in _flat(timers, 6.5) if isinstance(e, Kick)]
    assert [k.peer_id for k in kicked] == [ids[1]]


def test_the_masters_own_stall_is_not_held_against_the_peers() -> None:
    # Under heavy load the master's monitor woke 3+ s later than it planned and, before its readers had
    # run, evicted every peer "silent for more than 3s" although each had sent its heartbeats (they were
    # in the socket buffers). The stall is credited: silence is judged without it for a heartbeat timeout.
    st = MasterState()
    timers = MasterTimers(st, CFG)
    alive, gone = st.new_connection("127.0.0.1", 0.0), st.new_connection("127.0.0.1", 0.0)
    for pid in (alive, gone):
        st.handle(pid, m.Register(p2p_port=4000 + pid), 0.0)
        st.handle(pid, m.Heartbeat(), 0.4)
    _flat(timers, 0.4)
    assert timers.wake_at(0.4) == 0.9  # the re-check (the silence deadline is 3.4)
    # The master does not run until 5.0: the monitor ticks before the readers.
    effects = _flat(timers, 5.0)
    assert not [e for e in effects if isinstance(e, Drop)] and {alive, gone} <= set(st.peers)
    assert timers.stalls.last_stall == 5.0 - 0.4  # the whole sleep that ended late
    # The readers run: the live peer's heartbeats come in; the other peer really is gone. Run the monitor
    # as the server does (tick, then wake at wake_at) with the live peer heartbeating every 0.5 s.
    now, dropped_at = 5.0, None
    st.handle(alive, m.Heartbeat(), now)
    while dropped_at is None and now < 20.0:
        wake = timers.wake_at(now)
        while st.peers[alive].last_seen + 0.5 <= wake:
            st.handle(alive, m.Heartbeat(), st.peers[alive].last_seen + 0.5)
        now = wake
        if Drop(gone) in _flat(timers, now):
            dropped_at = now
    # Declared once the credit's window ends (3 s after the stall); the live peer stays.
    assert dropped_at is not None and 5.0 < dropped_at <= 8.01
    assert gone not in st.peers and alive in st.peers


def test_a_late_wake_within_scheduling_noise_credits_nothing() -> None:
    st = MasterState()
    timers = MasterTimers(st, CFG)
    pid = st.new_connection("127.0.0.1", 0.0)
    st.handle(pid, m.Register(p2p_port=4000), 0.0)
    _flat(timers, 2.95)
    assert timers.wake_at(2.95) == 3.001  # just after the silence deadline
    effects = _flat(timers, 3.05)  # 49 ms late: noise, the peer is evicted as before
    assert Drop(pid) in effects and timers.stalls.stalls_total == 0
