"""The sending side of the ring pool (:mod:`pccl.peer.pool`): the outgoing connections to each partner,
opened, sized (striping), reopened and retired, and the frames sent on them.
"""

from __future__ import annotations

import logging

import trio

from .._config import PeerConfig
from .._errors import RankConnectionFailedError, RankConnectionLostError
from ..transport import Transport
from .credentials import CredentialStore
from .op_io import OpIo
from .p2p import open_p2p
from .ring_cc import RingCongestionControl
from .ring_conn import Broken, Conn, open_conn, path_estimate, rtt_inflation, tcp_counters
from .striping import StripeSizer

__all__ = ["RING_CHANNEL", "RingLinks", "Transfer"]

log = logging.getLogger("pccl.p2p")

RING_CHANNEL = "ring"


class Transfer:
    """One operation's transfer to one partner, from :meth:`RingLinks.begin_transfer` to
    :meth:`RingLinks.end_transfer`: its start (trio's clock), its connection count, and whether
    another transfer to the same partner overlapped it (then its throughput is a share of the link's,
    not the link's, and is not observed)."""

    __slots__ = ("connections", "counters", "peer_id", "shared", "start")

    def __init__(self, peer_id: int, start: float, connections: int) -> None:
        self.peer_id = peer_id
        self.start = start
        self.connections = connections
        self.shared = False
        #: each striped connection's (retransmitted, sent) segment counters at the start
        self.counters: list[tuple[Conn, tuple[int, int]]] = []


def _retransmitted(t: Transfer) -> float:
    """The share of the segments ``t``'s connections sent during it that were retransmissions (0 where
    the counters are unknown or a connection was replaced meanwhile)."""
    again = sent = 0
    for conn, (r0, s0) in t.counters:
        now = tcp_counters(conn.stream)
        if now is None or conn.closed:
            continue
        again += (now[0] - r0) % (1 << 32)
        sent += (now[1] - s0) % (1 << 32)
    return again / sent if sent else 0.0


def _queued(t: Transfer) -> float | None:
    """The most any of ``t``'s connections' smoothed round trip stood above its smallest at the end
    (:func:`~pccl.peer.ring_conn.rtt_inflation`; None where no connection can say): logged with each
    observation (a queue the stripe filled, against random loss that leaves it empty; not a rule of
    the sizer, docs/topology.md "At least four connections")."""
    known = [x for x in (rtt_inflation(conn.stream) for conn, _ in t.counters if not conn.closed)
             if x is not None]
    return max(known) if known else None


class RingLinks:
    """This peer's outgoing ring connections, ``pool_size`` per partner (or sized per partner when 0).

    The arguments are those of :class:`pccl.peer.pool.P2PPool`.
    """

    def __init__(
        self,
        *,
        transport: Transport,
        my_peer_id: int,
        pool_size: int,
        config: PeerConfig,
        secret: str,
        socket_buffer_bytes: int | None,
        credentials: CredentialStore | None,
    ) -> None:
        self.transport = transport
        self.my_peer_id = my_peer_id
        self.pool_size = pool_size
        self.config = config
        self.secret = secret
        self.socket_buffer_bytes = socket_buffer_bytes
        self.credentials = credentials
        self.closed = False
        self.conns: dict[int, list[Conn | None]] = {}
        # pool_size 0: each partner's count (pccl.peer.striping), kept while the partner is a partner
        # (across a failed operation's reconnect; retire() forgets it)
        self.sizers: dict[int, StripeSizer] = {}
        self._transfers: dict[int, set[Transfer]] = {}
        self._addr: dict[int, tuple[str, int]] = {}
        self._connect_locks: dict[int, trio.Lock] = {}
        # counters for statistics()
        self.tx_bytes = 0
        self.frames_sent = 0
        self.io: OpIo | None = None  # bytes per operation and partner (the pool sets it)
        self.connections_lost = 0
        self.retired = 0  # peers whose connections retire() closed
        #: per partner, the share of segments retransmitted in its last observed transfer
        self.retransmitted: dict[int, float] = {}
        #: the congestion control of the outgoing connections (pccl.peer.ring_cc)
        self.cc = RingCongestionControl(config)

    async def connect(self, peer_id: int, host: str, port: int) -> None:
        """Make sure all ``pool_size`` outgoing connections to ``peer_id`` are open.

        Idempotent: open, healthy connections are kept; closed or broken ones are replaced; all
        missing ones are opened concurrently. If the address changed, the old ones are closed.

        Raises:
            RankConnectionFailedError: some connection could not be opened (those that did
                open are kept; calling again opens the rest).
        """
        if self.closed:
            raise RankConnectionFailedError("the P2P pool is closed")
        lock = self._connect_locks.setdefault(peer_id, trio.Lock())
        async with lock:
            conns = self.conns.get(peer_id)
            if conns is not None and self._addr.get(peer_id) != (host, port):
                self.conns.pop(peer_id, None)
                self.sizers.pop(peer_id, None)  # another address: another path
                for c in conns:
                    if c is not None:
                        await c.aclose()
                conns = None
            if conns is None:
                conns = [None] * (self.pool_size or 1)
                self.conns[peer_id] = conns
                self._addr[peer_id] = (host, port)
                if not self.pool_size:
                    await self._open_sized(peer_id, host, port, conns)
            sizer = self.sizers.get(peer_id)
            if sizer is not None and len(conns) < sizer.count:
                conns.extend([None] * (sizer.count - len(conns)))  # the sizer raised the count
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

    async def _open_sized(self, peer_id: int, host: str, port: int, conns: list[Conn | None]) -> None:
        """Open the first connection to ``peer_id``, then size the stripe from its round trip:
        ``conns`` grows (in place) to the count its :class:`~pccl.peer.striping.StripeSizer` gives (made
        now from the round trip; after a failed operation closed them, the sizer the partner had)."""
        errors: list[str] = []
        await self._open_one(peer_id, host, port, 0, conns, errors)
        first = conns[0]
        if errors or first is None:
            # Forget the unsized list: the next connect() starts over and sizes the stripe then.
            if self.conns.get(peer_id) is conns:
                del self.conns[peer_id]
                self._addr.pop(peer_id, None)
            raise RankConnectionFailedError(
                f"the first connection to peer {peer_id} failed: {errors[0] if errors else 'closed'}"
            )
        sizer = self.sizers.get(peer_id)
        if sizer is None:
            path = path_estimate(first.stream)
            if path is None:
                return
            rtt, window = path
            sizer = self.sizers[peer_id] = StripeSizer(
                rtt,
                window_bytes=window,
                guess_bytes_per_s=self.config.p2p_stripe_target_mbit * 1e6 / 8,
                max_stripes=self.config.p2p_max_stripes,
            )
            log.debug("peer %d: rtt %.2f ms, window %d: %d connection(s)", peer_id, rtt * 1e3, window,
                      sizer.count)
            self.cc.opened(first, sizer, False)  # (_open_one could not tell before the sizer)
        conns.extend([None] * (sizer.count - 1))

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
        """How many connections an operation stripes over to ``peer_id`` (its open pool's size, or
        the sizer's count where the sizer lowered it; before it is connected the configured size,
        at least 1)."""
        conns = self.conns.get(peer_id)
        if not conns:
            return max(1, self.pool_size)
        sizer = self.sizers.get(peer_id)
        return len(conns) if sizer is None else max(1, min(sizer.count, len(conns)))

    def far(self, peer_id: int) -> bool:
        """True if ``peer_id``'s round trip alone asked for more than one connection (the sizer's first
        guess; roughly over 20 ms), or this peer stripes to it: a master round trip is then a visible
        share of a large operation (the speculative start's test)."""
        sizer = self.sizers.get(peer_id)
        return (sizer is not None and sizer.guess > 1) or self.stripes(peer_id) > 1

    def begin_transfer(self, peer_id: int) -> Transfer:
        """A large operation starts sending to ``peer_id`` over :meth:`stripes` connections."""
        t = Transfer(peer_id, trio.current_time(), self.stripes(peer_id))
        if peer_id in self.sizers and not self.pool_size:
            for c in self.conns.get(peer_id, [])[: t.connections]:
                counters = None if c is None else tcp_counters(c.stream)
                if c is not None and counters is not None:
                    t.counters.append((c, counters))
        running = self._transfers.setdefault(peer_id, set())
        if running:
            t.shared = True
            for other in running:
                other.shared = True
        running.add(t)
        return t

    def end_transfer(self, t: Transfer, nbytes: int, completed: bool) -> None:
        """``t`` ended, ``nbytes`` sent. A completed transfer that had the partner's connections to
        itself tells the partner's sizer its throughput (which may change the count for the next
        operations: more connections are opened by the next :meth:`connect`, fewer leave the rest
        idle and open)."""
        running = self._transfers.get(t.peer_id)
        if running is not None:
            running.discard(t)
            if not running:
                del self._transfers[t.peer_id]
        sizer = self.sizers.get(t.peer_id)
        if not completed or t.shared or sizer is None or self.pool_size:
            return
        before = sizer.count
        again = self.retransmitted[t.peer_id] = _retransmitted(t)
        after = sizer.observe(nbytes, trio.current_time() - t.start, t.connections, again)
        level = logging.INFO if after != before else logging.DEBUG
        if log.isEnabledFor(level):  # (the round trip's figure costs a TCP_INFO read per connection)
            queued = _queued(t)
            log.log(level, "peer %d: %d bytes in %.3f s over %d connection(s), %.2f%% retransmitted, round "
                    "trip %s of its smallest: %d from now on (%r)", t.peer_id, nbytes,
                    trio.current_time() - t.start, t.connections, 100 * again,
                    "unknown" if queued is None else f"{queued:.2f}x", after, sizer)
        self.cc.lowered(t.peer_id, self.conns.get(t.peer_id, []), before, after)

    async def _open_one(
        self, peer_id: int, host: str, port: int, index: int, conns: list[Conn | None], errors: list[str]
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
        conn = open_conn(ms.stream, peer_id, index, outgoing=True, buffer_bytes=self.socket_buffer_bytes)
        if self.closed or self.conns.get(peer_id) is not conns:
            # disconnect() or aclose() ran while we were connecting: this connection is unwanted
            await conn.aclose()
            errors.append("disconnected while connecting")
            return
        conns[index] = conn
        self.cc.opened(conn, self.sizers.get(peer_id), bool(self.pool_size))

    def blocked_partners(self) -> list[int]:
        """Peers with a frame being sent to them right now (a stall watch asks this when no frame has
        moved for ``p2p_stall_timeout``: a send still under way then is one the receiver does not take)."""
        return sorted(p for p, cs in self.conns.items()
                      if any(c is not None and not c.closed and c.lock.locked() for c in cs))

    def is_connected(self, peer_id: int) -> bool:
        """True if all outgoing connections to ``peer_id`` (``pool_size``, or as many as its sizing
        chose) are open and healthy."""
        conns = self.conns.get(peer_id)
        if conns is None:
            return False
        sizer = self.sizers.get(peer_id)
        if sizer is not None and len(conns) < sizer.count:
            return False
        return all(c is not None and c.alive() for c in conns)

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
        gone = [p for p in self.conns if p not in keep]
        conns: list[Conn] = []
        for p in gone:
            conns += [c for c in self.conns.pop(p) if c is not None]
            self._addr.pop(p, None)
            self.sizers.pop(p, None)
            self.retransmitted.pop(p, None)
        self.retired += len(gone)
        with trio.CancelScope(shield=True):
            for c in conns:
                await c.aclose()
        return gone

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
        conns = self.conns.get(peer_id)
        conn = conns[conn_index % len(conns)] if conns else None
        if conn is None or conn.closed:
            await trio.lowlevel.checkpoint()
            raise RankConnectionLostError(f"no open connection to peer {peer_id}")
        row = self.io.row(op_seq, peer_id) if self.io is not None else None
        if row is not None:
            row[2] += 1  # under way (stays so if the send is cut off)
        try:
            await conn.send_frame(tag, op_seq, seq, data)
        except Broken as exc:
            self.connections_lost += 1
            raise RankConnectionLostError(f"connection to peer {peer_id} lost while sending: {exc}") from None
        self.tx_bytes += len(data)
        self.frames_sent += 1
        if row is not None:
            row[2] -= 1
            row[0] += len(data)

    # ------------------------------------------------------------------------------------------
    # receiving

    def pop_peer(self, peer_id: int) -> list[Conn]:
        """Take every connection to ``peer_id`` out (the caller closes them); its address is kept."""
        return [c for c in self.conns.pop(peer_id, []) if c is not None]

    def close(self) -> list[Conn]:
        """Refuse new connections; take every connection out (the caller closes them)."""
        self.closed = True
        conns = [c for cs in self.conns.values() for c in cs if c is not None]
        self.conns.clear()
        return conns

    def statistics(self) -> dict[int, int]:
        """Per peer, how many outgoing connections are open."""
        return {p: sum(1 for c in cs if c is not None and not c.closed) for p, cs in self.conns.items()}

    def stripe_statistics(self) -> dict[int, int]:
        """Per connected peer, how many connections operations stripe over (:meth:`stripes`)."""
        return {p: self.stripes(p) for p in self.conns}

    def send_waits(self) -> int:
        """How many times a send waited for room in a socket's buffer (open connections)."""
        return sum(c.send_waits for cs in self.conns.values() for c in cs if c is not None)
