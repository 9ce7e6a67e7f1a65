"""The data plane of the collectives over a :class:`~pccl.collectives.interface.DataPool` (the peer's
P2P pool): one plan of any kind of :mod:`pccl.collectives.kinds` under any schedule of
:mod:`pccl.collectives.schedule` (the ring, recursive halving-doubling, the binomial tree), executed
frame by frame (:func:`run_plan`). :mod:`pccl.collectives.executor` computes the plan, opens the
partner connections, runs it and owns the failure path.

The plan (which frames to send and receive, and to or from which rank) is executed as a
dependency-driven pipeline rather than step by step: every receive is registered up front and
lands straight in ``out`` (zero copy) or, for frames that are combined with a partial this rank
already holds, in scratch memory; as soon as a frame has arrived and been applied (reduced in
place with this rank's input, or accumulated), the sends it releases go. So the reduction of one
block overlaps the arrival of the next, sends overlap receives, and data moves on without
waiting for whole steps.

Ring reduce-scatter needs no scratch buffer: the predecessor's partial for a block is received
into ``out`` and this rank's contribution is added in place (``out op= send``). SUM, PROD, MIN
and MAX are commutative element-wise, and under every schedule each element's final bits are
computed once (by its owner) and then only copied, so every peer ends with identical bits.

Two peers' small all-reduces under the ring use the one-step exchange plan instead
(:func:`schedule.plan_exchange`, ``EXCHANGE_MAX_BYTES``): each sends its whole input and both
reduce, in the same operand order. Quantized operations always run the ring.

Small operations send inline from the operation's own task (no extra tasks, no channels); large
ones run one sender task per (partner, pool connection) they use, fed in release order, so a send
blocked on one connection never holds up reduction or other connections.

Failure (:meth:`pccl.collectives.executor.Attempt.fail`): any error or cancellation forgets the
operation in the pool (pending receives stop writing into ``out`` before that returns) and
disconnects every partner the plan names, whose stream state is then unknown. Nothing writes to
``out`` after :func:`~pccl.collectives.executor.run_collective` has returned or raised.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence

import numpy as np
import trio

from .._errors import (
    InvalidArgumentError,
    PCCLError,
    RankConnectionLostError,
    RemoteProtocolError,
    TooFewPeersError,
)
from .._types import DataType, QuantizationAlgorithm, QuantizationOptions, ReduceOp
from ..kernels.buffers import BufferCache
from ..kernels.quantize import dequantize, metadata_size, quantize
from ._reduce import reduce_into
from .gate import SendGate
from .interface import DataPool, Receive
from .kinds import Kind
from .op_plan import DEFAULT_BLOCK_BYTES as DEFAULT_BLOCK_BYTES  # re-exported: the executor default
from .op_plan import build_plan
from .schedule import (
    SRC_SEND,
    Plan,
    SendFrame,
    plan_ring,
)
from .staging import Staging

# Operations sending at most this many bytes in total run inline: no sender tasks, no queues, the
# operation's own task sends each frame when it is released. That is cheaper per operation, and
# safe: the peer's reader tasks always drain their sockets, so a send that blocks only delays us.
# Bigger operations get one sender task per connection, so a send blocked on a full socket never
# holds up the reduction of blocks that have already arrived (measured on loopback: inline is
# cheaper up to a few MB; beyond, the overlap wins).
INLINE_SEND_LIMIT = 8 << 20

# Quantized operations keep their frames in scratch memory; a fresh 24 MB buffer costs ~20 ms of
# page faults and zero-filling (measured: 10% of a 64 MB all-reduce on 1 Gbit/s), so the
# buffers of successful operations are kept for the next one of the same size.
_SCRATCH_KEEP = 4
# How often one connection of a stripe may be reopened within one operation before it fails.
_REOPENS_PER_CONNECTION = 3
_SCRATCH_KEEP_BYTES = 1 << 30
_scratch = BufferCache(max_entries=_SCRATCH_KEEP, max_bytes=_SCRATCH_KEEP_BYTES)
_scratch_lock = threading.Lock()  # communicators in several threads share it

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


def _take_scratch(nbytes: int) -> np.ndarray:
    """A ``uint8`` array of ``nbytes`` (contents unspecified), reused from an earlier op when possible."""
    with _scratch_lock:
        return _scratch.take(np.dtype(np.uint8), nbytes)


def _give_back_scratch(buf: np.ndarray) -> None:
    """Keep ``buf`` for a later op. Only for ops that succeeded: nothing references it any more."""
    with _scratch_lock:
        _scratch.give_back(buf)


def _byte_view(a: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte memoryview of a contiguous 1-D array (any dtype)."""
    return memoryview(a.view(np.uint8))  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def validate(
    kind: Kind,
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
    problem = kind.size_problem(len(ring), send.shape[0], out.shape[0])
    if problem is not None:
        want = kind.output_count(len(ring), send.shape[0])
        raise InvalidArgumentError(
            f"{kind.name}: out must have {want} elements, has {out.shape[0]} ({problem})"
        )
    if send.size and out.size and np.may_share_memory(send, out):
        raise InvalidArgumentError("out must not overlap send")
    if kind.reducing and op not in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX):
        raise InvalidArgumentError(f"the ring reduces with SUM, PROD, MIN or MAX, not {op!r}")
    if kind.rooted and not 0 <= root < len(ring):
        raise InvalidArgumentError(f"{kind.name} root {root} is not a ring index (0..{len(ring) - 1})")
    if block_bytes < 1:
        raise InvalidArgumentError("block_bytes must be >= 1")


_QUANTIZABLE = ("float16", "bfloat16", "float32", "float64")


def validate_quantization(kind: Kind, send: np.ndarray, q: QuantizationOptions) -> None:
    """Raises InvalidArgumentError unless ``kind`` on ``send``'s dtype may be quantized with ``q``."""
    if not kind.quantizable:
        raise InvalidArgumentError(f"quantization applies to all_reduce and reduce_scatter, not {kind.name}")
    if send.dtype.name not in _QUANTIZABLE:
        raise InvalidArgumentError(f"quantization needs a floating dtype, not {send.dtype}")
    if q.quantized_datatype not in (DataType.UINT8, DataType.UINT16):
        raise InvalidArgumentError(f"quantized dtype must be UINT8 or UINT16, not {q.quantized_datatype!r}")
    if q.algorithm not in (QuantizationAlgorithm.MIN_MAX, QuantizationAlgorithm.ZERO_POINT_SCALE):
        raise InvalidArgumentError(f"unknown quantization algorithm {q.algorithm!r}")


def plan_for(
    kind: str | Kind,
    n: int,
    rank: int,
    count: int,
    itemsize: int,
    *,
    schedule: str = "ring",
    root: int = 0,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    quantized: bool = False,
) -> Plan:
    """The plan :func:`~pccl.collectives.executor.run_collective` runs on ring index ``rank`` (the
    caller opens connections to every rank its sends name, see :func:`plan_partners`, before running
    it). :class:`~pccl.collectives.executor.Attempt` is the one caller on a peer.

    ``schedule`` "ring" runs the ring (two peers' small all-reduces the exchange); "hd" and "tree" run
    halving-doubling and binomial-tree plans; quantized operations always run the ring (their
    forwarding rule relies on the ring's steps).

    Raises:
        InvalidArgumentError: an unknown schedule, or one without a plan for ``kind`` (no "hd"
            broadcast or reduce), or sizes the kind cannot plan (an all-to-all whose count is not
            ``n`` equal blocks).
    """
    try:
        return build_plan(kind, n, rank, count, itemsize, schedule=schedule, root=root,
                          block_bytes=block_bytes, quantized=quantized)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def plan_partners(plan: Plan) -> tuple[list[int], list[int]]:
    """``(ranks this plan sends to, ranks it receives from)``, each sorted and without repeats."""
    return sorted({f.peer for f in plan.sends}), sorted({f.peer for f in plan.recvs})


async def run_plan(
    pool: DataPool, ex: _Exec, ids: Sequence[int], tag: int, op_seq: int, send: np.ndarray, out: np.ndarray,
    staging: Staging | None = None, gate: SendGate | None = None,
) -> None:
    """Execute ``ex.plan`` over ``pool``: register every receive, make the local copy, then send and
    apply frames as their dependencies complete (inline for small operations, with one sender task
    per connection for large ones). Failure handling is the caller's
    (:meth:`pccl.collectives.executor.Attempt.fail`).

    ``gate``: a speculative start's :class:`~pccl.collectives.gate.SendGate`: every frame passes it
    before it is sent (at most its limit before the master's go-ahead).

    ``staging``: ``send`` is the host stage of a device tensor that ``staging`` fills block by block
    (:mod:`pccl.collectives.staging`): each block is waited for before it is read, and every range of
    ``out`` that becomes final is reported. After a failure the caller must await ``staging.abort()``.
    """
    plan = ex.plan
    if staging is not None:
        staging.begin(plan, out, quantized=isinstance(ex, _QuantExec))
    slots = [pool.expect(ids[f.peer], tag, op_seq, f.seq, ex.recv_dest(i)) for i, f in enumerate(plan.recvs)]
    if plan.local_copy is not None:
        s0, s1, o0 = plan.local_copy
        if staging is not None:
            await staging.before_local_copy()
        out[o0 : o0 + (s1 - s0)] = send[s0:s1]
        if staging is not None:
            staging.after_local_copy()
    if plan.sends or plan.recvs:
        runner = _run_inline if ex.tx <= INLINE_SEND_LIMIT else _run_pipelined
        await runner(pool, ex, slots, ids, tag, op_seq, staging, gate)
    else:
        await trio.lowlevel.checkpoint()
    if staging is not None:
        await staging.finish()


def make_exec(
    plan: Plan, n: int, send: np.ndarray, out: np.ndarray, op: ReduceOp,
    quantization: QuantizationOptions | None,
) -> _Exec:
    """The executor state of one plan: quantized frames when ``quantization`` quantizes."""
    if quantization is not None and quantization.algorithm != QuantizationAlgorithm.NONE:
        return _QuantExec(plan, n, send, out, op, quantization)
    return _Exec(plan, n, send, out, op)


def owned_range(kind: str, n: int, rank: int, count: int) -> tuple[int, int]:
    """The ``(start, end)`` of ``out`` that is meaningful after ``kind`` on ring index ``rank``
    (reduce_scatter: chunk ``rank``; other kinds: all of ``out``)."""
    return plan_ring(kind, n, rank, count, max(1, count)).owned


class _Exec:
    """What each frame of a plan reads, where each lands, and what happens when one arrives."""

    def __init__(self, plan: Plan, n: int, send: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        self.plan = plan
        self.n = n
        self.send = send
        self.out = out
        self.op = op
        self.itemsize = isz = send.dtype.itemsize
        self.send_b = _byte_view(send)
        self.out_b = _byte_view(out)
        self.tx = plan.send_elems * isz
        self.rx = plan.recv_elems * isz
        # Receives marked to_scratch land in scratch memory: the exchange plan's rank 0 at their
        # ``out`` offsets in an out-sized buffer (``scratch == -1``), halving-doubling and tree
        # plans each at its own offset of the plan's scratch area (``Plan.scratch_elems``).
        self._landing: np.ndarray | None = None
        self._area: np.ndarray | None = None
        if any(f.to_scratch and f.scratch < 0 for f in plan.recvs):
            self._landing = _take_scratch(out.nbytes)
            self.landing = self._landing.view(out.dtype)
        if plan.scratch_elems:
            self._area = _take_scratch(plan.scratch_elems * isz)
            self.area = self._area.view(out.dtype)

    def release(self) -> None:
        """The operation succeeded: hand back scratch memory (nothing refers to it any more)."""
        if self._landing is not None:
            _give_back_scratch(self._landing)
            self._landing = None
        if self._area is not None:
            _give_back_scratch(self._area)
            self._area = None

    def _scratch_of(self, i: int) -> np.ndarray:
        f = self.plan.recvs[i]
        if f.scratch >= 0:
            return self.area[f.scratch : f.scratch + (f.end - f.start)]
        return self.landing[f.start : f.end]

    def recv_dest(self, i: int) -> memoryview:
        """Where receive ``i`` lands: straight in ``out`` (or scratch memory, see to_scratch)."""
        f = self.plan.recvs[i]
        if f.to_scratch:
            return _byte_view(self._scratch_of(i))
        return self.out_b[f.start * self.itemsize : f.end * self.itemsize]

    # payload(j) may be called again for a frame already sent (its bytes are a view of the input or
    # of output that only a frame depending on this one's arrival can overwrite): a lost connection
    # of a stripe is resent whole.
    resendable = True

    def payload(self, j: int) -> memoryview:
        """The bytes of send ``j`` (called when it is about to go)."""
        f = self.plan.sends[j]
        src = self.send_b if f.source == SRC_SEND else self.out_b
        return src[f.start * self.itemsize : f.end * self.itemsize]

    def received(self, i: int) -> None:
        """Receive ``i`` has fully arrived: reduce it in place with this rank's contribution."""
        f = self.plan.recvs[i]
        if f.to_scratch:
            reduce_into(self.out[f.start : f.end], self._scratch_of(i), self.op)
        elif f.reduce:
            reduce_into(self.out[f.start : f.end], self.send[f.start : f.end], self.op)


class _QuantExec(_Exec):
    """Quantized execution: frames carry ``metadata + quantized values`` for each block.

    Receives land in a scratch buffer and are dequantized into ``out`` (then reduced with this
    rank's input in the reduce-scatter half). All-gather forwards resend the received bytes as
    they are; the owner of a chunk quantizes it once and replaces its own copy with the
    dequantized values, so every peer ends with the same bits.
    """

    def __init__(
        self, plan: Plan, n: int, send: np.ndarray, out: np.ndarray, op: ReduceOp, q: QuantizationOptions
    ) -> None:
        super().__init__(plan, n, send, out, op)
        self.resendable = False  # payload() quantizes, and the owner's copy changes when it does
        self.qdtype = q.quantized_datatype
        self.algorithm = q.algorithm
        self.qnp = np.dtype(np.uint8 if q.quantized_datatype == DataType.UINT8 else np.uint16)
        self.meta_size = metadata_size(q.algorithm)
        qsize = self.qnp.itemsize

        def frame_len(start: int, end: int) -> int:
            return self.meta_size + (end - start) * qsize

        self.recv_offsets: list[int] = []
        total = 0
        for rf in plan.recvs:
            self.recv_offsets.append(total)
            total += frame_len(rf.start, rf.end)
        self.rx = total
        # forwards (all-gather steps after the owner's) resend received bytes; the rest need a buffer
        self.send_offsets: list[int] = []
        stotal = 0
        self.tx = 0
        for f in plan.sends:
            self.send_offsets.append(stotal)
            ln = frame_len(f.start, f.end)
            self.tx += ln
            if not self._is_forward(f):
                stotal += ln
        self._scratch: np.ndarray | None = _take_scratch(total + stotal)
        whole = memoryview(self._scratch)  # type: ignore[arg-type]  # ndarray implements the buffer protocol
        self.rscratch = whole[:total]
        self.sscratch = whole[total:]

    def release(self) -> None:
        if self._scratch is not None:
            _give_back_scratch(self._scratch)
            self._scratch = None

    def _is_forward(self, f: SendFrame) -> bool:
        return f.step >= self.n

    def recv_dest(self, i: int) -> memoryview:
        f = self.plan.recvs[i]
        off = self.recv_offsets[i]
        return self.rscratch[off : off + self.meta_size + (f.end - f.start) * self.qnp.itemsize]

    def payload(self, j: int) -> memoryview:
        f = self.plan.sends[j]
        if self._is_forward(f):
            return self.recv_dest(f.after)
        ln = self.meta_size + (f.end - f.start) * self.qnp.itemsize
        off = self.send_offsets[j]
        buf = self.sscratch[off : off + ln]
        src = self.send if f.source == SRC_SEND else self.out
        qv = np.frombuffer(buf, dtype=self.qnp, offset=self.meta_size)
        _q, meta = quantize(src[f.start : f.end], self.qdtype, self.algorithm, out=qv)
        buf[: self.meta_size] = meta
        if f.step == self.n - 1:
            # the owner's chunk, leaving for the all-gather: keep exactly what the others will get
            dequantize(qv, meta, out=self.out[f.start : f.end])
        return buf

    def received(self, i: int) -> None:
        f = self.plan.recvs[i]
        buf = self.recv_dest(i)
        qv = np.frombuffer(buf, dtype=self.qnp, offset=self.meta_size)
        try:
            dequantize(qv, buf[: self.meta_size], out=self.out[f.start : f.end])
        except InvalidArgumentError as exc:
            raise RemoteProtocolError(f"bad quantized frame from the predecessor: {exc.message}") from exc
        if f.reduce:
            reduce_into(self.out[f.start : f.end], self.send[f.start : f.end], self.op)


async def _run_inline(
    pool: DataPool,
    ex: _Exec,
    slots: list[Receive],
    ids: Sequence[int],
    tag: int,
    op_seq: int,
    staging: Staging | None = None,
    gate: SendGate | None = None,
) -> None:
    sends = ex.plan.sends

    async def send(j: int) -> None:
        # one coroutine layer per frame: this is every small operation's path
        f = sends[j]
        if staging is not None:
            await staging.before_send(j)
        data = ex.payload(j)
        if gate is not None:
            await gate.admit(data.nbytes)
        await pool.send(ids[f.peer], tag, op_seq, f.seq, data, conn_index=tag + f.lane)
        if staging is not None:
            staging.after_send(j)

    for j in ex.plan.initial:
        await send(j)
    unlocks = ex.plan.unlocks
    for i in range(len(slots)):
        if staging is None:  # _take_in without the staging window, inline
            await slots[i].wait()
            ex.received(i)
        else:
            await _take_in(ex, slots, staging, i)
        for j in unlocks[i]:
            await send(j)


class _ReadyFrames:
    """Frames ready to go on one connection: earlier ring steps first, then in ``seq`` order.

    Earlier steps first keeps every rank's frames of step ``t`` ahead of its step ``t+1`` frames,
    so the receives that release the last frames of the operation arrive as early as possible
    and the wire never waits on them. (Later steps first, the former order, let the all-gather
    overtake the reduce-scatter: a rank's last reduce-scatter blocks then went out at the very
    end and the successor's last all-gather frames waited for them, with the link idle: ~25 ms
    of a 64 MB all-reduce over 1 Gbit/s.)

    Unbounded on purpose: it never holds more than the operation's own frame count.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []
        self._lot = trio.lowlevel.ParkingLot()
        self.closed = False

    def push(self, frame: SendFrame, index: int) -> None:
        heapq.heappush(self._heap, (frame.step, frame.seq, index))
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
    pool: DataPool,
    ex: _Exec,
    slots: list[Receive],
    ids: Sequence[int],
    tag: int,
    op_seq: int,
    staging: Staging | None = None,
    gate: SendGate | None = None,
) -> None:
    plan = ex.plan
    sends = plan.sends
    # One sender task per (partner, connection); each partner's own stripe count. A partner over
    # one connection gets one queue per lane as before; the connections of a stripe share one
    # queue, and whichever connection is free takes the next frame (_shared_queues).
    stripes = {p: pool.stripes(ids[p]) for p in {f.peer for f in sends}}
    queue_of, senders = _shared_queues(sends, stripes, tag)
    errors: list[BaseException] = []
    sender = _Sender(pool, ex, tag, op_seq, staging, gate)
    # A ring plan sends to its successor all through the operation, so the operation's time is that
    # link's: its throughput sizes the stripe for the next operations (pccl.peer.striping). Other
    # schedules send to each partner for part of the operation only.
    transfers = {p: pool.begin_transfer(ids[p]) for p in stripes} if plan.schedule == "ring" else {}
    completed = False

    def ready(j: int) -> None:
        queue_of[j].push(sends[j], j)

    try:
        await _pipeline(sender, ex, slots, ids, stripes, senders, queue_of, ready, staging, errors)
        completed = not errors
    finally:
        for p, t in transfers.items():
            pool.end_transfer(t, sender.sent_bytes.get(ids[p], 0), completed)
    if errors:
        raise errors[0]


async def _pipeline(
    sender: _Sender, ex: _Exec, slots: list[Receive], ids: Sequence[int], stripes: dict[int, int],
    senders: list[tuple[int, int, _ReadyFrames]], queue_of: list[_ReadyFrames], ready: Callable[[int], None],
    staging: Staging | None, errors: list[BaseException],
) -> None:
    """Run the sender tasks and take the receives in; a failure goes to ``errors``."""
    plan = ex.plan
    async with trio.open_nursery() as nursery:
        for p, conn, q in senders:
            nursery.start_soon(sender.run, ids[p], conn, stripes[p] > 1, q, errors, nursery.cancel_scope)
        try:
            for j in plan.initial:
                ready(j)
            if staging is None and type(ex) is _Exec and plan.schedule == "ring" \
                    and any(k > 1 for k in stripes.values()) and not any(f.to_scratch for f in plan.recvs):
                await _receive_in_arrival_order(ex, slots, ready)
            else:
                await _receive_all(ex, slots, staging, ready)
        except PCCLError as exc:
            errors.append(exc)
            nursery.cancel_scope.cancel()
        finally:
            for _p, _c, q in senders:
                q.close()


def _shared_queues(
    sends: Sequence[SendFrame], stripes: dict[int, int], tag: int
) -> tuple[list[_ReadyFrames], list[tuple[int, int, _ReadyFrames]]]:
    """The ready queue of each send, and the sender tasks to run as ``(partner, connection, queue)``.

    A partner reached over one connection: one queue per connection the frames' lanes name (as
    many as the plan's lanes, modulo 1: one). A partner reached over a stripe of ``k > 1``
    connections: **one** queue that all ``k`` connections' senders take from, so a connection
    takes the next frame when it has handed its last one to the kernel. With the frames dealt out
    by lane instead (``(tag + lane) % k``), a 2-peer 64 MiB all-reduce over 3 connections put 24,
    24 and 16 MiB on them: measured on the WAN emulator (50 ms, 1000 Mbit/s) the third one sat
    idle for the last ~0.15 s of a 0.7 s operation while the other two carried the rest.
    """
    by_key: dict[tuple[int, int], _ReadyFrames] = {}
    queue_of: list[_ReadyFrames] = []
    senders: list[tuple[int, int, _ReadyFrames]] = []
    for f in sends:
        k = stripes[f.peer]
        key = (f.peer, -1 if k > 1 else (tag + f.lane) % k)
        q = by_key.get(key)
        if q is None:
            q = by_key[key] = _ReadyFrames()
            if k > 1:
                senders += [(f.peer, c, q) for c in range(k)]
            else:
                senders.append((f.peer, key[1], q))
        queue_of.append(q)
    return queue_of, senders


async def _receive_all(
    ex: _Exec, slots: list[Receive], staging: Staging | None, ready: Callable[[int], None]
) -> None:
    """Wait for each receive in plan order, take it in, and hand the sends it unlocks to ``ready``."""
    unlocks = ex.plan.unlocks
    for i in range(len(slots)):
        await _take_in(ex, slots, staging, i)
        for j in unlocks[i]:
            ready(j)


async def _receive_in_arrival_order(ex: _Exec, slots: list[Receive], ready: Callable[[int], None]) -> None:
    """Like :func:`_receive_all`, but each receive is taken in as soon as it has arrived, whatever
    its place in the plan: over a stripe the frames of one step travel side by side on several
    connections and finish in any order (measured on the WAN emulator at 100 ms: a step's first
    frames completed 262-368 ms into the operation, and in plan order the all-gather waited for the
    last of them while the link sat idle).

    Only for plain ring plans (no staging, no quantization): there every receive either lands final
    bytes or reduces a range of ``out`` no other receive of the reduce-scatter touches, and a
    receive that overlaps an earlier one (the all-gather's copy of a chunk this rank reduced) can
    only arrive after that one was taken in and its send left, so any order of taking them in gives
    the same bits as plan order.
    """
    unlocks = ex.plan.unlocks
    arrived_tx, arrived_rx = trio.open_memory_channel[tuple[int, PCCLError | None]](len(slots))
    failure: list[PCCLError] = []

    async def watch(i: int) -> None:
        try:
            await slots[i].wait()
        except PCCLError as exc:
            arrived_tx.send_nowait((i, exc))
            return
        arrived_tx.send_nowait((i, None))

    async with trio.open_nursery() as nursery:
        for i in range(len(slots)):
            nursery.start_soon(watch, i)
        for _ in range(len(slots)):
            i, exc = await arrived_rx.receive()
            if exc is not None:
                failure.append(exc)
                nursery.cancel_scope.cancel()
                break
            ex.received(i)
            for j in unlocks[i]:
                ready(j)
    if failure:
        raise failure[0]


async def _take_in(ex: _Exec, slots: list[Receive], staging: Staging | None, i: int) -> None:
    """Wait for receive ``i`` and take it in (through the staging buffer's window, if any)."""
    await slots[i].wait()
    if staging is not None:
        await staging.before_receive(i)
    ex.received(i)
    if staging is not None:
        staging.after_receive(i)


class _Sender:
    """Sends one operation's frames, one task per (partner, connection) of the pipelined executor."""

    __slots__ = ("ex", "gate", "op_seq", "pool", "sent_bytes", "staging", "tag")

    def __init__(
        self, pool: DataPool, ex: _Exec, tag: int, op_seq: int, staging: Staging | None,
        gate: SendGate | None = None,
    ) -> None:
        self.pool = pool
        self.gate = gate
        self.ex = ex
        self.tag = tag
        self.op_seq = op_seq
        self.staging = staging
        #: payload bytes sent to each partner (resends after a reopen not counted twice)
        self.sent_bytes: dict[int, int] = {}

    async def run(
        self, peer_id: int, conn: int, striped: bool, queue: _ReadyFrames,
        errors: list[BaseException], cancel: trio.CancelScope,
    ) -> None:
        """Send the frames ``queue`` gives, in its order, to ``peer_id`` on connection ``conn`` (one of a
        stripe of several if ``striped``) until it is closed; a failure goes to ``errors`` and cancels
        ``cancel`` (raising here would surface as an ExceptionGroup)."""
        pool, ex, staging, tag, op_seq = self.pool, self.ex, self.staging, self.tag, self.op_seq
        sends = ex.plan.sends
        sent: list[int] = []  # frames of this operation sent on this connection
        reopened = 0
        try:
            while True:
                j = await queue.pop()
                if j is None:
                    return
                # Let the readers drain their sockets (and the operation task reduce) before this
                # frame's payload is prepared: a send that fits in the socket buffer never yields,
                # so without this a sender could quantize frame after frame while the peer's data
                # piles up unread and the peer's own sends stall.
                await trio.lowlevel.checkpoint()
                if staging is not None:
                    await staging.before_send(j)
                payload = ex.payload(j)
                if self.gate is not None:
                    await self.gate.admit(payload.nbytes)
                try:
                    await pool.send(peer_id, tag, op_seq, sends[j].seq, payload, conn_index=conn)
                except RankConnectionLostError as exc:
                    reopened = await self._recover(exc, peer_id, conn, j, sent, striped, reopened)
                sent.append(j)
                self.sent_bytes[peer_id] = self.sent_bytes.get(peer_id, 0) + payload.nbytes
                if staging is not None:
                    staging.after_send(j)
        except PCCLError as exc:
            errors.append(exc)
            cancel.cancel()

    async def _recover(
        self, lost: RankConnectionLostError, peer_id: int, conn: int, j: int, sent: list[int], striped: bool,
        reopened: int,
    ) -> int:
        """Sending frame ``j`` lost the connection (``lost``): reopen it, resend ``sent`` and ``j``, as
        often as allowed. Returns the reopens so far on this connection; raises ``lost`` (or the
        latest loss) when the connection may not be reopened."""
        # One connection of a stripe lost (a reset on the path): reopen it and
        # resend everything this operation sent on it, since what arrived is
        # unknown (the receiver drops the copies of frames it has). A peer that
        # is gone refuses the reopen, and a single connection keeps failing fast.
        # A staged (device) operation is not resent: its host stage may already
        # hold final ranges (AVG divided in place) that an older frame would carry.
        pool, ex, sends, tag, op_seq = self.pool, self.ex, self.ex.plan.sends, self.tag, self.op_seq
        while True:
            if (self.staging is not None or not ex.resendable or not striped
                    or reopened >= _REOPENS_PER_CONNECTION):
                raise lost
            reopened += 1
            await pool.reopen(peer_id)
            for k in sent:
                await pool.send(peer_id, tag, op_seq, sends[k].seq, ex.payload(k), conn_index=conn)
            try:
                await pool.send(peer_id, tag, op_seq, sends[j].seq, ex.payload(j), conn_index=conn)
                return reopened
            except RankConnectionLostError as exc:
                lost = exc
