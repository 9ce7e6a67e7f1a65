"""A peer's long waits, said at WARNING (the trio adapter of :class:`pccl._waits.WaitBoard`).

One task per communicator sleeps until the next report is due; a call that waits registers itself with
:meth:`WaitReporter.waiting` (a dict entry, no wake-up unless the task sleeps past the new wait's first
report), so the collective path pays next to nothing for it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import trio

from .._waits import Describe, WaitBoard


class WaitReporter:
    """Reports the waits of one side that last (first after ``board.first`` seconds, then at doubling
    intervals) to ``logger`` at WARNING.

    Args:
        logger: where the reports go.
        board: the schedule (default :class:`WaitBoard` with its defaults).
    """

    def __init__(self, logger: logging.Logger, board: WaitBoard | None = None) -> None:
        self.log = logger
        self.board = board or WaitBoard()
        self._wake = trio.Event()
        self._sleeping_until = math.inf

    def begin(self, key: Hashable, describe: Describe) -> None:
        """A wait under ``key`` begins now."""
        now = trio.current_time()
        self.board.begin(key, describe, now)
        if now + self.board.first < self._sleeping_until:
            self._wake.set()

    def end(self, key: Hashable) -> None:
        """The wait under ``key`` is over."""
        self.board.end(key)

    @contextmanager
    def waiting(self, key: Hashable, describe: Describe) -> Iterator[None]:
        """``with reporter.waiting(key, describe): await ...``: the wait is reported while it lasts."""
        self.begin(key, describe)
        try:
            yield
        finally:
            self.end(key)

    async def run(self) -> None:
        """Report due waits until cancelled."""
        while True:
            deadline = self.board.next_deadline()
            self._sleeping_until = math.inf if deadline is None else deadline
            with trio.move_on_at(self._sleeping_until):
                await self._wake.wait()
            if self._wake.is_set():
                self._wake = trio.Event()
            for line in self.board.due(trio.current_time()):
                self.log.warning("%s", line)


__all__ = ["WaitReporter"]
