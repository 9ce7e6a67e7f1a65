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

The pool is a facade over four parts, each in its own module:

* :mod:`pccl.peer.ring_conn`: one connection and how its bytes move (``Conn`` for any stream,
  ``SocketConn`` the fast path on TCP and the same-host shortcut, with its socket options);
* :mod:`pccl.peer.ring_links`: the outgoing connections to each partner (open, size the stripe, reopen,
  retire) and the frames sent on them;
* :mod:`pccl.peer.ring_reader`: the incoming connections and the reader each runs (headers, payload
  into its receive, the stash or the discard scratch; backpressure);
* :mod:`pccl.peer.ring_inbox`: the book the readers and operations share, with no I/O: registered
  receives, the stash, finished operations, the parking lot of blocked readers.

One read path and one write path: the pool's logic (headers, routing, stash, discard) is written
once against a connection's ``receive_into`` / ``send_frame``; how the bytes move is a property of the
connection.
"""

from __future__ import annotations

from collections.abc import Collection, Coroutine, Iterable
from typing import Any

import trio

from .._config import PeerConfig
from ..transport import Transport
from ..wire.messages import Hello
from ..wire.stream import MessageStream
from .credentials import CredentialStore
from .op_io import OpIo
from .ring_conn import DEFAULT_RCVLOWAT, DEFAULT_SOCKET_BUFFER, Conn, path_estimate
from .ring_inbox import ReceiveSlot, RingInbox, SlotKey
from .ring_links import RING_CHANNEL, RingLinks, Transfer
from .ring_reader import RingReaders

__all__ = [
    "DEFAULT_RCVLOWAT",
    "DEFAULT_SOCKET_BUFFER",
    "RING_CHANNEL",
    "P2PPool",
    "ReceiveSlot",
    "SlotKey",
    "path_estimate",
]


class P2PPool:
    """Ring data connections to neighbours, with per-frame routing of received data.

    Args:
        transport: how to open connections.
        my_peer_id: this peer's id (presented in every Hello).
        pool_size: connections per neighbour and direction (>= 1), or 0: sized per partner from the
            round trip of its first connection, then from the throughput of its large transfers
            (:mod:`pccl.peer.striping`, with the config's ``p2p_stripe_target_mbit`` and
            ``p2p_max_stripes``).
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
        self._closed = False
        self.links = RingLinks(
            transport=transport,
            my_peer_id=my_peer_id,
            pool_size=pool_size,
            config=config,
            secret=secret,
            socket_buffer_bytes=socket_buffer_bytes,
            credentials=credentials,
        )
        self.inbox = RingInbox(config)
        self.readers = RingReaders(self.inbox, socket_buffer_bytes)
        # Data bytes by operation and partner: what a member testifies when an operation stalls.
        self.io = self.links.io = self.readers.io = OpIo()

    # ------------------------------------------------------------------------------------------
    # connections

    async def connect(self, peer_id: int, host: str, port: int) -> None:
        """Make sure all outgoing connections to ``peer_id`` are open (:meth:`RingLinks.connect
        <pccl.peer.ring_links.RingLinks.connect>`).

        Raises:
            RankConnectionFailedError: the pool is closed, or some connection could not be opened
                (those that did open are kept; calling again opens the rest).
        """
        await self.links.connect(peer_id, host, port)

    async def reopen(self, peer_id: int) -> None:
        """Reopen the lost connections to ``peer_id`` at the address it was connected at (one of a
        stripe broke while the operation using it runs).

        Raises:
            RankConnectionFailedError: not connected before, or a connection could not be opened.
        """
        await self.links.reopen(peer_id)

    def stripes(self, peer_id: int) -> int:
        """How many connections an operation stripes over to ``peer_id`` (its open pool's size,
        before it is connected the configured size, at least 1)."""
        return self.links.stripes(peer_id)

    def far(self, peer_id: int) -> bool:
        """True if ``peer_id`` is far enough that a master round trip is a visible share of a large
        operation (:meth:`RingLinks.far <pccl.peer.ring_links.RingLinks.far>`)."""
        return self.links.far(peer_id)

    def begin_transfer(self, peer_id: int) -> Transfer:
        """A large operation starts sending to ``peer_id`` (:meth:`RingLinks.begin_transfer
        <pccl.peer.ring_links.RingLinks.begin_transfer>`); pass the result to :meth:`end_transfer`."""
        return self.links.begin_transfer(peer_id)

    def end_transfer(self, transfer: Transfer, nbytes: int, completed: bool) -> None:
        """The transfer ended with ``nbytes`` sent: its throughput sizes the partner's stripe for the next
        operations (:meth:`RingLinks.end_transfer <pccl.peer.ring_links.RingLinks.end_transfer>`)."""
        self.links.end_transfer(transfer, nbytes, completed)

    def op_io(self, op_seq: int) -> list[tuple[int, int, int]]:
        """``(peer, bytes sent to it, bytes taken from it)`` of operation ``op_seq`` (one of the last
        few): what this member testifies when the operation stalls (:class:`~pccl.peer.op_io.OpIo`)."""
        return self.io.rows(op_seq)

    def op_arrived(self, op_seq: int) -> Collection[tuple[int, int, int]]:
        """The frames ``(peer, tag, seq)`` of operation ``op_seq`` (one of the last few) taken whole
        when it ended (:meth:`OpIo.arrived <pccl.peer.op_io.OpIo.arrived>`)."""
        return self.io.arrived(op_seq)

    def op_blocked(self, op_seq: int) -> list[int]:
        """The partners of operation ``op_seq`` whose send was under way when it ended."""
        return self.io.blocked(op_seq)

    def blocked_partners(self) -> list[int]:
        """Peers with a frame being sent to them right now (a stall watch asks this when no frame has
        moved for ``p2p_stall_timeout``: a send still under way then is one the receiver does not take)."""
        return self.links.blocked_partners()

    def is_connected(self, peer_id: int) -> bool:
        """True if all outgoing connections to ``peer_id`` (``pool_size``, or as many as its sizing
        chose) are open and healthy."""
        return self.links.is_connected(peer_id)

    async def retire(self, keep: set[int]) -> list[int]:
        """Close the outgoing connections to every peer not in ``keep`` (after a topology change; see
        :meth:`RingLinks.retire <pccl.peer.ring_links.RingLinks.retire>`). Call it only with no
        operation of this pool in flight.

        Returns:
            The peers whose connections were closed.
        """
        return await self.links.retire(keep)

    async def disconnect(self, peer_id: int) -> None:
        """Close every connection with ``peer_id``, both directions.

        Used after a failed operation, when the state of those streams is unknown. Pending
        receives from that peer fail with RankConnectionLostError; its stashed frames are dropped;
        the next :meth:`connect` rebuilds the outgoing side (the peer rebuilds the other).
        """
        conns = self.links.pop_peer(peer_id) + self.readers.pop_peer(peer_id)
        self.inbox.drop_peer(peer_id, f"connections to peer {peer_id} were closed")
        await _close_all(conns)
        self.inbox.wake()  # readers of those connections parked on a full stash see them closed

    async def disconnect_all(self, peer_ids: Iterable[int]) -> None:
        """:meth:`disconnect` each of ``peer_ids``, shielded from cancellation: the partners of a
        failed operation, closed while that operation is being cancelled."""
        with trio.CancelScope(shield=True):
            for peer_id in peer_ids:
                await self.disconnect(peer_id)

    async def aclose(self) -> None:
        """Close every connection; pending receives fail; the pool cannot be used again."""
        self._closed = True
        conns = self.links.close() + self.readers.close()
        self.inbox.close()
        await _close_all(conns)
        self.inbox.wake()

    # ------------------------------------------------------------------------------------------
    # data

    def send(
        self, peer_id: int, tag: int, op_seq: int, seq: int, data: memoryview, *, conn_index: int
    ) -> Coroutine[Any, Any, None]:
        """Send one data frame to ``peer_id`` on outgoing connection ``conn_index % pool_size``
        (:meth:`RingLinks.send <pccl.peer.ring_links.RingLinks.send>`: arguments, ordering, errors)."""
        # The links' coroutine itself (no wrapper of its own): this is on every frame's path.
        return self.links.send(peer_id, tag, op_seq, seq, data, conn_index=conn_index)

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
        return self.inbox.expect(peer_id, tag, op_seq, seq, dest)

    def forget_op(self, op_seq: int) -> None:
        """Drop every receive and stash of operation ``op_seq`` and discard its later frames.

        Pending receives fail; readers stop writing into their destinations before this returns.
        Call it whenever an operation ends (successfully or not), and for operations aborted
        before they ran here, so their stragglers do not pile up in the stash.
        """
        # what arrived whole: a stall testimony reads it (pccl/peer/early_frames.py)
        self.io.ended(op_seq, self.inbox.arrived.get(op_seq))
        self.inbox.forget_op(op_seq)

    async def handle_incoming(self, ms: MessageStream, hello: Hello) -> None:
        """The "ring" channel handler for :func:`~pccl.peer.p2p.serve_p2p`: this connection's reader.

        Runs until the connection closes or breaks; then, if it was still this pool's current
        connection for its (peer, index), fails the pending receives from that peer with
        RankConnectionLostError. A protocol violation (bad header, wrong length, stash over the
        limit) closes the connection the same way.
        """
        await self.readers.handle_incoming(ms, hello)

    # ------------------------------------------------------------------------------------------
    # introspection

    def statistics(self) -> dict[str, Any]:
        """A snapshot of the pool's state and counters."""
        links, readers, inbox = self.links, self.readers, self.inbox
        return {
            "pool_size": self.pool_size,
            "closed": self._closed,
            "outgoing": links.statistics(),
            "stripes": links.stripe_statistics(),
            "retransmitted": dict(links.retransmitted),
            # far connections given config.p2p_congestion_control, and those the kernel refused it
            "congestion_control_set": links.cc.set,
            "congestion_control_refused": links.cc.refused,
            "incoming": readers.statistics(),
            **inbox.statistics(),
            "blocked_connections_dropped": readers.blocked_drops,
            "tx_bytes": links.tx_bytes,
            "rx_bytes": inbox.rx_bytes,
            "frames_sent": links.frames_sent,
            "frames_received": inbox.frames_received,
            "frames_stashed_total": inbox.frames_stashed,
            "bytes_discarded": inbox.bytes_discarded,
            "connections_lost": links.connections_lost + readers.connections_lost,
            "connections_retired": links.retired,
            "connections_closed_by_peer": readers.closed_by_peer,
            "recv_waits": readers.recv_waits + sum(c.recv_waits for c in readers.conns.values()),
            "send_waits": links.send_waits(),
        }

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<P2PPool peer={self.my_peer_id} size={self.pool_size} out={s['outgoing']} in={s['incoming']} "
            f"pending={s['pending_receives']} stashed={s['stashed_frames']}"
            f"{' closed' if self._closed else ''}>"
        )


async def _close_all(conns: list[Conn]) -> None:
    """Close ``conns``, shielded from cancellation."""
    with trio.CancelScope(shield=True):
        for c in conns:
            await c.aclose()
