"""Issue 33 item 3: the master's work per message does not grow with the open votes. A message only marks
the deadlock watch changed; the check (a walk of every open vote) runs on the timers' clock, at most every
``DeadlockWatch.every`` seconds, and declares a deadlock when it did before (from the last change, after
``grace``). The vote timeout's deadline is found without building a row per vote."""

from __future__ import annotations

from typing import Any

import pytest

from pccl.master.deadlock import DeadlockWatch
from pccl.master.state import MasterState
from pccl.master.timers import MasterTimers, TimerConfig
from pccl.wire import messages as m

from ._effects import sends
from .test_deadlock import AR, _group_of


def _count(monkeypatch: pytest.MonkeyPatch, st: MasterState, name: str) -> list[int]:
    calls = [0]
    real = getattr(st, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(st, name, counted)
    return calls


def test_messages_only_mark_the_watch_and_one_check_runs_when_due(monkeypatch: pytest.MonkeyPatch) -> None:
    hs, (a, _, _) = _group_of(3)
    watch = DeadlockWatch(grace=1.0, every=0.25)
    walks = _count(monkeypatch, hs.st, "deadlock_candidates")
    for tag in range(1000):  # a member opens 1000 votes nobody else calls, one message each
        hs.now = 10.0 + tag * 1e-4
        hs.h(a, m.CollectiveInitiate(tag=100 + tag, descriptor=AR))
        watch.changed(hs.now)
    assert walks[0] == 0 and watch.due() == 10.25  # from the first change since the last check
    assert watch.poll(hs.st, 10.2499) == [] and walks[0] == 0
    assert watch.poll(hs.st, 10.25) == [] and walks[0] == 1 and watch.checks == 1
    assert watch.deadline() is None  # no candidate (b and c vote in nothing), nothing changed since


def test_a_deadlock_is_declared_grace_after_the_last_change_as_before() -> None:
    hs, (a, b) = _group_of(2)
    watch = DeadlockWatch(grace=1.0, every=0.25)
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    watch.changed(10.0)
    hs.h(b, m.CollectiveInitiate(tag=1, descriptor=AR))  # the deadlock forms at 10.1
    watch.changed(10.1)
    assert watch.deadline() == 10.25
    assert watch.poll(hs.st, 10.25) == []  # found, counted from 10.1
    assert watch.deadline() == pytest.approx(11.1)
    assert watch.poll(hs.st, 11.09) == []
    eff = watch.poll(hs.st, 11.1)
    assert {p for p, _ in sends(eff, m.CollectiveAbort)} == {a, b} and watch.detected == 1


def test_grace_zero_declares_at_the_first_check() -> None:
    hs, (a, b) = _group_of(2)
    watch = DeadlockWatch(grace=0.0, every=0.25)
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    hs.h(b, m.CollectiveInitiate(tag=1, descriptor=AR))
    watch.changed(5.0)
    assert watch.poll(hs.st, 5.1) == []
    assert len(sends(watch.poll(hs.st, 5.25), m.CollectiveAbort)) == 2


def test_the_timers_poll_the_watch_and_find_the_vote_deadline_without_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hs, (a, b, c) = _group_of(3)
    watch = DeadlockWatch(grace=1.0)
    timers = MasterTimers(hs.st, TimerConfig(heartbeat_interval=0.5, heartbeat_timeout=1e9,
                                             p2p_setup_timeout=15.0, vote_timeout=60.0), watch)
    for tag in range(500):
        hs.h(a, m.CollectiveInitiate(tag=tag, descriptor=AR))
    watch.changed(0.0)
    rows = [0]
    real = hs.st._open_votes

    def counted(with_ops: bool = True) -> Any:
        rows[0] += with_ops
        return real(with_ops)

    monkeypatch.setattr(hs.st, "_open_votes", counted)
    assert timers.next_deadline() == 0.25  # the watch's check
    assert [e for batch in timers.tick(0.25) for e in batch] == []
    assert watch.checks == 1 and timers.next_deadline() == 60.0  # the votes' timeout, from the first
    assert rows[0] == 0  # no row per vote was built for either
    eff = [e for batch in timers.tick(60.01) for e in batch]
    assert rows[0] == 1  # overdue: now the rows
    assert len([msg for p, msg in sends(eff, m.CollectiveAbort) if p == a]) == 500  # a alone: its calls fail
    assert hs.st.accepted() == [a, b, c]
