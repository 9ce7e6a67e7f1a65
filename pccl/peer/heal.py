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
from dataclasses import dataclass
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
from .swarm import Item, Piece, SwarmSchedule

log = logging.getLogger("pccl.shared_state")

#: Chunk sums one StateManifestRequest asks for (one small frame).
MANIFEST_SUMS_PER_REQUEST = 2048
#: Bytes a fetch moves from which its chunks are verified in worker threads (smaller: on the event loop).
VERIFY_IN_THREAD_BYTES = 8 * 1024 * 1024


class _Corrupt(Exception):
    """A donor's bytes failed their sums."""


@dataclass(frozen=True)
class _Landed:
    """A piece's received bytes, not yet verified; ``in_place``: in the staging buffer itself."""

    piece: Piece
    buf: np.ndarray[Any, Any]
    in_place: bool


class _Conn:
    """One donor connection's items: requested (``in_flight``, bytes not all in) and received but not yet
    verified (``checking``), and how it ended (``bad``: bytes failed their sums; ``broke``: it failed)."""

    def __init__(self, donor: int) -> None:
        self.donor = donor
        self.ms: MessageStream | None = None
        self.in_flight: deque[Item] = deque()
        self.checking: list[Item] = []
        self.checked = trio.Event()  # set when a check ends well
        self.checks: trio.Nursery | None = None
        self.bad = ""
        self.broke = ""


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
        verify_in_thread: verify chunks in worker threads, overlapping the next chunks' arrival (None:
            when the fetch moves at least :data:`VERIFY_IN_THREAD_BYTES`; tests on a virtual clock keep
            smaller fetches on the event loop, where no real wait moves that clock).
    """

    def __init__(self, dialer: Dialer, seq: int, addresses: dict[int, tuple[str, int]],
                 fetch: list[tuple[str, int, list[int]]], sizes: dict[str, int], own: dict[str, Any],
                 local_sums: dict[str, list[int]], on_bytes: Callable[[int], None], stall_timeout: float,
                 chunk_bytes: int = swarm.CHUNK_BYTES, verify_in_thread: bool | None = None) -> None:
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
        self.verify_in_thread = (sum(sizes.values()) >= VERIFY_IN_THREAD_BYTES if verify_in_thread is None
                                 else verify_in_thread)
        donors = sorted({h for _, _, hs in fetch for h in hs})
        self.schedule = SwarmSchedule((), donors)
        self.schedule.manifest_items(swarm.plan_items(self.schedule, fetch, sizes, chunk_bytes))
        self.staged: dict[str, np.ndarray[Any, Any]] = {}
        self._in_place: dict[int, int] = {}  # item id -> the donor whose copy landed in place, unchecked
        self._overwritten: set[int] = set()  # of those, the items another verified copy was written over
        self.rx = 0
        self._changed = _Changed()
        self._scope = trio.CancelScope()  # run()'s: cancelled when the fetch ends
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
            self._scope = nursery.cancel_scope
            for donor in self.schedule.donors:
                nursery.start_soon(self._donor, donor)
        stranded = self.schedule.stranded()
        if stranded or not self.schedule.finished:
            keys = sorted({p.key for i in stranded for p in i.pieces}
                          | {i.manifest_key for i in stranded if i.manifest_key})
            reasons = {d: s.failed or s.excluded for d, s in self.schedule.donors.items()}
            raise SharedStateSyncError(f"no holder could deliver tensor(s) {keys} (donors: {reasons})")
        return self.staged, self.rx

    def _check_end(self) -> None:
        """Stop every donor's task when everything is in, or something can no longer come; else wake
        the idle ones (there may be work for them now)."""
        if self.schedule.finished or self.schedule.stranded():
            self._scope.cancel()
        self._changed.fire()

    async def _donor(self, donor: int) -> None:
        conn = _Conn(donor)
        try:
            address = self.addresses.get(donor)
            if address is None:
                raise SharedStateSyncError(f"holder {donor} is not in the group table")
            conn.ms = await self.dialer.dial(address[0], address[1], channel="state", peer_id=donor)
            async with trio.open_nursery() as checks:
                conn.checks = checks
                try:
                    await self._pump(conn, conn.ms)
                except _Corrupt as exc:
                    conn.bad = str(exc)
                except (PCCLError, StreamBroken, trio.TooSlowError) as exc:
                    conn.broke = "stalled" if isinstance(exc, trio.TooSlowError) else str(exc)
                # (leaving the block waits for the checks under way: bytes that came whole still count)
        except (PCCLError, StreamBroken, trio.TooSlowError) as exc:
            conn.broke = "stalled" if isinstance(exc, trio.TooSlowError) else str(exc)
        finally:
            if conn.ms is not None:
                with trio.CancelScope(shield=True):
                    await conn.ms.aclose()
        left = [*conn.checking, *conn.in_flight]
        if conn.bad:
            log.warning("shared state: peer %d sent bytes that fail their hash (%s); it is excluded from "
                        "this transfer", donor, conn.bad)
            self.schedule.corrupt(donor, conn.bad, 0, left)
            self._check_end()
        elif conn.broke:
            log.warning("shared state: fetching from peer %d failed (%s); %d item(s) in flight go to the "
                        "other donors", donor, conn.broke, len(left))
            self.schedule.failed(donor, conn.broke, left)
            self._check_end()

    async def _pump(self, conn: _Conn, ms: MessageStream) -> None:
        """Request and receive ``conn``'s items until none is left for its donor; each data item's bytes
        are verified by a task of their own (:meth:`_check`) while the next ones arrive."""
        donor = conn.donor
        while True:
            await self._ask(ms, donor, conn.in_flight)
            if not conn.in_flight:
                if not self.schedule.usable(donor):
                    return
                await self._changed.wait(self.schedule.next_steal_at(donor))
                continue
            item = conn.in_flight[0]
            if item.manifest_key:
                await self._receive_manifest(ms, donor, item)
                conn.in_flight.popleft()
                self._check_end()
                continue
            while len(conn.checking) >= swarm.DEPTH:
                conn.checked = trio.Event()
                await conn.checked.wait()  # bounded: the donor does not outrun the verification
            landed = await self._receive(ms, donor, item)
            conn.checking.append(conn.in_flight.popleft())
            assert conn.checks is not None
            conn.checks.start_soon(self._check, conn, item, landed)

    async def _check(self, conn: _Conn, item: Item, landed: list[_Landed]) -> None:
        """Verify the bytes of ``item`` from ``conn``'s donor and stage them (unless another copy came
        first); bytes that fail their sums exclude the donor and stop its connection."""
        bad = await self._verify(landed)
        own = any(x.in_place for x in landed) and self._in_place.get(item.id) == conn.donor
        overwritten = own and item.id in self._overwritten
        if own:
            del self._in_place[item.id]
            self._overwritten.discard(item.id)
        if bad:
            if any(x.in_place for x in landed):
                # Another donor's copy may have been staged and then overwritten by these bytes.
                self.schedule.reopen(item)
            self.schedule.corrupt(conn.donor, bad, item.nbytes, ())
            conn.bad = bad
            assert conn.checks is not None
            conn.checks.cancel_scope.cancel()
            return
        conn.checking.remove(item)
        conn.checked.set()
        if overwritten:
            # Another donor's verified copy was written over these bytes before they were checked: what
            # passed was that copy, not this donor's bytes; no credit (the item is done already).
            self.schedule.returned(item, conn.donor)
        elif self.schedule.delivered(item, conn.donor, trio.current_time()):
            for x in landed:
                if x.piece.whole:
                    self.staged[x.piece.key] = x.buf
                elif not x.in_place:
                    pending = self._in_place.get(item.id)
                    if pending is not None and pending != conn.donor:
                        self._overwritten.add(item.id)  # its copy, landed in place, is not checked yet
                    self._stage(x.piece.key)[x.piece.offset : x.piece.offset + x.piece.nbytes] = x.buf
        # else another donor's copy came first (the same bytes: they were verified too)
        self._check_end()

    async def _ask(self, ms: MessageStream, donor: int, in_flight: deque[Item]) -> None:
        """Request items from ``donor`` until :data:`~pccl.peer.swarm.DEPTH` are in flight (or none is
        left for it)."""
        now = trio.current_time()
        while len(in_flight) < swarm.DEPTH:
            item = self.schedule.next_for(donor, now)
            if item is None:
                return
            in_flight.append(item)
            await self._request(ms, item)

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

    async def _next(self, ms: MessageStream, donor: int, read_ahead: bool = True) -> m.Message:
        with trio.fail_after(self.stall_timeout):
            msg = await ms.receive(read_ahead=read_ahead)
        if isinstance(msg, m.Refused):
            raise SharedStateSyncError(f"peer {donor} refused the transfer: {msg.reason}")
        return msg

    async def _receive(self, ms: MessageStream, donor: int, item: Item) -> list[_Landed]:
        """Receive the bytes of data ``item`` (not yet verified): a chunk into its place in the staging
        buffer when this donor has the only copy of the item in flight, anything else (a whole small
        tensor, a stolen chunk) into a new buffer."""
        landed: list[_Landed] = []
        for p in item.pieces:
            hdr = await self._next(ms, donor, read_ahead=False)  # the bytes that follow land in place
            if not isinstance(hdr, m.StateChunk) or (hdr.key, hdr.offset, hdr.nbytes) != (
                    p.key, p.offset, p.nbytes):
                raise RemoteProtocolError(f"peer {donor} sent an unexpected chunk header {hdr!r:.120}")
            x = self._landing(item, donor, p)
            await self._receive_bytes(ms, x.buf)
            landed.append(x)
        return landed

    def _landing(self, item: Item, donor: int, p: Piece) -> _Landed:
        """Where ``donor``'s bytes of piece ``p`` of ``item`` land: in place in the staging buffer when
        it has the only copy of the item in flight (remembered until its check: another copy verified
        and written over the range before then makes that check read the other copy's bytes), else a
        buffer of their own."""
        if not p.whole and not item.done and set(item.copies) == {donor}:
            self._in_place[item.id] = donor
            self._overwritten.discard(item.id)
            return _Landed(p, self._stage(p.key)[p.offset : p.offset + p.nbytes], True)
        return _Landed(p, np.empty(p.nbytes, dtype=np.uint8), False)

    async def _receive_bytes(self, ms: MessageStream, buf: np.ndarray[Any, Any]) -> None:
        """Fill ``buf`` with the raw bytes that follow the last frame, as they come (each read as large
        as the socket gives); :class:`trio.TooSlowError` when no byte came for ``stall_timeout``."""
        view = memoryview(buf).cast("B")  # type: ignore[arg-type]  # ndarray implements the buffer protocol
        n = len(view)
        got = len(pre := ms.take_buffered(n))
        view[:got] = pre
        if got:
            self._count(got)
        with trio.CancelScope(deadline=trio.current_time() + self.stall_timeout) as idle:
            while got < n:
                k = await ms.stream.receive_into(view[got:])
                if k == 0:
                    raise StreamBroken(f"connection closed after {got} of {n} bytes")
                got += k
                self._count(k)  # (every byte received counts: those of a chunk cut short too)
                idle.deadline = trio.current_time() + self.stall_timeout
        if idle.cancelled_caught:
            raise trio.TooSlowError

    def _count(self, n: int) -> None:
        self.rx += n
        self.on_bytes(n)

    def _stage(self, key: str, keep: bool = False) -> np.ndarray[Any, Any]:
        """The staging buffer of a large tensor: a copy of this peer's bytes when some of its chunks are
        kept (``keep``, on the manifest's arrival), else fresh memory that the chunks fill."""
        buf = self.staged.get(key)
        if buf is None:
            own = self.own[key]
            buf = np.array(own, dtype=np.uint8, copy=True) if keep else np.empty(len(own), dtype=np.uint8)
            self.staged[key] = buf
        return buf

    async def _verify(self, landed: list[_Landed]) -> str:
        """"" when every piece matches what it must hash to, else what failed (in a worker thread when
        :attr:`verify_in_thread`: the event loop keeps receiving meanwhile)."""
        def check() -> str:
            for x in landed:
                p = x.piece
                if p.whole:
                    got = hashing.content_hash(x.buf)
                else:
                    got = hashing.chunk_sum(x.buf, p.offset // hashing.CHUNK_ALIGN)
                if got != p.expected:
                    return (f"{p.key!r} bytes {p.offset}..{p.offset + p.nbytes} hash to {got:#x}, "
                            f"expected {p.expected:#x}")
            return ""

        if self.verify_in_thread:
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
