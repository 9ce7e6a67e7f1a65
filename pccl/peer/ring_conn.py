"""One connection of the ring pool (:mod:`pccl.peer.pool`) and how its bytes move.

:class:`Conn` works on any :class:`~pccl.transport.Stream`; :class:`SocketConn` is the fast path on a
:class:`~pccl.transport.TcpStream` (TCP, or the Unix socket of its same-host shortcut, docs/transport.md):
it drives a private ``dup`` of the socket with non-blocking ``sendmsg``/``recv_into`` and waits with
``trio.lowlevel.wait_readable`` / ``wait_writable`` only when the kernel says EAGAIN (or a short read/write
says the same). This skips the two scheduler round trips per syscall that trio's socket methods spend on
checkpoints. Two socket options matter as much as the code (measured on loopback, 64 MB all-reduce):

* ``TCP_NOTSENT_LOWAT``: ``trio.open_tcp_stream`` sets it to 16 KiB for interactive latency,
  which caps each ``send`` at a few segments; with it lifted a 64 MB operation needs ~10 send
  wake-ups instead of ~300.
* ``SO_RCVLOWAT``: while a frame's payload is outstanding the reader asks to be woken only once
  ``min(rest of frame, 1 MiB)`` has arrived, so it copies in large pieces with few wake-ups.

The pool's read and write logic is written once against a connection's ``receive_into`` /
``send_frame`` (:mod:`pccl.peer.ring_reader`, :mod:`pccl.peer.ring_links`).
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import trio

from ..transport import Stream, StreamBroken
from ..wire.data import DATA_HEADER_SIZE, pack_data_header_into

__all__ = [
    "DEFAULT_RCVLOWAT",
    "DEFAULT_SOCKET_BUFFER",
    "Blocked",
    "Broken",
    "Conn",
    "Eof",
    "Retired",
    "SocketConn",
    "congestion_control",
    "open_conn",
    "path_estimate",
    "restart_congestion_control",
    "rtt_inflation",
    "set_congestion_control",
    "tcp_counters",
    "tcp_window_max",
    "tcp_wmem_max",
]

_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_MSG_PEEK_DONTWAIT = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
_AF_UNIX = getattr(socket, "AF_UNIX", None)  # the same-host shortcut's sockets (pccl.transport)

# SO_SNDBUF/SO_RCVBUF for ring connections; None leaves the kernel's autotuning alone, which
# measured best on loopback (it grows the receive side well past what a fixed SO_RCVBUF may).
DEFAULT_SOCKET_BUFFER: int | None = None

# Largest SO_RCVLOWAT used while a frame's payload is outstanding: the reader wakes once per MiB
# (or per frame rest) instead of once per arriving segment.
DEFAULT_RCVLOWAT = 1 << 20


class Broken(Exception):
    """This connection is unusable (closed locally, EOF, reset)."""


class Eof(Broken):
    """The other side closed the connection (end of stream)."""


class Retired(Broken):
    """The other side closed the connection between two frames (:meth:`~pccl.peer.pool.P2PPool.retire`:
    it no longer sends to this peer), which loses nothing."""


class Blocked(Exception):
    """A frame waited longer than the bound for a receive or stash room (backpressure)."""


def fast_socket(stream: Stream, buffer_bytes: int | None) -> socket.socket | None:
    """A private non-blocking ``dup`` of the stream's TCP socket, or None for other transports.

    A dup (rather than the trio socket's own fd) means a closed connection can never leave us
    holding a stale fd number that the OS hands to a different socket.
    """
    tsock: Any = getattr(stream, "socket", None)  # TcpStream.socket
    if not isinstance(tsock, trio.socket.SocketType):
        return None
    try:
        fd = tsock.fileno()
        if fd < 0:
            return None
        sock = socket.fromfd(fd, tsock.family, tsock.type, tsock.proto)
        sock.setblocking(False)
    except OSError:
        return None
    notsent = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if notsent is not None and sock.family != _AF_UNIX:
        # trio.SocketStream (used by trio.open_tcp_stream) sets TCP_NOTSENT_LOWAT to 16 KiB for
        # interactive latency. For bulk frames it caps every send() at a few 64 KiB segments and
        # makes the socket "writable" again after each: ~300 scheduler round trips per 64 MB
        # instead of ~10. Put the kernel default (no limit) back.
        try:
            sock.setsockopt(socket.IPPROTO_TCP, notsent, 0x7FFFFFFF)
        except OSError:
            pass
    if buffer_bytes:
        # Only the direction this connection is used in matters; the kernel caps (and doubles) it.
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass
    return sock


_TCP_INFO_RTT_OFFSET = 68  # struct tcp_info: tcpi_rtt (microseconds, u32)
_TCP_INFO_MIN_RTT_OFFSET = 148  # struct tcp_info: tcpi_min_rtt (microseconds, u32; Linux 4.10+)
_wmem_max: int | None = None
_window_max: int | None = None


def _sysctl_max(name: str, default: int) -> int:
    """The maximum (third field) of ``net.ipv4.<name>``, or ``default`` where it cannot be read."""
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return default


def tcp_wmem_max() -> int:
    """The send buffer's maximum (``net.ipv4.tcp_wmem``, read once; 4 MiB where it cannot be read)."""
    global _wmem_max
    if _wmem_max is None:
        _wmem_max = _sysctl_max("tcp_wmem", 4 << 20)
    return _wmem_max


def tcp_window_max() -> int:
    """The most one connection's window may grow to under autotuning (read once): the send buffer's
    maximum, or half the receive buffer's maximum (``net.ipv4.tcp_rmem``; the kernel advertises about
    half of a receive buffer as window) if that is smaller. The receiving host is assumed to be
    configured like this one. 4 MiB here (``tcp_wmem`` 4 MiB, ``tcp_rmem`` 32 MiB); on a stock kernel
    (``tcp_rmem`` 6 MiB) 3 MiB."""
    global _window_max
    if _window_max is None:
        _window_max = min(tcp_wmem_max(), _sysctl_max("tcp_rmem", 6 << 20) // 2)
    return _window_max


def _tcp_option(stream: Stream, name: str) -> tuple[Any, int] | None:
    """``(trio socket, option number)`` for the ``IPPROTO_TCP`` option ``name`` (``socket.TCP_...``)
    of a stream over TCP, or None: another stream (TLS, a Unix socket, the virtual network) or a
    platform without the option."""
    tsock: Any = getattr(stream, "socket", None)
    option = getattr(socket, name, None)
    if option is None or not isinstance(tsock, trio.socket.SocketType):
        return None
    if tsock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return tsock, option


class _TcpInfo:
    """The kernel's ``TCP_INFO`` of a TCP socket's stream, read once (``None`` from :meth:`read`
    where there is none: TLS and Unix-socket streams, a closed socket, a platform without it)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def read(cls, stream: Stream) -> _TcpInfo | None:
        found = _tcp_option(stream, "TCP_INFO")
        if found is None:
            return None
        tsock, tcp_info = found
        try:
            return cls(tsock.getsockopt(socket.IPPROTO_TCP, tcp_info, 160))
        except OSError:
            return None

    def u32(self, offset: int) -> int | None:
        """The unsigned 32-bit field at ``offset`` (None: this kernel's struct is shorter)."""
        if len(self.data) < offset + 4:
            return None
        return int.from_bytes(self.data[offset : offset + 4], sys.byteorder)


def path_estimate(stream: Stream) -> tuple[float, int] | None:
    """``(round trip in seconds, window in bytes)`` of an open connection, or None when unknown.

    A stream may say itself (``stream.path_estimate()``, as the virtual network's do); on a TCP
    socket the kernel's smallest round trip sample (``TCP_INFO`` ``tcpi_min_rtt``; its smoothed
    round trip on kernels without it) and :func:`tcp_window_max` are used; other streams (TLS, Unix
    sockets) are unknown. The smallest, not the smoothed one: under loss a handshake whose segment
    was retransmitted can leave one sample of a retransmission timeout in the smoothed figure (seen
    on the WAN emulator at 1% loss: a 50 ms partner guessed at 16 connections, the cap).
    """
    own = getattr(stream, "path_estimate", None)
    if callable(own):
        result: tuple[float, int] | None = own()
        return result
    info = _TcpInfo.read(stream)
    rtt_us = None if info is None else info.u32(_TCP_INFO_RTT_OFFSET)
    if info is None or rtt_us is None:
        return None
    min_us = info.u32(_TCP_INFO_MIN_RTT_OFFSET)
    if min_us is not None and 0 < min_us < 0xFFFFFFFF:  # ~0U: no sample yet
        rtt_us = min(rtt_us, min_us) if rtt_us else min_us
    return rtt_us / 1e6, tcp_window_max()


def rtt_inflation(stream: Stream) -> float | None:
    """The connection's smoothed round trip over its smallest one (``TCP_INFO`` ``tcpi_rtt`` /
    ``tcpi_min_rtt``), or None where unknown: about 1 on a path whose queues are empty, up to 2 where
    the connection's recent segments waited in a queue as deep as the path's bandwidth-delay product."""
    info = _TcpInfo.read(stream)
    if info is None:
        return None
    rtt, low = info.u32(_TCP_INFO_RTT_OFFSET), info.u32(_TCP_INFO_MIN_RTT_OFFSET)
    if not rtt or not low or low == 0xFFFFFFFF:
        return None
    return rtt / low


_TCP_INFO_TOTAL_RETRANS_OFFSET = 100  # struct tcp_info: tcpi_total_retrans (segments, u32)
_TCP_INFO_DATA_SEGS_OUT_OFFSET = 156  # struct tcp_info: tcpi_data_segs_out (segments, u32; Linux 4.6+)


def tcp_counters(stream: Stream) -> tuple[int, int] | None:
    """``(segments retransmitted, data segments sent)`` of an open connection so far, or None when
    unknown (the loss signal of :meth:`pccl.peer.striping.StripeSizer.observe`).

    A stream may say itself (``stream.tcp_counters()``); on a TCP socket the kernel's ``TCP_INFO``
    (``tcpi_total_retrans``, ``tcpi_data_segs_out``) is read; other streams are unknown. Both
    counters are 32 bits wide and wrap: take differences modulo 2**32.
    """
    own = getattr(stream, "tcp_counters", None)
    if callable(own):
        result: tuple[int, int] | None = own()
        return result
    info = _TcpInfo.read(stream)
    if info is None:
        return None
    again, sent = info.u32(_TCP_INFO_TOTAL_RETRANS_OFFSET), info.u32(_TCP_INFO_DATA_SEGS_OUT_OFFSET)
    return None if again is None or sent is None else (again, sent)


def set_congestion_control(stream: Stream, name: str) -> str | None:
    """Make an open TCP connection send with the congestion control ``name`` (``TCP_CONGESTION``).

    Returns:
        None when it does (or the stream is not a TCP socket's: TLS, a Unix socket, the virtual
        network, which have nothing to set), else why not (the kernel's refusal: no such algorithm,
        or one an unprivileged process may not pick).
    """
    found = _tcp_option(stream, "TCP_CONGESTION")
    if found is None:
        return None
    try:
        found[0].setsockopt(socket.IPPROTO_TCP, found[1], name.encode("ascii"))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def congestion_control(stream: Stream) -> str | None:
    """The congestion control an open TCP connection sends with (None: not a TCP socket's stream)."""
    found = _tcp_option(stream, "TCP_CONGESTION")
    if found is None:
        return None
    tsock, option = found
    try:
        return str(tsock.getsockopt(socket.IPPROTO_TCP, option, 16).split(b"\0", 1)[0].decode("ascii"))
    except (OSError, UnicodeDecodeError):
        return None


def restart_congestion_control(stream: Stream) -> bool:
    """Start an open connection's congestion control afresh (Linux: ``TCP_CONGESTION`` set to another
    algorithm the kernel lets any process use, then back); True if it was restarted.

    Why: a connection that shared a link with others keeps its congestion control's estimate of its
    share for a while after they go (bbr grows its bandwidth estimate by a quarter every eight round
    trips), so when the stripe drops from five connections to one the one left needs seconds to fill
    the link alone. Restarted, bbr begins in its start-up mode from the connection's current window and
    doubles its rate every round trip (cubic restarts its growth curve). Other streams (TLS, Unix
    sockets, the virtual network) and kernels without the option are left alone (False).
    """
    current = congestion_control(stream)
    if current is None:
        return False
    # reno is in every kernel and any process may pick it; a connection on reno goes through cubic,
    # which a process may be refused (then nothing changes and the answer is False)
    other = "cubic" if current == "reno" else "reno"
    return set_congestion_control(stream, other) is None and set_congestion_control(stream, current) is None


def open_conn(
    stream: Stream, peer_id: int, index: int, *, outgoing: bool, buffer_bytes: int | None = None
) -> Conn:
    """The connection object for ``stream``: the TCP fast path where there is a socket to drive."""
    sock = fast_socket(stream, buffer_bytes)
    if sock is None:
        return Conn(stream, peer_id, index, outgoing=outgoing)
    return SocketConn(stream, peer_id, index, outgoing=outgoing, sock=sock)


class Conn:
    """One P2P connection of the pool (send-only if outgoing, receive-only if incoming).

    The pool's read and write logic is written once, against :meth:`receive_into` and
    :meth:`send_frame`; how bytes move is this object's business. This base class works on any
    :class:`~pccl.transport.Stream`; :class:`SocketConn` is the TCP fast path.
    """

    __slots__ = ("bounce", "closed", "hdr", "hdr_view", "index", "lock", "outgoing", "peer_id",
                 "recv_waits", "rx_bytes", "send_waits", "sent", "stashed", "stream", "tx_bytes", "waited")

    # True if receive_into never writes into ``view`` after a checkpoint, so a destination that may be
    # cancelled meanwhile can be handed to it directly (the check before each call suffices); else the
    # pool receives through a bounce buffer (see :meth:`~pccl.peer.ring_reader.RingReaders.fill`).
    direct = False
    # True if receive_into always waits (a checkpoint per call), as a generic stream does.
    always_waits = True

    def __init__(self, stream: Stream, peer_id: int, index: int, *, outgoing: bool) -> None:
        self.stream = stream
        self.peer_id = peer_id
        self.index = index
        self.outgoing = outgoing
        self.closed = False
        self.lock = trio.StrictFIFOLock()
        self.hdr = bytearray(DATA_HEADER_SIZE)
        self.hdr_view = memoryview(self.hdr)
        self.bounce: memoryview | None = None
        self.sent = 0  # bytes of the frame being sent that left (0 < sent < total: a partial frame)
        self.waited = False  # set by receive_into when it had to wait
        self.send_waits = 0
        self.recv_waits = 0
        self.tx_bytes = 0
        self.rx_bytes = 0
        self.stashed = 0  # bytes of this (incoming) connection's frames in the pool's stash

    def alive(self) -> bool:
        """False once closed (a generic stream cannot tell more without reading)."""
        return not self.closed

    def _close_io(self) -> None:
        """Release what this connection drives besides its stream."""

    async def aclose(self) -> None:
        """Close (idempotent, never raises, safe under cancellation)."""
        if self.closed:
            return
        self.closed = True
        self._close_io()
        with trio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except Exception:  # closing an already broken stream: nothing left to do
                pass

    async def receive_into(self, view: memoryview, want: int) -> int:
        """Receive up to ``len(view)`` bytes into ``view``.

        Returns 0 when it only waited for bytes to arrive (the fast path never writes into ``view``
        after a checkpoint): the caller re-checks whether it still wants them and calls again.

        Args:
            view: where the bytes go.
            want: bytes certain to arrive (the rest of the header or frame): how long a wake-up may
                be put off.

        Raises:
            Broken: closed here, or EOF.
        """
        self.waited = True
        k = await self.stream.receive_into(view)
        if k == 0:
            raise Eof("connection closed by the other side")
        return k

    async def _send_parts(self, header: memoryview, data: memoryview, total: int) -> None:
        self.sent = 1  # from here on, any failure may have left a partial frame behind
        await self.stream.send_all(header)
        await self.stream.send_all(data)
        self.sent = total

    async def send_frame(self, tag: int, op_seq: int, seq: int, data: memoryview) -> None:
        """Send header + payload as one uninterrupted frame.

        A frame cut short (error or cancellation after its first byte) leaves the byte stream
        unparseable, so the connection is closed.

        Raises:
            Broken: the connection is (now) unusable.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        lock = self.lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        total = DATA_HEADER_SIZE + len(data)
        self.sent = 0
        try:
            if self.closed:
                raise Broken("connection closed")
            pack_data_header_into(self.hdr, tag, op_seq, seq, len(data))
            await self._send_parts(self.hdr_view, data, total)
            self.tx_bytes += len(data)
        except (OSError, StreamBroken, trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            await self.aclose()
            raise Broken(str(exc) or type(exc).__name__) from exc
        except BaseException:
            if 0 < self.sent < total:
                await self.aclose()
            raise
        finally:
            lock.release()


class SocketConn(Conn):
    """The TCP fast path: non-blocking syscalls on a private dup of the socket, waiting for readiness
    only when the kernel says EAGAIN (or a short read/write says the same). See the module docstring."""

    __slots__ = ("drained", "lowat", "lowat_cap", "sock")

    direct = True  # the receive syscall is synchronous: nothing can cancel a destination during it
    always_waits = False

    def __init__(
        self, stream: Stream, peer_id: int, index: int, *, outgoing: bool, sock: socket.socket
    ) -> None:
        super().__init__(stream, peer_id, index, outgoing=outgoing)
        self.sock = sock
        self.lowat = 1  # current SO_RCVLOWAT (incoming connections)
        # 1 once the kernel refused SO_RCVLOWAT, and on a Unix socket (the same-host shortcut of
        # pccl.transport), whose epoll ignores it: setting it would only cost a syscall per frame.
        self.lowat_cap = 1 if sock.family == _AF_UNIX else DEFAULT_RCVLOWAT
        self.drained = False  # the last read was short: the socket is empty, wait before the next

    def alive(self) -> bool:
        """False once closed or (outgoing) once the other side has closed or reset it."""
        if self.closed:
            return False
        if not self.outgoing:
            return True
        try:
            self.sock.recv(1, _MSG_PEEK_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        # EOF, or bytes on a connection the other side must never write to: either way unusable.
        return False

    def _close_io(self) -> None:
        sock = self.sock
        # wake any task parked in wait_readable/wait_writable on our dup first
        trio.lowlevel.notify_closing(sock)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()

    def _set_lowat(self, want: int) -> None:
        """Set SO_RCVLOWAT so that epoll reports the socket readable only with ``want`` bytes queued.

        Never above what is certain to arrive (the rest of the current header or frame), so it
        cannot stall; the kernel also wakes us when the receive window fills or the peer closes.
        """
        if want != self.lowat:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, want))
                self.lowat = want
            except OSError:  # not supported: plain wake-ups still work
                self.lowat_cap = 1

    async def _wait_readable(self, want: int) -> None:
        # Wake up only once a worthwhile amount has arrived (or the rest of the frame): fewer, larger
        # recv_into calls and far fewer trips through the scheduler than retrying on every trickle.
        self.waited = True
        self._set_lowat(min(want, self.lowat_cap))
        self.recv_waits += 1
        await trio.lowlevel.wait_readable(self.sock)

    async def receive_into(self, view: memoryview, want: int) -> int:
        """See :meth:`Conn.receive_into`: one ``recv_into`` without a checkpoint while the kernel has
        bytes, else (EAGAIN, or the previous read was short, which means the same) one wait."""
        if self.closed:
            raise Broken("connection closed")
        if not self.drained:
            try:
                k = self.sock.recv_into(view)
            except BlockingIOError:
                k = -1
            if k == 0:
                raise Eof("connection closed by the other side")
            if k > 0:
                self.drained = k < len(view)
                return k
        self.drained = False
        await self._wait_readable(want)
        return 0

    async def _send_parts(self, header: memoryview, data: memoryview, total: int) -> None:
        sock = self.sock
        sent = 0
        while True:
            try:
                if sent < DATA_HEADER_SIZE:
                    sent += sock.sendmsg([header[sent:], data], (), _MSG_NOSIGNAL)
                else:
                    sent += sock.send(data[sent - DATA_HEADER_SIZE :], _MSG_NOSIGNAL)
            except BlockingIOError:
                pass
            self.sent = sent
            if sent >= total:
                return
            # The send buffer is full (a short write means the same). Retrying at once would spin on
            # whatever trickle the receiver frees; epoll reports writable only once a good part of the
            # buffer is free again, so each send is large.
            self.send_waits += 1
            await trio.lowlevel.wait_writable(sock)
            if self.closed:
                raise Broken("connection closed")
