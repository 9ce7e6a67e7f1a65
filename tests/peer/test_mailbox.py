"""The communicator's mailbox keeps back-to-back master messages of one exchange in order."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import pccl
from pccl.peer.mailbox import Mailbox as _Mailbox
from pccl.wire import messages as m


async def test_messages_arriving_before_the_reader_waits_are_kept_in_order() -> None:
    box = _Mailbox()
    plan = m.SharedStatePlan(sync_seq=3, revision=1, fetch=[], peers=[])
    result = m.SharedStateResult(sync_seq=3, success=False, revision=1, reason="lost", code=11)
    box.put(plan)
    box.put(result)
    assert await box.get() is plan
    assert await box.get() is result


async def test_get_waits_then_fails_when_the_master_is_lost() -> None:
    box = _Mailbox()
    got: list[m.Message] = []

    async def reader() -> None:
        got.append(await box.get())
        with pytest.raises(pccl.MasterConnectionError):
            await box.get()

    async with trio.open_nursery() as n:
        n.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        box.put(m.Heartbeat())
        await trio.testing.wait_all_tasks_blocked()
        box.fail(pccl.MasterConnectionError("gone"))
    assert len(got) == 1
