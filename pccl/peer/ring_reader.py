"""The readers of the ring pool (:mod:`pccl.peer.pool`): one task per incoming connection that reads
frame headers and moves each payload where :class:`~pccl.peer.ring_inbox.RingInbox` says it goes (its
receive, zero copy; the stash; or the discard scratch), parking the connection unread while the stash is
full (backpressure, see :mod:`pccl.peer.pool`).

Safety of the destination: on TCP the reader checks the receive's state before every ``recv_into``
syscall (trio is single-threaded, so nothing can write between the check and the syscall); on other
transports it receives through a bounce buffer owned by the connection and copies only while the receive
is live.
"""

from __future__ import annotations

import logging

import trio

from .._errors import RemoteProtocolError
from ..transport import StreamBroken
from ..wire.data import DATA_HEADER_SIZE, MAX_DATA_FRAME_LENGTH, unpack_data_header_fields
from ..wire.messages import Hello
from ..wire.stream import MessageStream
from .op_io import OpIo
from .ring_conn import Blocked, Broken, Conn, Eof, Retired, open_conn
from .ring_inbox import ReceiveSlot, RingInbox, SlotKey

__all__ = ["RingReaders"]

log = logging.getLogger("pccl.p2p")

_BOUNCE_BYTES = 256 * 1024  # generic-transport receive bounce buffer (per connection)
_DISCARD_BYTES = 1 << 20  # scratch that frames of dead operations are read into and dropped
_YIELD_EVERY_BYTES = 4 << 20  # a reader that never had to wait yields after this many bytes
# Scheduler passes a reader gives an operation's task to register a receive before it stashes the
# frame (see RingReaders.read_frame). A pass with nothing else to run costs a few microseconds.
_REGISTER_PASSES = 16
_REGISTER_WAIT_MIN_BYTES = 256 * 1024

_LOST = (Broken, StreamBroken, trio.ClosedResourceError, trio.BrokenResourceError, OSError)


class RingReaders:
    """The incoming ring connections, by ``(peer, index)``, and the reader each one runs.

    Args:
        inbox: where frames go.
        socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF for TCP connections (None: the kernel's autotuning).
    """

    def __init__(self, inbox: RingInbox, socket_buffer_bytes: int | None) -> None:
        self.inbox = inbox
        self.socket_buffer_bytes = socket_buffer_bytes
        self.io: OpIo | None = None  # bytes per operation and partner (the pool sets it)
        self.closed = False
        self.conns: dict[tuple[int, int], Conn] = {}
        self._discard = memoryview(bytearray(_DISCARD_BYTES))
        # counters for statistics()
        self.connections_lost = 0
        self.closed_by_peer = 0  # connections the other side closed between two frames
        self.blocked_drops = 0  # connections closed because a frame stayed blocked too long
        self.recv_waits = 0  # of connections that are gone (live ones count their own)

    async def handle_incoming(self, ms: MessageStream, hello: Hello) -> None:
        """Read connection ``ms`` (its handshake said ``hello``) until it closes or breaks; see
        :meth:`pccl.peer.pool.P2PPool.handle_incoming`."""
        if self.closed:
            return
        conn = await self._adopt(ms, hello)
        reason = "closed"
        retired = False
        try:
            await self._read_all(conn, ms)
        except Retired:
            reason = f"peer {conn.peer_id} closed its connection (it sends to this peer no more)"
            retired = True
        except _LOST as exc:
            reason = f"connection from peer {conn.peer_id} lost: {exc or type(exc).__name__}"
        except RemoteProtocolError as exc:
            reason = f"peer {conn.peer_id} broke the data protocol: {exc.message}"
            log.warning("closing ring connection from peer %d: %s", conn.peer_id, exc.message)
        except Blocked as exc:
            reason = f"ring connection from peer {conn.peer_id} blocked: {exc}"
            log.warning("closing ring connection %d from peer %d: %s", conn.index, conn.peer_id, exc)
            self.blocked_drops += 1
            # What this connection stashed is suspect (nothing claimed it while it was blocked, see
            # pccl.peer.pool): its budget goes back to the other connections (in _end).
        finally:
            await self._end(conn, (hello.peer_id, hello.index), reason, retired)

    async def _adopt(self, ms: MessageStream, hello: Hello) -> Conn:
        """The connection for ``ms``, now the current one of its ``(peer, index)``."""
        conn = open_conn(ms.stream, hello.peer_id, hello.index, outgoing=False,
                         buffer_bytes=self.socket_buffer_bytes)
        key = (hello.peer_id, hello.index)
        old = self.conns.get(key)
        self.conns[key] = conn
        if old is not None:
            # The peer reopened this slot, so it gave the old connection up (and resends what it
            # had sent on it): the frame it was filling waits for the copy.
            self.inbox.release_fills(old)
            await old.aclose()
            self.inbox.wake()
        return conn

    async def _read_all(self, conn: Conn, ms: MessageStream) -> None:
        """Read frames from ``conn`` until it ends (by an exception)."""
        # The first header may already be buffered in the message stream behind the Hello.
        pre = ms.take_buffered(DATA_HEADER_SIZE)
        conn.hdr_view[: len(pre)] = pre
        await self.read_header(conn, len(pre))
        unyielded = 0
        while True:
            if await self.read_frame(conn):
                unyielded = 0
            else:
                # Fairness: a sender that keeps the socket full must not keep this reader from
                # yielding for long; but a yield per small frame would cost a scheduler pass.
                unyielded += DATA_HEADER_SIZE + unpack_data_header_fields(conn.hdr)[3]
                if unyielded >= _YIELD_EVERY_BYTES:
                    unyielded = 0
                    await trio.lowlevel.checkpoint()
            await self.read_header(conn)

    async def _end(self, conn: Conn, key: tuple[int, int], reason: str, retired: bool) -> None:
        """``conn`` ended (``reason``); if it was still the current connection of ``key``, the receives
        it owed fail, or, while the peer has other connections, wait for the resent copy."""
        # A connection leaves nothing behind when it ends, however it ends: had an operation
        # still needed its frames, it fails with the lost connection anyway; a sender retires
        # its connections (closes them between two frames) only after a topology change, which
        # every member votes for only with its own operations ended (their frames claimed or
        # forgotten). So a member cannot park frames here and walk away.
        self.inbox.drop_stash_of(conn)
        was_closed = conn.closed
        self.recv_waits += conn.recv_waits
        conn.recv_waits = 0
        await conn.aclose()
        if self.conns.get(key) is not conn:
            return
        del self.conns[key]
        if retired:
            self.closed_by_peer += 1
        elif not was_closed:
            self.connections_lost += 1
        if not retired and not was_closed and any(
            p == conn.peer_id and c.alive() for (p, _i), c in self.conns.items()
        ):
            # One connection of a stripe lost while the peer still has others: its sender
            # reopens it and resends (ring._run_pipelined); only the frame it was filling
            # waits again. A peer that is gone loses them all, and its last one fails.
            self.inbox.release_fills(conn)
        else:
            self.inbox.fail_peer(conn.peer_id, reason)

    async def read_header(self, conn: Conn, got: int = 0) -> None:
        """Read a frame's header into ``conn.hdr_view`` (``got`` bytes of it are there already).

        Raises:
            Retired: the other side closed the connection before the header's first byte.
            Broken: the connection broke, or closed within the header.
        """
        view = conn.hdr_view
        while got < DATA_HEADER_SIZE:
            try:
                got += await conn.receive_into(view[got:] if got else view, DATA_HEADER_SIZE - got)
            except Eof:
                if got == 0:
                    raise Retired from None  # between two frames: nothing was cut off
                raise

    async def read_frame(self, conn: Conn) -> bool:
        """Read the payload of the frame whose header is in ``conn.hdr``; True if it had to wait."""
        tag, op_seq, seq, length = unpack_data_header_fields(conn.hdr)
        if length > MAX_DATA_FRAME_LENGTH:
            raise RemoteProtocolError(f"data frame length {length} exceeds the limit")
        if self.io is not None:
            self.io.count(op_seq, conn.peer_id, 1, length)
        inbox = self.inbox
        key = (conn.peer_id, tag, op_seq, seq)
        slot = inbox.slots.get(key)
        if slot is None and length >= _REGISTER_WAIT_MIN_BYTES and op_seq not in inbox.dead_ops:
            slot = await self._let_register(key)
        if slot is not None:
            # straight into the registered receive (inline: this is every frame's path)
            if slot.filling:
                raise RemoteProtocolError(f"frame {key} received twice")
            slot.filler = conn
            if length != slot.nbytes:
                inbox.reject(key, slot, length)
                raise RemoteProtocolError(f"frame {key}: {length} bytes, expected {slot.nbytes}")
            slot.filling = True
            blocked = await self.fill(conn, slot.dest, slot)
            inbox.filled(key, slot, length)
            return blocked
        if inbox.is_straggler(key):
            inbox.bytes_discarded += length
            return await self.drop(conn, length)
        if key in inbox.stashing:
            raise RemoteProtocolError(f"frame {key} received twice")
        if not inbox.fits(length):
            # Backpressure: stop reading this connection until the frame can go somewhere.
            slot = await inbox.wait_for_room(conn, key, length)
            if slot is not None:
                await self.read_frame(conn)  # registered meanwhile: straight into place
                return True
            if op_seq in inbox.dead_ops:
                inbox.bytes_discarded += length
                return await self.drop(conn, length)
            if key in inbox.stash or key in inbox.stashing:
                raise RemoteProtocolError(f"frame {key} received twice")
        return await self._stash(conn, key, length)

    async def _let_register(self, key: SlotKey) -> ReceiveSlot | None:
        """Give the operation's task a few scheduler passes to register receive ``key``; its slot, or
        None (not registered, or the operation ended)."""
        # Usually the operation's own task is already runnable (this peer got the master's
        # go-ahead too) and registers its receives within a few scheduler passes. Let it, rather
        # than stash: a stashed frame costs a fresh buffer and a second copy, and while this
        # reader fills the stash it keeps that very task from running (measured: 1-7 ms late
        # ring starts at 3 peers x 16 MB). Bounded: a truly early frame is stashed after that.
        # Small frames are stashed at once: cheap to stash, and the passes would cost more.
        inbox = self.inbox
        for _ in range(_REGISTER_PASSES):
            await trio.lowlevel.checkpoint()
            slot = inbox.slots.get(key)
            if slot is not None or key[2] in inbox.dead_ops:
                return slot
        return None

    async def _stash(self, conn: Conn, key: SlotKey, length: int) -> bool:
        """Read the frame into a fresh stash buffer; True if it had to wait."""
        buf = self.inbox.reserve(key, length)
        try:
            blocked = await self.fill(conn, memoryview(buf), None)
        except BaseException:
            self.inbox.abandon(key, length)
            raise
        self.inbox.keep(key, buf, conn)
        return blocked

    async def fill(self, conn: Conn, view: memoryview, slot: ReceiveSlot | None) -> bool:
        """Receive exactly ``len(view)`` bytes into ``view``; stop writing once ``slot`` is cancelled.

        Returns:
            True if it had to wait for bytes.
        """
        n = len(view)
        got = 0
        conn.waited = conn.always_waits
        bounce: memoryview | None = None
        if slot is not None and not conn.direct:
            # receive_into may write after waking, so never hand it a destination that could be
            # cancelled meanwhile; go through a bounce buffer owned by the connection.
            bounce = conn.bounce
            if bounce is None:
                bounce = conn.bounce = memoryview(bytearray(_BOUNCE_BYTES))
        while got < n:
            if slot is not None and slot.cancelled:
                await self.drop(conn, n - got)
                return True
            if bounce is None:
                got += await conn.receive_into(view[got:] if got else view, n - got)
            else:
                assert slot is not None
                k = await conn.receive_into(bounce[: min(n - got, _BOUNCE_BYTES)], n - got)
                if not slot.cancelled:
                    view[got : got + k] = bounce[:k]
                got += k
        return conn.waited

    async def drop(self, conn: Conn, n: int) -> bool:
        """Read ``n`` bytes from ``conn`` and throw them away; True (it counts as having waited)."""
        got = 0
        discard = self._discard
        while got < n:
            want = min(n - got, _DISCARD_BYTES)
            got += await conn.receive_into(discard[:want], want)
        return True

    def pop_peer(self, peer_id: int) -> list[Conn]:
        """Take every connection from ``peer_id`` out (the caller closes them)."""
        return [self.conns.pop(k) for k in [k for k in self.conns if k[0] == peer_id]]

    def close(self) -> list[Conn]:
        """Refuse new connections; take every connection out (the caller closes them)."""
        self.closed = True
        conns = list(self.conns.values())
        self.conns.clear()
        return conns

    def statistics(self) -> dict[int, int]:
        """Per peer, how many incoming connections are open."""
        return {p: sum(1 for (q, _i) in self.conns if q == p) for p in {q for (q, _i) in self.conns}}
