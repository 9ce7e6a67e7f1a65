"""The send gate of a speculative data plane (pccl/collectives/gate.py): up to its limit before the
master's go-ahead, everything after it, and a failed go-ahead fails the sender."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import pccl
from pccl.collectives.gate import SendGate, early_send_limit
from pccl.peer.mailbox import Waiter
from pccl.wire import messages as m

GO = m.CollectiveCommence(tag=1, op_seq=7, peers=[])


def test_half_the_stash_goes_before_the_go_ahead() -> None:
    assert early_send_limit(64 << 20) == 32 << 20
    assert early_send_limit(0) == 0
    with pytest.raises(ValueError):
        SendGate(-1, Waiter())


async def test_frames_within_the_limit_pass_and_the_next_waits_for_the_go_ahead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    go: Waiter[m.CollectiveCommence] = Waiter()
    gate = SendGate(10, go)
    await gate.admit(4)
    await gate.admit(6)  # exactly the limit
    assert gate.sent_early == 10 and not gate.waited
    admitted: list[float] = []

    async def send_one() -> None:
        await gate.admit(1)
        admitted.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_one)
        await trio.sleep(3)
        assert admitted == [] and gate.waited
        go.set(GO)
    assert admitted == [3.0]
    await gate.admit(1 << 30)  # open for good
    assert gate.sent_early == 10


async def test_a_frame_larger_than_the_limit_waits_and_a_failed_go_ahead_fails_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    go: Waiter[m.CollectiveCommence] = Waiter()
    gate = SendGate(0, go)
    with trio.move_on_after(1) as scope:
        await gate.admit(1)
    assert scope.cancelled_caught
    go.fail(pccl.MasterConnectionError("master lost"))
    with pytest.raises(pccl.MasterConnectionError):
        await gate.admit(1)
