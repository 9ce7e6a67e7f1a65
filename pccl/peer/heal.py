"""Fetching shared state from many donors, chunk by chunk (the trio side of :mod:`pccl.peer.swarm`).

One connection per donor (every holder of the elected content the plan names), each keeping
:data:`~pccl.peer.swarm.DEPTH` items requested. Every chunk is checked against its chunk sum on arrival
(a large tensor's sums first checked against its elected content hash, see
:func:`pccl.kernels.hashing.chunk_sums`), and only chunks whose sums differ from this peer's own are
fetched. A donor that breaks, refuses or moves no byte for ``stall_timeout`` seconds costs only its items
in flight; one whose bytes fail their sums is logged, counted and excluded. Nothing is applied here: the
caller stages and applies all or nothing.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from .._errors import PCCLError, RemoteProtocolError, SharedStateSyncError
from ..kernels import hashing
from ..transport import StreamBroken
from ..wire import limits
from ..wire import messages as m
from ..wire.stream import MessageStream
from . import swarm
from .links import Dialer
from .swarm import Item, SwarmSchedule

log = logging.getLogger("pccl.shared_state")

#: Chunk sums one StateManifestRequest asks for (one small frame).
MANIFEST_SUMS_PER_REQUEST = 2048
_RECV_STEP = 256 * 1024


class _Corrupt(Exception):
    """A donor's bytes failed their sums."""


class _Changed:
    """Wakes the donors' tasks when the schedule changed (an item returned, a manifest verified)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, until: float | None) -> None:
        event = self._event
        with trio.move_on_at(until if until is not None else float("inf")):
            await event.wait()


class SwarmFetch:
    """One fetch: the schedule, the staging buffers and the donors' tasks.

    Args:
        dialer: opens the "state" connections.
        seq: the sync's sequence number.
        addresses: donor id -> (host, port).
        fetch: the plan's ``(key, elected hash, holders)`` rows.
        sizes: bytes per key.
        own: this peer's current bytes per key (host, uint8): the base of a large tensor's staging
            buffer, whose matching chunks are not fetched.
        local_sums: this peer's chunk sums per large key.
        on_bytes: called with each count of bytes received.
        stall_timeout: seconds a donor with items in flight may move no byte.
        chunk_bytes: the chunk size.
    """

    def __init__(self, dialer: Dialer, seq: int, addresses: dict[int, tuple[str, int]],
                 fetch: list[tuple[str, int, list[int]]], sizes: dict[str, int], own: dict[str, Any],
                 local_sums: dict[str, list[int]], on_bytes: Callable[[int], None], stall_timeout: float,
                 chunk_bytes: int = swarm.CHUNK_BYTES) -> None:
        self.dialer = dialer
        self.seq = seq
        self.addresses = addresses
        self.sizes = sizes
        self.expected = {k: h for k, h, _ in fetch}
        self.holders = {k: frozenset(hs) for k, _, hs in fetch}
        self.own = own
        self.local_sums = local_sums
        self.on_bytes = on_bytes
        self.stall_timeout = stall_timeout
        self.chunk_bytes = chunk_bytes
        donors = sorted({h for _, _, hs in fetch for h in hs})
        self.schedule = SwarmSchedule((), donors)
        self.schedule.manifest_items(swarm.plan_items(self.schedule, fetch, sizes, chunk_bytes))
        self.staged: dict[str, np.ndarray[Any, Any]] = {}
        self.rx = 0
        self._changed = _Changed()
        self.started = trio.current_time()

    def statistics(self) -> dict[str, Any]:
        """:meth:`pccl.peer.swarm.SwarmSchedule.statistics` plus ``rx_bytes`` (all bytes received,
        duplicates and refused ones too), ``elapsed`` seconds and ``rate`` (verified bytes per second)."""
        elapsed = trio.current_time() - self.started
        st = self.schedule.statistics()
        return {**st, "rx_bytes": self.rx, "elapsed": elapsed,
                "rate": st["bytes_done"] / elapsed if elapsed > 0 else 0.0}

    async def run(self) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
        """Fetch everything; returns the staged bytes per key and the bytes received.

        Raises:
            SharedStateSyncError: some item has no usable donor left.
        """
        async with trio.open_nursery() as nursery:
            for donor in self.schedule.donors:
                nursery.start_soon(self._donor, donor, nursery.cancel_scope)
        stranded = self.schedule.stranded()
        if stranded or not self.schedule.finished:
            keys = sorted({p.key for i in stranded for p in i.pieces}
                          | {i.manifest_key for i in stranded if i.manifest_key})
            reasons = {d: s.failed or s.excluded for d, s in self.schedule.donors.items()}
            raise SharedStateSyncError(f"no holder could deliver tensor(s) {keys} (donors: {reasons})")
        return self.staged, self.rx

    def _check_end(self, scope: trio.CancelScope) -> None:
        if self.schedule.finished or self.schedule.stranded():
            scope.cancel()
        self._changed.fire()

    async def _donor(self, donor: int, scope: trio.CancelScope) -> None:
        in_flight: deque[Item] = deque()
        ms: MessageStream | None = None
        # A chunk of a large tensor lands here, then, verified, in its staging buffer: one reused buffer
        # per connection (fresh memory per chunk cost its page faults, more than the copy).
        scratch: np.ndarray[Any, Any] | None = None
        try:
            address = self.addresses.get(donor)
            if address is None:
                raise SharedStateSyncError(f"holder {donor} is not in the group table")
            ms = await self.dialer.dial(address[0], address[1], channel="state", peer_id=donor)
            while True:
                now = trio.current_time()
                while len(in_flight) < swarm.DEPTH:
                    item = self.schedule.next_for(donor, now)
                    if item is None:
                        break
                    in_flight.append(item)
                    await self._request(ms, item)
                if not in_flight:
                    if not self.schedule.usable(donor):
                        return
                    await self._changed.wait(self.schedule.next_steal_at(donor))
                    continue
                item = in_flight[0]
                if scratch is None:
                    scratch = np.empty(self.chunk_bytes, dtype=np.uint8)
                await self._receive(ms, donor, item, scratch)
                in_flight.popleft()
                self._check_end(scope)
        except _Corrupt as exc:
            log.warning("shared state: peer %d sent bytes that fail their hash (%s); it is excluded from "
                        "this transfer", donor, exc)
            self.schedule.corrupt(donor, str(exc), 0, in_flight)
            self._check_end(scope)
        except (PCCLError, StreamBroken, trio.TooSlowError) as exc:
            why = "stalled" if isinstance(exc, trio.TooSlowError) else str(exc)
            log.warning("shared state: fetching from peer %d failed (%s); %d item(s) in flight go to the "
                        "other donors", donor, why, len(in_flight))
            self.schedule.failed(donor, why, in_flight)
            self._check_end(scope)
        finally:
            if ms is not None:
                with trio.CancelScope(shield=True):
                    await ms.aclose()

    async def _request(self, ms: MessageStream, item: Item) -> None:
        if item.manifest_key:
            key = item.manifest_key
            count = -(-self.sizes[key] // self.chunk_bytes)
            for first in range(0, count, MANIFEST_SUMS_PER_REQUEST):
                await ms.send(m.StateManifestRequest(
                    sync_seq=self.seq, key=key, chunk_bytes=self.chunk_bytes, first=first,
                    count=min(MANIFEST_SUMS_PER_REQUEST, count - first)))
            return
        rows = [[p.key, p.offset, p.nbytes] for p in item.pieces]
        for part in limits.split_rows(rows):
            await ms.send(m.StateChunkRequest(sync_seq=self.seq, pieces=part))

    async def _next(self, ms: MessageStream, donor: int) -> m.Message:
        with trio.fail_after(self.stall_timeout):
            msg = await ms.receive()
        if isinstance(msg, m.Refused):
            raise SharedStateSyncError(f"peer {donor} refused the transfer: {msg.reason}")
        return msg

    async def _receive(self, ms: MessageStream, donor: int, item: Item,
                       scratch: np.ndarray[Any, Any]) -> None:
        if item.manifest_key:
            await self._receive_manifest(ms, donor, item)
            return
        bufs: list[np.ndarray[Any, Any]] = []
        for p in item.pieces:
            hdr = await self._next(ms, donor)
            if not isinstance(hdr, m.StateChunk) or (hdr.key, hdr.offset, hdr.nbytes) != (
                    p.key, p.offset, p.nbytes):
                raise RemoteProtocolError(f"peer {donor} sent an unexpected chunk header {hdr!r:.120}")
            # a whole small tensor keeps its own buffer (it becomes the staged one); a chunk has one piece
            buf = np.empty(p.nbytes, dtype=np.uint8) if p.whole else scratch[: p.nbytes]
            view = buf.data
            for off in range(0, p.nbytes, _RECV_STEP):
                part = view[off : off + _RECV_STEP]
                with trio.fail_after(self.stall_timeout):
                    await ms.receive_raw_into(part)
                self.rx += len(part)
                self.on_bytes(len(part))
            bufs.append(buf)
        bad = await self._verify(item, bufs)
        if bad:
            self.schedule.corrupt(donor, bad, item.nbytes, ())
            raise _Corrupt(bad)
        if not self.schedule.delivered(item, donor, trio.current_time()):
            return  # another donor's copy came first
        for p, buf in zip(item.pieces, bufs, strict=True):
            if p.whole:
                self.staged[p.key] = buf
            else:
                self._stage(p.key)[p.offset : p.offset + p.nbytes] = buf

    def _stage(self, key: str, keep: bool = False) -> np.ndarray[Any, Any]:
        """The staging buffer of a large tensor: a copy of this peer's bytes when some of its chunks are
        kept (``keep``, on the manifest's arrival), else fresh memory that the chunks fill."""
        buf = self.staged.get(key)
        if buf is None:
            own = self.own[key]
            buf = np.array(own, dtype=np.uint8, copy=True) if keep else np.empty(len(own), dtype=np.uint8)
            self.staged[key] = buf
        return buf

    async def _verify(self, item: Item, bufs: list[np.ndarray[Any, Any]]) -> str:
        def check() -> str:
            for p, buf in zip(item.pieces, bufs, strict=True):
                if p.whole:
                    got = hashing.content_hash(buf)
                else:
                    got = hashing.chunk_sum(buf, p.offset // hashing.CHUNK_ALIGN)
                if got != p.expected:
                    return (f"{p.key!r} bytes {p.offset}..{p.offset + p.nbytes} hash to {got:#x}, "
                            f"expected {p.expected:#x}")
            return ""

        if item.nbytes >= 8 * 1024 * 1024:
            return await trio.to_thread.run_sync(check)
        return check()

    async def _receive_manifest(self, ms: MessageStream, donor: int, item: Item) -> None:
        key = item.manifest_key
        nbytes = self.sizes[key]
        count = -(-nbytes // self.chunk_bytes)
        sums: list[int] = []
        for first in range(0, count, MANIFEST_SUMS_PER_REQUEST):
            msg = await self._next(ms, donor)
            if not isinstance(msg, m.StateManifest) or msg.key != key or msg.first != first:
                raise RemoteProtocolError(f"peer {donor} sent an unexpected manifest {msg!r:.120}")
            sums.extend(int(s) for s in msg.sums)
        if len(sums) != count or hashing.combine_chunk_sums(sums, nbytes) != self.expected[key]:
            raise _Corrupt(f"the chunk sums of {key!r} do not combine to its elected hash")
        if not self.schedule.delivered(item, donor, trio.current_time()):
            return
        new = swarm.chunk_items(self.schedule, key, self.holders[key], nbytes, sums, self.local_sums.get(key),
                                self.chunk_bytes)
        if len(new) < count:
            self._stage(key, keep=True)  # the chunks this peer holds already stay as they are
        self.schedule.manifest_items(new)


__all__ = ["MANIFEST_SUMS_PER_REQUEST", "SwarmFetch"]
