"""The transport seam: everything that opens or accepts a connection goes through here.

Production uses :class:`TcpTransport` (trio sockets, TCP_NODELAY, ``recv_into`` for zero-copy
receives). Between processes of one host it takes a shortcut: every TCP listener also listens on a Unix
socket named after its address, and a connection to an address of this host goes there (the same bytes,
half the kernel's work; docs/transport.md "Same-host connections"). ``pccl.testing`` provides an
in-memory network implementing the same :class:`Transport` protocol, driven by trio's clock.

Every I/O failure surfaces as :class:`StreamBroken` (or its subclass :class:`ConnectFailed`), so
layers above never see raw ``OSError`` / ``trio.BrokenResourceError``.

:class:`TlsTransport` wraps any transport in TLS (``trio.SSLStream``; see :mod:`pccl._tls` for the
contexts and docs/security.md "TLS").
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import os as _os
import socket as _stdsocket
import ssl
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import trio

from . import _tls
from ._env import local_sockets_enabled

Address = tuple[str, int]

log = logging.getLogger("pccl.transport")

# Largest slice handed to one send()/recv_into() syscall: big enough to amortize the syscall,
# small enough that trio gets to schedule other tasks between slices.
_IO_SLICE = 4 * 1024 * 1024
_MSG_NOSIGNAL = getattr(_stdsocket, "MSG_NOSIGNAL", 0)
_MSG_PEEK_DONTWAIT = _stdsocket.MSG_PEEK | getattr(_stdsocket, "MSG_DONTWAIT", 0)
_R = TypeVar("_R")
# SO_MAX_PACING_RATE (Linux; Python's socket module does not name it): the most bytes per second the
# kernel sends on this socket, spread packet by packet (TCP's own pacing, no qdisc needed).
_SO_MAX_PACING_RATE: int | None = getattr(_stdsocket, "SO_MAX_PACING_RATE",
                                          47 if sys.platform.startswith("linux") else None)
# TCP_NOTSENT_LOWAT (Linux 25, macOS 0x201): a socket takes writes only while fewer bytes than this wait
# unsent in its buffer.
_TCP_NOTSENT_LOWAT: int | None = getattr(_stdsocket, "TCP_NOTSENT_LOWAT",
                                         25 if sys.platform.startswith("linux") else None)


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
    """A :class:`Stream` over a connected trio socket: TCP, or the Unix socket of the same-host shortcut
    (:class:`TcpTransport`), which then reports the TCP addresses it stands for.

    Args:
        sock: the connected socket.
        peer: the other side's address (default: the socket's own, for TCP).
        local: this side's address (default: the socket's own, for TCP).
    """

    def __init__(
        self, sock: trio.socket.SocketType, *, peer: Address | None = None, local: Address | None = None
    ) -> None:
        self._sock = sock
        self._unix = _AF_UNIX is not None and getattr(sock, "family", None) == _AF_UNIX
        if not self._unix:
            try:
                sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - platform dependent
                pass
        elif _LOCAL_SNDBUF:
            try:
                sock.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_SNDBUF, _LOCAL_SNDBUF)
            except OSError:  # pragma: no cover - platform dependent
                pass
        self._peer = peer if peer is not None else _addr(sock.getpeername())
        self._local = local if local is not None else _addr(sock.getsockname())
        self._closed = False
        self._raw: _stdsocket.socket | None = None  # created by the first try_send
        self._peer_gone = False  # a send met the other side's close (Unix sockets: _last_words_pending)

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

    @property
    def same_host(self) -> bool:
        """True when this connection takes the same-host shortcut (a Unix socket, not TCP)."""
        return self._unix

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
        except OSError as exc:
            if self._last_words_pending(exc):
                return
            raise StreamBroken(f"send to {self._peer} failed: {exc}") from exc
        except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            raise StreamBroken(f"send to {self._peer} failed: {exc}") from exc

    def try_send(self, data: bytes | bytearray | memoryview) -> int:
        """Send what the socket buffer takes now, without waiting; returns the byte count (0 when
        it is full). Raises StreamBroken."""
        try:
            return self._raw_socket().send(data, _MSG_NOSIGNAL)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if self._last_words_pending(exc):
                return len(memoryview(data).cast("B"))
            raise StreamBroken(f"send to {self._peer} failed: {exc}") from exc

    def _last_words_pending(self, exc: OSError) -> bool:
        """Whether a failed send should look sent, once, as over TCP: a Unix socket fails a send at
        once (EPIPE) when the other side has closed, while TCP takes that first send and fails later
        ones. Over TCP the other side's last words (a ``Refused`` with its reason, a TLS alert) are then
        read by the receive that follows; over a Unix socket they are still queued, so the first send
        that meets the close is taken as sent when something is left to read, and the receive reads
        it, then the end of the stream."""
        if not self._unix or self._peer_gone or exc.errno not in (errno.EPIPE, errno.ECONNRESET):
            return False
        self._peer_gone = True
        try:
            return bool(self._raw_socket().recv(1, _MSG_PEEK_DONTWAIT))
        except OSError:
            return False

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
        via = " (unix)" if self._unix else ""
        return f"<TcpStream {self._local} -> {self._peer}{via}{' closed' if self._closed else ''}>"


def limit_send_rate(stream: Stream, rate: float) -> bool:
    """Ask the kernel to send at most ``rate`` bytes per second on ``stream``'s TCP socket, paced packet
    by packet (Linux ``SO_MAX_PACING_RATE``; a TLS stream's TCP socket below it). What serving a heal
    sets on its connections under ``PeerConfig.state_serve_rate``, so that not even a piece of a chunk
    leaves as a burst. Best effort: False (nothing set) elsewhere, on a same-host Unix socket, on the
    virtual network, or when the kernel refuses."""
    while isinstance(stream, TlsStream):
        stream = stream.inner
    if _SO_MAX_PACING_RATE is None or not isinstance(stream, TcpStream) or stream.same_host:
        return False
    try:
        stream.socket.setsockopt(_stdsocket.SOL_SOCKET, _SO_MAX_PACING_RATE,
                                 max(1, min(int(rate), 0xFFFF_FFFE)))
    except OSError as exc:
        log.debug("SO_MAX_PACING_RATE refused on %s: %s", stream, exc)
        return False
    return True


def limit_unsent(stream: Stream, nbytes: int) -> bool:
    """Let at most about ``nbytes`` wait unsent in ``stream``'s TCP send buffer (``TCP_NOTSENT_LOWAT``:
    a write waits while that many are queued; a TLS stream's TCP socket below it). What serving a heal
    sets on its connections, so that when the pace drops (a collective of this peer starts,
    :mod:`pccl.peer.ratecap`) little of ours is already queued ahead of it. Best effort: False (nothing
    set) where there is no TCP socket, on a same-host Unix socket, or when the kernel refuses."""
    while isinstance(stream, TlsStream):
        stream = stream.inner
    if _TCP_NOTSENT_LOWAT is None or not isinstance(stream, TcpStream) or stream.same_host:
        return False
    try:
        stream.socket.setsockopt(_stdsocket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, max(1, int(nbytes)))
    except OSError as exc:
        log.debug("TCP_NOTSENT_LOWAT refused on %s: %s", stream, exc)
        return False
    return True


class TcpListener:
    """A :class:`Listener` over a trio TCP listening socket and, when the transport takes the same-host
    shortcut, the Unix sockets named after the addresses it is reached at (:func:`local_socket_name`).

    Args:
        sock: the TCP listening socket.
        local: the shortcut's listening Unix sockets, each with the IPv4 address it is named after:
            the one a same-host connection to it dialled, and so where a TCP connection would have come
            from.
    """

    def __init__(
        self, sock: trio.socket.SocketType, local: Sequence[tuple[trio.socket.SocketType, str]] = ()
    ) -> None:
        self._sock = sock
        self._address = _addr(sock.getsockname())
        self._local = {unix: ip for unix, ip in local}

    @property
    def address(self) -> Address:
        return self._address

    @property
    def same_host(self) -> bool:
        """True when this listener also accepts the same-host shortcut's Unix connections."""
        return bool(self._local)

    @property
    def same_host_addresses(self) -> list[str]:
        """The addresses whose same-host connections this listener accepts over a Unix socket."""
        return sorted(self._local.values())

    async def accept(self) -> Stream:
        while True:
            sock = await self._readable() if self._local else self._sock
            try:
                conn, _ = await sock.accept()
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
                ip = self._local.get(sock)
                if ip is not None:
                    return TcpStream(conn, peer=(ip, 0), local=(ip, self._address[1]))
                return TcpStream(conn)
            except OSError:
                conn.close()
                continue

    async def _readable(self) -> trio.socket.SocketType:
        """The first listening socket with a connection waiting (or closed: its accept then says so)."""
        ready: list[trio.socket.SocketType] = []
        async with trio.open_nursery() as nursery:

            async def wait(sock: trio.socket.SocketType) -> None:
                try:
                    await trio.lowlevel.wait_readable(sock)
                except (trio.ClosedResourceError, OSError):
                    pass  # closed: accept() reports it
                ready.append(sock)
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait, self._sock)
            for unix in self._local:
                nursery.start_soon(wait, unix)
        return ready[0]

    async def aclose(self) -> None:
        self._sock.close()
        for unix in self._local:
            unix.close()
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        return f"<TcpListener {self._address}{' (+unix)' if self._local else ''}>"


class TcpTransport:
    """Real TCP via trio sockets, with a shortcut between processes of one host.

    The shortcut (Linux): every listener on an IPv4 address also listens on the Unix socket
    :func:`local_socket_name` names after that address, in the abstract namespace (no file; it goes
    with the socket and, like the port, belongs to the network namespace). A connection to an
    address of this host goes to that socket when a listener of this user holds it (checked with
    ``SO_PEERCRED``), and over TCP otherwise. The bytes are the same (handshake, secret, TLS,
    frames); the kernel's work per byte and per wake-up is about half of loopback TCP's
    (docs/transport.md "Same-host connections").

    Args:
        connect_timeout: bound on a TCP connect.
        backlog: listen backlog.
        same_host: take the shortcut; None: unless ``$PCCL_LOCAL_SOCKETS`` is ``0``.
    """

    def __init__(
        self, *, connect_timeout: float = 5.0, backlog: int = 1024, same_host: bool | None = None
    ) -> None:
        self.connect_timeout = connect_timeout
        self.backlog = backlog
        wanted = local_sockets_enabled() if same_host is None else same_host
        self.same_host = wanted and _LOCAL_SOCKETS

    async def connect(self, host: str, port: int) -> Stream:
        if self.same_host:
            local = self._connect_local(host, port)
            if local is not None:
                await trio.lowlevel.checkpoint()
                return local
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

    def _connect_local(self, host: str, port: int) -> TcpStream | None:
        """A connected same-host stream to the listener of ``host:port``, or None (not this host, no
        such listener, its backlog full, or a listener of another user: TCP decides then)."""
        ip = _local_ip(host)
        if ip is None:
            return None
        assert _AF_UNIX is not None
        try:
            sock = _unix_socket()
        except OSError:  # no descriptor left, or Unix sockets forbidden here: TCP says what it can
            return None
        try:
            sock.setblocking(False)
            # Immediate on a Unix socket: refused (no such listener), EAGAIN (its backlog is full) or done.
            sock.connect(local_socket_name(ip, port))
            if not _same_user(sock):
                log.warning("not taking the same-host shortcut to %s:%d: its Unix socket belongs to another "
                            "user (connecting over TCP)", host, port)
                sock.close()
                return None
            log.debug("connected to %s:%d over the same-host shortcut", host, port)
            return TcpStream(trio.socket.from_stdlib_socket(sock), peer=(ip, port), local=(ip, 0))
        except OSError:
            sock.close()
            return None

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
        local = await self._listen_local(sock) if self.same_host and family == _stdsocket.AF_INET else []
        return TcpListener(sock, local)

    async def _listen_local(self, tcp: trio.socket.SocketType) -> list[tuple[trio.socket.SocketType, str]]:
        """The Unix listening sockets of ``tcp``'s shortcut: one named after its address, or for a
        wildcard listener one per IPv4 address of this host. A name already taken is logged and left
        out (connections to that address then come over TCP)."""
        ip, port = _addr(tcp.getsockname())
        assert _AF_UNIX is not None
        local: list[tuple[trio.socket.SocketType, str]] = []
        for address in host_addresses() if ip == _WILDCARD else [ip]:
            try:
                sock = trio.socket.from_stdlib_socket(_unix_socket())
            except OSError as exc:
                log.warning("no same-host shortcut for the listener on %s:%d (%s): connections come over "
                            "TCP", ip, port, exc.strerror or exc)
                break
            try:
                await sock.bind(local_socket_name(address, port))  # abstract: no file in the file system
                sock.listen(self.backlog)
            except OSError as exc:
                sock.close()
                log.warning("no same-host shortcut for the listener on %s:%d through %s (%s): connections "
                            "to %s:%d come over TCP", ip, port, address, exc.strerror or exc, address, port)
                continue
            local.append((sock, address))
        return local

    def __repr__(self) -> str:
        return f"<TcpTransport{' (same-host shortcut)' if self.same_host else ''}>"


# --------------------------------------------------------------------------------------------
# Same-host shortcut

_AF_UNIX: Any = getattr(_stdsocket, "AF_UNIX", None)
# Abstract Unix socket names and SO_PEERCRED are Linux's.
_LOCAL_SOCKETS = (
    _AF_UNIX is not None and sys.platform.startswith("linux") and hasattr(_stdsocket, "SO_PEERCRED")
)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_WILDCARD = "0.0.0.0"  # a listener on every address: one Unix socket per address of the host
_LOOPBACK = "127.0.0.1"
# SO_SNDBUF of a same-host connection. A Unix socket's sender may queue only this much (the kernel's
# default, 208 KiB, means five wake-ups per MiB frame) and epoll ignores SO_RCVLOWAT on it; 1 MiB measured
# best on loopback (docs/transport.md "Same-host connections"). The kernel caps it at net.core.wmem_max.
_LOCAL_SNDBUF = 1 << 20
_local_addresses: dict[str, bool] = {}


def local_socket_name(ip: str, port: int) -> bytes:
    """The abstract Unix socket name of the same-host shortcut of a TCP listener on ``ip:port``."""
    return f"\0pccl-tcp/{ip}/{port}".encode()


def host_addresses() -> list[str]:
    """This host's IPv4 addresses (its network namespace's, from the kernel's local routes in
    ``/proc/net/fib_trie``), 127.0.0.1 always among them: what a wildcard listener is reached at."""
    found = {_LOOPBACK}
    try:
        # procfs is generated in memory: this read never waits on a disk (called once per listen).
        with open("/proc/net/fib_trie", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return sorted(found)
    for before, line in itertools.pairwise(lines):
        # "  |-- 192.0.2.2" then "     /32 host LOCAL": an address of one of this host's interfaces
        if line.strip() == "/32 host LOCAL" and "-- " in before:
            try:
                found.add(str(ipaddress.IPv4Address(before.rsplit("-- ", 1)[1].strip())))
            except ValueError:
                continue
    return sorted(found)


def _local_ip(host: str) -> str | None:
    """``host`` as an IPv4 address of this host (its network namespace), or None."""
    if host == "localhost":
        return _LOOPBACK
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        return None  # a name (resolved by TCP) or IPv6: no shortcut
    text = str(ip)
    if ip.is_loopback:
        return text
    known = _local_addresses.get(text)
    if known is None:
        # An address of this host's own interfaces is one a socket can bind to.
        try:
            probe = _stdsocket.socket(_stdsocket.AF_INET, _stdsocket.SOCK_DGRAM)
        except OSError:  # no descriptor left: TCP decides (and the next connect asks again)
            return None
        try:
            probe.bind((text, 0))
            known = True
        except OSError:
            known = False
        finally:
            probe.close()
        _local_addresses[text] = known
    return text if known else None


def _unix_socket() -> _stdsocket.socket:
    """A new Unix stream socket. Raises OSError (no descriptor left, or Unix sockets not allowed here)."""
    return _stdsocket.socket(_AF_UNIX, _stdsocket.SOCK_STREAM)


def _same_user(sock: _stdsocket.socket) -> bool:
    """Whether the process holding the other end of a connected Unix socket runs as this user."""
    try:
        _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_PEERCRED,
                                                        _UCRED.size))
    except OSError:
        return False
    return bool(uid == _os.geteuid())


# --------------------------------------------------------------------------------------------
# TLS

# Plaintext bytes handed to one SSLStream.send_all: it encrypts all it is given in one synchronous
# call, so a 64 MB frame would hold the event loop (and a 64 MB ciphertext copy) at once.
_TLS_SEND_SLICE = 256 * 1024
# Ciphertext bytes asked of the inner stream per refill of the TLS receive buffer.
_TLS_READ = 256 * 1024
# How long a failed handshake's alert may take to leave (it is a few bytes; the socket takes it at once).
_ALERT_TIMEOUT = 1.0


class _TrioSide(trio.abc.Stream):
    """A pccl :class:`Stream` seen as a ``trio.abc.Stream``, the kind ``trio.SSLStream`` runs over
    (errors pass through unchanged: :class:`StreamBroken`)."""

    def __init__(self, inner: Stream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.inner.receive_some(_TLS_READ if max_bytes is None else max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


class TlsStream:
    """A :class:`Stream` speaking TLS over another stream (``trio.SSLStream``).

    It has no ``socket`` and no ``try_send``: everything goes through the TLS layer, so the P2P pool
    uses its generic connection path, never the TCP fast path that drives the raw socket.

    Closing does not send a TLS close_notify (``https_compatible``): a close must never wait for the
    other side (or run a handshake on a connection that never had one, as a refused one), and the
    framing on top already tells a truncated frame from a clean end between frames.

    Args:
        inner: the stream the TLS records travel on.
        context: the SSL context (:func:`pccl._tls.server_context` / :func:`pccl._tls.client_context`).
        server_side: True on the accepting side.
        server_hostname: the name to check the other side's certificate against (connecting side, when
            the context checks names).
    """

    def __init__(
        self,
        inner: Stream,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        self.inner = inner
        self._ssl = trio.SSLStream(_TrioSide(inner), context, server_side=server_side,
                                   server_hostname=server_hostname, https_compatible=True)
        self._shaken = False
        self._failed: str | None = None
        self._lock = trio.Lock()
        self._server_side = server_side
        self._received = False  # any data received after the handshake
        # The SSL object inside trio.SSLStream, for _drain_into (None if a trio version moved it: then
        # every record takes one SSLStream call, which works, slower).
        obj = getattr(self._ssl, "_ssl_object", None)
        self._obj: ssl.SSLObject | None = obj if isinstance(obj, ssl.SSLObject) else None

    @property
    def peer_address(self) -> Address:
        return self.inner.peer_address

    @property
    def local_address(self) -> Address:
        return self.inner.local_address

    @property
    def handshake_done(self) -> bool:
        """True once the TLS handshake has succeeded."""
        return self._shaken

    def _where(self) -> str:
        try:
            host, port = self.inner.peer_address
        except Exception:  # an exotic stream: the message must not fail
            return "the other side"
        return f"{host}:{port}"

    async def handshake(self) -> None:
        """Run the TLS handshake now (else the first send or receive runs it). The caller bounds it
        with a timeout. Concurrent callers wait for the one running it; once it failed, every call
        fails the same way.

        Raises:
            StreamBroken: the handshake failed (the message says why: untrusted certificate, wrong
                name, no certificate, not TLS on the other side...).
        """
        if self._shaken:
            await trio.lowlevel.checkpoint()
            return
        async with self._lock:
            if self._failed is not None:
                raise StreamBroken(self._failed)
            if self._shaken:
                return
            try:
                await self._ssl.do_handshake()
            except (trio.BrokenResourceError, trio.ClosedResourceError, StreamBroken) as exc:
                self._failed = f"TLS handshake with {self._where()} failed: {_tls.reason(exc)}"
                await self._send_alert()
                raise StreamBroken(self._failed) from None
            except BaseException:  # cancelled meanwhile: the SSL stream is unusable now
                self._failed = f"TLS handshake with {self._where()} was interrupted"
                raise
            self._shaken = True

    async def _send_alert(self) -> None:
        """Send the TLS alert a failed handshake left unsent, so that the other side learns why (an
        unknown CA, no certificate...) instead of seeing the connection close. trio.SSLStream keeps it
        in its outgoing buffer when the handshake raises; best effort (skipped if that buffer moved)."""
        bio = getattr(self._ssl, "_outgoing", None)
        alert = bio.read() if isinstance(bio, ssl.MemoryBIO) else b""
        if alert:
            with trio.move_on_after(_ALERT_TIMEOUT):
                try:
                    await self.inner.send_all(alert)
                except StreamBroken:
                    pass

    def _broken(self, exc: BaseException, what: str) -> StreamBroken:
        if isinstance(exc, StreamBroken):
            return exc
        return StreamBroken(f"TLS {what} {self._where()} failed: {_tls.reason(exc)}")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if not self._shaken:
            await self.handshake()
        view = memoryview(data).cast("B")
        try:
            if len(view) <= _TLS_SEND_SLICE:
                await self._ssl.send_all(view)
                return
            for start in range(0, len(view), _TLS_SEND_SLICE):
                await self._ssl.send_all(view[start : start + _TLS_SEND_SLICE])
        except (trio.BrokenResourceError, trio.ClosedResourceError, StreamBroken) as exc:
            raise self._broken(exc, "send to") from None

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        if not self._shaken:
            await self.handshake()
        try:
            data = bytes(await self._ssl.receive_some(max_bytes))
        except (trio.BrokenResourceError, trio.ClosedResourceError, StreamBroken) as exc:
            if self._received or self._server_side or _tls.is_alert(exc):
                raise self._broken(exc, "receive from") from None
            data = b""  # reset before any data: said below
        if not data and not self._received and not self._server_side:
            # TLS 1.3: a client's handshake ends before the listener has checked its certificate, so
            # a refusal arrives as an alert or, when it was lost, as a close before any data.
            raise StreamBroken(
                f"{self._where()} closed the connection right after the TLS handshake: it may have "
                "refused this side's certificate (its log says why)"
            )
        self._received = True
        return data

    async def receive_into(self, buf: memoryview) -> int:
        data = await self.receive_some(len(buf))
        n = len(data)
        buf[:n] = data
        if n and n < len(buf) and self._obj is not None:
            n += self._drain_into(buf[n:])
        return n

    def _drain_into(self, buf: memoryview) -> int:
        """Decrypt, without waiting, what the TLS layer already holds, straight into ``buf``.

        trio.SSLStream returns at most one TLS record (16 KiB) per call, with a scheduler pass each:
        on bulk data that per-record cost, not the cipher, is most of TLS's price. The records it has
        already read sit decrypted-to-be in its SSL object; reading them here, in one go, is what its own
        next calls would do, minus the passes. Only called between SSLStream calls of this (the one)
        receiving task, so the SSL object is not in use; anything that is not plain data (a close, an
        error, a want-read) ends the drain and is left for the next SSLStream call to meet again.
        """
        obj = self._obj
        assert obj is not None
        got = 0
        while got < len(buf):
            try:
                # With a buffer, read returns the byte count (typeshed says bytes).
                k = cast(int, obj.read(len(buf) - got, buf[got:]))
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLError, OSError):
                break  # the next receive meets it through SSLStream, which then marks the stream broken
            if k <= 0:
                break
            got += k
        return got

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            try:
                await self._ssl.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, StreamBroken):
                pass

    def __repr__(self) -> str:
        return f"<TlsStream over {self.inner!r}{'' if self._shaken else ' (no handshake yet)'}>"


class TlsListener:
    """A :class:`Listener` handing out :class:`TlsStream` s. Their handshake runs on their first receive
    (or an explicit :meth:`TlsStream.handshake`) in the connection's own task, under its hello timeout,
    never in the accept loop."""

    def __init__(self, inner: Listener, context: ssl.SSLContext) -> None:
        self.inner = inner
        self.context = context

    @property
    def address(self) -> Address:
        return self.inner.address

    async def accept(self) -> Stream:
        return TlsStream(await self.inner.accept(), self.context, server_side=True)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __repr__(self) -> str:
        return f"<TlsListener {self.inner!r}>"


class TlsTransport:
    """TLS over another :class:`Transport` (TCP, or ``pccl.testing``'s virtual network).

    Args:
        inner: the transport the TLS records travel on.
        server_context: the context of listeners (None: this transport only connects).
        client_context: the context of outgoing connections (None: this transport only listens).
        handshake_timeout: bound on an outgoing connection's TLS handshake (after ``inner.connect``).
        server_name: the name an outgoing connection checks the certificate against when the client
            context checks names; None: the host dialled.
    """

    def __init__(
        self,
        inner: Transport,
        *,
        server_context: ssl.SSLContext | None,
        client_context: ssl.SSLContext | None,
        handshake_timeout: float = 5.0,
        server_name: str | None = None,
    ) -> None:
        self.inner = inner
        self.server_context = server_context
        self.client_context = client_context
        self.handshake_timeout = handshake_timeout
        self.server_name = server_name

    async def connect(self, host: str, port: int) -> Stream:
        """Connect and run the TLS handshake.

        Raises:
            ConnectFailed: the connect failed, or the handshake failed or timed out (the message says
                why).
        """
        ctx = self.client_context
        if ctx is None:
            raise ConnectFailed("this TLS transport cannot connect (no client context)")
        stream = await self.inner.connect(host, port)
        name = (self.server_name or host) if ctx.check_hostname else None
        tls = TlsStream(stream, ctx, server_side=False, server_hostname=name)
        try:
            with trio.fail_after(self.handshake_timeout):
                await tls.handshake()
        except trio.TooSlowError:
            await tls.aclose()
            raise ConnectFailed(
                f"TLS handshake with {host}:{port} timed out after {self.handshake_timeout}s"
            ) from None
        except StreamBroken as exc:
            await tls.aclose()
            raise ConnectFailed(str(exc)) from None
        except BaseException:
            await tls.aclose()
            raise
        return tls

    async def listen(self, host: str, port: int) -> Listener:
        """Listen on ``inner``; accepted streams speak TLS.

        Raises:
            ConnectFailed: the address cannot be bound, or this transport has no server context.
        """
        if self.server_context is None:
            raise ConnectFailed("this TLS transport cannot listen (no server context)")
        return TlsListener(await self.inner.listen(host, port), self.server_context)

    def __repr__(self) -> str:
        return f"<TlsTransport over {self.inner!r}>"
