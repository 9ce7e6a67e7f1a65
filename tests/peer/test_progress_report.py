"""The receiving peer's SharedStateProgress reports (issue 37 item 5): at most one per PROGRESS_EVERY,
only when bytes came since the last one, never past the total, and none after a failed send."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pccl import RankConnectionLostError
from pccl.peer.mailbox import Mailbox
from pccl.peer.shared_state import PROGRESS_EVERY, _report_progress, _Seen
from pccl.wire import messages as m


class _Link:
    def __init__(self, fail_after: int = -1) -> None:
        self.sent: list[tuple[float, m.Message]] = []
        self.fail_after = fail_after

    @property
    def inbox(self) -> Mailbox:
        raise AssertionError("not used")

    async def send(self, msg: m.Message) -> None:
        if len(self.sent) == self.fail_after:
            raise RankConnectionLostError("lost the master; reconnecting: retry")
        self.sent.append((trio.current_time(), msg))


async def test_reports_follow_the_bytes(autojump_clock: trio.testing.MockClock) -> None:
    link = _Link()
    calls: list[tuple[int, int]] = []
    seen = _Seen(lambda d, t: calls.append((d, t)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_report_progress, link, 7, seen)
        await trio.sleep(2.5 * PROGRESS_EVERY)  # nothing arrived: nothing reported
        seen(10, 100)
        await trio.sleep(PROGRESS_EVERY)  # one report
        await trio.sleep(2 * PROGRESS_EVERY)  # no new byte: none
        seen(60, 100)
        seen(130, 100)  # a retried tensor counted twice: reported as the total
        await trio.sleep(PROGRESS_EVERY)
        nursery.cancel_scope.cancel()
    assert calls == [(10, 100), (60, 100), (130, 100)]  # the caller's callback sees every call
    assert [(t, msg) for t, msg in link.sent] == [
        (3.0, m.SharedStateProgress(sync_seq=7, rx_bytes=10, total_bytes=100)),
        (6.0, m.SharedStateProgress(sync_seq=7, rx_bytes=100, total_bytes=100)),
    ]


@pytest.mark.parametrize("fail_after", [0, 1])
async def test_a_failed_send_ends_the_reports(autojump_clock: trio.testing.MockClock,
                                              fail_after: int) -> None:
    link = _Link(fail_after)
    seen = _Seen(None)
    ended: list[float] = []

    async def reporter() -> None:
        await _report_progress(link, 1, seen)
        ended.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reporter)
        # Half a period out of phase with the reporter: tasks that wake at the same virtual instant run
        # in an order trio leaves open, so the bytes never change at a reporter's wake-up.
        await trio.sleep(PROGRESS_EVERY / 2)
        for i in range(1, 9):
            seen(i, 10)
            await trio.sleep(PROGRESS_EVERY)
        nursery.cancel_scope.cancel()
    assert len(link.sent) == fail_after  # nothing after the failed send
    assert ended == [(fail_after + 1) * PROGRESS_EVERY]  # it returned at once, by itself
