"""Message stream adapter: frames + msgpack messages over a transport :class:`~pccl.transport.Stream`.

Writers are serialized with a ``trio.StrictFIFOLock`` so concurrent tasks never interleave
frames; exactly one task reads. Raw byte payloads (state transfers, bandwidth probes) can follow
a control frame on the same stream via :meth:`MessageStream.receive_raw_into`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from .._errors import RemoteProtocolError
from ..transport import Stream, StreamBroken, receive_exactly_into
from .framing import HEADER_SIZE, Framer, encode_frame
from .limits import HANDSHAKE_TAGS, PRE_AUTH_MAX_FRAME, FrameLimits
from .messages import Message, decode, encode

_RECV_SIZE = 256 * 1024
# The first bytes of a TLS record (handshake 0x16 or alert 0x15, version 3.x): what a side that speaks
# TLS sends to one that does not (docs/security.md "TLS").
_TLS_RECORD_TYPES = (0x15, 0x16)


# The last few messages of a SHARED type encoded here (the objects themselves, so that identity stays
# meaningful) and their bytes: a master sends the same P2PCredentials and EstablishP2P objects to every
# member of an epoch (interleaved per member), encoded once.
_SHARED_SLOTS = 8
_shared: list[tuple[Message, bytes]] = []


def encode_message(msg: Message) -> bytes:
    """:func:`~pccl.wire.messages.encode` as every stream sends: a message of a ``SHARED`` type sent
    again (the same object, to another peer) reuses the bytes of its encoding."""
    if not msg.SHARED:
        return encode(msg)
    for obj, data in _shared:
        if obj is msg:
            return data
    data = encode(msg)
    if len(_shared) >= _SHARED_SLOTS:
        del _shared[0]
    _shared.append((msg, data))
    return data


#: The message of the StreamBroken raised when the other side closed the connection between frames.
CLOSED_BY_PEER = "connection closed by the other side"


def looks_like_tls(head: bytes) -> bool:
    """True when ``head`` (a connection's first bytes) starts like a TLS record, not a pccl frame."""
    return len(head) >= 3 and head[0] in _TLS_RECORD_TYPES and head[1] == 3 and head[2] <= 4


class LargeFrameGuard(Protocol):
    """What a frame larger than :attr:`threshold` may cost (the master's budget for peers not yet
    admitted, :mod:`pccl.master.budget`)."""

    threshold: int
    deadline: float  # seconds the frame may take to arrive whole once reserved

    def reserve(self, n: int) -> int | str:
        """Bytes reserved for an ``n``-byte frame under way (0: not counted), or why it is refused."""

    def release(self, n: int) -> None:
        """Give back bytes :meth:`reserve` returned."""


# First bytes of other protocols a pccl port may be confused with (a status page, a web server, ssh).
_FOREIGN = (
    (b"HTTP/", "an HTTP server answered (is this the status page's port rather than the master's?)"),
    (b"GET ", "an HTTP client sent a request (this port serves pccl, not HTTP)"),
    (b"POST", "an HTTP client sent a request (this port serves pccl, not HTTP)"),
    (b"HEAD", "an HTTP client sent a request (this port serves pccl, not HTTP)"),
    (b"SSH-", "an SSH server answered"),
)


def foreign_protocol(head: bytes) -> str | None:
    """What ``head`` (a connection's first bytes, up to 5) looks like when it is not pccl framing: a TLS
    record, HTTP, SSH; None when it is none of these."""
    if looks_like_tls(head):
        return ("the other side speaks TLS and this one does not: configure TLS on both sides or on "
                "neither")
    for prefix, what in _FOREIGN:
        if head.startswith(prefix[: len(head)]) and len(head) >= min(4, len(prefix)):
            return f"not pccl: {what}"
    return None


class MessageStream:
    """Send and receive control messages on one stream.

    Args:
        stream: the transport stream.
        max_frame_size: largest frame sent, and received while ``limits`` is None.
        limits: what a received frame may cost (:mod:`pccl.wire.limits`); None: only
            ``max_frame_size``. Change it with :meth:`set_limits` as the connection earns trust.
    """

    def __init__(self, stream: Stream, *, max_frame_size: int, limits: FrameLimits | None = None) -> None:
        self.stream = stream
        self.max_frame_size = max_frame_size
        self._framer = Framer(max_frame_size=max_frame_size)
        self.limits: FrameLimits | None = None
        if limits is not None:
            self.set_limits(limits)
        self._send_lock = trio.StrictFIFOLock()
        self._owed: memoryview | None = None  # see send_nowait
        self._head = b""  # the connection's first bytes, to name a TLS/plain mismatch
        self._frames = 0  # frames received
        self.guard: LargeFrameGuard | None = None  # see set_guard
        self._reserved = 0  # bytes the guard reserved for the frame under way
        self._reserved_until = 0.0

    @property
    def received_any(self) -> bool:
        """Whether any byte arrived on this connection (a port probe closes without sending one)."""
        return bool(self._head)

    def _frame(self, msg: Message) -> bytes:
        limit = self.max_frame_size
        if msg.TAG in HANDSHAKE_TAGS:
            limit = max(limit, PRE_AUTH_MAX_FRAME)  # the handshake fits whatever the configured size
        return encode_frame(encode_message(msg), max_frame_size=limit)

    def set_limits(self, limits: FrameLimits) -> None:
        """Receive the next frames under ``limits`` (the framer's cap applies to the next length prefix
        not yet checked)."""
        self.limits = limits
        self._framer.max_frame_size = limits.max_frame
        self._framer.check_head = limits.check_head

    def set_guard(self, guard: LargeFrameGuard | None) -> None:
        """Ask ``guard`` before buffering a frame larger than its threshold (None: never ask)."""
        self._release()
        self.guard = guard

    def _release(self) -> None:
        if self._reserved and self.guard is not None:
            self.guard.release(self._reserved)
        self._reserved = 0

    def _check_large(self) -> None:
        """Reserve the frame under way with the guard, once (its length prefix is in)."""
        guard = self.guard
        if guard is None or self._reserved:
            return
        n = self._framer.pending_length()
        if n is None or n <= guard.threshold:
            return
        got = guard.reserve(n)
        if isinstance(got, str):
            raise RemoteProtocolError(got)
        if got:
            self._reserved = got
            self._reserved_until = trio.current_time() + guard.deadline

    async def send(self, msg: Message) -> None:
        """Send one message. Raises StreamBroken."""
        data = self._frame(msg)
        async with self._send_lock:
            await self._pay_owed()
            await self.stream.send_all(data)

    async def send_with_raw(self, msg: Message, raw: memoryview | bytes, *,
                            pace: Callable[[int], Awaitable[None]] | None = None, piece: int = 0) -> None:
        """Send a message immediately followed by raw bytes, atomically w.r.t. other senders.

        Args:
            pace: paced sending (a rate cap, :mod:`pccl.peer.ratecap`): the raw bytes go in writes of at
                most ``piece`` bytes, each after ``await pace(its length)`` returns (the message's
                frame, a few dozen bytes, goes unpaced). None: everything at once.
            piece: the largest paced write (> 0 with ``pace``).
        """
        data = self._frame(msg)
        async with self._send_lock:
            await self._pay_owed()
            await self.stream.send_all(data)
            if pace is None:
                await self.stream.send_all(raw)
                return
            if piece <= 0:
                raise ValueError(f"a paced send needs a piece size > 0, not {piece}")
            view = memoryview(raw).cast("B")
            for offset in range(0, len(view), piece):
                part = view[offset : offset + piece]
                await pace(len(part))
                await self.stream.send_all(part)

    def send_nowait(self, msg: Message) -> bool:
        """Start sending ``msg`` at once, from synchronous code, when no other send is under way and
        the transport takes bytes without waiting (its optional ``try_send``).

        Saves the hand-off to a writer task and its scheduler passes on every control message.
        Returns False, having sent nothing, when that is not possible now: send it with
        :meth:`send` instead. True means the frame went out, or its beginning did and the rest is
        :attr:`owes` - to be sent by :meth:`flush` (or the next :meth:`send`) before anything else.

        Raises:
            StreamBroken: the transport failed.
        """
        try_send = getattr(self.stream, "try_send", None)
        if try_send is None or self._owed is not None or self._send_lock.locked():
            return False
        data = self._frame(msg)
        n = try_send(data)
        if n == 0:
            return False
        if n < len(data):
            self._owed = memoryview(data)[n:]
        return True

    @property
    def owes(self) -> bool:
        """True while the tail of a frame started by :meth:`send_nowait` is still unsent."""
        return self._owed is not None

    async def flush(self) -> None:
        """Send what :meth:`send_nowait` left unsent. Raises StreamBroken."""
        async with self._send_lock:
            await self._pay_owed()

    async def _pay_owed(self) -> None:
        if self._owed is not None:
            await self.stream.send_all(self._owed)
            self._owed = None

    async def receive(self, *, read_ahead: bool = True) -> Message:
        """Receive the next message.

        Args:
            read_ahead: read as much as the transport has (fewer reads); False: read no byte past this
                frame (two reads: its length, then the rest), for raw bytes that follow it and that the
                caller reads in place (:meth:`receive_raw_into`) instead of copying them out of the
                buffer.

        Raises:
            StreamBroken: the stream broke or closed (EOF between frames included).
            RemoteProtocolError: the peer sent something malformed.
        """
        while True:
            try:
                payload = self._framer.next_frame()
            except RemoteProtocolError as exc:
                foreign = foreign_protocol(self._head) if self._frames == 0 else None
                if foreign is not None:
                    raise RemoteProtocolError(f"{exc.message} ({foreign})") from None
                raise
            if payload is not None:
                self._frames += 1
                self._release()
                # The framer already ran the limits' size check on the frame's head.
                try:
                    if self.limits is None:
                        return decode(payload)
                    return decode(payload, unpack_limits=self.limits.unpack_for(payload[1]))
                except RemoteProtocolError as exc:
                    foreign = foreign_protocol(self._head) if self._frames == 1 else None
                    if foreign is None:
                        raise
                    raise RemoteProtocolError(f"{exc.message} ({foreign})") from None
            if self._framer.at_eof:
                raise StreamBroken(CLOSED_BY_PEER)
            self._check_large()
            if self._reserved:
                with trio.move_on_at(self._reserved_until):
                    data = await self.stream.receive_some(self._read_size(read_ahead))
                    self._framer.feed(data)
                    continue
                assert self.guard is not None
                raise RemoteProtocolError(
                    f"a {self._reserved}-byte frame did not arrive whole within {self.guard.deadline:g}s"
                )
            data = await self.stream.receive_some(self._read_size(read_ahead))
            if len(self._head) < 5:
                self._head += data[: 5 - len(self._head)]
            self._framer.feed(data)

    def _read_size(self, read_ahead: bool) -> int:
        if read_ahead:
            return _RECV_SIZE
        length = self._framer.pending_length()
        want = HEADER_SIZE if length is None else HEADER_SIZE + length
        return max(1, min(want - self._framer.buffered, _RECV_SIZE))

    def take_buffered(self, n: int) -> bytes:
        """Up to ``n`` raw bytes after the last frame that this stream already read off the
        transport (the rest is still in the transport): for a reader that takes the raw bytes
        from here on itself."""
        return self._framer.take_buffered(n)

    async def receive_raw_into(self, buf: memoryview) -> None:
        """Fill ``buf`` with raw bytes that follow the last frame."""
        pre = self._framer.take_buffered(len(buf))
        if pre:
            buf[: len(pre)] = pre
        if len(pre) < len(buf):
            await receive_exactly_into(self.stream, buf[len(pre) :])

    async def aclose(self) -> None:
        """Close the underlying stream (and give back what the guard reserved)."""
        self._release()
        await self.stream.aclose()


def expect(msg: Message, cls: type[Message]) -> Message:
    """Raise RemoteProtocolError unless ``msg`` is a ``cls``."""
    if not isinstance(msg, cls):
        raise RemoteProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg
