"""Busy-polling while a collective is in flight (``PeerConfig.spin_seconds``).

A small operation waits several times for a message that is only microseconds away: a partner's
frame, the master's confirmation. A process that blocks in ``epoll_wait`` for each of them lets its
CPU go idle, and waking an idle CPU is what such a wait costs: on a virtual machine about 35 us per
wake-up, ten times a loopback round trip between two processes that keep polling (measured on
the project's 2-vCPU VM: 75-80 us blocking against 6 us polling; docs/history/benchmarks-allreduce.md "Polling
while an operation runs"). MPI implementations poll by default for the same reason.

The :class:`Spinner` runs one task per communicator. While at least one collective of that
communicator is in flight, and for at most ``budget`` seconds after the latest one started, it
keeps the trio loop polling: each pass gives the CPU to any other runnable process
(``os.sched_yield``, which also releases the GIL to the process's other threads) and then lets the
scheduler poll its sockets without blocking. After the budget, or once no operation is in flight,
the loop blocks again as usual, so a long operation or an idle communicator costs no CPU beyond
the budget. Correctness never depends on it: the polling task only keeps the loop awake.

It stays off where it cannot help and can only cost:

* ``budget`` 0;
* under a clock that is not the real one (``trio.testing.MockClock``: a polling task would keep
  the clock from jumping);
* in every communicator of a process but one at a time: communicators that share a process (the
  in-process test clusters, several peers in one program) would only take the GIL from each
  other. The first that polls holds a process-wide token until its polling ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import trio
from trio.testing import MockClock

__all__ = ["Spinner"]

_holder: Spinner | None = None
"""The spinner of this process that polls now (at most one)."""


def _real_clock() -> bool:
    """False under a virtual clock (a polling task would keep ``MockClock`` from jumping)."""
    return not isinstance(trio.lowlevel.current_clock(), MockClock)


class Spinner:
    """Keeps a trio loop polling while operations are in flight (see the module docstring).

    Args:
        budget: seconds to poll after each operation starts (0: never).
        now: the clock the budget is measured on (wall seconds).
        give_way: called on each polling pass to let other runnable threads and processes run.
    """

    def __init__(
        self,
        budget: float,
        *,
        now: Callable[[], float] = time.perf_counter,
        give_way: Callable[[], None] = os.sched_yield,
    ) -> None:
        if not budget >= 0:
            raise ValueError(f"spin budget must be >= 0 seconds, not {budget}")
        self.budget = budget
        self._now = now
        self._give_way = give_way
        self._inflight = 0
        self._until = 0.0
        self._wake = trio.Event()
        self.passes = 0
        """Polling passes made so far (statistics)."""

    @property
    def inflight(self) -> int:
        """Operations begun and not yet ended."""
        return self._inflight

    def begin(self) -> None:
        """An operation starts: poll for up to ``budget`` seconds from now while it runs."""
        self._inflight += 1
        if self.budget > 0:
            self._until = self._now() + self.budget
            self._wake.set()

    def end(self) -> None:
        """An operation ended (successfully or not)."""
        if self._inflight <= 0:
            raise RuntimeError("Spinner.end() without a matching begin()")
        self._inflight -= 1

    def _polling(self) -> bool:
        return self._inflight > 0 and self._now() < self._until

    async def run(self) -> None:
        """The polling task: runs until cancelled."""
        global _holder
        if self.budget <= 0:
            await trio.sleep_forever()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if not _real_clock() or (_holder is not None and _holder is not self):
                continue
            _holder = self
            try:
                while self._polling():
                    self._give_way()
                    self.passes += 1
                    await trio.lowlevel.checkpoint()
            finally:
                if _holder is self:  # communicators in other threads' trio loops race for it, harmlessly
                    _holder = None
