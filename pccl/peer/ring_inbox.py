"""The receiving side's book of the ring pool (:mod:`pccl.peer.pool`): registered receives, the stash of
early frames, finished operations and the backpressure parking lot.

No I/O: the reader of each incoming connection (:mod:`pccl.peer.ring_reader`) asks it where a frame goes
and tells it what arrived; an operation's task registers receives (:meth:`RingInbox.expect`) and forgets
operations (:meth:`RingInbox.forget_op`). The rules (what is stashed, when a reader parks, why that cannot
deadlock) are in the module docstring of :mod:`pccl.peer.pool`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import trio

from .._config import PeerConfig
from .._errors import (
    InvalidUsageError,
    LocalProtocolError,
    PCCLError,
    RankConnectionLostError,
    RemoteProtocolError,
)
from .ring_conn import Blocked, Broken, Conn

__all__ = ["ReceiveSlot", "RingInbox", "SlotKey"]

SlotKey = tuple[int, int, int, int]  # (from_peer, tag, op_seq, seq)

_DEAD_OPS_KEEP = 8192  # how many finished op_seqs we remember to drop their stragglers


class ReceiveSlot:
    """A registered receive: one frame from one peer, landing in ``dest``.

    Created by :meth:`pccl.peer.pool.P2PPool.expect`; ``await slot.wait()`` returns once ``dest`` is full.
    """

    __slots__ = ("_error", "_task", "cancelled", "dest", "done", "filler", "filling", "key", "nbytes")

    def __init__(self, key: SlotKey, dest: memoryview) -> None:
        self.key = key
        self.dest = dest
        self.nbytes = len(dest)
        self.done = False
        self.filling = False
        self.filler: Conn | None = None  # the connection filling it (while ``filling``)
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


class RingInbox:
    """Where each incoming frame goes: its registered receive, the stash, or nowhere (its operation is
    finished, or it is a resent copy of a frame that already arrived).

    Args:
        config: ``recv_stash_limit`` and ``recv_stash_frames`` (the stash's bounds) and
            ``p2p_stall_timeout`` (how long a reader parks for room).
    """

    def __init__(self, config: PeerConfig) -> None:
        self.closed = False
        self.slots: dict[SlotKey, ReceiveSlot] = {}
        self.stash: dict[SlotKey, bytearray] = {}
        self.stash_conn: dict[SlotKey, Conn] = {}  # the connection each stashed frame came on
        self.stashing: set[SlotKey] = set()
        self.stash_bytes = 0
        self.stash_limit = config.recv_stash_limit
        self.stash_frames_limit = config.recv_stash_frames
        # Backpressure (see pccl.peer.pool): readers whose frame neither has a receive nor fits in the
        # stash park here; everything that registers a receive, forgets an operation, frees stash space
        # or closes connections wakes them to look again.
        self.room = trio.lowlevel.ParkingLot()
        self.block_limit = config.p2p_stall_timeout
        self.dead_ops: OrderedDict[int, None] = OrderedDict()
        # Frames of live operations that arrived whole, by op_seq: a sender that lost a connection
        # of a stripe resends what it had sent on it (it cannot know what arrived), and the copies
        # of frames already here are dropped instead of stashed. Cleared by forget_op.
        self.arrived: dict[int, set[tuple[int, int, int]]] = {}
        # counters for statistics()
        self.rx_bytes = 0
        self.frames_received = 0
        self.frames_stashed = 0
        self.bytes_discarded = 0
        self.stash_peak = 0  # most bytes the stash ever held (reserved included)
        self.reader_blocks = 0  # times a reader stopped reading because the stash was full

    # ------------------------------------------------------------------------------------------
    # an operation's side

    def expect(self, peer_id: int, tag: int, op_seq: int, seq: int, dest: memoryview) -> ReceiveSlot:
        """Register a receive of frame ``(tag, op_seq, seq)`` from ``peer_id`` into ``dest``; see
        :meth:`pccl.peer.pool.P2PPool.expect`."""
        if self.closed:
            raise InvalidUsageError("the P2P pool is closed")
        if op_seq in self.dead_ops:
            raise InvalidUsageError(f"operation {op_seq} is already finished on this peer")
        key = (peer_id, tag, op_seq, seq)
        if key in self.slots:
            raise LocalProtocolError(f"receive {key} registered twice")
        if dest.format != "B" or dest.ndim != 1:
            dest = dest.cast("B")
        slot = ReceiveSlot(key, dest)
        buf = self.unstash(key)
        if buf is not None:
            self._deliver_stash(slot, buf)
            return slot
        self.slots[key] = slot
        if self.room:
            self.room.unpark_all()  # a reader may be parked on exactly this frame
        return slot

    def forget_op(self, op_seq: int) -> None:
        """Drop every receive and stash of operation ``op_seq`` and discard its later frames; see
        :meth:`pccl.peer.pool.P2PPool.forget_op`."""
        self.dead_ops[op_seq] = None
        self.dead_ops.move_to_end(op_seq)
        self.arrived.pop(op_seq, None)
        while len(self.dead_ops) > _DEAD_OPS_KEEP:
            self.dead_ops.popitem(last=False)
        if self.slots:
            for key in [k for k in self.slots if k[2] == op_seq]:
                self.slots.pop(key)._fail(RankConnectionLostError, f"operation {op_seq} was aborted")
        if self.stash:
            for key in [k for k in self.stash if k[2] == op_seq]:
                self.unstash(key)
        self.wake()  # a reader parked on a frame of this op now drops it

    # ------------------------------------------------------------------------------------------
    # a reader's side

    def is_straggler(self, key: SlotKey) -> bool:
        """True if frame ``key`` (which has no receive) is to be read and dropped: its operation is
        finished here, or it is a copy its sender resent after losing the connection the first one came
        on (the first arrived, or is stashed)."""
        peer, tag, op_seq, seq = key
        return (op_seq in self.dead_ops or (peer, tag, seq) in self.arrived.get(op_seq, ())
                or key in self.stash)

    def reject(self, key: SlotKey, slot: ReceiveSlot, length: int) -> None:
        """Fail receive ``key``: its frame came with ``length`` bytes instead of ``slot.nbytes``."""
        slot._fail(RemoteProtocolError, f"peer {key[0]} sent {length} bytes for a {slot.nbytes}-byte receive")
        del self.slots[key]

    def filled(self, key: SlotKey, slot: ReceiveSlot, length: int) -> None:
        """Frame ``key`` of ``length`` bytes was read into ``slot``: done, unless the slot was cancelled or
        replaced meanwhile."""
        if not slot.cancelled and self.slots.get(key) is slot:
            del self.slots[key]
            self.rx_bytes += length
            self.frames_received += 1
            self._mark_arrived(key)
            slot._complete()

    def fits(self, length: int) -> bool:
        """True if a frame of ``length`` bytes fits in the stash now."""
        # Counted in bytes and in frames: a frame of length 0 costs no payload but ~350 bytes of
        # bookkeeping (its key, its buffer object, two dict slots), so frames are capped on their own.
        return (self.stash_bytes + length <= self.stash_limit
                and len(self.stash) + len(self.stashing) < self.stash_frames_limit)

    def reserve(self, key: SlotKey, length: int) -> bytearray:
        """A fresh buffer for frame ``key``, its room counted in the stash while a reader fills it."""
        buf = bytearray(length)
        self.stash_bytes += length
        self.stash_peak = max(self.stash_peak, self.stash_bytes)
        self.stashing.add(key)
        return buf

    def abandon(self, key: SlotKey, length: int) -> None:
        """The reader filling the buffer :meth:`reserve` gave for ``key`` failed: its room goes back."""
        self.stashing.discard(key)
        self.stash_bytes -= length
        self.wake()

    def keep(self, key: SlotKey, buf: bytearray, conn: Conn) -> None:
        """Frame ``key``, read into ``buf`` (from :meth:`reserve`) on ``conn``: delivered if its receive was
        registered meanwhile, dropped if its operation ended meanwhile, else stashed."""
        self.stashing.discard(key)
        self.frames_stashed += 1
        slot = self.slots.pop(key, None)
        if slot is not None:  # registered while we were stashing
            self.stash_bytes -= len(buf)
            self.wake()
            self._deliver_stash(slot, buf)
        elif key[2] in self.dead_ops:
            self.stash_bytes -= len(buf)
            self.wake()
        else:
            self.stash[key] = buf
            self.stash_conn[key] = conn
            conn.stashed += len(buf)

    async def wait_for_room(self, conn: Conn, key: SlotKey, length: int) -> ReceiveSlot | None:
        """Backpressure: park this reader (its connection stays unread) until frame ``key`` can go
        somewhere: its receive is registered (returned), its operation is forgotten or the stash has
        room for it (None).

        Raises:
            Blocked: none of that within ``p2p_stall_timeout``.
            Broken: the connection or the pool was closed meanwhile.
        """
        self.reader_blocks += 1
        with trio.move_on_after(self.block_limit):
            while True:
                await self.room.park()
                if conn.closed or self.closed:
                    raise Broken("connection closed")
                slot = self.slots.get(key)
                if slot is not None:
                    return slot
                if key[2] in self.dead_ops or self.fits(length):
                    return None
        raise Blocked(
            f"{length}-byte frame {key} waited {self.block_limit:g}s (p2p_stall_timeout) for its receive "
            f"while the stash is full ({self.stash_bytes} of {self.stash_limit} bytes, "
            f"{conn.stashed} of them from this connection; {len(self.stash)} of "
            f"{self.stash_frames_limit} frames)"
        )

    def release_fills(self, conn: Conn) -> None:
        """The slot ``conn`` was filling goes back to waiting: the sender resends its frame on
        another connection of the stripe (a lost connection that was not the peer's last)."""
        for slot in self.slots.values():
            if slot.filling and slot.filler is conn:
                slot.filling = False
                slot.filler = None

    def drop_stash_of(self, conn: Conn) -> None:
        """Release every stashed frame that came on ``conn``."""
        if self.stash_conn:
            for skey in [k for k, c in self.stash_conn.items() if c is conn]:
                self.unstash(skey)

    # ------------------------------------------------------------------------------------------
    # peers and the whole pool

    def fail_peer(self, peer_id: int, reason: str) -> None:
        """Fail every pending receive from ``peer_id`` with RankConnectionLostError(``reason``)."""
        for key in [k for k in self.slots if k[0] == peer_id]:
            self.slots.pop(key)._fail(RankConnectionLostError, reason)

    def drop_peer(self, peer_id: int, reason: str) -> None:
        """Fail ``peer_id``'s pending receives and drop its stashed frames (its connections are closed)."""
        self.fail_peer(peer_id, reason)
        for key in [k for k in self.stash if k[0] == peer_id]:
            self.unstash(key)

    def close(self) -> None:
        """Fail every pending receive and drop the stash; :meth:`expect` refuses from now on."""
        self.closed = True
        for slot in list(self.slots.values()):
            slot._fail(RankConnectionLostError, "the P2P pool was closed")
        self.slots.clear()
        self.arrived.clear()
        self.stash.clear()
        self.stash_conn.clear()
        self.stash_bytes = 0

    def unstash(self, key: SlotKey) -> bytearray | None:
        """Take frame ``key`` out of the stash (None if it is not there); parked readers look again."""
        buf = self.stash.pop(key, None)
        if buf is None:
            return None
        self.stash_bytes -= len(buf)
        conn = self.stash_conn.pop(key, None)
        if conn is not None:
            conn.stashed -= len(buf)
        if self.room:
            self.room.unpark_all()
        return buf

    def wake(self) -> None:
        """Parked readers look again (something changed: room, receives, closed connections)."""
        if self.room:
            self.room.unpark_all()

    def _deliver_stash(self, slot: ReceiveSlot, buf: bytearray) -> None:
        if len(buf) != slot.nbytes:
            slot._fail(RemoteProtocolError,
                       f"peer {slot.key[0]} sent {len(buf)} bytes for a {slot.nbytes}-byte receive")
            return
        slot.dest[:] = buf
        self.rx_bytes += len(buf)
        self.frames_received += 1
        self._mark_arrived(slot.key)
        slot._complete()

    def _mark_arrived(self, key: SlotKey) -> None:
        peer, tag, op_seq, seq = key
        self.arrived.setdefault(op_seq, set()).add((peer, tag, seq))

    def statistics(self) -> dict[str, Any]:
        """The receiving side's part of :meth:`pccl.peer.pool.P2PPool.statistics`."""
        return {
            "pending_receives": len(self.slots),
            "stashed_frames": len(self.stash),
            "stashed_bytes": self.stash_bytes,
            "stash_limit": self.stash_limit,
            "stash_frames_limit": self.stash_frames_limit,
            "stash_peak_bytes": self.stash_peak,
            "readers_blocked": len(self.room),
            "reader_blocks_total": self.reader_blocks,
        }
