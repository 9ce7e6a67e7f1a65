"""A fake accelerator for testing the staging pipeline (:mod:`pccl.collectives.staging`) on any machine.

:class:`FakeDevice` implements :class:`~pccl.collectives.staging.StagingDevice` over host memory.
Its "device tensors" are :class:`FakeTensor` arrays. A queued copy does nothing until it completes,
and it completes only when the test says so (:meth:`FakeDevice.complete`) or, with
:meth:`FakeDevice.run_automatically`, whenever every task is blocked. Copies complete in the order
they were queued, like one CUDA stream, and move their bytes at completion, so a pipeline that reads
a destination before its copy completed sees stale bytes, as it would on a GPU.

Every queue and completion is appended to :attr:`FakeDevice.log` (a list shared with whatever else a
test records, e.g. the frames a pool sends), so a test can assert how copies interleave with the
wire: that the copy of block k+1 was still running while block k was sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio
import trio.testing

from ..collectives.staging import DeviceCopyError, StagingDevice, register_device

__all__ = ["FakeCopy", "FakeDevice", "FakeTensor", "use_fake_device"]


class FakeTensor(np.ndarray):  # type: ignore[type-arg]
    """An array that stands for device memory: the communicator stages it through
    :func:`use_fake_device`'s device. Make one with ``FakeTensor.of(array)``."""

    @staticmethod
    def of(a: np.ndarray) -> FakeTensor:
        """A fake device tensor holding a copy of ``a`` (1-D views of it share its memory)."""
        return np.array(a, copy=True).view(FakeTensor)


@dataclass
class FakeCopy:
    """One queued copy: ``direction`` "d2h" or "h2d", elements ``[lo, hi)``."""

    direction: str
    lo: int
    hi: int
    src: np.ndarray
    dst: np.ndarray
    device: FakeDevice
    done: bool = False
    error: str | None = None
    _event: trio.Event = field(default_factory=trio.Event)

    def query(self) -> bool:
        """True once complete; raises :class:`DeviceCopyError` if it failed."""
        if self.error is not None:
            raise DeviceCopyError(self.error)
        return self.done

    async def wait(self) -> None:
        """Return once complete; raises :class:`DeviceCopyError` if it failed."""
        self.device.waits += 1
        await self._event.wait()
        self.query()


class FakeDevice:
    """A :class:`~pccl.collectives.staging.StagingDevice` whose copies complete when told to.

    Args:
        log: the list events are appended to (a new one by default); tuples
            ``("queue" | "complete" | "fail", direction, lo, hi)``.
    """

    def __init__(self, log: list[tuple[Any, ...]] | None = None) -> None:
        self.log: list[tuple[Any, ...]] = [] if log is None else log
        self.pending: deque[FakeCopy] = deque()
        self.copies: list[FakeCopy] = []
        self.waits = 0
        self.ordered_after_caller = 0
        self._fail: list[Callable[[FakeCopy], bool]] = []
        self._queued = trio.lowlevel.ParkingLot()

    # the StagingDevice interface

    def order_after_caller(self) -> None:
        self.ordered_after_caller += 1

    def to_host(self, src: Any, host: np.ndarray, lo: int, hi: int) -> FakeCopy:
        return self._queue("d2h", np.asarray(src).reshape(-1), host.reshape(-1), lo, hi)

    def to_device(self, host: np.ndarray, dst: Any, lo: int, hi: int) -> FakeCopy:
        return self._queue("h2d", host.reshape(-1), np.asarray(dst).reshape(-1), lo, hi)

    # control

    def fail_when(self, matches: Callable[[FakeCopy], bool]) -> None:
        """Make the next copy for which ``matches`` holds fail when it completes."""
        self._fail.append(matches)

    def complete(self, k: int = 1) -> int:
        """Complete the ``k`` oldest queued copies (fewer if fewer are queued); returns how many."""
        done = 0
        while done < k and self.pending:
            c = self.pending.popleft()
            rule = next((r for r in self._fail if r(c)), None)
            if rule is not None:
                self._fail.remove(rule)
                c.error = f"fake {c.direction} copy [{c.lo}, {c.hi}) failed"
                self.log.append(("fail", c.direction, c.lo, c.hi))
            else:
                c.dst[c.lo : c.hi] = c.src[c.lo : c.hi]
                c.done = True
                self.log.append(("complete", c.direction, c.lo, c.hi))
            c._event.set()
            done += 1
        return done

    def complete_all(self) -> int:
        """Complete every queued copy."""
        return self.complete(len(self.pending))

    async def run_automatically(self) -> None:
        """Run until cancelled: whenever every other task is blocked, complete the oldest copy
        (one copy per idle moment, so the data plane runs between completions)."""
        while True:
            if not self.pending:
                await self._queued.park()
            await trio.testing.wait_all_tasks_blocked()
            self.complete(1)

    def _queue(self, direction: str, src: np.ndarray, dst: np.ndarray, lo: int, hi: int) -> FakeCopy:
        if not 0 <= lo <= hi <= min(src.size, dst.size):
            raise ValueError(f"copy range [{lo}, {hi}) out of bounds")
        c = FakeCopy(direction, lo, hi, src, dst, self)
        self.pending.append(c)
        self.copies.append(c)
        self.log.append(("queue", direction, lo, hi))
        self._queued.unpark_all()
        return c


@contextmanager
def use_fake_device(device: FakeDevice) -> Iterator[FakeDevice]:
    """Stage every :class:`FakeTensor` through ``device`` while the block runs (the communicator
    then treats them as device tensors).

    Yields:
        ``device``.
    """
    dev: StagingDevice = device
    remove = register_device(lambda t: isinstance(t, FakeTensor), lambda _t: dev)
    try:
        yield device
    finally:
        remove()
