"""Pipelined staging of a device tensor through host memory, written against a small device interface.

The collectives' wire is TCP, so a GPU tensor's bytes pass through host memory. Copying the whole
tensor to the host before the operation and the whole result back after it puts both copies on
the critical path. :class:`Staging` overlaps them with the wire instead:

* **device to host**: once the plan is known (:meth:`Staging.begin`), every block of ``send`` is
  queued for copying into the host stage, in the order the plan first reads it; the data plane
  waits only for the block it is about to send or reduce, so block k+1 is being copied while
  block k is on the wire;
* **host to device**: as soon as a range of the operation's host result is final (its last
  receive applied, and, for AVG, every frame that forwards it sent, so it can be divided in
  place), it is queued for copying into ``recv``, while the next frames are still arriving.

The device interface (:class:`StagingDevice`, :class:`CopyEvent`) is asynchronous copies in one
ordered queue, with an event per copy that can be queried and awaited. :class:`SynchronousDevice`
implements it with the existing synchronous torch/cupy copies of :mod:`pccl.kernels.backend` (every
copy complete when it is queued: no overlap yet); a CUDA implementation on a side stream with
events is the only part that needs a GPU. :class:`pccl.testing.fake_device.FakeDevice` implements it
over host memory with copies that complete when a test says so.

Failure: the caller's ``recv`` is written before the operation commits only when it is ``send``
itself (in place, so the stage holds its previous bits) and the result bits are the wire bits (no
quantization). Then :meth:`Staging.abort` waits for every queued copy and copies the stage back
over every range already delivered, so the caller finds ``recv`` as it was. Otherwise ``recv`` is
written at the commit, as before, and :meth:`Staging.abort` only waits for the queued copies (a
device copy must not outlive the host memory it reads or writes).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import trio

from .._errors import PCCLError, Result
from .._types import DataType
from ..kernels import backend
from ..kernels.reduce import finalize_avg
from .schedule import SRC_OUT, SRC_SEND, Plan

__all__ = [
    "CopyEvent",
    "DeviceCopyError",
    "Staging",
    "StagingDevice",
    "SynchronousDevice",
    "device_for",
    "register_device",
]


class DeviceCopyError(PCCLError):
    """A copy between a device tensor and host memory failed (or the caller's buffer could not be
    restored after one)."""

    default_result = Result.INTERNAL_ERROR


class CopyEvent(Protocol):
    """The completion of one queued copy."""

    def query(self) -> bool:
        """True once the copy is complete.

        Raises:
            DeviceCopyError: the copy failed.
        """
        ...

    async def wait(self) -> None:
        """Return once the copy is complete. A cancelled wait leaves the copy running.

        Raises:
            DeviceCopyError: the copy failed.
        """
        ...


class StagingDevice(Protocol):
    """Asynchronous copies between one device's tensors and host arrays.

    Copies run in the order they are queued (one CUDA stream), each one after everything queued
    before it: :class:`Staging` relies on that to copy a range of ``recv`` back only after the
    range's previous bits reached the stage. Element ranges refer to the flat views of the tensor
    and of the host array, which have the same element count and size.
    """

    def order_after_caller(self) -> None:
        """Make the copies queued from now on run after the work the caller has queued so far on
        the tensor's current stream (CUDA: an event recorded there that the copy stream waits for)."""
        ...

    def to_host(self, src: Any, host: np.ndarray, lo: int, hi: int) -> CopyEvent:
        """Queue a copy of elements ``[lo, hi)`` of device tensor ``src`` into ``host[lo:hi]``."""
        ...

    def to_device(self, host: np.ndarray, dst: Any, lo: int, hi: int) -> CopyEvent:
        """Queue a copy of ``host[lo:hi]`` into elements ``[lo, hi)`` of device tensor ``dst``."""
        ...


class _Done:
    """The event of a copy that was complete when it was queued."""

    def query(self) -> bool:
        return True

    async def wait(self) -> None:
        return None


_DONE = _Done()


class SynchronousDevice:
    """:class:`StagingDevice` over the existing synchronous copies of :mod:`pccl.kernels.backend`
    (torch CUDA tensors and cupy arrays, on the caller's current stream): every copy is complete
    when it is queued, so nothing overlaps yet. ``copy_to_host`` has no range form: the first
    :meth:`to_host` of a tensor copies all of it, later ones find their range there already.
    """

    def __init__(self) -> None:
        self._copied: set[int] = set()

    def order_after_caller(self) -> None:
        """Nothing to do: the copies run on the caller's current stream."""

    def to_host(self, src: Any, host: np.ndarray, lo: int, hi: int) -> CopyEvent:
        if id(src) not in self._copied:
            backend.copy_to_host(src, host)
            self._copied.add(id(src))
        return _DONE

    def to_device(self, host: np.ndarray, dst: Any, lo: int, hi: int) -> CopyEvent:
        backend.copy_from_host(dst, host, lo, hi)
        return _DONE


_registry: list[tuple[Callable[[object], bool], Callable[[object], StagingDevice]]] = []


def register_device(
    matches: Callable[[object], bool], make: Callable[[object], StagingDevice]
) -> Callable[[], None]:
    """Stage tensors for which ``matches(t)`` holds through ``make(t)`` (checked before the CUDA
    default; :mod:`pccl.testing.fake_device` uses it).

    Returns:
        A function that removes the registration again.
    """
    entry = (matches, make)
    _registry.append(entry)
    return lambda: _registry.remove(entry)


def device_for(t: object) -> StagingDevice | None:
    """The staging device for tensor ``t``: a registered one, :class:`SynchronousDevice` for torch
    CUDA tensors and cupy arrays, None for host tensors (they need no staging)."""
    for matches, make in reversed(_registry):
        if matches(t):
            return make(t)
    if backend.is_cuda(t):
        return SynchronousDevice()
    return None


def _cuts(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[int]:
    """The sorted boundaries that split ``[lo, hi)`` at every end of ``ranges`` inside it."""
    points = {lo, hi}
    for a, b in ranges:
        points.update(p for p in (a, b) if lo < p < hi)
    return sorted(points)


class Staging:
    """One operation's staging of device tensors (see the module docstring).

    The data plane (:func:`pccl.collectives.executor.run_collective`) calls :meth:`begin` with its
    plan, awaits :meth:`before_send` / :meth:`before_receive` / :meth:`before_local_copy` before it
    reads ``send``, reports :meth:`after_send` / :meth:`after_receive` / :meth:`after_local_copy`,
    and awaits :meth:`finish` when its last frame is applied. The caller then either commits (and
    writes ``recv`` itself unless :attr:`delivered`) or calls :meth:`abort`.

    Args:
        device: the device the tensors live on.
        send: the caller's input tensor (on the device).
        stage: a host array of ``send``'s element count and dtype: the data plane's ``send``.
        recv: the caller's output tensor; results are delivered into it during the data plane
            only when it is ``send`` (in place), else at the commit.
        average_over: nonzero for AVG: the world size the host result is divided by, range by
            range, before it is delivered.
        dtype: the tensor's data type (for dividing bfloat16 stored as ``uint16``).
    """

    def __init__(
        self,
        device: StagingDevice,
        send: Any,
        stage: np.ndarray,
        *,
        recv: Any = None,
        average_over: int = 0,
        dtype: DataType | None = None,
    ) -> None:
        self.device = device
        self.send = send
        self.stage = stage
        self.recv = recv
        self.average_over = average_over
        self.dtype = dtype
        self._pipelined_h2d = recv is not None and recv is send
        self._begun = False
        self.delivered = False
        """True once every committed range of the result is in ``recv`` (the commit then skips it)."""
        self._plan: Plan | None = None
        self._out: np.ndarray | None = None
        # device to host: blocks sorted by start, with their events
        self._block_starts: list[int] = []
        self._block_ends: list[int] = []
        self._block_events: list[CopyEvent] = []
        # host to device: pieces of the committed range, the receive whose application makes
        # each final (-1: the local copy, -2: nothing writes it) and the sends still to read it
        self._pieces: list[tuple[int, int]] = []
        self._piece_writer: list[int] = []
        self._piece_readers: list[int] = []
        self._piece_final: list[bool] = []
        self._by_writer: dict[int, list[int]] = {}
        self._by_reader: dict[int, list[int]] = {}
        self._undelivered = 0
        self._h2d: list[tuple[int, int, CopyEvent]] = []
        self._aborted = False

    # ------------------------------------------------------------------------------------------
    # set-up

    def begin(self, plan: Plan, out: np.ndarray, *, quantized: bool = False) -> None:
        """Queue the copies of ``send`` to the stage, in the order ``plan`` first reads each block.

        Args:
            plan: the plan the data plane runs.
            out: the data plane's host output (the result is delivered from it).
            quantized: the operation quantizes its frames (its result is then delivered at the
                commit: the owner's chunk is rewritten when it is sent).

        Raises:
            DeviceCopyError: a copy could not be queued.
        """
        if self._begun:
            raise PCCLError("a Staging runs one operation", result=Result.INTERNAL_ERROR)
        self._begun = True
        self._plan, self._out = plan, out
        if quantized:
            self._pipelined_h2d = False
        count = self.stage.shape[0]
        reads = self._send_reads(plan)
        cuts = _cuts(reads, 0, count)
        blocks = list(itertools.pairwise(cuts))
        first_read = {b: len(reads) for b in blocks}
        for k, (a, b) in enumerate(reads):
            lo = bisect.bisect_right(cuts, a) - 1
            for blk in blocks[lo:]:
                if blk[0] >= b:
                    break
                first_read[blk] = min(first_read[blk], k)
        order = sorted(blocks, key=lambda blk: (first_read[blk], blk[0]))
        events: dict[tuple[int, int], CopyEvent] = {}
        self._call(self.device.order_after_caller)
        for a, b in order:
            events[(a, b)] = self._call(self.device.to_host, self.send, self.stage, a, b)
        self._block_starts = [a for a, _ in blocks]
        self._block_ends = [b for _, b in blocks]
        self._block_events = [events[blk] for blk in blocks]
        if self._pipelined_h2d:
            self._plan_delivery(plan)

    @staticmethod
    def _send_reads(plan: Plan) -> list[tuple[int, int]]:
        """The ranges of ``send`` the data plane reads, in the order it first reads them."""
        reads: list[tuple[int, int]] = []
        if plan.local_copy is not None:
            reads.append((plan.local_copy[0], plan.local_copy[1]))
        sends = plan.sends
        for j in plan.initial:
            if sends[j].source == SRC_SEND:
                reads.append((sends[j].start, sends[j].end))
        for i, f in enumerate(plan.recvs):
            if f.reduce and not f.to_scratch:
                reads.append((f.start, f.end))
            for j in plan.unlocks[i] if i < len(plan.unlocks) else ():
                if sends[j].source == SRC_SEND:
                    reads.append((sends[j].start, sends[j].end))
        return [(a, b) for a, b in reads if a < b]

    def _plan_delivery(self, plan: Plan) -> None:
        """Split the committed range into pieces and find what each one waits for."""
        c0, c1 = plan.owned
        writes = [(f.start, f.end) for f in plan.recvs]
        if plan.local_copy is not None:
            s0, s1, o0 = plan.local_copy
            writes.append((o0, o0 + s1 - s0))
        # AVG divides each piece in place once it is final: every frame that reads it must be gone
        out_reads = [(j, f.start, f.end) for j, f in enumerate(plan.sends) if f.source == SRC_OUT]
        cuts = _cuts(writes + [(a, b) for _, a, b in out_reads], c0, c1)
        self._pieces = list(itertools.pairwise(cuts))
        count = len(self._pieces)

        def covered(a: int, b: int) -> range:
            """The pieces inside ``[a, b)`` (every cut of the range is a piece boundary)."""
            return range(bisect.bisect_left(cuts, max(a, c0)), max(0, bisect.bisect_left(cuts, min(b, c1))))

        writer = [-2] * count  # -2: nothing writes it
        if plan.local_copy is not None:
            s0, s1, o0 = plan.local_copy
            for p in covered(o0, o0 + s1 - s0):
                writer[p] = -1
        for i, f in enumerate(plan.recvs):  # applied in index order: the last one decides
            for p in covered(f.start, f.end):
                writer[p] = i
        self._piece_readers = [0] * count
        if self.average_over:
            for j, a, b in out_reads:
                for p in covered(a, b):
                    self._piece_readers[p] += 1
                    self._by_reader.setdefault(j, []).append(p)
        self._piece_writer = writer
        self._piece_final = [False] * count
        for p, w in enumerate(writer):
            self._by_writer.setdefault(w, []).append(p)
        self._undelivered = count
        self._written(-2)  # pieces nothing writes are final from the start

    # ------------------------------------------------------------------------------------------
    # hooks the data plane calls

    async def _ready(self, lo: int, hi: int) -> None:
        """Wait until ``stage[lo:hi]`` holds ``send``'s bits."""
        k = bisect.bisect_right(self._block_starts, lo) - 1
        k = max(k, 0)
        while k < len(self._block_starts) and self._block_starts[k] < hi:
            if self._block_ends[k] > lo:
                ev = self._block_events[k]
                if not self._query(ev):
                    await self._wait(ev)
            k += 1

    async def before_local_copy(self) -> None:
        """The plan's local copy is about to read ``send``."""
        assert self._plan is not None and self._plan.local_copy is not None
        s0, s1, _ = self._plan.local_copy
        await self._ready(s0, s1)

    def after_local_copy(self) -> None:
        """The plan's local copy was made."""
        self._written(-1)

    async def before_send(self, j: int) -> None:
        """Send ``j`` is about to read its payload."""
        assert self._plan is not None
        f = self._plan.sends[j]
        if f.source == SRC_SEND:
            await self._ready(f.start, f.end)

    def after_send(self, j: int) -> None:
        """Send ``j`` is gone (its payload is no longer read)."""
        for p in self._by_reader.get(j, ()):
            self._piece_readers[p] -= 1
            self._maybe_deliver(p)

    async def before_receive(self, i: int) -> None:
        """Receive ``i`` has arrived and is about to be applied (reduced with ``send``)."""
        assert self._plan is not None
        f = self._plan.recvs[i]
        if f.reduce and not f.to_scratch:
            await self._ready(f.start, f.end)

    def after_receive(self, i: int) -> None:
        """Receive ``i`` was applied to ``out``."""
        self._written(i)

    def _written(self, writer: int) -> None:
        for p in self._by_writer.get(writer, ()):
            self._piece_final[p] = True
            self._maybe_deliver(p)

    def _maybe_deliver(self, p: int) -> None:
        if not self._piece_final[p] or self._piece_readers[p] > 0 or self._aborted:
            return
        self._piece_final[p] = False  # delivered once
        assert self._out is not None
        a, b = self._pieces[p]
        if self.average_over:
            finalize_avg(self._out[a:b], self.average_over, dtype=self.dtype)
        self._h2d.append((a, b, self._call(self.device.to_device, self._out, self.recv, a, b)))
        self._undelivered -= 1

    async def finish(self) -> None:
        """The data plane applied its last frame: wait until every copy it queued is complete.

        Raises:
            DeviceCopyError: a copy failed.
        """
        await self._ready(0, self.stage.shape[0])
        if not self._pipelined_h2d:
            return
        if self._undelivered:
            raise PCCLError(
                f"staging: {self._undelivered} range(s) of the result were never final",
                result=Result.INTERNAL_ERROR,
            )
        for _a, _b, ev in self._h2d:
            if not self._query(ev):
                await self._wait(ev)
        self.delivered = True

    # ------------------------------------------------------------------------------------------
    # failure

    async def abort(self) -> None:
        """The operation failed (or was cancelled): wait, shielded, for every queued copy, then
        copy the stage back over every range of ``recv`` already delivered.

        Raises:
            DeviceCopyError: ``recv`` could not be restored (a copy failed).
        """
        self._aborted = True
        failed: BaseException | None = None
        with trio.CancelScope(shield=True):
            for ev in [*self._block_events, *(ev for _a, _b, ev in self._h2d)]:
                try:
                    await self._wait(ev)
                except DeviceCopyError as exc:
                    failed = failed or exc
            dirty = _merge([(a, b) for a, b, _ev in self._h2d])
            self._h2d = []
            self.delivered = False
            if not dirty:
                return
            try:
                events = [self._call(self.device.to_device, self.stage, self.recv, a, b) for a, b in dirty]
                for ev in events:
                    await self._wait(ev)
            except DeviceCopyError as exc:
                raise DeviceCopyError(
                    f"the operation failed and recv could not be restored: {exc.message}"
                ) from (failed or exc)
        if failed is not None:
            raise DeviceCopyError(
                f"a staging copy failed, recv was restored: {failed}"
            ) from failed

    def statistics(self) -> dict[str, int]:
        """Copies queued each way and ranges delivered so far (for tests and debugging)."""
        return {
            "to_host": len(self._block_events),
            "to_device": len(self._h2d),
            "pieces": len(self._pieces),
            "undelivered": self._undelivered,
        }

    # ------------------------------------------------------------------------------------------

    @staticmethod
    def _call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except DeviceCopyError:
            raise
        except Exception as exc:  # the device library's own errors become one domain error
            raise DeviceCopyError(f"queueing a device copy failed: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _query(ev: CopyEvent) -> bool:
        try:
            return ev.query()
        except DeviceCopyError:
            raise
        except Exception as exc:
            raise DeviceCopyError(f"a device copy failed: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    async def _wait(ev: CopyEvent) -> None:
        try:
            await ev.wait()
        except DeviceCopyError:
            raise
        except Exception as exc:
            raise DeviceCopyError(f"a device copy failed: {type(exc).__name__}: {exc}") from exc


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, coalesced ``ranges``."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
