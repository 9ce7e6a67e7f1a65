"""The collective pipeline of one peer: plan, open the partner connections, run the data plane,
commit or restore, close the partners' connections on failure (trio adapter over the pure plans).

:class:`Attempt` is one attempt of one collective on this peer. It computes the plan once (the one
place it is computed: the partners it connects to and the frames it runs are the same object), opens
the outgoing connections the plan needs, runs :func:`pccl.collectives.ring.run_plan`, and commits the
result into the caller's buffer through the kind (:meth:`Kind.result_range
<pccl.collectives.kinds.base.Kind.result_range>`). Every way an attempt can fail (a partner it
cannot connect to, its data plane, a failure elsewhere after its data plane finished) ends in
:meth:`Attempt.fail`: forget the operation's frames in the pool, close the connections with every
partner of the plan (their stream state is unknown). The caller's ``recv`` is written only by
:meth:`Attempt.commit`, so a failed operation leaves it as it was.

:func:`run_collective` is the same pipeline without the master: the pool already connected (tests,
benchmarks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import trio

from .._errors import InvalidArgumentError, PCCLError, RankConnectionFailedError
from .._types import DataType, QuantizationAlgorithm, QuantizationOptions, ReduceOp
from ..kernels import backend, reduce
from .gate import SendGate
from .interface import DataPool
from .kinds import Kind, get_kind
from .plan import Plan
from .ring import (
    _U32,
    DEFAULT_BLOCK_BYTES,
    make_exec,
    plan_for,
    plan_partners,
    run_plan,
    validate,
    validate_quantization,
)
from .staging import Staging

# Between two attempts to open a partner connection inside an operation (Attempt.connect):
# doubling from the first to the last.
PARTNER_BACKOFF = 0.05
PARTNER_BACKOFF_MAX = 1.0


class PartnerRow(Protocol):
    """Where a partner listens (``pccl.wire.messages.PeerRow`` is one)."""

    @property
    def peer_id(self) -> int: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class ConnectingPool(DataPool, Protocol):
    """A :class:`DataPool` that opens its own outgoing connections (the peer's P2P pool)."""

    def is_connected(self, peer_id: int) -> bool:
        """True if every outgoing connection to ``peer_id`` is open and healthy."""
        ...

    async def connect(self, peer_id: int, host: str, port: int) -> None:
        """Open the outgoing connections to ``peer_id``; raises RankConnectionFailedError."""
        ...


def _quantized(q: QuantizationOptions | None) -> bool:
    return q is not None and q.algorithm != QuantizationAlgorithm.NONE


class Attempt:
    """One attempt of one collective on this peer (see the module docstring).

    Args:
        pool: the P2P pool.
        kind: the collective kind (or its name).
        ring: peer ids in ring order, the ring the operation commenced on (``my_id`` among them).
        my_id: this peer's id.
        tag: the operation's tag.
        op_seq: the master's sequence number of this attempt.
        count: elements of each participant's input.
        itemsize: bytes per element.
        op: the reduction (reducing kinds; AVG runs as SUM and is divided at the commit).
        root: rooted kinds: the root's index in ``ring``.
        schedule: the schedule (:func:`pccl.collectives.cost.schedule_for`'s answer, or any request:
            a schedule the kind has no plan for runs :meth:`Kind.run_schedule`'s instead).
        quantization: optional wire quantization (quantizable kinds, float dtypes).
        block_bytes: the pipelining block, equal on every participant.

    Raises:
        InvalidArgumentError: sizes the kind cannot plan, an unknown schedule.
        ValueError: an unknown kind.
    """

    def __init__(
        self,
        pool: DataPool,
        *,
        kind: str | Kind,
        ring: Sequence[int],
        my_id: int,
        tag: int,
        op_seq: int,
        count: int,
        itemsize: int,
        op: ReduceOp = ReduceOp.SUM,
        root: int = 0,
        schedule: str = "ring",
        quantization: QuantizationOptions | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> None:
        self.pool = pool
        self.kind = get_kind(kind)
        self.ring = list(ring)
        self.my_id = my_id
        self.rank = self.ring.index(my_id) if my_id in self.ring else -1
        self.tag = tag
        self.op_seq = op_seq
        self.op = ReduceOp(op)
        # AVG runs as SUM and is divided at the commit
        self.ring_op = ReduceOp.SUM if self.op == ReduceOp.AVG else self.op
        self.root = root
        self.quantization = quantization if _quantized(quantization) else None
        self.block_bytes = block_bytes
        self.schedule = self.kind.run_schedule(schedule)
        try:
            # the one place the plan is computed: the partners connected to and the frames run
            self.plan = plan_for(
                self.kind, len(self.ring), max(self.rank, 0), count, itemsize, schedule=self.schedule,
                root=root, block_bytes=block_bytes, quantized=self.quantization is not None,
            )
        except BaseException:
            pool.forget_op(op_seq)  # nothing will run: frames others already sent must not stay stashed
            raise
        self._sizes = (count, itemsize)
        to_ranks, from_ranks = plan_partners(self.plan)
        #: the peers this peer's plan sends to
        self.sends_to = [self.ring[r] for r in to_ranks]
        #: every peer this peer's plan sends to or receives from: closed on failure
        self.partners = sorted({self.ring[r] for r in to_ranks} | {self.ring[r] for r in from_ranks})

    def partner_plan(self, rank: int) -> Plan:
        """The plan ring index ``rank`` runs in this operation (built as this peer built its own; small
        plans are cached): what a stall testimony compares its receives with
        (pccl/peer/early_frames.py)."""
        count, itemsize = self._sizes
        return plan_for(
            self.kind, len(self.ring), rank, count, itemsize, schedule=self.schedule, root=self.root,
            block_bytes=self.block_bytes, quantized=self.quantization is not None,
        )

    async def fail(self) -> None:
        """The one failure path: forget the operation in the pool (pending receives stop writing
        into the work buffer before this returns; its late frames are dropped), and close the
        connections with every partner of the plan, shielded from cancellation (it runs while the
        operation is being cancelled). A partner whose data plane failed closed its connections with
        this peer; closing ours too means the retry opens fresh ones instead of writing into one a
        partner gave up (a generic stream cannot tell that without a failed send)."""
        self.pool.forget_op(self.op_seq)
        await self.pool.disconnect_all(self.partners)

    async def connect(
        self, rows: Sequence[PartnerRow], *, ride_out: float, closed: Callable[[], bool] = lambda: False
    ) -> None:
        """Open (or check) the outgoing connections to every peer this plan sends to: the ring
        successor under the ring, the halving-doubling partners or tree parent and children
        otherwise, every other peer for an all-to-all. Open connections cost nothing; new ones one
        round trip, concurrently. Each is tried again while it fails for up to ``ride_out`` seconds
        (``p2p_stall_timeout``: an operation rides out a partitioned link while it opens a
        connection, as its data plane does while it sends; a partner that died is evicted by the
        master meanwhile, whose abort cancels this).

        Args:
            rows: where each peer of the ring listens, in ring order.
            ride_out: seconds to keep trying a connection that fails.
            closed: True once the communicator closed (no more tries).

        Raises:
            RankConnectionFailedError: a connection could not be opened (the attempt failed: the
                partners' connections are closed and the operation forgotten).
        """
        pool: Any = self.pool
        by_id = {r.peer_id: r for r in rows}
        targets = [by_id[p] for p in self.sends_to if not pool.is_connected(p)]
        try:
            if not targets:  # the steady state: every connection open (a peek each); no tasks
                await trio.lowlevel.checkpoint()
                return
            errors: list[PCCLError] = []

            async def one(row: PartnerRow) -> None:
                try:
                    await _connect_riding_out(pool, row, ride_out, closed)
                except PCCLError as exc:  # reported once, as itself (not as an exception group)
                    errors.append(exc)

            if len(targets) == 1:
                await _connect_riding_out(pool, targets[0], ride_out, closed)
            else:
                async with trio.open_nursery() as nursery:
                    for row in targets:
                        nursery.start_soon(one, row)
            if errors:
                raise errors[0]
        except BaseException:
            # The operation fails here, before its data plane: the partners whose data planes did
            # start fail too and close their connections with this peer.
            await self.fail()
            raise

    async def run(
        self, send: np.ndarray, work: np.ndarray, staging: Staging | None = None, gate: SendGate | None = None
    ) -> tuple[int, int]:
        """Run the plan's data plane: ``work`` (a buffer this peer owns) gets the result; ``send`` is
        never modified. On any error or cancellation the attempt fails (:meth:`fail`). ``staging``:
        ``send`` is a device tensor's host stage, filled block by block (see
        :func:`pccl.collectives.ring.run_plan`; the caller awaits ``staging.abort()`` after a failure).
        ``gate``: a speculative start's send gate (:mod:`pccl.collectives.gate`).

        Returns:
            ``(tx_bytes, rx_bytes)``.

        Raises:
            InvalidArgumentError: bad buffers (nothing sent; the attempt has not failed).
            RankConnectionLostError, RemoteProtocolError: the data plane failed.
        """
        validate(self.kind, self.ring, self.my_id, self.tag, self.op_seq, send, work, self.ring_op, self.root,
                 self.block_bytes)
        if self.quantization is not None:
            validate_quantization(self.kind, send, self.quantization)
        if len(self.plan.sends) > _U32 or len(self.plan.recvs) > _U32:
            raise InvalidArgumentError("too many frames for one operation: raise block_bytes")
        ex = make_exec(self.plan, len(self.ring), send, work, self.ring_op, self.quantization)
        try:
            await run_plan(self.pool, ex, self.ring, self.tag, self.op_seq, send, work, staging, gate)
        except BaseException:
            await self.fail()
            raise
        # Late or duplicate frames of this op must be dropped, never stashed.
        self.pool.forget_op(self.op_seq)
        ex.release()
        return ex.tx, ex.rx

    def commit(self, work: np.ndarray, recv: Any, dtype: DataType, delivered: bool = False) -> slice | None:
        """Write the result (host ``work``) into the caller's ``recv``: the kind's result range
        (reduce_scatter: this rank's chunk; reduce: all of it on the root, nothing elsewhere). AVG
        is finalized here, on host. A GPU ``recv`` gets a synchronous host-to-device copy (complete
        on return), unless the staging pipeline already ``delivered`` the result (finalized) into it
        during the data plane. Synchronous: a cancellation cannot land half-way.

        Returns:
            The range of ``recv`` written, or None.
        """
        n = len(self.ring)
        rng = self.kind.result_range(work.size, n, self.rank, self.root)
        if rng is None:
            return None
        lo, hi = rng
        if delivered:
            return slice(lo, hi)
        if self.op == ReduceOp.AVG and self.kind.reducing:
            reduce.finalize_avg(work[lo:hi], n, dtype=dtype)
        if backend.is_cuda(recv):
            backend.copy_from_host(recv, work, lo, hi)
        else:
            backend.as_numpy(recv)[lo:hi] = work[lo:hi]
        return slice(lo, hi)


async def _connect_riding_out(
    pool: Any, row: PartnerRow, ride_out: float, closed: Callable[[], bool]
) -> None:
    """``pool.connect`` to a partner, tried again while it fails for up to ``ride_out`` seconds.

    Raises:
        RankConnectionFailedError: still failing at the deadline.
    """
    deadline = trio.current_time() + ride_out
    backoff = PARTNER_BACKOFF
    while True:
        try:
            await pool.connect(row.peer_id, row.host, row.port)
            return
        except RankConnectionFailedError:
            if closed() or trio.current_time() + backoff >= deadline:
                raise
        await trio.sleep(backoff)  # a back-off between attempts, not a synchronization
        backoff = min(2 * backoff, PARTNER_BACKOFF_MAX)


async def run_collective(
    pool: DataPool,
    *,
    kind: str | Kind,
    ring: Sequence[int],
    my_id: int,
    tag: int,
    op_seq: int,
    send: np.ndarray,
    out: np.ndarray,
    op: ReduceOp = ReduceOp.SUM,
    root: int = 0,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    quantization: QuantizationOptions | None = None,
    schedule: str = "ring",
    staging: Staging | None = None,
) -> tuple[int, int]:
    """Run one collective with the ranks this peer's plan names (no master: the caller agrees on
    everything with the other participants).

    Every participant must call it with the same ``kind``, ``ring``, ``tag``, ``op_seq``, dtype,
    element count, ``op``, ``root``, ``block_bytes``, ``quantization`` and ``schedule``; the pool
    must already be connected to every rank this peer's plan sends to (:func:`plan_for`,
    :func:`plan_partners`; under the ring: the successor; the others connect to us).

    Args:
        pool: the P2P connection pool.
        kind: a kind of :mod:`pccl.collectives.kinds` or its name ("all_reduce", "reduce_scatter",
            "all_gather", "broadcast", "reduce", "all_to_all"); each kind's module says what ``out``
            holds after it.
        ring: peer ids in ring order (at least 2, ``my_id`` among them); the plans' ranks are
            indices into it.
        my_id: this peer's id.
        tag: the operation tag (0 <= tag < 2**64).
        op_seq: the master's sequence number for this operation (0 <= op_seq < 2**32), unique
            on this peer for its lifetime.
        send: this peer's input, contiguous 1-D; never modified.
        out: the output, contiguous 1-D, same dtype, not overlapping ``send``; a scratch buffer
            the caller owns (its contents are unspecified after a failure).
        op: SUM, PROD, MIN or MAX (reducing kinds only).
        root: rooted kinds (broadcast, reduce) only: ring index of the root.
        block_bytes: pipelining granularity; must be equal on every participant.
        quantization: all_reduce and reduce_scatter on float dtypes only: send min-max or
            zero-point-scale quantized blocks (8 or 16 bit), always over the ring. Senders quantize
            their partial sums; in the all-gather half the chunk owner quantizes once and keeps the
            dequantized values itself, and forwarders pass the quantized bytes on unchanged, so
            every peer ends bit-identical.
        schedule: "ring", "hd" (recursive halving-doubling) or "tree" (binomial tree); a kind
            without plans under it runs its fallback (a halving-doubling broadcast or reduce runs
            the tree). Every schedule computes each element's final bits once and then only copies
            them, so every peer ends with identical bits; integer ops are exact under each.
        staging: ``send`` is the host stage of a device tensor that ``staging`` fills block by
            block (:mod:`pccl.collectives.staging`); after a failure the caller must await
            ``staging.abort()``.

    Returns:
        ``(tx_bytes, rx_bytes)``: payload bytes this peer sent and received (quantized sizes,
        metadata included, when quantizing).

    Raises:
        TooFewPeersError: fewer than 2 peers in the ring.
        InvalidArgumentError: bad arguments (raised before anything is sent).
        RankConnectionLostError: a partner's connection broke or is missing, or a peer failed.
        RemoteProtocolError: a partner sent a frame that does not fit the plan.
    """
    try:
        k = get_kind(kind)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    # the arguments first: nothing is planned for a call that cannot run
    validate(k, ring, my_id, tag, op_seq, send, out, op, root, block_bytes)
    if _quantized(quantization):
        assert quantization is not None
        validate_quantization(k, send, quantization)
    attempt = Attempt(
        pool, kind=k, ring=ring, my_id=my_id, tag=tag, op_seq=op_seq, count=send.shape[0],
        itemsize=send.dtype.itemsize, op=op, root=root, schedule=schedule, quantization=quantization,
        block_bytes=block_bytes,
    )
    return await attempt.run(send, out, staging)


__all__ = ["Attempt", "ConnectingPool", "PartnerRow", "run_collective"]
