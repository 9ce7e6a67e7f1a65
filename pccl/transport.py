"""The transport seam: everything that opens or accepts a connection goes through here.

Production uses :class:`TcpTransport` (trio sockets, TCP_NODELAY, ``recv_into`` for zero-copy
receives). ``pccl.testing`` provides an in-memory network implementing the same
:class:`Transport` protocol, driven by trio's clock.

Every I/O failure surfaces as :class:`StreamBroken` (or its subclass :class:`ConnectFailed`), so
layers above never see raw ``OSError`` / ``trio.BrokenResourceError``.
"""

from __future__ import annotations

import errno
import os as _os
import socket as _stdsocket
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import trio

Address = tuple[str, int]

# Largest slice handed to one send()/recv_into() syscall: big enough to amortize the syscall,
# small enough that trio gets to schedule other tasks between slices.
_IO_SLICE = 4 * 1024 * 1024
_MSG_NOSIGNAL = getattr(_stdsocket, "MSG_NOSIGNAL", 0)
_R = TypeVar("_R")


class StreamBroken(Exception):
    """The connection failed, was reset, or was closed (locally or by the other side)."""


class ConnectFailed(StreamBroken):
    """A connection could not be opened."""


class AcceptExhausted(StreamBroken):
    """``accept`` failed for want of a resource (EMFILE, ENFILE, ENOBUFS, ENOMEM); the listener is fine
    and accepting again later may succeed (see :func:`pccl._accept.accept_loop`)."""


@runtime_checkable
class Stream(Protocol):
    """A reliable, ordered byte stream.

    Concurrency rule: at most one task sends and at most one task receives at a time (callers
    serialize with locks); sending and receiving may happen concurrently.
    """

    @property
    def peer_address(self) -> Address:
        """(host, port) of the other side, as seen by this side."""
        ...

    @property
    def local_address(self) -> Address:
        """(host, port) of this side of the connection."""
        ...

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send every byte of ``data``. Raises StreamBroken."""
        ...

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        """Receive 1..max_bytes bytes; ``b""`` means the other side closed cleanly."""
        ...

    # Optional: ``def try_send(self, data) -> int`` sends, without waiting, what the connection
    # takes at once and returns how many bytes that was (0 when it is busy or full; StreamBroken
    # when it failed). Both built-in transports have it; a custom transport without it works, it
    # only forgoes the immediate send (see MessageStream.send_nowait).

    async def receive_into(self, buf: memoryview) -> int:
        """Receive up to ``len(buf)`` bytes into ``buf``; 0 means EOF. Raises StreamBroken."""
        ...

    async def aclose(self) -> None:
        """Close the stream; pending operations in other tasks fail with StreamBroken."""
        ...


@runtime_checkable
class Listener(Protocol):
    """Accepts incoming streams."""

    @property
    def address(self) -> Address:
        """The bound (host, port); port is the real one even when 0 was asked for."""
        ...

    async def accept(self) -> Stream:
        """Wait for the next connection. Raises StreamBroken once closed."""
        ...

    async def aclose(self) -> None:
        """Stop listening."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Factory for outgoing and listening endpoints."""

    async def connect(self, host: str, port: int) -> Stream:
        """Open a stream to (host, port). Raises ConnectFailed."""
        ...

    async def listen(self, host: str, port: int) -> Listener:
        """Listen on (host, port); port 0 lets the system choose. Raises ConnectFailed."""
        ...


async def receive_exactly_into(stream: Stream, buf: memoryview) -> None:
    """Fill ``buf`` completely from ``stream``.

    Raises:
        StreamBroken: on EOF before ``buf`` is full, or any I/O failure.
    """
    got = 0
    n = len(buf)
    while got < n:
        k = await stream.receive_into(buf[got:])
        if k == 0:
            raise StreamBroken(f"connection closed after {got} of {n} bytes")
        got += k


# --------------------------------------------------------------------------------------------
# TCP


def _os_reason(exc: OSError) -> str:
    """The reason of a failed connect in words: trio's "all attempts to connect failed" hides the
    per-address errors in its cause; name them (``Connection refused``) instead."""
    cause = exc.__cause__
    if exc.strerror is None and isinstance(cause, BaseExceptionGroup):
        reasons = sorted({getattr(e, "strerror", None) or str(e) for e in cause.exceptions})
        if reasons:
            return "; ".join(reasons)
    return exc.strerror or str(exc)


def _addr(sockaddr: object) -> Address:
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        return (str(sockaddr[0]), int(sockaddr[1]))
    return ("", 0)


class TcpStream:
    """A :class:`Stream` over a connected trio TCP socket."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock
        try:
            sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
        except OSError:  # pragma: no cover - platform dependent
            pass
        self._peer = _addr(sock.getpeername())
        self._local = _addr(sock.getsockname())
        self._closed = False
        self._raw: _stdsocket.socket | None = None  # created by the first try_send

    @property
    def peer_address(self) -> Address:
        return self._peer

    @property
    def local_address(self) -> Address:
        return self._local

    @property
    def socket(self) -> trio.socket.SocketType:
        """The underlying trio socket (for socket options such as SO_RCVLOWAT)."""
        return self._sock

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        total = len(view)
        sent = 0
        try:
            if total == 0:
                await trio.lowlevel.checkpoint()
                return
            while sent < total:
                sent += await self._sock.send(view[sent : sent + _IO_SLICE])
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            raise StreamBroken(f"send to {self._peer} failed: {exc}") from exc

    def try_send(self, data: bytes | bytearray | memoryview) -> int:
        """Send what the socket buffer takes now, without waiting; returns the byte count (0 when
        it is full). Raises StreamBroken."""
        try:
            return self._raw_socket().send(data, _MSG_NOSIGNAL)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise StreamBroken(f"send to {self._peer} failed: {exc}") from exc

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        return await self._receive(_stdsocket.socket.recv, max_bytes)

    async def receive_into(self, buf: memoryview) -> int:
        return await self._receive(
            _stdsocket.socket.recv_into, buf[:_IO_SLICE] if len(buf) > _IO_SLICE else buf
        )

    async def _receive(self, fn: Callable[[_stdsocket.socket, Any], _R], arg: Any) -> _R:
        """``fn(sock, arg)`` once data is there. Like trio's socket methods it is a checkpoint, with
        one pass less: when it had to wait for data, the wait was its schedule point, so it returns
        as soon as the data is read instead of yielding again (an idle peer's next message is
        handled one scheduler pass sooner; a busy stream still yields on every call)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            raw = self._raw_socket()
            try:
                result = fn(raw, arg)
            except BlockingIOError:
                pass
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return result
            while True:
                await trio.lowlevel.wait_readable(self._sock)
                try:
                    return fn(raw, arg)
                except BlockingIOError:
                    pass
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            raise StreamBroken(f"receive from {self._peer} failed: {exc}") from exc

    def _raw_socket(self) -> _stdsocket.socket:
        """A private non-blocking dup of the socket for direct syscalls (trio waits on its own fd,
        which ``trio.socket`` closes with notify_closing). Raises OSError."""
        if self._closed:
            raise OSError(errno.EBADF, "stream closed")
        raw = self._raw
        if raw is None:
            raw = self._raw = _stdsocket.socket(fileno=_os.dup(self._sock.fileno()))
            raw.setblocking(False)
        return raw

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._raw is not None:
                self._raw.close()
            self._sock.close()
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        return f"<TcpStream {self._local} -> {self._peer}{' closed' if self._closed else ''}>"


class TcpListener:
    """A :class:`Listener` over a trio TCP listening socket."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock
        self._address = _addr(sock.getsockname())

    @property
    def address(self) -> Address:
        return self._address

    async def accept(self) -> Stream:
        while True:
            try:
                sock, _ = await self._sock.accept()
            except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
                raise StreamBroken("listener closed") from exc
            except OSError as exc:
                # Transient per-connection errors (e.g. the client reset before we accepted) must not
                # kill the accept loop.
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.ECONNRESET):
                    continue
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise AcceptExhausted(f"accept failed: {exc}") from exc
                raise StreamBroken(f"accept failed: {exc}") from exc
            try:
                return TcpStream(sock)
            except OSError:
                sock.close()
                continue

    async def aclose(self) -> None:
        self._sock.close()
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        return f"<TcpListener {self._address}>"


class TcpTransport:
    """Real TCP via trio sockets."""

    def __init__(self, *, connect_timeout: float = 5.0, backlog: int = 1024) -> None:
        self.connect_timeout = connect_timeout
        self.backlog = backlog

    async def connect(self, host: str, port: int) -> Stream:
        try:
            with trio.fail_after(self.connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError as exc:
            raise ConnectFailed(f"connect to {host}:{port} timed out after {self.connect_timeout}s") from exc
        except OSError as exc:
            raise ConnectFailed(f"connect to {host}:{port} failed: {_os_reason(exc)}") from exc
        try:
            return TcpStream(stream.socket)
        except OSError as exc:
            # Reset right after the connect (e.g. the master was killed as it accepted): getpeername()
            # fails with ENOTCONN. A failed connect, not a crash of the caller.
            stream.socket.close()
            raise ConnectFailed(f"connect to {host}:{port} failed: {_os_reason(exc)}") from exc

    async def listen(self, host: str, port: int) -> Listener:
        family = _stdsocket.AF_INET6 if ":" in host else _stdsocket.AF_INET
        sock = trio.socket.socket(family, _stdsocket.SOCK_STREAM)
        try:
            sock.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_REUSEADDR, 1)
            await sock.bind((host, port))
            sock.listen(self.backlog)
        except OSError as exc:
            sock.close()
            raise ConnectFailed(f"cannot listen on {host}:{port}: {exc}") from exc
        return TcpListener(sock)

    def __repr__(self) -> str:
        return "<TcpTransport>"
