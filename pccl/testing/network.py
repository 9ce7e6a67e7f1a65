"""An in-memory virtual network implementing the :mod:`pccl.transport` seam.

Everything runs on trio's clock, so a test under ``trio.testing.MockClock(autojump_threshold=0)``
sees latencies, bandwidth limits and timeouts in virtual time with no real waiting.

Model
-----
* **Hosts.** ``net.host(name)`` returns a :class:`VirtualHost`, a :class:`~pccl.transport.Transport`.
  A host has one IP-like address (``"10.0.x.y"`` allocated in creation order, or the name itself
  when the name is an IPv4 address) plus its own private ``127.0.0.1``. With ``loopback=True`` every
  host's address is ``127.0.0.1`` and all hosts share one port space, like processes on one machine.
* **Links.** Each directed host pair ``(src, dst)`` has a one-way ``latency`` (seconds) and a
  ``bandwidth`` (bytes/s, ``None`` = infinite). Traffic a host sends to itself uses a separate
  self-link that defaults to zero latency and infinite bandwidth.
* **Timing ("next free time" token model).** Data is cut into segments of at most
  ``segment_size`` bytes. A segment of ``n`` bytes handed to a link at time ``t`` starts
  serializing at ``start = max(t, link.next_free)``, finishes at ``done = start + n / bandwidth``
  (``link.next_free`` becomes ``done``), and arrives at ``done + latency (+ hook delay)``. Arrival
  times are made non-decreasing per connection direction, so delivery is FIFO. Connections sharing a
  directed link interleave their segments in the order they were sent; since each connection can have
  at most ``buffer_size`` unacknowledged bytes, no connection can reserve the link far ahead of the
  others, which shares bandwidth fairly enough for tests.
* **Backpressure (a TCP-like window).** A sender may have at most ``buffer_size`` bytes that the
  receiving *application* has not yet consumed-and-acknowledged. Consumed bytes return to the sender's
  window one reverse-link latency after the read, so one connection moves at most about
  ``buffer_size`` bytes per round trip (long fat pipes need several connections or a bigger buffer,
  as with real TCP). A receiver that stops reading stalls its sender once the window is full.
* **Close and reset travel in-band.** ``aclose()`` queues a FIN behind the data already sent: the peer
  reads the data, then EOF (``b""`` / ``0``). A reset (crash, :class:`Reset` hook) queues an RST the
  same way: the peer reads what was already sent, then gets :class:`~pccl.transport.StreamBroken`.
  Once a FIN or RST has *arrived* at an end, sending on that end raises ``StreamBroken`` (broken pipe /
  reset by peer); data sent towards an end that is already closed is discarded. The local end of
  ``aclose()`` or of a crash fails its own pending and future operations at once.
* **Faults.** :meth:`VirtualNetwork.partition` black-holes a direction: segments not yet arrived stay
  queued (nothing is delivered, no FIN/RST, the sender blocks once its window is full) and are
  retransmitted when :meth:`~VirtualNetwork.heal` lifts the partition, as TCP would. Window credits
  are not affected by partitions, so a one-way partition stays one-way.
  :meth:`~VirtualNetwork.hang` freezes a host's application (its I/O calls block; its kernel keeps
  receiving and sending what was already queued). :meth:`~VirtualNetwork.crash` kills a host:
  listeners stop, every stream of the host fails at once locally and with an RST at the peer, and
  connects from it fail; connects to it time out until :meth:`~VirtualNetwork.restart`.
* **Hooks** (:meth:`VirtualNetwork.add_hook`) see every chunk of data as it is sent and may delay it,
  stall the direction, or reset/close the connection after a chosen number of bytes. See
  :func:`reset_after`, :func:`close_after`, :func:`stall_after`, :func:`delay_after` and
  :func:`trickle`.

Known simplifications: closing a stream with unread received data sends a FIN (real TCP sends an RST);
an RST does not discard data that already arrived; connection handshakes ignore bandwidth and
partitions that start mid-handshake; listener backlogs are unbounded; one listener per port per host
(a wildcard and a specific bind on the same port conflict).
"""

from __future__ import annotations

import ipaddress
import math
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

import trio

from ..transport import Address, ConnectFailed, StreamBroken

__all__ = [
    "Close",
    "Delay",
    "Hook",
    "HookAction",
    "LinkConfig",
    "NetworkStatistics",
    "Reset",
    "Stall",
    "StreamStatistics",
    "TrafficEvent",
    "VirtualHost",
    "VirtualListener",
    "VirtualNetwork",
    "VirtualStream",
    "close_after",
    "delay_after",
    "reset_after",
    "stall_after",
    "trickle",
]

_LOOPBACK: Final = "127.0.0.1"
_WILDCARD: Final = "0.0.0.0"
_EPHEMERAL_FIRST: Final = 49152
_EPHEMERAL_LAST: Final = 65535

_DATA: Final = 0
_FIN: Final = 1
_RST: Final = 2


def _now() -> float:
    """trio's (virtual) time; 0.0 outside ``trio.run``, where no stream can exist yet."""
    try:
        return trio.current_time()
    except RuntimeError:
        return 0.0


def _reached(t: float | None, now: float) -> bool:
    """Whether virtual time ``t`` has come.

    The tolerance absorbs float rounding in ``MockClock.jump`` (``base + (deadline - base)`` need
    not equal ``deadline``); without it a waiter could spin forever one ulp short of its deadline.
    """
    return t is not None and t <= now + max(1e-9, abs(now) * 1e-12)


# --------------------------------------------------------------------------------------------
# Public value types


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """Properties of one directed link.

    Attributes:
        latency: one-way delay in seconds.
        bandwidth: bytes per second; ``None`` means infinite.
    """

    latency: float
    bandwidth: float | None


@dataclass(frozen=True, kw_only=True)
class TrafficEvent:
    """A chunk of data about to enter the network, as seen by hooks.

    Attributes:
        connection: id of the connection (same for both directions, see
            :attr:`VirtualStream.connection_id`).
        src: name of the sending host.
        dst: name of the receiving host.
        src_address: (host, port) of the sending end.
        dst_address: (host, port) of the receiving end.
        offset: byte offset of ``data`` within this direction of the connection.
        data: the bytes (at most ``segment_size``).
        time: virtual time of the send.
    """

    connection: int
    src: str
    dst: str
    src_address: Address
    dst_address: Address
    offset: int
    data: bytes
    time: float


@dataclass(frozen=True)
class Delay:
    """Deliver the chunk ``seconds`` later than the link alone would.

    Later data in the same direction cannot overtake it (FIFO), so a delay is also a stall of that
    long. ``math.inf`` stalls forever.

    Attributes:
        seconds: extra delay (>= 0).
        nbytes: apply the delay to the first ``nbytes`` of the chunk only; the rest goes through the
            hooks again as a new event. ``None`` means the whole chunk.
    """

    seconds: float
    nbytes: int | None = None

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ValueError(f"delay must be >= 0, got {self.seconds}")
        if self.nbytes is not None and self.nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {self.nbytes}")


@dataclass(frozen=True)
class Reset:
    """Send the first ``after`` bytes of the chunk, then reset the connection (RST).

    The sender's pending and later operations fail at once; the receiver reads the bytes sent before
    the reset, then gets StreamBroken.
    """

    after: int = 0


@dataclass(frozen=True)
class Close:
    """Send the first ``after`` bytes of the chunk, then close the sending end cleanly (FIN).

    The receiver reads those bytes, then EOF (e.g. "a frame arriving with EOF"); the sender's
    ``send_all`` raises StreamBroken as if another task had closed its stream.
    """

    after: int = 0


@dataclass(frozen=True)
class Stall:
    """Send the first ``after`` bytes of the chunk; nothing later in this direction is ever delivered.

    The connection stays open (no FIN/RST); the sender blocks once its window is full.
    """

    after: int = 0


HookAction = Delay | Reset | Close | Stall
Hook = Callable[[TrafficEvent], HookAction | None]


@dataclass(frozen=True, kw_only=True)
class StreamStatistics:
    """Counters of one :class:`VirtualStream` end."""

    connection_id: int
    local_address: Address
    peer_address: Address
    bytes_sent: int
    bytes_received: int
    open: bool


@dataclass(frozen=True, kw_only=True)
class NetworkStatistics:
    """A snapshot of a :class:`VirtualNetwork`.

    Attributes:
        hosts: names of all hosts, in creation order.
        crashed: hosts that are crashed and not restarted.
        hung: hosts currently hung.
        partitions: blocked directed (src, dst) pairs.
        listeners: open listeners.
        open_connections: connections with at least one end still open.
        connections_opened: connections established so far.
        connections_refused: connects refused (no listener).
        connect_timeouts: connects that timed out (partition or crashed host).
        bytes_sent: data bytes accepted from senders.
        bytes_delivered: data bytes handed to receiving applications.
        bytes_discarded: data bytes thrown away (sent to or queued at a closed end).
    """

    hosts: tuple[str, ...]
    crashed: tuple[str, ...]
    hung: tuple[str, ...]
    partitions: tuple[tuple[str, str], ...]
    listeners: int
    open_connections: int
    connections_opened: int
    connections_refused: int
    connect_timeouts: int
    bytes_sent: int
    bytes_delivered: int
    bytes_discarded: int


# --------------------------------------------------------------------------------------------
# Internals


class _Signal:
    """Wake-up point for tasks waiting on some state; waiters re-check their condition."""

    __slots__ = ("_lot",)

    def __init__(self) -> None:
        self._lot = trio.lowlevel.ParkingLot()

    def fire(self) -> None:
        self._lot.unpark_all()

    async def wait(self, deadline: float = math.inf) -> None:
        """Wait for :meth:`fire` or for virtual time ``deadline``, whichever comes first."""
        with trio.move_on_at(deadline):
            await self._lot.park()


class _Link:
    __slots__ = ("bandwidth", "latency", "next_free")

    def __init__(self, latency: float, bandwidth: float | None) -> None:
        self.latency = latency
        self.bandwidth = bandwidth
        self.next_free = -math.inf


class _Segment:
    __slots__ = ("arrival", "data", "delay", "kind")

    def __init__(self, kind: int, data: bytes, delay: float) -> None:
        self.kind = kind
        self.data = data
        self.delay = delay
        # None: not scheduled (partitioned or stalled); it is (re)scheduled when the path opens.
        self.arrival: float | None = None


class _Pipe:
    """One direction of a connection: the bytes in flight plus the sender's window."""

    __slots__ = (
        "credits",
        "dst",
        "head_pos",
        "last_arrival",
        "offset",
        "queue",
        "receiver_gone",
        "src",
        "stalled",
        "terminal",
        "unacked",
    )

    def __init__(self, src: str, dst: str) -> None:
        self.src = src
        self.dst = dst
        self.queue: deque[_Segment] = deque()
        self.head_pos = 0  # bytes of queue[0] already consumed
        self.last_arrival = -math.inf
        self.unacked = 0
        self.credits: deque[tuple[float, int]] = deque()  # (time the ack reaches the sender, bytes)
        self.receiver_gone = False
        self.stalled = False
        self.terminal: _Segment | None = None  # the FIN or RST, once queued
        self.offset = 0

    def settle_credits(self, now: float) -> None:
        while self.credits and _reached(self.credits[0][0], now):
            self.unacked -= self.credits.popleft()[1]


class _Connection:
    __slots__ = ("a", "b", "id", "signal")

    def __init__(self, conn_id: int) -> None:
        self.id = conn_id
        self.signal = _Signal()
        self.a: VirtualStream
        self.b: VirtualStream


class _PortSpace:
    __slots__ = ("listeners", "next_ephemeral", "used")

    def __init__(self) -> None:
        self.listeners: dict[int, VirtualListener] = {}
        self.used: set[int] = set()
        self.next_ephemeral = _EPHEMERAL_FIRST

    def allocate(self) -> int:
        for _ in range(_EPHEMERAL_LAST - _EPHEMERAL_FIRST + 1):
            port = self.next_ephemeral
            self.next_ephemeral = port + 1 if port < _EPHEMERAL_LAST else _EPHEMERAL_FIRST
            if port not in self.used:
                self.used.add(port)
                return port
        raise ConnectFailed("no free ephemeral port")


def _normalize(host: str) -> str:
    h = host.strip()
    if h in ("", "*", _WILDCARD):
        return _WILDCARD
    if h == "localhost":
        return _LOOPBACK
    return h


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Streams, listeners, hosts


class VirtualStream:
    """One end of a virtual connection; implements :class:`~pccl.transport.Stream`.

    At most one task may send and one task receive at a time (``trio.BusyResourceError`` otherwise:
    the check exists to catch callers that forgot their lock).
    """

    def __init__(
        self,
        net: VirtualNetwork,
        conn: _Connection,
        host: VirtualHost,
        out_pipe: _Pipe,
        in_pipe: _Pipe,
        local: Address,
        peer: Address,
        local_port_owned: bool,
    ) -> None:
        self._net = net
        self._conn = conn
        self._host = host
        self._out = out_pipe
        self._in = in_pipe
        self._local = local
        self._peer = peer
        self._owns_port = local_port_owned
        self._dead: str | None = None
        self._sending = False
        self._receiving = False
        self._bytes_sent = 0
        self._bytes_received = 0

    # -- Stream protocol ---------------------------------------------------------------------

    @property
    def peer_address(self) -> Address:
        """(host, port) of the other side."""
        return self._peer

    @property
    def local_address(self) -> Address:
        """(host, port) of this side."""
        return self._local

    @property
    def connection_id(self) -> int:
        """Id shared by both ends of the connection (the ``connection`` of :class:`TrafficEvent`)."""
        return self._conn.id

    @property
    def host(self) -> VirtualHost:
        """The host (incarnation) that owns this end."""
        return self._host

    def path_estimate(self) -> tuple[float, int]:
        """``(round trip in seconds, window in bytes)`` of this connection now, as a kernel's
        ``TCP_INFO`` would tell a TCP socket's (the P2P pool sizes its stripes with it)."""
        there = self._net._wire.link(self._out.src, self._out.dst).latency
        back = self._net._wire.link(self._out.dst, self._out.src).latency
        return there + back, self._net.buffer_size

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send every byte of ``data``, blocking while the window is full.

        Raises:
            StreamBroken: this end is closed or its host crashed, the peer's FIN/RST has arrived, or
                a hook reset/closed the connection.
            trio.BusyResourceError: another task is already sending on this stream.
        """
        view = memoryview(data).cast("B")
        with self._exclusive("_sending", "sending"):
            await trio.lowlevel.checkpoint()
            total = len(view)
            pos = 0
            fresh = True  # a checkpoint just happened
            while True:
                if not fresh:
                    # A schedule point between segments, as a real socket gives between send() calls.
                    await trio.lowlevel.checkpoint()
                fresh = False
                if self._host._hung:
                    await self._conn.signal.wait()
                    fresh = True
                    continue
                now = trio.current_time()
                self._check_sendable(now)
                if pos >= total:
                    return
                n = self._transmit_segment(view, pos, now)
                if n == 0:
                    pipe = self._out
                    term = self._in.terminal
                    deadline = pipe.credits[0][0] if pipe.credits else math.inf
                    if term is not None and term.arrival is not None:
                        deadline = min(deadline, term.arrival)
                    await self._conn.signal.wait(deadline)
                    fresh = True
                    continue
                pos += n
                if pos >= total:
                    return

    def try_send(self, data: bytes | bytearray | memoryview) -> int:
        """Send what the window takes now, without waiting (no schedule point); returns the byte
        count: 0 when the window is full, another task is sending or the host hangs.

        Raises:
            StreamBroken: as :meth:`send_all`.
        """
        if self._sending or self._host._hung:
            return 0
        view = memoryview(data).cast("B")
        now = trio.current_time()
        self._check_sendable(now)
        pos = 0
        while pos < len(view):
            n = self._transmit_segment(view, pos, now)
            if n == 0:
                break
            pos += n
        return pos

    def _check_sendable(self, now: float) -> None:
        self._raise_if_dead()
        term = self._in.terminal
        if term is not None and _reached(term.arrival, now):
            kind = "reset by peer" if term.kind == _RST else "closed by peer (broken pipe)"
            raise StreamBroken(f"send to {self._peer} failed: connection {kind}")

    def _transmit_segment(self, view: memoryview, pos: int, now: float) -> int:
        """Hand the next segment of ``view`` from ``pos`` to the network if the window has room;
        returns its size (0: no room). Raises StreamBroken (a hook reset or closed the connection)."""
        pipe = self._out
        pipe.settle_credits(now)
        room = self._net.buffer_size - pipe.unacked
        if room <= 0:
            return 0
        n = min(room, self._net.segment_size, len(view) - pos)
        self._net._wire.transmit(self, bytes(view[pos : pos + n]), now)
        self._bytes_sent += n
        return n

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        """Receive 1..max_bytes bytes that have arrived; ``b""`` once the peer's FIN is reached.

        Raises:
            StreamBroken: this end is closed or crashed, or the peer's RST is reached.
            ValueError: ``max_bytes < 1``.
            trio.BusyResourceError: another task is already receiving on this stream.
        """
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        with self._exclusive("_receiving", "receiving"):
            parts: list[bytes] = []
            await self._receive(max_bytes, parts.append)
            return b"".join(parts)

    async def receive_into(self, buf: memoryview) -> int:
        """Receive up to ``len(buf)`` arrived bytes into ``buf``; 0 means EOF.

        Raises:
            StreamBroken: this end is closed or crashed, or the peer's RST is reached.
            trio.BusyResourceError: another task is already receiving on this stream.
        """
        target = memoryview(buf).cast("B")
        with self._exclusive("_receiving", "receiving"):
            if len(target) == 0:
                # Like recv_into() on a socket: nothing to do, not an EOF signal.
                await trio.lowlevel.checkpoint()
                return 0
            filled = 0

            def put(chunk: bytes) -> None:
                nonlocal filled
                target[filled : filled + len(chunk)] = chunk
                filled += len(chunk)

            await self._receive(len(target), put)
            return filled

    async def aclose(self) -> None:
        """Close this end: the peer reads what was sent, then EOF; pending local operations fail.

        Idempotent. The close happens even if the call is cancelled.
        """
        if self._dead is None:
            self._net._wire.kill_end(self, "stream closed", _FIN)
        await trio.lowlevel.checkpoint()

    # -- extras ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once this end was closed locally, reset, or its host crashed."""
        return self._dead is not None

    def statistics(self) -> StreamStatistics:
        """Counters of this end.

        Returns:
            A :class:`StreamStatistics` snapshot.
        """
        return StreamStatistics(
            connection_id=self._conn.id,
            local_address=self._local,
            peer_address=self._peer,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            open=self._dead is None,
        )

    def __repr__(self) -> str:
        state = "" if self._dead is None else f" {self._dead}"
        return (
            f"<VirtualStream #{self._conn.id} {self._host.name} {self._local} -> {self._peer}"
            f" sent={self._bytes_sent} received={self._bytes_received}{state}>"
        )

    # -- internals ---------------------------------------------------------------------------

    @contextmanager
    def _exclusive(self, flag: str, what: str) -> Iterator[None]:
        if getattr(self, flag):
            raise trio.BusyResourceError(f"another task is already {what} on this stream")
        setattr(self, flag, True)
        try:
            yield
        finally:
            setattr(self, flag, False)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise StreamBroken(f"stream {self._local} -> {self._peer}: {self._dead}")

    async def _receive(self, limit: int, put: Callable[[bytes], None]) -> None:
        await trio.lowlevel.checkpoint()
        pipe = self._in
        while True:
            if self._host._hung:
                await self._conn.signal.wait()
                continue
            self._raise_if_dead()
            now = trio.current_time()
            queue = pipe.queue
            head = queue[0] if queue else None
            if head is None or not _reached(head.arrival, now):
                deadline = math.inf if head is None or head.arrival is None else head.arrival
                await self._conn.signal.wait(deadline)
                continue
            if head.kind == _FIN:
                return
            if head.kind == _RST:
                self._net._wire.kill_end(self, "connection reset by peer", None)
                self._raise_if_dead()
            got = 0
            while got < limit and queue:
                seg = queue[0]
                if seg.kind != _DATA or not _reached(seg.arrival, now):
                    break
                start = pipe.head_pos
                take = min(limit - got, len(seg.data) - start)
                put(seg.data if start == 0 and take == len(seg.data) else seg.data[start : start + take])
                got += take
                if start + take == len(seg.data):
                    queue.popleft()
                    pipe.head_pos = 0
                else:
                    pipe.head_pos = start + take
            self._bytes_received += got
            self._net._wire.consumed(pipe, got, now)
            self._conn.signal.fire()
            return


class VirtualListener:
    """A listening endpoint on a :class:`VirtualHost`; implements :class:`~pccl.transport.Listener`."""

    def __init__(self, net: VirtualNetwork, host: VirtualHost, address: Address, space: _PortSpace) -> None:
        self._net = net
        self._host = host
        self._address = address
        self._space = space
        self._backlog: deque[tuple[float, VirtualStream]] = deque()
        self._signal = _Signal()
        self._closed = False
        self.accepted = 0

    @property
    def address(self) -> Address:
        """The bound (host, port); port is the real one even when 0 was asked for."""
        return self._address

    @property
    def host(self) -> VirtualHost:
        """The host (incarnation) this listener belongs to."""
        return self._host

    @property
    def closed(self) -> bool:
        """True once closed (explicitly or by a crash)."""
        return self._closed

    async def accept(self) -> VirtualStream:
        """Wait for the next established connection.

        Returns:
            The server end of the connection.

        Raises:
            StreamBroken: the listener is closed (or its host crashed).
        """
        await trio.lowlevel.checkpoint()
        while True:
            if self._host._hung:
                await self._signal.wait()
                continue
            if self._closed:
                raise StreamBroken(f"listener {self._address} closed")
            now = trio.current_time()
            if self._backlog and _reached(self._backlog[0][0], now):
                self.accepted += 1
                return self._backlog.popleft()[1]
            await self._signal.wait(self._backlog[0][0] if self._backlog else math.inf)

    async def aclose(self) -> None:
        """Stop listening; connections not yet accepted are reset. Idempotent."""
        self._net._sockets.close_listener(self)
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        state = " closed" if self._closed else f" backlog={len(self._backlog)}"
        return f"<VirtualListener {self._host.name} {self._address}{state}>"


class VirtualHost:
    """One incarnation of a virtual machine; implements :class:`~pccl.transport.Transport`.

    Get it with :meth:`VirtualNetwork.host`. After :meth:`VirtualNetwork.crash` this object stays dead
    forever (its connects and listens fail); :meth:`VirtualNetwork.restart` returns a new incarnation
    with the same name and address.

    Attributes:
        name: the host's name.
        address: its IP-like address (``"127.0.0.1"`` in loopback mode).
        connect_timeout: seconds (virtual) a connect waits for an unreachable host before failing.
    """

    def __init__(self, net: VirtualNetwork, name: str, address: str, incarnation: int) -> None:
        self._net = net
        self.name = name
        self.address = address
        self.incarnation = incarnation
        self.connect_timeout = net.connect_timeout
        self._alive = True
        self._hung = False
        self._ends: set[VirtualStream] = set()
        self._listeners: set[VirtualListener] = set()

    @property
    def alive(self) -> bool:
        """False once this incarnation crashed."""
        return self._alive

    @property
    def hung(self) -> bool:
        """True while the host is hung."""
        return self._hung

    @property
    def network(self) -> VirtualNetwork:
        """The network this host belongs to."""
        return self._net

    async def connect(self, host: str, port: int) -> VirtualStream:
        """Open a stream to (host, port); ``host`` is an address or a host name.

        Takes one round trip of virtual time.

        Returns:
            The client end.

        Raises:
            ConnectFailed: no listener there ("connection refused", after one round trip); the
                target is partitioned away or crashed and stays so for ``connect_timeout``; the
                address is unknown; or this host crashed.
        """
        return await self._net._sockets.connect(self, host, port)

    async def listen(self, host: str, port: int) -> VirtualListener:
        """Listen on (host, port) of this host.

        Args:
            host: ``"0.0.0.0"`` (or ``""``) for all of this host's addresses, this host's address or
                name, or ``"127.0.0.1"``/``"localhost"``.
            port: 0 picks a free ephemeral port.

        Returns:
            The listener; its ``address`` carries the real port.

        Raises:
            ConnectFailed: the address is not this host's, the port is in use, or the host crashed.
        """
        return await self._net._sockets.listen(self, host, port)

    def __repr__(self) -> str:
        state = "crashed" if not self._alive else ("hung" if self._hung else "up")
        return (
            f"<VirtualHost {self.name} {self.address} {state} streams={len(self._ends)}"
            f" listeners={len(self._listeners)}>"
        )


# --------------------------------------------------------------------------------------------
# The network


class _Unset:
    """Marker for "leave unchanged" (``None`` already means infinite bandwidth)."""

    def __repr__(self) -> str:
        return "UNSET"


_UNSET: Final = _Unset()

HostRef = str | VirtualHost


class _Wire:
    """The traffic between hosts: links, partitions, the segments queued on each connection, hooks and
    the bytes moved. Schedules every segment on its link (the "next free time" token model of the module
    docstring), reschedules when partitions change, and kills connection ends.

    Args:
        latency: default one-way latency of links between distinct hosts.
        bandwidth: their default bandwidth (``None``: infinite).
        topology: fired when partitions change (connects waiting for a path look again).
        release_port: frees the port of a dead end that owns one.
    """

    def __init__(
        self, latency: float, bandwidth: float | None, topology: _Signal,
        release_port: Callable[[VirtualStream], None],
    ) -> None:
        self.default_latency = latency
        self.default_bandwidth = bandwidth
        self.topology = topology
        self.release_port = release_port
        self.links: dict[tuple[str, str], _Link] = {}
        self.blocked: set[tuple[str, str]] = set()
        self.conns: dict[int, _Connection] = {}
        self.hooks: list[Hook] = []
        self.bytes_sent = 0
        self.bytes_delivered = 0
        self.bytes_discarded = 0

    def link(self, src: str, dst: str) -> _Link:
        link = self.links.get((src, dst))
        if link is None:
            if src == dst:
                link = _Link(0.0, None)
            else:
                link = _Link(self.default_latency, self.default_bandwidth)
            self.links[(src, dst)] = link
        return link

    def is_blocked(self, src: str, dst: str) -> bool:
        return src != dst and (src, dst) in self.blocked

    def schedule(self, pipe: _Pipe, seg: _Segment, now: float) -> None:
        if pipe.stalled or self.is_blocked(pipe.src, pipe.dst):
            seg.arrival = None
            return
        link = self.link(pipe.src, pipe.dst)
        done = now
        if seg.kind == _DATA and link.bandwidth is not None:
            start = max(now, link.next_free)
            done = start + len(seg.data) / link.bandwidth
            link.next_free = done
        arrival = max(done + link.latency + seg.delay, pipe.last_arrival)
        pipe.last_arrival = arrival
        seg.arrival = arrival

    def reschedule(self) -> None:
        """Apply the current partition set to every queued segment, then wake everyone."""
        now = _now()
        for (s, d), link in self.links.items():
            if self.is_blocked(s, d):
                # Bandwidth reserved for data that will now be retransmitted is not used.
                link.next_free = min(link.next_free, now)
        for conn in list(self.conns.values()):
            for pipe in (conn.a._out, conn.b._out):
                if pipe.stalled:
                    continue
                if self.is_blocked(pipe.src, pipe.dst):
                    for seg in pipe.queue:
                        if seg.arrival is not None and not _reached(seg.arrival, now):
                            seg.arrival = None
                    pipe.last_arrival = min(pipe.last_arrival, now)
                else:
                    for seg in pipe.queue:
                        if seg.arrival is None:
                            self.schedule(pipe, seg, now)
            conn.signal.fire()
        self.topology.fire()

    def enqueue(self, pipe: _Pipe, seg: _Segment, now: float, signal: _Signal) -> None:
        if pipe.receiver_gone:
            self.bytes_discarded += len(seg.data)
            return
        pipe.queue.append(seg)
        if seg.kind == _DATA:
            pipe.unacked += len(seg.data)
        else:
            pipe.terminal = seg
        self.schedule(pipe, seg, now)
        signal.fire()

    def transmit(self, end: VirtualStream, chunk: bytes, now: float) -> None:
        """Hand one chunk from ``end`` to the network, running the hooks. Raises StreamBroken."""
        pipe = end._out
        signal = end._conn.signal
        self.bytes_sent += len(chunk)
        while chunk:
            action = self._hook_action(end, chunk, now) if self.hooks else None
            if action is None:
                pipe.offset += len(chunk)
                self.enqueue(pipe, _Segment(_DATA, chunk, 0.0), now, signal)
                return
            if isinstance(action, Delay):
                k = len(chunk) if action.nbytes is None else min(action.nbytes, len(chunk))
                pipe.offset += k
                self.enqueue(pipe, _Segment(_DATA, chunk[:k], action.seconds), now, signal)
                chunk = chunk[k:]
                continue
            k = max(0, min(action.after, len(chunk)))
            if k:
                pipe.offset += k
                self.enqueue(pipe, _Segment(_DATA, chunk[:k], 0.0), now, signal)
            rest = chunk[k:]
            if isinstance(action, Stall):
                pipe.stalled = True
                if rest:
                    pipe.offset += len(rest)
                    self.enqueue(pipe, _Segment(_DATA, rest, 0.0), now, signal)
                return
            self.bytes_discarded += len(rest)
            if isinstance(action, Reset):
                self.kill_end(end, "connection reset (hook)", _RST)
            else:
                self.kill_end(end, "stream closed (hook)", _FIN)
            end._raise_if_dead()
            return

    def _hook_action(self, end: VirtualStream, chunk: bytes, now: float) -> HookAction | None:
        """What the first hook that acts on ``chunk`` wants done with it (None: no hook acts)."""
        pipe = end._out
        event = TrafficEvent(
            connection=end._conn.id,
            src=pipe.src,
            dst=pipe.dst,
            src_address=end._local,
            dst_address=end._peer,
            offset=pipe.offset,
            data=chunk,
            time=now,
        )
        for hook in list(self.hooks):
            action = hook(event)
            if action is not None:
                return action
        return None

    def consumed(self, pipe: _Pipe, nbytes: int, now: float) -> None:
        """The receiving application read ``nbytes``: the ack reaches the sender one latency later."""
        self.bytes_delivered += nbytes
        back = self.link(pipe.dst, pipe.src).latency
        if back <= 0:
            pipe.unacked -= nbytes
        else:
            pipe.credits.append((now + back, nbytes))

    def kill_end(self, end: VirtualStream, reason: str, send: int | None) -> None:
        """Make ``end`` dead: fail its operations, tell the peer (FIN/RST, in-band), drop its input."""
        if end._dead is not None:
            return
        end._dead = reason
        now = _now()
        signal = end._conn.signal
        if send is not None and end._out.terminal is None:
            self.enqueue(end._out, _Segment(send, b"", 0.0), now, signal)
        # Nothing will read this end any more: drop what is queued and give the sender its window
        # back so it is not stuck on a dead receiver.
        inp = end._in
        inp.receiver_gone = True
        discarded = sum(len(s.data) for s in inp.queue if s.kind == _DATA) - inp.head_pos
        self.bytes_discarded += max(0, discarded)
        inp.queue.clear()
        inp.head_pos = 0
        inp.unacked = 0
        inp.credits.clear()
        end._host._ends.discard(end)
        if end._owns_port:
            self.release_port(end)
        conn = end._conn
        if conn.a._dead is not None and conn.b._dead is not None:
            self.conns.pop(conn.id, None)
        signal.fire()


class _Sockets:
    """Ports, listeners and connection set-up of a :class:`VirtualNetwork`: which host an address names,
    whether a path is open, the SYN / SYN-ACK round trip, refusals and connect timeouts.

    Args:
        net: the network (its hosts, their addresses, loopback mode).
        wire: its traffic (links, partitions, connections).
        topology: fired when hosts or partitions change (connects waiting for a path look again).
    """

    def __init__(self, net: VirtualNetwork, wire: _Wire, topology: _Signal) -> None:
        self.net = net
        self.wire = wire
        self.topology = topology
        self.spaces: dict[str, _PortSpace] = {}
        self.shared_space = _PortSpace()
        self.next_conn_id = 1
        self.opened = 0
        self.refused = 0
        self.timeouts = 0

    def space_of(self, host: VirtualHost) -> _PortSpace:
        if self.net.loopback:
            return self.shared_space
        space = self.spaces.get(host.name)
        if space is None:
            space = self.spaces[host.name] = _PortSpace()
        return space

    def release_port(self, end: VirtualStream) -> None:
        """The port ``end`` owns is free again."""
        self.space_of(end._host).used.discard(end._local[1])

    def close_listener(self, lst: VirtualListener) -> None:
        if lst._closed:
            return
        lst._closed = True
        port = lst._address[1]
        if lst._space.listeners.get(port) is lst:
            del lst._space.listeners[port]
            lst._space.used.discard(port)
        lst._host._listeners.discard(lst)
        while lst._backlog:
            _, end = lst._backlog.popleft()
            self.wire.kill_end(end, "listener closed", _RST)
        lst._signal.fire()

    async def listen(self, host: VirtualHost, bind: str, port: int) -> VirtualListener:
        await trio.lowlevel.checkpoint()
        while host._hung:
            await self.topology.wait()
        if not host._alive:
            raise ConnectFailed(f"cannot listen on {bind}:{port}: host {host.name} crashed")
        if not 0 <= port <= 65535:
            raise ConnectFailed(f"cannot listen on {bind}:{port}: invalid port")
        addr = _normalize(bind)
        if addr == host.name:
            addr = host.address
        if addr not in (_WILDCARD, _LOOPBACK, host.address):
            raise ConnectFailed(f"cannot listen on {bind}:{port}: cannot assign requested address")
        space = self.space_of(host)
        if port == 0:
            port = space.allocate()
        elif port in space.used:
            raise ConnectFailed(f"cannot listen on {bind}:{port}: address already in use")
        else:
            space.used.add(port)
        lst = VirtualListener(self.net, host, (addr, port), space)
        space.listeners[port] = lst
        host._listeners.add(lst)
        return lst

    def find_listener(self, space: _PortSpace, ip: str, port: int) -> VirtualListener | None:
        lst = space.listeners.get(port)
        if lst is None or lst._closed or not lst._host._alive:
            return None
        if lst._address[0] not in (_WILDCARD, ip):
            return None
        return lst

    async def connect(self, src: VirtualHost, host: str, port: int) -> VirtualStream:
        await trio.lowlevel.checkpoint()
        target = f"{host}:{port}"
        while src._hung:
            await self.topology.wait()
        if not src._alive:
            raise ConnectFailed(f"connect to {target} failed: host {src.name} crashed")
        if not 1 <= port <= 65535:
            raise ConnectFailed(f"connect to {target} failed: invalid port")
        dst_ip, dst_name, space = self._resolve(src, host, target)
        peer = await self._wait_for_path(src, dst_name, dst_ip, space, port, target)
        there = self.wire.link(src.name, peer).latency
        back = self.wire.link(peer, src.name).latency
        await trio.sleep(there)  # the SYN travels
        if not src._alive:
            raise ConnectFailed(f"connect to {target} failed: host {src.name} crashed")
        lst = self.find_listener(space, dst_ip, port)
        if lst is None:
            await trio.sleep(back)  # the RST travels back
            self.refused += 1
            raise ConnectFailed(f"connect to {target} failed: connection refused")
        client = self._open(src, lst, dst_ip, port)
        # The server's accept completes when the client's final ACK arrives: one round trip from now.
        lst._backlog.append((trio.current_time() + back + there, client._conn.b))
        lst._signal.fire()
        try:
            await trio.sleep(back)  # the SYN/ACK travels back
        except BaseException:
            self.wire.kill_end(client, "connect cancelled", _FIN)
            raise
        if not src._alive:
            raise ConnectFailed(f"connect to {target} failed: host {src.name} crashed")
        return client

    def _resolve(self, src: VirtualHost, host: str, target: str) -> tuple[str, str | None, _PortSpace]:
        """``(destination ip, destination host name or None, port space)`` of ``host`` seen from ``src``
        (None: loopback mode, the listener decides)."""
        net = self.net
        addr = _normalize(host)
        if net.loopback:
            if addr == _LOOPBACK or addr in net._hosts:
                return _LOOPBACK, None, self.shared_space
            raise ConnectFailed(f"connect to {target} failed: no route to host (loopback network)")
        if addr == _LOOPBACK:
            return _LOOPBACK, src.name, self.space_of(src)
        name = addr if addr in net._hosts else net._by_address.get(addr)
        if name is None:
            raise ConnectFailed(f"connect to {target} failed: no route to host")
        return net._hosts[name].address, name, self.space_of(net._hosts[name])

    async def _wait_for_path(
        self, src: VirtualHost, dst_name: str | None, dst_ip: str, space: _PortSpace, port: int, target: str
    ) -> str:
        """Wait for a path: SYN and SYN/ACK both need to cross, and someone must be there to answer.
        Returns the destination host's name."""
        deadline = trio.current_time() + src.connect_timeout
        while True:
            if src._hung:
                await self.topology.wait()
                continue
            if not src._alive:
                raise ConnectFailed(f"connect to {target} failed: host {src.name} crashed")
            peer = dst_name
            if peer is None:  # loopback: whoever listens on the port is the destination
                lst = self.find_listener(space, dst_ip, port)
                peer = lst._host.name if lst is not None else src.name
            reachable = (
                not self.wire.is_blocked(src.name, peer)
                and not self.wire.is_blocked(peer, src.name)
                and self.net._hosts[peer]._alive
            )
            if reachable:
                return peer
            if _reached(deadline, trio.current_time()):
                self.timeouts += 1
                raise ConnectFailed(f"connect to {target} timed out after {src.connect_timeout}s")
            await self.topology.wait(deadline)

    def _open(self, src: VirtualHost, lst: VirtualListener, dst_ip: str, port: int) -> VirtualStream:
        """A new connection from ``src`` to listener ``lst``; its client end."""
        src_ip = _LOOPBACK if dst_ip == _LOOPBACK else src.address
        dst_host = lst._host
        src_port = self.space_of(src).allocate()
        conn = _Connection(self.next_conn_id)
        self.next_conn_id += 1
        up = _Pipe(src.name, dst_host.name)
        down = _Pipe(dst_host.name, src.name)
        net = self.net
        client = VirtualStream(net, conn, src, up, down, (src_ip, src_port), (dst_ip, port), True)
        server = VirtualStream(net, conn, dst_host, down, up, (dst_ip, port), (src_ip, src_port), False)
        conn.a, conn.b = client, server
        self.wire.conns[conn.id] = conn
        src._ends.add(client)
        dst_host._ends.add(server)
        self.opened += 1
        return client


class VirtualNetwork:
    """An in-memory network of virtual hosts driven by trio's clock.

    Construct it anywhere (no trio calls happen until streams are used). See the module docstring for
    the timing and fault model.

    Args:
        loopback: every host's address is ``127.0.0.1`` and all hosts share one port space.
        latency: default one-way latency (seconds) of links between distinct hosts.
        bandwidth: default bandwidth (bytes/s) of links between distinct hosts; ``None`` = infinite.
        connect_timeout: default (virtual) seconds a connect waits for an unreachable host.
        buffer_size: per-connection, per-direction window: bytes sent but not yet read and
            acknowledged by the receiver, above which ``send_all`` blocks. The 4 MiB default is
            about what Linux autotunes a TCP connection to; one connection then moves at most
            ``buffer_size`` bytes per round trip.
        segment_size: largest chunk handed to the link at once (granularity of timing, hooks and
            partial delivery).
    """

    def __init__(
        self,
        *,
        loopback: bool = False,
        latency: float = 0.0,
        bandwidth: float | None = None,
        connect_timeout: float = 5.0,
        buffer_size: int = 4 << 20,
        segment_size: int = 64 << 10,
    ) -> None:
        if latency < 0:
            raise ValueError("latency must be >= 0")
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError("bandwidth must be > 0 or None")
        if buffer_size < 1 or segment_size < 1:
            raise ValueError("buffer_size and segment_size must be >= 1")
        self.loopback = loopback
        self.connect_timeout = connect_timeout
        self.buffer_size = buffer_size
        self.segment_size = segment_size
        self._hosts: dict[str, VirtualHost] = {}
        self._by_address: dict[str, str] = {}
        self._topology = _Signal()
        self._next_auto_ip = 1
        self._wire = _Wire(latency, bandwidth, self._topology, self._release_port)
        self._sockets = _Sockets(self, self._wire, self._topology)

    @property
    def default_latency(self) -> float:
        """One-way latency (seconds) of links between distinct hosts not configured otherwise."""
        return self._wire.default_latency

    @property
    def default_bandwidth(self) -> float | None:
        """Bandwidth (bytes/s, None: infinite) of links between distinct hosts not configured otherwise."""
        return self._wire.default_bandwidth

    def _release_port(self, end: VirtualStream) -> None:
        self._sockets.release_port(end)

    # -- hosts --------------------------------------------------------------------------------

    def host(self, name_or_ip: str) -> VirtualHost:
        """Get the current incarnation of a host, creating it if needed.

        Args:
            name_or_ip: a name (an address is allocated) or an IPv4 address (used as the address,
                except in loopback mode). An existing host is also found by its address.

        Returns:
            The host.
        """
        found = self._hosts.get(name_or_ip)
        if found is None and name_or_ip in self._by_address:
            found = self._hosts[self._by_address[name_or_ip]]
        if found is not None:
            return found
        if not name_or_ip or _normalize(name_or_ip) in (_WILDCARD, _LOOPBACK):
            raise ValueError(f"{name_or_ip!r} cannot name a host")
        if self.loopback:
            address = _LOOPBACK
        elif _is_ipv4(name_or_ip):
            address = name_or_ip
        else:
            address = self._allocate_ip()
        h = VirtualHost(self, name_or_ip, address, 1)
        self._hosts[name_or_ip] = h
        if not self.loopback:
            self._by_address[address] = name_or_ip
        return h

    @property
    def hosts(self) -> list[VirtualHost]:
        """Current incarnations of all hosts, in creation order."""
        return list(self._hosts.values())

    def _allocate_ip(self) -> str:
        while True:
            n = self._next_auto_ip
            self._next_auto_ip += 1
            ip = f"10.0.{n // 254}.{n % 254 + 1}"
            if ip not in self._by_address and ip not in self._hosts:
                return ip

    def _incarnation(self, ref: HostRef) -> VirtualHost:
        """The given incarnation, or the current one of a name/address."""
        return ref if isinstance(ref, VirtualHost) else self._hosts[self._name(ref)]

    def _name(self, ref: HostRef) -> str:
        name = ref.name if isinstance(ref, VirtualHost) else ref
        if name not in self._hosts:
            if name in self._by_address:
                return self._by_address[name]
            raise ValueError(f"unknown host {name!r}")
        return name

    # -- links --------------------------------------------------------------------------------

    def set_link(
        self,
        a: HostRef,
        b: HostRef,
        *,
        latency: float | _Unset = _UNSET,
        bandwidth: float | _Unset | None = _UNSET,
        oneway: bool = False,
    ) -> None:
        """Configure the link a -> b (and b -> a unless ``oneway``). Affects data sent afterwards.

        Args:
            a: source host (name, address or :class:`VirtualHost`).
            b: destination host.
            latency: one-way seconds; omitted = unchanged.
            bandwidth: bytes/s, ``None`` = infinite; omitted = unchanged.
            oneway: configure only a -> b.

        Raises:
            ValueError: unknown host or invalid value.
        """
        if isinstance(latency, float | int) and latency < 0:
            raise ValueError("latency must be >= 0")
        if isinstance(bandwidth, float | int) and bandwidth <= 0:
            raise ValueError("bandwidth must be > 0 or None")
        na, nb = self._name(a), self._name(b)
        pairs = [(na, nb)] if oneway or na == nb else [(na, nb), (nb, na)]
        for s, d in pairs:
            link = self._wire.link(s, d)
            if not isinstance(latency, _Unset):
                link.latency = float(latency)
            if not isinstance(bandwidth, _Unset):
                link.bandwidth = None if bandwidth is None else float(bandwidth)

    def link(self, a: HostRef, b: HostRef) -> LinkConfig:
        """The current configuration of the directed link a -> b.

        Raises:
            ValueError: unknown host.
        """
        link = self._wire.link(self._name(a), self._name(b))
        return LinkConfig(latency=link.latency, bandwidth=link.bandwidth)

    # -- faults -------------------------------------------------------------------------------

    def partition(self, a: HostRef, b: HostRef | None = None, *, oneway: bool = False) -> None:
        """Black-hole traffic a -> b (and b -> a unless ``oneway``).

        Data not yet arrived stays queued and is delivered after :meth:`heal`; senders block once
        their window fills; no FIN/RST crosses; new connects between them time out.

        Args:
            a: a host.
            b: the other host; ``None`` means every other host that exists now.
            oneway: block only a -> b.
        """
        na = self._name(a)
        others = [self._name(b)] if b is not None else [n for n in self._hosts if n != na]
        for nb in others:
            if nb == na:
                raise ValueError("a host cannot be partitioned from itself")
            self._wire.blocked.add((na, nb))
            if not oneway:
                self._wire.blocked.add((nb, na))
        self._wire.reschedule()

    def heal(self, a: HostRef | None = None, b: HostRef | None = None) -> None:
        """Lift partitions: all of them, all involving ``a``, or those between ``a`` and ``b``.

        Queued data is retransmitted from now on.
        """
        if a is None:
            if b is not None:
                raise ValueError("heal(b=...) needs a")
            self._wire.blocked.clear()
        else:
            na = self._name(a)
            nb = self._name(b) if b is not None else None
            self._wire.blocked = {
                (s, d)
                for (s, d) in self._wire.blocked
                if not ((nb is None and na in (s, d)) or (nb is not None and {s, d} == {na, nb}))
            }
        self._wire.reschedule()

    def is_partitioned(self, a: HostRef, b: HostRef) -> bool:
        """Whether traffic a -> b is currently blocked."""
        return (self._name(a), self._name(b)) in self._wire.blocked

    def reset(self, a: HostRef, b: HostRef) -> int:
        """Reset every connection between hosts ``a`` and ``b`` now, as a middlebox that drops its
        state would: both ends fail at once (pending and later operations raise StreamBroken), data
        still in flight between them is lost, and both hosts stay up (new connects work).

        Returns:
            How many connections were reset.
        """
        ha, hb = self._incarnation(a), self._incarnation(b)
        conns = {end._conn.id: end._conn for end in list(ha._ends)
                 if (end._conn.b if end._conn.a is end else end._conn.a)._host is hb}
        for conn in conns.values():
            self._wire.kill_end(conn.a, "connection reset by the network", _RST)
            self._wire.kill_end(conn.b, "connection reset by the network", _RST)
        self._topology.fire()
        return len(conns)

    def hang(self, host: HostRef) -> None:
        """Freeze a host's application: its I/O calls block until :meth:`unhang`.

        Its connections stay open, peers see no FIN, and its kernel keeps receiving (so senders to
        it stall only once their window is full) and keeps sending what was already queued.
        """
        self._incarnation(host)._hung = True

    def unhang(self, host: HostRef) -> None:
        """Resume a hung host."""
        h = self._incarnation(host)
        h._hung = False
        for end in list(h._ends):
            end._conn.signal.fire()
        for lst in list(h._listeners):
            lst._signal.fire()
        self._topology.fire()

    def crash(self, host: HostRef) -> None:
        """Kill a host abruptly.

        Its listeners stop; every stream it holds fails at once locally (pending operations raise
        StreamBroken) and with an RST at the peer (which reads what was already sent, then gets
        StreamBroken); connects from it fail and connects to it time out until :meth:`restart`.
        """
        h = self._incarnation(host)
        if not h._alive:
            return
        h._alive = False
        h._hung = False
        for lst in list(h._listeners):
            self._sockets.close_listener(lst)
        for end in list(h._ends):
            self._wire.kill_end(end, "host crashed", _RST)
        self._topology.fire()

    def restart(self, host: HostRef) -> VirtualHost:
        """Bring a crashed host back as a new incarnation (same name, address and links).

        A host that is still up is crashed first. The old :class:`VirtualHost` object stays dead.

        Returns:
            The new incarnation.
        """
        name = self._name(host)
        old = self._hosts[name]
        self.crash(old)
        new = VirtualHost(self, name, old.address, old.incarnation + 1)
        new.connect_timeout = old.connect_timeout
        self._hosts[name] = new
        self._topology.fire()
        return new

    # -- hooks --------------------------------------------------------------------------------

    def add_hook(self, hook: Hook) -> Hook:
        """Register a hook called for every chunk of data as it is sent.

        Hooks run in registration order; the first that returns an action (not ``None``) decides.

        Args:
            hook: ``hook(event: TrafficEvent) -> HookAction | None``.

        Returns:
            ``hook``, for :meth:`remove_hook`.
        """
        self._wire.hooks.append(hook)
        return hook

    def remove_hook(self, hook: Hook) -> None:
        """Unregister a hook (no error if absent)."""
        if hook in self._wire.hooks:
            self._wire.hooks.remove(hook)

    # -- reporting ----------------------------------------------------------------------------

    def statistics(self) -> NetworkStatistics:
        """A snapshot of hosts, connections and bytes moved.

        Returns:
            A :class:`NetworkStatistics`.
        """
        hosts = list(self._hosts.values())
        return NetworkStatistics(
            hosts=tuple(h.name for h in hosts),
            crashed=tuple(h.name for h in hosts if not h._alive),
            hung=tuple(h.name for h in hosts if h._hung),
            partitions=tuple(sorted(self._wire.blocked)),
            listeners=sum(len(h._listeners) for h in hosts),
            open_connections=len(self._wire.conns),
            connections_opened=self._sockets.opened,
            connections_refused=self._sockets.refused,
            connect_timeouts=self._sockets.timeouts,
            bytes_sent=self._wire.bytes_sent,
            bytes_delivered=self._wire.bytes_delivered,
            bytes_discarded=self._wire.bytes_discarded,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        extra = ""
        if s.crashed:
            extra += f" crashed={list(s.crashed)}"
        if s.hung:
            extra += f" hung={list(s.hung)}"
        if s.partitions:
            extra += f" partitions={len(s.partitions)}"
        return (
            f"<VirtualNetwork{' loopback' if self.loopback else ''} hosts={len(s.hosts)}{extra}"
            f" listeners={s.listeners} connections={s.open_connections} open/{s.connections_opened} total"
            f" bytes sent={s.bytes_sent} delivered={s.bytes_delivered}>"
        )

# --------------------------------------------------------------------------------------------
# Ready-made hooks


def _matcher(
    src: str | None, dst: str | None, port: int | None, connection: int | None
) -> Callable[[TrafficEvent], bool]:
    def match(ev: TrafficEvent) -> bool:
        return (
            (src is None or ev.src == src)
            and (dst is None or ev.dst == dst)
            and (port is None or port in (ev.src_address[1], ev.dst_address[1]))
            and (connection is None or ev.connection == connection)
        )

    return match


def _after_hook(
    nbytes: int,
    make: Callable[[int], HookAction],
    src: str | None,
    dst: str | None,
    port: int | None,
    connection: int | None,
) -> Hook:
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    match = _matcher(src, dst, port, connection)
    fired: set[tuple[int, str]] = set()

    def hook(ev: TrafficEvent) -> HookAction | None:
        key = (ev.connection, ev.src)
        if key in fired or not match(ev) or ev.offset + len(ev.data) < nbytes:
            return None
        fired.add(key)
        return make(nbytes - ev.offset)

    return hook


def reset_after(
    nbytes: int,
    *,
    src: str | None = None,
    dst: str | None = None,
    port: int | None = None,
    connection: int | None = None,
) -> Hook:
    """A hook that resets each matching connection direction once ``nbytes`` have been sent on it.

    The receiver reads exactly ``nbytes`` bytes, then StreamBroken. Filters: sending host name
    ``src``, receiving host name ``dst``, a ``port`` at either end, a ``connection`` id.
    """
    return _after_hook(nbytes, Reset, src, dst, port, connection)


def close_after(
    nbytes: int,
    *,
    src: str | None = None,
    dst: str | None = None,
    port: int | None = None,
    connection: int | None = None,
) -> Hook:
    """A hook that closes the sending end (FIN) once ``nbytes`` have been sent in that direction.

    The receiver reads exactly ``nbytes`` bytes, then EOF. Filters as for :func:`reset_after`.
    """
    return _after_hook(nbytes, Close, src, dst, port, connection)


def stall_after(
    nbytes: int,
    *,
    src: str | None = None,
    dst: str | None = None,
    port: int | None = None,
    connection: int | None = None,
) -> Hook:
    """A hook after which nothing more is delivered in a matching direction (no FIN, no RST).

    The receiver reads exactly ``nbytes`` bytes, then waits forever. Filters as for
    :func:`reset_after`.
    """
    return _after_hook(nbytes, Stall, src, dst, port, connection)


def delay_after(
    nbytes: int,
    seconds: float,
    *,
    src: str | None = None,
    dst: str | None = None,
    port: int | None = None,
    connection: int | None = None,
) -> Hook:
    """A hook that holds a matching direction for ``seconds`` once ``nbytes`` have been sent.

    Bytes from offset ``nbytes`` on arrive ``seconds`` late (and nothing overtakes them). Filters as
    for :func:`reset_after`.
    """
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    match = _matcher(src, dst, port, connection)
    fired: set[tuple[int, str]] = set()

    def hook(ev: TrafficEvent) -> HookAction | None:
        key = (ev.connection, ev.src)
        if key in fired or not match(ev) or ev.offset + len(ev.data) <= nbytes:
            return None
        if ev.offset < nbytes:
            return Delay(0.0, nbytes=nbytes - ev.offset)  # the prefix passes untouched
        fired.add(key)
        return Delay(seconds)

    return hook


def trickle(
    bytes_per_second: float,
    *,
    piece: int = 1,
    src: str | None = None,
    dst: str | None = None,
    port: int | None = None,
    connection: int | None = None,
) -> Hook:
    """A hook that delivers matching directions ``piece`` bytes at a time at ``bytes_per_second``.

    Filters as for :func:`reset_after`.
    """
    if bytes_per_second <= 0 or piece < 1:
        raise ValueError("bytes_per_second must be > 0 and piece >= 1")
    match = _matcher(src, dst, port, connection)
    next_at: dict[tuple[int, str], float] = {}
    interval = piece / bytes_per_second

    def hook(ev: TrafficEvent) -> HookAction | None:
        if not match(ev):
            return None
        key = (ev.connection, ev.src)
        at = max(ev.time, next_at.get(key, ev.time)) + interval
        next_at[key] = at
        return Delay(at - ev.time, nbytes=piece)

    return hook
