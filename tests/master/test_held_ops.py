"""pccl/master/held_ops.py: a running collective that one participant holds alone (issue 33 item 6)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pccl.master import held_ops
from pccl.master.penalties import RepeatOffenders


@dataclass
class Op:
    group: int = 0
    tag: int = 5
    op_seq: int = 9
    running: bool = True
    participants: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    done: set[int] = field(default_factory=set)
    alone_since: float | None = None


def same(_peer: int, timeout: float) -> float:
    return timeout


def test_only_the_last_participant_of_a_running_operation_is_a_holder() -> None:
    assert held_ops.holder(Op()) is None  # nobody done yet
    assert held_ops.holder(Op(done={1, 2}, alone_since=3.0)) is None  # two still running
    assert held_ops.holder(Op(done={1, 2, 4}, alone_since=3.0)) == 3
    assert held_ops.holder(Op(done={1, 2, 4}, alone_since=3.0, running=False)) is None  # a vote
    assert held_ops.holder(Op(done={1, 2, 4})) is None  # (no time: never judged)


def test_the_holder_is_removed_after_the_timeout_and_not_before() -> None:
    ops = [Op(done={1, 2, 4}, alone_since=10.0), Op(tag=6, done={1}, alone_since=None)]
    assert held_ops.deadline(ops, 60.0, same) == 70.0
    assert held_ops.overdue(ops, 70.0, 60.0, same) == []
    ((pid, reason),) = held_ops.overdue(ops, 70.5, 60.0, same)
    assert pid == 3 and "held the running collective tag 5 (group 0, op 9) alone for 60.5s" in reason
    assert "[1, 2, 4]" in reason
    assert held_ops.deadline([Op()], 60.0, same) is None


def test_a_repeat_offender_gets_half_the_time_per_strike() -> None:
    o = RepeatOffenders()
    o.strike(["host:h"], 0.0, "before")
    o.strike(["host:h"], 1.0, "before")
    assert o.refusal(3, ["host:h"], 1.0 + o.backoff(2) + 1) is None  # back-off over: admitted, strikes kept
    ops = [Op(done={1, 2, 4}, alone_since=0.0)]
    assert held_ops.deadline(ops, 60.0, o.grace) == 15.0
    assert [p for p, _ in held_ops.overdue(ops, 15.5, 60.0, o.grace)] == [3]


def test_a_lone_failure_counts_only_from_the_holder_after_the_lone_time() -> None:
    op = Op(done={1, 2, 4}, alone_since=10.0)
    assert held_ops.lone_failure(op, 3, 10.0 + held_ops.LONE) == held_ops.LONE
    assert held_ops.lone_failure(op, 3, 10.0 + held_ops.LONE - 0.1) is None  # failed at once: a local error
    assert held_ops.lone_failure(op, 2, 100.0) is None  # not the holder
    assert held_ops.lone_failure(Op(done={1}, alone_since=None), 3, 100.0) is None
    assert held_ops.lone_failure(None, 3, 100.0) is None
