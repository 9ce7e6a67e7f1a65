"""The P2P connection pool of the collective data plane ("ring" channel).

Each peer keeps ``pool_size`` TCP connections to its ring successor (opened by this peer, used
only to send) and accepts ``pool_size`` from its predecessor (used only to receive). Every
data frame carries ``(tag, op_seq, seq)`` (see :mod:`pccl.wire.data`), so the connection a
frame travels on does not matter: concurrent operations share connections without blocking each
other (sends are serialized per connection, one whole frame at a time), and a large operation
stripes its blocks over every connection.

Receiving: one reader task per incoming connection (:meth:`P2PPool.handle_incoming`, the "ring"
handler of :func:`~pccl.peer.p2p.serve_p2p`) reads a header, finds the receive registered for
``(from_peer, tag, op_seq, seq)`` with :meth:`P2PPool.expect`, and ``recv_into``s the payload
straight into the registered destination (zero copy). A frame that arrives before its receive is
registered (the sender got the master's go-ahead first) is stashed in a pool-owned buffer and
copied over on registration. Frames of operations known to be finished or aborted
(:meth:`P2PPool.forget_op`) are read and dropped.

Backpressure instead of a drop: the stash holds at most ``PeerConfig.recv_stash_limit`` bytes
(all incoming connections together, 64 MiB by default). A reader whose frame has no receive and
does not fit stops reading its connection (the header is read, the payload stays in the socket, so
TCP flow control holds the sender back) and parks until one of these happens, then goes on:

1. the frame's receive is registered: the payload goes straight into its destination (zero copy);
2. the frame's operation is forgotten: the payload is read and dropped;
3. the stash has room for it (another frame was claimed or dropped): it is stashed;
4. the connection or the pool is closed: the reader ends;
5. ``PeerConfig.p2p_stall_timeout`` passes: the connection is closed with a logged reason ("waited
   30s (p2p_stall_timeout) for its receive while the stash is full"), pending receives from that peer fail as
   on any lost connection, and the frames it had stashed are released (nothing claimed them while
   it was blocked, so they are suspect, and their room goes back to the other connections).

Why this cannot deadlock (and why ``p2p_stall_timeout`` is the bound). A connection is a FIFO, so a
parked frame F of operation A holds up every frame behind it on that connection, whatever their
operation B. That is safe as long as A's receives get registered (or A forgotten) without any
data frame having to arrive first, because then case 1 or 2 ends the wait whatever is queued
behind F. The invariant that gives it, and which every data plane must keep:

* (send after the vote) a peer sends frames of A to a neighbour only after the master's
  go-ahead for A (``CollectiveCommence``), which the master sends only once every member of A voted
  for it; so the receiver's own call of A is already in progress when F arrives;
* (register before waiting) on the go-ahead, the receiver's operation task registers every
  receive of A at once (:func:`~pccl.collectives.ring.run_plan` calls :meth:`P2PPool.expect`
  for the whole plan before it sends or waits for anything), and the steps before that (validating
  the go-ahead, :meth:`connect` to the successor) wait for no data frame; any failure on the way
  calls :meth:`forget_op`.

Concurrent tagged operations are covered by the same argument: each one's receives are registered
on its own go-ahead, independently of the others' frames, so a frame of A blocking B's frames on
one connection is released by A's registration, never by B's progress. The pipelined executor only
changes when frames are sent, not when receives are registered. The one way to break this is a
sender that runs ahead of the receiver's vote (for example starting an operation speculatively on
its own vote): then A's registration may wait for the user's next call, which may wait for B, whose
frames are parked behind F. The pool does not deadlock even then: the wait ends at case 5 after
``p2p_stall_timeout``, the bound on "no data moved" that the stall watch (:mod:`pccl.peer.stall`)
applies to operations anyway; any frame that waited that long with its operation running here
would have failed its operation there too. An honest frame waits only for the receiver's go-ahead
(the commence skew between two peers, microseconds to milliseconds), so a small stash costs the
sender at most that wait and no exactness or liveness. A member (or any connection able to send
data frames) that floods frames nobody will ever receive gets at most ``recv_stash_limit`` bytes of
this peer's memory and one blocked connection, closed after ``p2p_stall_timeout``.

Binding: a frame is routed by the sender the connection's Hello named (``from_peer``), never by
anything in the frame, so it can only fill receives registered for that sender. In a communicator the
listener authenticates that name (the master-issued credential for that peer, the "ring" channel and the
epoch, :mod:`pccl.peer.p2p`) before the connection reaches :meth:`P2PPool.handle_incoming`: a frame from
peer X lands only through a connection that proved to be X's, and no other connection can take X's slot.

Safety of the destination: once :meth:`P2PPool.forget_op` (or :meth:`P2PPool.disconnect`)
returns, no reader writes into a destination of that operation again. On TCP the reader checks
the receive's state before every ``recv_into`` syscall (trio is single-threaded, so nothing can
write between the check and the syscall); on other transports it receives through a pool-owned
bounce buffer and copies only while the receive is live.

One read path and one write path: the pool's logic (headers, routing, stash, discard) is written
once against a connection's ``receive_into`` / ``send_frame``; how the bytes move is a property of the
connection (``_Conn`` for any stream, ``_SocketConn`` for TCP).

Fast path: on :class:`~pccl.transport.TcpStream` (TCP, or the Unix socket of its same-host shortcut,
docs/transport.md) the connection drives a private ``dup`` of the socket
with non-blocking ``sendmsg``/``recv_into`` and waits with ``trio.lowlevel.wait_readable`` /
``wait_writable`` only when the kernel says EAGAIN (or a short read/write says the same). This
skips the two scheduler round trips per syscall that trio's socket methods spend on checkpoints.
Two socket options matter as much as the code (measured on loopback, 64 MB all-reduce):

* ``TCP_NOTSENT_LOWAT``: ``trio.open_tcp_stream`` sets it to 16 KiB for interactive latency,
  which caps each ``send`` at a few segments; with it lifted a 64 MB operation needs ~10 send
  wake-ups instead of ~300.
* ``SO_RCVLOWAT``: while a frame's payload is outstanding the reader asks to be woken only once
  ``min(rest of frame, 1 MiB)`` has arrived, so it copies in large pieces with few wake-ups.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import trio

from .._config import PeerConfig
from .._errors import (
    InvalidUsageError,
    LocalProtocolError,
    PCCLError,
    RankConnectionFailedError,
    RankConnectionLostError,
    RemoteProtocolError,
)
from ..transport import Stream, StreamBroken, Transport
from ..wire.data import (
    DATA_HEADER_SIZE,
    MAX_DATA_FRAME_LENGTH,
    pack_data_header_into,
    unpack_data_header_fields,
)
from ..wire.messages import Hello
from ..wire.stream import MessageStream
from .credentials import CredentialStore
from .p2p import open_p2p
from .striping import stripe_count

log = logging.getLogger("pccl.p2p")

RING_CHANNEL = "ring"

_BOUNCE_BYTES = 256 * 1024  # generic-transport receive bounce buffer (per connection)
_DISCARD_BYTES = 1 << 20  # scratch that frames of dead operations are read into and dropped
_DEAD_OPS_KEEP = 8192  # how many finished op_seqs we remember to drop their stragglers
_YIELD_EVERY_BYTES = 4 << 20  # a reader that never had to wait yields after this many bytes
# Scheduler passes a reader gives an operation's task to register a receive before it stashes the
# frame (see _read_frame). A pass with nothing else to run costs a few microseconds.
_REGISTER_PASSES = 16
_REGISTER_WAIT_MIN_BYTES = 256 * 1024
_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_MSG_PEEK_DONTWAIT = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
_AF_UNIX = getattr(socket, "AF_UNIX", None)  # the same-host shortcut's sockets (pccl.transport)

# SO_SNDBUF/SO_RCVBUF for ring connections; None leaves the kernel's autotuning alone, which
# measured best on loopback (it grows the receive side well past what a fixed SO_RCVBUF may).
DEFAULT_SOCKET_BUFFER: int | None = None

# Largest SO_RCVLOWAT used while a frame's payload is outstanding: the reader wakes once per MiB
# (or per frame rest) instead of once per arriving segment.
DEFAULT_RCVLOWAT = 1 << 20

SlotKey = tuple[int, int, int, int]  # (from_peer, tag, op_seq, seq)


class _Broken(Exception):
    """Internal: this connection is unusable (closed locally, EOF, reset)."""


class _Eof(_Broken):
    """Internal: the other side closed the connection (end of stream)."""


class _Retired(_Broken):
    """Internal: the other side closed the connection between two frames (:meth:`P2PPool.retire`:
    it no longer sends to this peer), which loses nothing."""


class _Blocked(Exception):
    """Internal: a frame waited longer than the bound for a receive or stash room (backpressure)."""


def _fast_socket(stream: Stream, buffer_bytes: int | None) -> socket.socket | None:
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
_wmem_max: int | None = None


def _tcp_wmem_max() -> int:
    """The send buffer's maximum (``net.ipv4.tcp_wmem``, read once; 4 MiB where it cannot be read)."""
    global _wmem_max
    if _wmem_max is None:
        try:
            with open("/proc/sys/net/ipv4/tcp_wmem") as f:
                _wmem_max = int(f.read().split()[2])
        except (OSError, ValueError, IndexError):
            _wmem_max = 4 << 20
    return _wmem_max


def path_estimate(stream: Stream) -> tuple[float, int] | None:
    """``(round trip in seconds, window in bytes)`` of an open connection, or None when unknown.

    A stream may say itself (``stream.path_estimate()``, as the virtual network's do); on a TCP
    socket the kernel's smoothed round trip (``TCP_INFO``) and the send buffer's maximum are used;
    other streams (TLS, Unix sockets) are unknown.
    """
    own = getattr(stream, "path_estimate", None)
    if callable(own):
        result: tuple[float, int] | None = own()
        return result
    tsock: Any = getattr(stream, "socket", None)
    tcp_info = getattr(socket, "TCP_INFO", None)
    if tcp_info is None or not isinstance(tsock, trio.socket.SocketType):
        return None
    if tsock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = tsock.getsockopt(socket.IPPROTO_TCP, tcp_info, 104)
    except OSError:
        return None
    if len(info) < _TCP_INFO_RTT_OFFSET + 4:
        return None
    rtt_us = int.from_bytes(info[_TCP_INFO_RTT_OFFSET : _TCP_INFO_RTT_OFFSET + 4], sys.byteorder)
    return rtt_us / 1e6, _tcp_wmem_max()


def _open_conn(
    stream: Stream, peer_id: int, index: int, *, outgoing: bool, buffer_bytes: int | None = None
) -> _Conn:
    """The connection object for ``stream``: the TCP fast path where there is a socket to drive."""
    sock = _fast_socket(stream, buffer_bytes)
    if sock is None:
        return _Conn(stream, peer_id, index, outgoing=outgoing)
    return _SocketConn(stream, peer_id, index, outgoing=outgoing, sock=sock)


class _Conn:
    """One P2P connection of the pool (send-only if outgoing, receive-only if incoming).

    The pool's read and write logic is written once, against :meth:`receive_into` and
    :meth:`send_frame`; how bytes move is this object's business. This base class works on any
    :class:`~pccl.transport.Stream`; :class:`_SocketConn` is the TCP fast path.
    """

    __slots__ = ("bounce", "closed", "hdr", "hdr_view", "index", "lock", "outgoing", "peer_id",
                 "recv_waits", "rx_bytes", "send_waits", "sent", "stashed", "stream", "tx_bytes", "waited")

    # True if receive_into never writes into ``view`` after a checkpoint, so a destination that may be
    # cancelled meanwhile can be handed to it directly (the check before each call suffices); else the
    # pool receives through a bounce buffer (see P2PPool._fill).
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
            _Broken: closed here, or EOF.
        """
        self.waited = True
        k = await self.stream.receive_into(view)
        if k == 0:
            raise _Eof("connection closed by the other side")
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
            _Broken: the connection is (now) unusable.
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
                raise _Broken("connection closed")
            pack_data_header_into(self.hdr, tag, op_seq, seq, len(data))
            await self._send_parts(self.hdr_view, data, total)
            self.tx_bytes += len(data)
        except (OSError, StreamBroken, trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            await self.aclose()
            raise _Broken(str(exc) or type(exc).__name__) from exc
        except BaseException:
            if 0 < self.sent < total:
                await self.aclose()
            raise
        finally:
            lock.release()


class _SocketConn(_Conn):
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
        """See :meth:`_Conn.receive_into`: one ``recv_into`` without a checkpoint while the kernel has
        bytes, else (EAGAIN, or the previous read was short, which means the same) one wait."""
        if self.closed:
            raise _Broken("connection closed")
        if not self.drained:
            try:
                k = self.sock.recv_into(view)
            except BlockingIOError:
                k = -1
            if k == 0:
                raise _Eof("connection closed by the other side")
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
                raise _Broken("connection closed")


class ReceiveSlot:
    """A registered receive: one frame from one peer, landing in ``dest``.

    Created by :meth:`P2PPool.expect`; ``await slot.wait()`` returns once ``dest`` is full.
    """

    __slots__ = ("_error", "_task", "cancelled", "dest", "done", "filler", "filling", "key", "nbytes")

    def __init__(self, key: SlotKey, dest: memoryview) -> None:
        self.key = key
        self.dest = dest
        self.nbytes = len(dest)
        self.done = False
        self.filling = False
        self.filler: _Conn | None = None  # the connection filling it (while ``filling``)
        self.cancelled = False
        self._error: tuple[type[PCCLError], str] | None = None
        self._task: trio.lowlevel.Task | None = None

    def _complete(self) -> None:
        self.done = True
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)

    def _fail(self, cls: type[PCCLError], message: str) -> None:
        if self.done:
            return
        self.cancelled = True  # a reader mid-frame must stop writing into dest
        self._error = (cls, message)
        self._complete()

    def _abort(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def wait(self) -> None:
        """Wait until the frame has fully arrived in ``dest``.

        Only one task may wait on a slot.

        Raises:
            RankConnectionLostError: the connection from that peer broke, the peer was
                disconnected, the operation was forgotten, or the pool closed.
            RemoteProtocolError: the peer sent a frame of the wrong length for this receive.
        """
        if not self.done:
            if self._task is not None:
                raise trio.BusyResourceError("another task is already waiting for this receive")
            # Parked directly on the task (no Event/ParkingLot): this is on every frame's path.
            self._task = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        if self._error is not None:
            cls, message = self._error
            raise cls(message)

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done else "filling" if self.filling else "pending"
        return f"<ReceiveSlot from={self.key[0]} tag={self.key[1]} op={self.key[2]} seq={self.key[3]} " \
               f"{self.nbytes}B {state}>"


class P2PPool:
    """Ring data connections to neighbours, with per-frame routing of received data.

    Args:
        transport: how to open connections.
        my_peer_id: this peer's id (presented in every Hello).
        pool_size: connections per neighbour and direction (>= 1), or 0: sized per partner from the
            round trip of its first connection (:mod:`pccl.peer.striping`, with the config's
            ``p2p_stripe_target_mbit`` and ``p2p_max_stripes``).
        config: timeouts and limits (``connect_timeout``, ``recv_stash_limit``, ``max_frame_size``).
        secret: shared secret presented to the other peers' listeners.
        socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF for TCP ring connections; None keeps the
            kernel's autotuning.
        credentials: this peer's P2P credentials, presented on every connection it opens (None: none).
    """

    def __init__(
        self,
        *,
        transport: Transport,
        my_peer_id: int,
        pool_size: int,
        config: PeerConfig,
        secret: str = "",
        socket_buffer_bytes: int | None = DEFAULT_SOCKET_BUFFER,
        credentials: CredentialStore | None = None,
    ) -> None:
        if pool_size < 0:
            raise ValueError("pool_size must be >= 0 (0: sized per partner)")
        self.transport = transport
        self.my_peer_id = my_peer_id
        self.pool_size = pool_size
        self.config = config
        self.secret = secret
        self.socket_buffer_bytes = socket_buffer_bytes
        self.credentials = credentials
        self._closed = False
        self._out: dict[int, list[_Conn | None]] = {}
        self._addr: dict[int, tuple[str, int]] = {}
        self._connect_locks: dict[int, trio.Lock] = {}
        self._in: dict[tuple[int, int], _Conn] = {}
        self._slots: dict[SlotKey, ReceiveSlot] = {}
        self._stash: dict[SlotKey, bytearray] = {}
        self._stash_conn: dict[SlotKey, _Conn] = {}  # the connection each stashed frame came on
        self._stashing: set[SlotKey] = set()
        self._stash_bytes = 0
        self._stash_limit = config.recv_stash_limit
        self._stash_frames_limit = config.recv_stash_frames
        # Backpressure (see the module docstring): readers whose frame neither has a receive nor fits
        # in the stash park here; everything that registers a receive, forgets an operation, frees
        # stash space or closes connections wakes them to look again.
        self._room = trio.lowlevel.ParkingLot()
        self._block_limit = config.p2p_stall_timeout
        self._dead_ops: OrderedDict[int, None] = OrderedDict()
        # Frames of live operations that arrived whole, by op_seq: a sender that lost a connection
        # of a stripe resends what it had sent on it (it cannot know what arrived), and the copies
        # of frames already here are dropped instead of stashed. Cleared by forget_op.
        self._arrived: dict[int, set[tuple[int, int, int]]] = {}
        self._discard = memoryview(bytearray(_DISCARD_BYTES))
        # counters for statistics()
        self._tx_bytes = 0
        self._rx_bytes = 0
        self._frames_sent = 0
        self._frames_received = 0
        self._frames_stashed = 0
        self._bytes_discarded = 0
        self._connections_lost = 0
        self._retired = 0  # outgoing peers whose connections retire() closed
        self._closed_by_peer = 0  # incoming connections the other side closed between two frames
        self._stash_peak = 0  # most bytes the stash ever held (reserved included)
        self._reader_blocks = 0  # times a reader stopped reading because the stash was full
        self._blocked_drops = 0  # connections closed because a frame stayed blocked too long
        self._recv_waits = 0  # of incoming connections that are gone (live ones count their own)

    # ------------------------------------------------------------------------------------------
    # connections

    async def connect(self, peer_id: int, host: str, port: int) -> None:
        """Make sure all ``pool_size`` outgoing connections to ``peer_id`` are open.

        Idempotent: open, healthy connections are kept; closed or broken ones are replaced; all
        missing ones are opened concurrently. If the address changed, the old ones are closed.

        Raises:
            RankConnectionFailedError: some connection could not be opened (those that did
                open are kept; calling again opens the rest).
        """
        if self._closed:
            raise RankConnectionFailedError("the P2P pool is closed")
        lock = self._connect_locks.setdefault(peer_id, trio.Lock())
        async with lock:
            conns = self._out.get(peer_id)
            if conns is not None and self._addr.get(peer_id) != (host, port):
                self._out.pop(peer_id, None)
                for c in conns:
                    if c is not None:
                        await c.aclose()
                conns = None
            if conns is None:
                conns = [None] * (self.pool_size or 1)
                self._out[peer_id] = conns
                self._addr[peer_id] = (host, port)
                if not self.pool_size:
                    await self._open_sized(peer_id, host, port, conns)
            for i, c in enumerate(conns):
                if c is not None and not c.alive():
                    conns[i] = None
                    await c.aclose()
            missing = [i for i, c in enumerate(conns) if c is None]
            if not missing:
                await trio.lowlevel.checkpoint()
                return
            errors: list[str] = []
            async with trio.open_nursery() as nursery:
                for i in missing:
                    nursery.start_soon(self._open_one, peer_id, host, port, i, conns, errors)
            if errors:
                raise RankConnectionFailedError(
                    f"{len(errors)} of {len(missing)} connections to peer {peer_id} failed: {errors[0]}"
                )

    async def _open_sized(self, peer_id: int, host: str, port: int, conns: list[_Conn | None]) -> None:
        """Open the first connection to ``peer_id``, then size the stripe from its round trip:
        ``conns`` grows (in place) to the count :func:`~pccl.peer.striping.stripe_count` gives."""
        errors: list[str] = []
        await self._open_one(peer_id, host, port, 0, conns, errors)
        first = conns[0]
        if errors or first is None:
            # Forget the unsized list: the next connect() starts over and sizes the stripe then.
            if self._out.get(peer_id) is conns:
                del self._out[peer_id]
                self._addr.pop(peer_id, None)
            raise RankConnectionFailedError(
                f"the first connection to peer {peer_id} failed: {errors[0] if errors else 'closed'}"
            )
        path = path_estimate(first.stream)
        n = 1
        if path is not None:
            rtt, window = path
            n = stripe_count(
                rtt,
                window_bytes=window,
                target_bytes_per_s=self.config.p2p_stripe_target_mbit * 1e6 / 8,
                max_stripes=self.config.p2p_max_stripes,
            )
            log.debug("peer %d: rtt %.2f ms, window %d: %d connection(s)", peer_id, rtt * 1e3, window, n)
        conns.extend([None] * (n - 1))

    async def reopen(self, peer_id: int) -> None:
        """Reopen the lost connections to ``peer_id`` at the address it was connected at (one of a
        stripe broke while the operation using it runs).

        Raises:
            RankConnectionFailedError: not connected before, or a connection could not be opened
                (the peer is gone: its listener refuses, or the connect times out).
        """
        addr = self._addr.get(peer_id)
        if addr is None:
            await trio.lowlevel.checkpoint()
            raise RankConnectionFailedError(f"no connections to peer {peer_id} to reopen")
        await self.connect(peer_id, *addr)

    def stripes(self, peer_id: int) -> int:
        """How many connections an operation stripes over to ``peer_id`` (its open pool's size,
        before it is connected the configured size, at least 1)."""
        conns = self._out.get(peer_id)
        return len(conns) if conns else max(1, self.pool_size)

    async def _open_one(
        self, peer_id: int, host: str, port: int, index: int, conns: list[_Conn | None], errors: list[str]
    ) -> None:
        try:
            ms = await open_p2p(
                self.transport,
                host,
                port,
                my_peer_id=self.my_peer_id,
                channel=RING_CHANNEL,
                index=index,
                config=self.config,
                secret=self.secret,
                to_peer=peer_id,
                credentials=self.credentials,
            )
        except RankConnectionFailedError as exc:
            errors.append(exc.message)
            return
        conn = _open_conn(ms.stream, peer_id, index, outgoing=True, buffer_bytes=self.socket_buffer_bytes)
        if self._closed or self._out.get(peer_id) is not conns:
            # disconnect() or aclose() ran while we were connecting: this connection is unwanted
            await conn.aclose()
            errors.append("disconnected while connecting")
            return
        conns[index] = conn

    def blocked_partners(self) -> list[int]:
        """Peers with a frame being sent to them right now (a stall watch asks this when no frame has
        moved for ``p2p_stall_timeout``: a send still under way then is one the receiver does not take)."""
        return sorted(p for p, cs in self._out.items()
                      if any(c is not None and not c.closed and c.lock.locked() for c in cs))

    def is_connected(self, peer_id: int) -> bool:
        """True if all outgoing connections to ``peer_id`` (``pool_size``, or as many as its sizing
        chose) are open and healthy."""
        conns = self._out.get(peer_id)
        return conns is not None and all(c is not None and c.alive() for c in conns)

    async def retire(self, keep: set[int]) -> list[int]:
        """Close the outgoing connections to every peer not in ``keep``: after a topology change the
        peers no plan of this one sends to any more (the ring successor and the halving-doubling and
        tree partners of the new ring are kept). Without it, every membership change of a long run
        would leave each peer holding connections to every peer it ever sent to: ``n`` of each kind
        per peer, twice that in file descriptors with the incoming side, at hundreds of peers beyond
        a process's usual limit. The other side sees a clean close between two frames, not a loss.

        Call it only with no operation of this pool in flight (its frames could be on one of them).
        A later :meth:`connect` reopens a retired peer's connections.

        Returns:
            The peers whose connections were closed.
        """
        gone = [p for p in self._out if p not in keep]
        conns: list[_Conn] = []
        for p in gone:
            conns += [c for c in self._out.pop(p) if c is not None]
            self._addr.pop(p, None)
        self._retired += len(gone)
        with trio.CancelScope(shield=True):
            for c in conns:
                await c.aclose()
        return gone

    async def disconnect(self, peer_id: int) -> None:
        """Close every connection with ``peer_id``, both directions.

        Used after a failed operation, when the state of those streams is unknown. Pending
        receives from that peer fail with RankConnectionLostError; its stashed frames are dropped;
        the next :meth:`connect` rebuilds the outgoing side (the peer rebuilds the other).
        """
        conns: list[_Conn] = [c for c in self._out.pop(peer_id, []) if c is not None]
        for in_key in [k for k in self._in if k[0] == peer_id]:
            conns.append(self._in.pop(in_key))
        self._fail_peer(peer_id, f"connections to peer {peer_id} were closed")
        for key in [k for k in self._stash if k[0] == peer_id]:
            self._unstash(key)
        with trio.CancelScope(shield=True):
            for c in conns:
                await c.aclose()
        self._wake()  # readers of those connections parked on a full stash see them closed

    async def disconnect_all(self, peer_ids: Iterable[int]) -> None:
        """:meth:`disconnect` each of ``peer_ids``, shielded from cancellation: the partners of a
        failed operation, closed while that operation is being cancelled."""
        with trio.CancelScope(shield=True):
            for peer_id in peer_ids:
                await self.disconnect(peer_id)

    async def aclose(self) -> None:
        """Close every connection; pending receives fail; the pool cannot be used again."""
        self._closed = True
        conns: list[_Conn] = [c for cs in self._out.values() for c in cs if c is not None]
        conns.extend(self._in.values())
        self._out.clear()
        self._in.clear()
        for slot in list(self._slots.values()):
            slot._fail(RankConnectionLostError, "the P2P pool was closed")
        self._slots.clear()
        self._arrived.clear()
        self._stash.clear()
        self._stash_conn.clear()
        self._stash_bytes = 0
        with trio.CancelScope(shield=True):
            for c in conns:
                await c.aclose()
        self._wake()

    # ------------------------------------------------------------------------------------------
    # sending

    async def send(
        self, peer_id: int, tag: int, op_seq: int, seq: int, data: memoryview, *, conn_index: int
    ) -> None:
        """Send one data frame to ``peer_id`` on outgoing connection ``conn_index % pool_size``.

        Frames on one connection never interleave (a per-connection FIFO lock); concurrent sends
        on different connections proceed in parallel.

        Args:
            peer_id: destination (must be connected).
            tag: operation tag.
            op_seq: operation sequence number.
            seq: frame number within the operation.
            data: the payload, a contiguous byte memoryview (format "B").
            conn_index: preferred connection.

        Raises:
            RankConnectionLostError: no open connection, or it broke while sending (it is then
                closed).
        """
        conns = self._out.get(peer_id)
        conn = conns[conn_index % len(conns)] if conns else None
        if conn is None or conn.closed:
            await trio.lowlevel.checkpoint()
            raise RankConnectionLostError(f"no open connection to peer {peer_id}")
        try:
            await conn.send_frame(tag, op_seq, seq, data)
        except _Broken as exc:
            self._connections_lost += 1
            raise RankConnectionLostError(f"connection to peer {peer_id} lost while sending: {exc}") from None
        self._tx_bytes += len(data)
        self._frames_sent += 1

    # ------------------------------------------------------------------------------------------
    # receiving

    def expect(self, peer_id: int, tag: int, op_seq: int, seq: int, dest: memoryview) -> ReceiveSlot:
        """Register a receive of frame ``(tag, op_seq, seq)`` from ``peer_id`` into ``dest``.

        If the frame was already stashed, it is copied into ``dest`` now and the slot is done.

        Args:
            peer_id: the sender.
            tag: operation tag.
            op_seq: operation sequence number.
            seq: frame number.
            dest: writable contiguous byte memoryview; the frame must have exactly this length.

        Returns:
            The slot; ``await slot.wait()``.

        Raises:
            InvalidUsageError: the operation was already forgotten, or the pool is closed.
            LocalProtocolError: this receive is already registered.
        """
        if self._closed:
            raise InvalidUsageError("the P2P pool is closed")
        if op_seq in self._dead_ops:
            raise InvalidUsageError(f"operation {op_seq} is already finished on this peer")
        key = (peer_id, tag, op_seq, seq)
        if key in self._slots:
            raise LocalProtocolError(f"receive {key} registered twice")
        if dest.format != "B" or dest.ndim != 1:
            dest = dest.cast("B")
        slot = ReceiveSlot(key, dest)
        buf = self._unstash(key)
        if buf is not None:
            self._deliver_stash(slot, buf)
            return slot
        self._slots[key] = slot
        if self._room:
            self._room.unpark_all()  # a reader may be parked on exactly this frame
        return slot

    def _unstash(self, key: SlotKey) -> bytearray | None:
        """Take frame ``key`` out of the stash (None if it is not there); parked readers look again."""
        buf = self._stash.pop(key, None)
        if buf is None:
            return None
        self._stash_bytes -= len(buf)
        conn = self._stash_conn.pop(key, None)
        if conn is not None:
            conn.stashed -= len(buf)
        if self._room:
            self._room.unpark_all()
        return buf

    def _wake(self) -> None:
        if self._room:
            self._room.unpark_all()

    def _fits(self, length: int) -> bool:
        # Counted in bytes and in frames: a frame of length 0 costs no payload but ~350 bytes of
        # bookkeeping (its key, its buffer object, two dict slots), so frames are capped on their own.
        return (self._stash_bytes + length <= self._stash_limit
                and len(self._stash) + len(self._stashing) < self._stash_frames_limit)

    def _deliver_stash(self, slot: ReceiveSlot, buf: bytearray) -> None:
        if len(buf) != slot.nbytes:
            slot._fail(RemoteProtocolError,
                       f"peer {slot.key[0]} sent {len(buf)} bytes for a {slot.nbytes}-byte receive")
            return
        slot.dest[:] = buf
        self._rx_bytes += len(buf)
        self._frames_received += 1
        self._mark_arrived(slot.key)
        slot._complete()

    def _mark_arrived(self, key: SlotKey) -> None:
        peer, tag, op_seq, seq = key
        self._arrived.setdefault(op_seq, set()).add((peer, tag, seq))

    def _release_fills(self, conn: _Conn) -> None:
        """The slot ``conn`` was filling goes back to waiting: the sender resends its frame on
        another connection of the stripe (a lost connection that was not the peer's last)."""
        for slot in self._slots.values():
            if slot.filling and slot.filler is conn:
                slot.filling = False
                slot.filler = None

    def forget_op(self, op_seq: int) -> None:
        """Drop every receive and stash of operation ``op_seq`` and discard its later frames.

        Pending receives fail; readers stop writing into their destinations before this returns.
        Call it whenever an operation ends (successfully or not), and for operations aborted
        before they ran here, so their stragglers do not pile up in the stash.
        """
        self._dead_ops[op_seq] = None
        self._dead_ops.move_to_end(op_seq)
        self._arrived.pop(op_seq, None)
        while len(self._dead_ops) > _DEAD_OPS_KEEP:
            self._dead_ops.popitem(last=False)
        if self._slots:
            for key in [k for k in self._slots if k[2] == op_seq]:
                self._slots.pop(key)._fail(RankConnectionLostError, f"operation {op_seq} was aborted")
        if self._stash:
            for key in [k for k in self._stash if k[2] == op_seq]:
                self._unstash(key)
        self._wake()  # a reader parked on a frame of this op now drops it

    def _fail_peer(self, peer_id: int, reason: str) -> None:
        for key in [k for k in self._slots if k[0] == peer_id]:
            self._slots.pop(key)._fail(RankConnectionLostError, reason)

    async def handle_incoming(self, ms: MessageStream, hello: Hello) -> None:
        """The "ring" channel handler for :func:`~pccl.peer.p2p.serve_p2p`: this connection's reader.

        Runs until the connection closes or breaks; then, if it was still this pool's current
        connection for its (peer, index), fails the pending receives from that peer with
        RankConnectionLostError. A protocol violation (bad header, wrong length, stash over the
        limit) closes the connection the same way.
        """
        if self._closed:
            return
        conn = _open_conn(ms.stream, hello.peer_id, hello.index, outgoing=False,
                          buffer_bytes=self.socket_buffer_bytes)
        key = (hello.peer_id, hello.index)
        old = self._in.get(key)
        self._in[key] = conn
        if old is not None:
            # The peer reopened this slot, so it gave the old connection up (and resends what it
            # had sent on it): the frame it was filling waits for the copy.
            self._release_fills(old)
            await old.aclose()
            self._wake()
        reason = "closed"
        retired = False
        try:
            # The first header may already be buffered in the message stream behind the Hello.
            pre = ms.take_buffered(DATA_HEADER_SIZE)
            conn.hdr_view[: len(pre)] = pre
            await self._read_header(conn, len(pre))
            unyielded = 0
            while True:
                if await self._read_frame(conn):
                    unyielded = 0
                else:
                    # Fairness: a sender that keeps the socket full must not keep this reader from
                    # yielding for long; but a yield per small frame would cost a scheduler pass.
                    unyielded += DATA_HEADER_SIZE + unpack_data_header_fields(conn.hdr)[3]
                    if unyielded >= _YIELD_EVERY_BYTES:
                        unyielded = 0
                        await trio.lowlevel.checkpoint()
                await self._read_header(conn)
        except _Retired:
            reason = f"peer {conn.peer_id} closed its connection (it sends to this peer no more)"
            retired = True
        except (_Broken, StreamBroken, trio.ClosedResourceError, trio.BrokenResourceError, OSError) as exc:
            reason = f"connection from peer {conn.peer_id} lost: {exc or type(exc).__name__}"
        except RemoteProtocolError as exc:
            reason = f"peer {conn.peer_id} broke the data protocol: {exc.message}"
            log.warning("closing ring connection from peer %d: %s", conn.peer_id, exc.message)
        except _Blocked as exc:
            reason = f"ring connection from peer {conn.peer_id} blocked: {exc}"
            log.warning("closing ring connection %d from peer %d: %s", conn.index, conn.peer_id, exc)
            self._blocked_drops += 1
            # What this connection stashed is suspect (nothing claimed it while it was blocked, see
            # the module docstring): its budget goes back to the other connections (below).
        finally:
            # A connection leaves nothing behind when it ends, however it ends: had an operation
            # still needed its frames, it fails with the lost connection anyway; a sender retires
            # its connections (closes them between two frames) only after a topology change, which
            # every member votes for only with its own operations ended (their frames claimed or
            # forgotten). So a member cannot park frames here and walk away.
            self._drop_stash_of(conn)
            was_closed = conn.closed
            self._recv_waits += conn.recv_waits
            conn.recv_waits = 0
            await conn.aclose()
            if self._in.get(key) is conn:
                del self._in[key]
                if retired:
                    self._closed_by_peer += 1
                elif not was_closed:
                    self._connections_lost += 1
                if not retired and not was_closed and any(
                    p == conn.peer_id and c.alive() for (p, _i), c in self._in.items()
                ):
                    # One connection of a stripe lost while the peer still has others: its sender
                    # reopens it and resends (ring._run_pipelined); only the frame it was filling
                    # waits again. A peer that is gone loses them all, and its last one fails.
                    self._release_fills(conn)
                else:
                    self._fail_peer(conn.peer_id, reason)

    def _drop_stash_of(self, conn: _Conn) -> None:
        """Release every stashed frame that came on ``conn``."""
        if self._stash_conn:
            for skey in [k for k, c in self._stash_conn.items() if c is conn]:
                self._unstash(skey)

    async def _read_header(self, conn: _Conn, got: int = 0) -> None:
        """Read a frame's header into ``conn.hdr_view`` (``got`` bytes of it are there already).

        Raises:
            _Retired: the other side closed the connection before the header's first byte.
            _Broken: the connection broke, or closed within the header.
        """
        view = conn.hdr_view
        while got < DATA_HEADER_SIZE:
            try:
                got += await conn.receive_into(view[got:] if got else view, DATA_HEADER_SIZE - got)
            except _Eof:
                if got == 0:
                    raise _Retired from None  # between two frames: nothing was cut off
                raise

    async def _read_frame(self, conn: _Conn) -> bool:
        """Read the payload of the frame whose header is in ``conn.hdr``; True if it had to wait."""
        tag, op_seq, seq, length = unpack_data_header_fields(conn.hdr)
        if length > MAX_DATA_FRAME_LENGTH:
            raise RemoteProtocolError(f"data frame length {length} exceeds the limit")
        peer = conn.peer_id
        key = (peer, tag, op_seq, seq)
        slot = self._slots.get(key)
        if slot is None and length >= _REGISTER_WAIT_MIN_BYTES and op_seq not in self._dead_ops:
            # Usually the operation's own task is already runnable (this peer got the master's
            # go-ahead too) and registers its receives within a few scheduler passes. Let it, rather
            # than stash: a stashed frame costs a fresh buffer and a second copy, and while this
            # reader fills the stash it keeps that very task from running (measured: 1-7 ms late
            # ring starts at 3 peers x 16 MB). Bounded: a truly early frame is stashed after that.
            # Small frames are stashed at once: cheap to stash, and the passes would cost more.
            for _ in range(_REGISTER_PASSES):
                await trio.lowlevel.checkpoint()
                slot = self._slots.get(key)
                if slot is not None or op_seq in self._dead_ops:
                    break
        if slot is not None:
            if slot.filling:
                raise RemoteProtocolError(f"frame {key} received twice")
            slot.filler = conn
            if length != slot.nbytes:
                slot._fail(RemoteProtocolError,
                           f"peer {peer} sent {length} bytes for a {slot.nbytes}-byte receive")
                del self._slots[key]
                raise RemoteProtocolError(f"frame {key}: {length} bytes, expected {slot.nbytes}")
            slot.filling = True
            blocked = await self._fill(conn, slot.dest, slot)
            if not slot.cancelled and self._slots.get(key) is slot:
                del self._slots[key]
                self._rx_bytes += length
                self._frames_received += 1
                self._mark_arrived(key)
                slot._complete()
            return blocked
        if op_seq in self._dead_ops or (peer, tag, seq) in self._arrived.get(op_seq, ()):
            self._bytes_discarded += length
            return await self._drop(conn, length)
        if key in self._stash:
            # a copy its sender resent after losing the connection the first one came on
            self._bytes_discarded += length
            return await self._drop(conn, length)
        if key in self._stashing:
            raise RemoteProtocolError(f"frame {key} received twice")
        if not self._fits(length):
            # Backpressure: stop reading this connection until the frame can go somewhere.
            slot = await self._wait_for_room(conn, key, length)
            if slot is not None:
                await self._read_frame(conn)  # registered meanwhile: straight into place
                return True
            if op_seq in self._dead_ops:
                self._bytes_discarded += length
                return await self._drop(conn, length)
            if key in self._stash or key in self._stashing:
                raise RemoteProtocolError(f"frame {key} received twice")
        buf = bytearray(length)
        self._stash_bytes += length
        self._stash_peak = max(self._stash_peak, self._stash_bytes)
        self._stashing.add(key)
        try:
            blocked = await self._fill(conn, memoryview(buf), None)
        except BaseException:
            self._stash_bytes -= length
            self._wake()
            raise
        finally:
            self._stashing.discard(key)
        self._frames_stashed += 1
        slot = self._slots.pop(key, None)
        if slot is not None:
            # registered while we were stashing
            self._stash_bytes -= length
            self._wake()
            self._deliver_stash(slot, buf)
        elif op_seq in self._dead_ops:
            self._stash_bytes -= length
            self._wake()
        else:
            self._stash[key] = buf
            self._stash_conn[key] = conn
            conn.stashed += length
        return blocked

    async def _wait_for_room(self, conn: _Conn, key: SlotKey, length: int) -> ReceiveSlot | None:
        """Backpressure: park this reader (its connection stays unread) until frame ``key`` can go
        somewhere: its receive is registered (returned), its operation is forgotten or the stash has
        room for it (None).

        Raises:
            _Blocked: none of that within ``p2p_stall_timeout``.
            _Broken: the connection or the pool was closed meanwhile.
        """
        self._reader_blocks += 1
        with trio.move_on_after(self._block_limit):
            while True:
                await self._room.park()
                if conn.closed or self._closed:
                    raise _Broken("connection closed")
                slot = self._slots.get(key)
                if slot is not None:
                    return slot
                if key[2] in self._dead_ops or self._fits(length):
                    return None
        raise _Blocked(
            f"{length}-byte frame {key} waited {self._block_limit:g}s (p2p_stall_timeout) for its receive "
            f"while the stash is full ({self._stash_bytes} of {self._stash_limit} bytes, "
            f"{conn.stashed} of them from this connection; {len(self._stash)} of "
            f"{self._stash_frames_limit} frames)"
        )

    async def _fill(self, conn: _Conn, view: memoryview, slot: ReceiveSlot | None) -> bool:
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
            # cancelled meanwhile; go through a pool-owned bounce buffer.
            bounce = conn.bounce
            if bounce is None:
                bounce = conn.bounce = memoryview(bytearray(_BOUNCE_BYTES))
        while got < n:
            if slot is not None and slot.cancelled:
                await self._drop(conn, n - got)
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

    async def _drop(self, conn: _Conn, n: int) -> bool:
        got = 0
        discard = self._discard
        while got < n:
            want = min(n - got, _DISCARD_BYTES)
            got += await conn.receive_into(discard[:want], want)
        return True

    # ------------------------------------------------------------------------------------------
    # introspection

    def statistics(self) -> dict[str, Any]:
        """A snapshot of the pool's state and counters."""
        return {
            "pool_size": self.pool_size,
            "closed": self._closed,
            "outgoing": {
                p: sum(1 for c in cs if c is not None and not c.closed) for p, cs in self._out.items()
            },
            "incoming": {p: sum(1 for (q, _i) in self._in if q == p) for p in {q for (q, _i) in self._in}},
            "pending_receives": len(self._slots),
            "stashed_frames": len(self._stash),
            "stashed_bytes": self._stash_bytes,
            "stash_limit": self._stash_limit,
            "stash_frames_limit": self._stash_frames_limit,
            "stash_peak_bytes": self._stash_peak,
            "readers_blocked": len(self._room),
            "reader_blocks_total": self._reader_blocks,
            "blocked_connections_dropped": self._blocked_drops,
            "tx_bytes": self._tx_bytes,
            "rx_bytes": self._rx_bytes,
            "frames_sent": self._frames_sent,
            "frames_received": self._frames_received,
            "frames_stashed_total": self._frames_stashed,
            "bytes_discarded": self._bytes_discarded,
            "connections_lost": self._connections_lost,
            "connections_retired": self._retired,
            "connections_closed_by_peer": self._closed_by_peer,
            "recv_waits": self._recv_waits + sum(c.recv_waits for c in self._in.values()),
            "send_waits": sum(c.send_waits for cs in self._out.values() for c in cs if c is not None),
        }

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<P2PPool peer={self.my_peer_id} size={self.pool_size} out={s['outgoing']} in={s['incoming']} "
            f"pending={s['pending_receives']} stashed={s['stashed_frames']}"
            f"{' closed' if self._closed else ''}>"
        )
