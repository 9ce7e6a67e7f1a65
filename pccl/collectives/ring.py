"""Ring collectives over a :class:`~pccl.peer.pool.P2PPool`: all-reduce, reduce-scatter,
all-gather and broadcast.

The plan (which frames to send and receive, see :mod:`pccl.collectives.schedule`) is executed as
a dependency-driven pipeline rather than step by step: every receive is registered up front and
lands straight in ``out`` (zero copy); as soon as block ``b`` of a step has arrived (and, in the
reduce-scatter half, has been reduced in place with this rank's input), block ``b`` of the next
step is released for sending. So the reduction of one block overlaps the arrival of the next,
sends overlap receives, and a chunk moves on around the ring without waiting for whole steps.

Reduce-scatter needs no scratch buffer: the predecessor's partial for a block is received into
``out`` and this rank's contribution is added in place (``out op= send``). SUM, PROD, MIN and
MAX are commutative element-wise, and the chunk owner's final bits are what the all-gather half
distributes, so every peer ends with identical bits.

Small operations send inline from the operation's own task (no extra tasks, no channels); large
ones run one sender task per pool connection they use, fed through channels in release order,
so a send blocked on one connection never holds up reduction or other connections.

Failure: any error or cancellation forgets the operation in the pool (pending receives stop
writing into ``out`` before that returns) and disconnects both ring neighbours, whose stream state
is then unknown. Nothing writes to ``out`` after :func:`run_collective` has returned or raised.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import trio

from .._errors import (
    InvalidArgumentError,
    PCCLError,
    TooFewPeersError,
)
from .._types import ReduceOp
from ..peer.pool import P2PPool, ReceiveSlot
from ._reduce import reduce_into
from .schedule import (
    KINDS,
    SRC_SEND,
    Plan,
    SendFrame,
    cached_plan,
    output_count,
    plan_ring,
    predecessor,
    successor,
)

# Operations sending at most this many bytes in total run inline (no sender tasks): their sends
# fit in the socket buffers, so they practically never block.
INLINE_SEND_LIMIT = 256 * 1024

_REDUCING_KINDS = ("all_reduce", "reduce_scatter")
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


def _byte_view(a: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte memoryview of a contiguous 1-D array (any dtype)."""
    return memoryview(a.view(np.uint8))  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def _validate(
    kind: str,
    ring: Sequence[int],
    my_id: int,
    tag: int,
    op_seq: int,
    send: np.ndarray,
    out: np.ndarray,
    op: ReduceOp,
    root: int,
    block_bytes: int,
) -> None:
    if kind not in KINDS:
        raise InvalidArgumentError(f"unknown collective kind {kind!r}")
    if len(ring) < 2:
        raise TooFewPeersError(f"a collective needs at least 2 peers, the ring has {len(ring)}")
    if len(set(ring)) != len(ring):
        raise InvalidArgumentError(f"ring {list(ring)} lists a peer twice")
    if my_id not in ring:
        raise InvalidArgumentError(f"peer {my_id} is not in the ring {list(ring)}")
    if not 0 <= tag <= _U64 or not 0 <= op_seq <= _U32:
        raise InvalidArgumentError(f"tag {tag} / op_seq {op_seq} out of range")
    for name, a in (("send", send), ("out", out)):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or not a.flags.c_contiguous:
            raise InvalidArgumentError(f"{name} must be a contiguous 1-D numpy array")
    if send.dtype != out.dtype:
        raise InvalidArgumentError(f"send dtype {send.dtype} != out dtype {out.dtype}")
    if not out.flags.writeable:
        raise InvalidArgumentError("out is read-only")
    want = output_count(kind, len(ring), send.shape[0])
    if out.shape[0] != want:
        raise InvalidArgumentError(f"{kind}: out must have {want} elements, has {out.shape[0]}")
    if send.size and out.size and np.may_share_memory(send, out):
        raise InvalidArgumentError("out must not overlap send")
    if kind in _REDUCING_KINDS and op not in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX):
        raise InvalidArgumentError(f"the ring reduces with SUM, PROD, MIN or MAX, not {op!r}")
    if kind == "broadcast" and not 0 <= root < len(ring):
        raise InvalidArgumentError(f"broadcast root {root} is not a ring index (0..{len(ring) - 1})")
    if block_bytes < 1:
        raise InvalidArgumentError("block_bytes must be >= 1")


async def run_collective(
    pool: P2PPool,
    *,
    kind: str,
    ring: Sequence[int],
    my_id: int,
    tag: int,
    op_seq: int,
    send: np.ndarray,
    out: np.ndarray,
    op: ReduceOp = ReduceOp.SUM,
    root: int = 0,
    block_bytes: int = 1 << 20,
) -> tuple[int, int]:
    """Run one ring collective with this peer's ring neighbours.

    Every participant must call it with the same ``kind``, ``ring``, ``tag``, ``op_seq``, dtype,
    element count, ``op``, ``root`` and ``block_bytes``; the pool must already be connected to
    this peer's successor (its predecessor connects to us).

    Args:
        pool: the ring connection pool.
        kind: "all_reduce" (``out`` = reduction of everyone's ``send``), "reduce_scatter" (only
            this rank's chunk of ``out`` is meaningful, see :func:`owned_range`), "all_gather"
            (``out`` = the ``send`` arrays in ring order, ``n * len(send)`` elements) or
            "broadcast" (``out`` = ``send`` of ring index ``root``).
        ring: peer ids in ring order (at least 2, ``my_id`` among them).
        my_id: this peer's id.
        tag: the operation tag (0 <= tag < 2**64).
        op_seq: the master's sequence number for this operation (0 <= op_seq < 2**32), unique
            on this peer for its lifetime.
        send: this peer's input, contiguous 1-D; never modified.
        out: the output, contiguous 1-D, same dtype, not overlapping ``send``; a scratch buffer
            the caller owns (its contents are unspecified after a failure).
        op: SUM, PROD, MIN or MAX (reducing kinds only).
        root: broadcast only: ring index of the source.
        block_bytes: pipelining granularity; must be equal on every participant.

    Returns:
        ``(tx_bytes, rx_bytes)``: payload bytes this peer sent and received.

    Raises:
        TooFewPeersError: fewer than 2 peers in the ring.
        InvalidArgumentError: bad arguments (raised before anything is sent).
        RankConnectionLostError: a neighbour's connection broke or is missing, or a peer failed.
        RemoteProtocolError: a neighbour sent a frame that does not fit the plan.
    """
    _validate(kind, ring, my_id, tag, op_seq, send, out, op, root, block_bytes)
    n = len(ring)
    rank = list(ring).index(my_id)
    itemsize = send.dtype.itemsize
    block_elems = max(1, block_bytes // itemsize)
    plan = cached_plan(kind, n, rank, send.shape[0], block_elems, root)
    if len(plan.sends) > _U32 or len(plan.recvs) > _U32:
        raise InvalidArgumentError("too many frames for one operation: raise block_bytes")
    nxt = successor(ring, rank)
    prv = predecessor(ring, rank)
    tx = sum(f.end - f.start for f in plan.sends) * itemsize
    rx = sum(f.end - f.start for f in plan.recvs) * itemsize
    ok = False
    try:
        out_b = _byte_view(out)
        slots = [
            pool.expect(prv, tag, op_seq, f.seq, out_b[f.start * itemsize : f.end * itemsize])
            for f in plan.recvs
        ]
        if plan.local_copy is not None:
            s0, s1, o0 = plan.local_copy
            out[o0 : o0 + (s1 - s0)] = send[s0:s1]
        if plan.sends or plan.recvs:
            runner = _run_inline if tx <= INLINE_SEND_LIMIT else _run_pipelined
            await runner(pool, plan, slots, nxt, tag, op_seq, send, out, op, itemsize)
        else:
            await trio.lowlevel.checkpoint()
        ok = True
        return tx, rx
    finally:
        # Always: late or duplicate frames of this op must be dropped, never stashed. On failure
        # this also stops every reader from writing into ``out`` before we return.
        pool.forget_op(op_seq)
        if not ok:
            with trio.CancelScope(shield=True):
                await pool.disconnect(prv)
                if nxt != prv:
                    await pool.disconnect(nxt)


def owned_range(kind: str, n: int, rank: int, count: int) -> tuple[int, int]:
    """The ``(start, end)`` of ``out`` that is meaningful after ``kind`` on ring index ``rank``
    (reduce_scatter: chunk ``rank``; other kinds: all of ``out``)."""
    return plan_ring(kind, n, rank, count, max(1, count)).owned


async def _run_inline(
    pool: P2PPool,
    plan: Plan,
    slots: list[ReceiveSlot],
    nxt: int,
    tag: int,
    op_seq: int,
    send: np.ndarray,
    out: np.ndarray,
    op: ReduceOp,
    itemsize: int,
) -> None:
    send_b = _byte_view(send)
    out_b = _byte_view(out)
    sends = plan.sends
    for i in plan.initial:
        f = sends[i]
        src = send_b if f.source == SRC_SEND else out_b
        await pool.send(nxt, tag, op_seq, f.seq, src[f.start * itemsize : f.end * itemsize],
                        conn_index=tag + f.lane)
    unlocks = plan.unlocks
    for i, rf in enumerate(plan.recvs):
        await slots[i].wait()
        if rf.reduce:
            reduce_into(out[rf.start : rf.end], send[rf.start : rf.end], op)
        for j in unlocks[i]:
            f = sends[j]
            await pool.send(nxt, tag, op_seq, f.seq, out_b[f.start * itemsize : f.end * itemsize],
                            conn_index=tag + f.lane)


class _ReadyFrames:
    """Frames ready to go on one connection: later ring steps first, then in ``seq`` order.

    Unbounded on purpose: it never holds more than the operation's own frame count.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []
        self._lot = trio.lowlevel.ParkingLot()
        self.closed = False

    def push(self, frame: SendFrame, index: int) -> None:
        heapq.heappush(self._heap, (-frame.step, frame.seq, index))
        if self._lot:
            self._lot.unpark_all()

    def close(self) -> None:
        self.closed = True
        self._lot.unpark_all()

    async def pop(self) -> int | None:
        while not self._heap:
            if self.closed:
                return None
            await self._lot.park()
        return heapq.heappop(self._heap)[2]


async def _run_pipelined(
    pool: P2PPool,
    plan: Plan,
    slots: list[ReceiveSlot],
    nxt: int,
    tag: int,
    op_seq: int,
    send: np.ndarray,
    out: np.ndarray,
    op: ReduceOp,
    itemsize: int,
) -> None:
    send_b = _byte_view(send)
    out_b = _byte_view(out)
    sends = plan.sends
    psize = pool.pool_size
    conn_of = [(tag + f.lane) % psize for f in sends]
    queues = {c: _ReadyFrames() for c in sorted(set(conn_of))}
    errors: list[BaseException] = []

    async def sender(conn: int, queue: _ReadyFrames, cancel: trio.CancelScope) -> None:
        try:
            while True:
                j = await queue.pop()
                if j is None:
                    return
                f = sends[j]
                src = send_b if f.source == SRC_SEND else out_b
                await pool.send(nxt, tag, op_seq, f.seq, src[f.start * itemsize : f.end * itemsize],
                                conn_index=conn)
        except PCCLError as exc:
            # Record and stop the whole operation; raising here would surface as an ExceptionGroup.
            errors.append(exc)
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for c, q in queues.items():
            nursery.start_soon(sender, c, q, nursery.cancel_scope)
        try:
            for j in plan.initial:
                queues[conn_of[j]].push(sends[j], j)
            unlocks = plan.unlocks
            for i, rf in enumerate(plan.recvs):
                await slots[i].wait()
                if rf.reduce:
                    reduce_into(out[rf.start : rf.end], send[rf.start : rf.end], op)
                for j in unlocks[i]:
                    queues[conn_of[j]].push(sends[j], j)
        except PCCLError as exc:
            errors.append(exc)
            nursery.cancel_scope.cancel()
        finally:
            for q in queues.values():
                q.close()
    if errors:
        raise errors[0]
