"""The collective calls of the native async :class:`~pccl.peer.communicator.Communicator`: the public
methods (one per kind of :mod:`pccl.collectives.kinds`, and ``all_reduce_multiple_with_retry``) and the
protocol of one call with the master (vote, commence, confirm). The data side of each attempt (its plan,
partner connections, data plane, commit and the one failure path) is
:class:`pccl.collectives.executor.Attempt`'s.

One call: check the buffers against the group and build the descriptor (the core's rules, before
voting, so that no other peer is dragged into a failed op); vote (the speculative start when the last
confirmation of the tag reserved an op_seq, docs/protocol.md section 4); run the attempt in its own
``trio.CancelScope`` registered under its tag (the master's abort cancels it); report to the master
and wait for its verdict; commit. The caller's ``recv`` is written only at the commit, after the master
confirmed that every participant succeeded.
"""

from __future__ import annotations

import collections
import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._errors import InvalidArgumentError, PCCLError, RankConnectionLostError, TooFewPeersError
from .._types import DataType, QuantizationAlgorithm, QuantizationOptions, ReduceInfo, ReduceOp
from .._waits import format_wait
from ..collectives.cost import LinkModel, same_host, schedule_for
from ..collectives.executor import Attempt
from ..collectives.gate import SendGate, early_send_limit
from ..collectives.kinds import Kind, get_kind
from ..collectives.staging import Staging, device_for
from ..kernels import backend
from ..kernels.buffers import BufferCache
from ..wire import messages as m
from .early_frames import early_partners
from .mailbox import Waiter
from .stall import StalledOn
from .state import SPECULATIVE_NEAR_MAX_BYTES

if TYPE_CHECKING:
    from .notices import WaitReporter
    from .shared_state import StateServer
    from .spin import Spinner
    from .stall import StallWatch
    from .state import PeerState

#: The schedule a plan ran, as reported with a stalled operation's testimony (the two-rank exchange is
#: the ring's plan for two peers' small all-reduces).
_REPORTED = {"ring": "ring", "exchange": "ring", "hd": "hd", "tree": "tree"}

#: The one-host link model (pccl.collectives.cost.same_host) for this machine's cores.
_SAME_HOST = same_host(os.cpu_count() or 1)

# The phases of a collective that statistics() reports, in call order (see _record_phases).
PHASES = ("vote", "ring", "confirm", "commit")


@dataclass
class OpState:
    """A collective in flight, registered under its tag."""

    tag: int
    commence: Waiter[m.CollectiveCommence]
    complete: Waiter[m.CollectiveComplete]
    scope: trio.CancelScope | None = None
    op_seq: int = -1
    abort_error: PCCLError | None = None
    concluded: bool = False
    plane_done: bool = False  # this peer's data plane finished


@dataclass
class _Call:
    """One collective call, checked and described, before it votes."""

    kind: Kind
    send: Any
    recv: Any
    op: ReduceOp
    tag: int
    dtype: DataType
    count: int  # elements of recv
    nbytes: int  # bytes of recv
    descriptor: m.CollectiveDescriptor
    quantization: QuantizationOptions
    staging_device: Any  # pccl.collectives.staging.device_for(send): None for host tensors
    on_gpu: bool
    called_n: int  # the group size this peer saw when it called


@dataclass
class _Commenced:
    """What the master's commence (or the speculative start) settled: the ring and the op_seq."""

    rows: list[m.PeerRow]
    ring: list[int]
    proposal: int  # >= 0: a speculative start
    t_commence: float


class CollectiveCalls:
    """The collective calls (a part of :class:`~pccl.peer.communicator.Communicator`, which provides
    the attributes declared here)."""

    config: Any
    pool: Any
    peer_group: int
    _notices: WaitReporter
    _core: PeerState
    _ops: dict[int, OpState]
    _closed: bool
    _stall: StallWatch
    _spinner: Spinner
    _stats: collections.Counter[str]
    _links: LinkModel | None
    _work_cache: BufferCache
    _gpu_cache: BufferCache
    _phase_seconds: dict[str, float]
    _last_phases: dict[str, float]
    _state_server: StateServer

    @property
    def peer_id(self) -> int:
        raise NotImplementedError

    @property
    def group_ring(self) -> list[int]:
        raise NotImplementedError

    async def _await_link(self) -> None:
        raise NotImplementedError

    async def _send(self, msg: m.Message) -> None:
        raise NotImplementedError

    async def _send_now(self, msg: m.Message) -> None:
        raise NotImplementedError

    def _send_soon(self, msg: m.Message) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------
    # the public calls

    async def all_reduce(
        self,
        send: Any,
        recv: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
    ) -> ReduceInfo:
        """All-reduce of ``send`` into ``recv`` (``recv`` None or ``send`` itself: in place).

        GPU tensors are staged through host memory (:mod:`pccl.collectives.staging`): ``send`` is
        copied to the host block by block (ordered after the work queued on the current CUDA stream)
        as the data plane needs each block; an in-place result is copied back range by range as it
        becomes final (and rolled back if the operation fails), any other at the commit. Every copy
        is complete when the call returns. This applies to every collective.

        Args:
            send: contiguous numpy array, torch tensor (CPU or CUDA) or cupy array.
            recv: output of the same dtype and element count (may be ``send``), on the same device as
                ``send`` (other peers may use other devices).
            op: SUM, AVG, PROD, MIN or MAX (accumulated in the tensor's dtype).
            tag: operations with different tags may run concurrently.
            quantization: optional wire compression (floats only).

        Returns:
            ReduceInfo(local_world_size, tx_bytes, rx_bytes).

        Raises:
            TooFewPeersError: fewer than 2 peers in the group.
            InvalidArgumentError: bad buffers (type, dtype, size, contiguity, ``send`` and ``recv`` on
                different devices), raised before voting.
            InvalidUsageError: ``tag`` is already running.
            RankConnectionLostError: a participant failed; ``recv`` holds its previous bits.
            MasterConnectionError: the master is lost.
        """
        info, _ = await self._collective("all_reduce", send, recv, op=op, tag=tag, quantization=quantization)
        return info

    async def reduce_scatter(
        self, send: Any, recv: Any = None, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0
    ) -> tuple[ReduceInfo, slice]:
        """Reduce ``send`` across the group; this peer receives its own chunk.

        Returns:
            (info, chunk): ``recv[chunk]`` holds this peer's reduced chunk (the rest of ``recv`` is
            unchanged). Chunk r has ``count // n`` elements plus one if ``r < count % n``.
        """
        info, chunk = await self._collective("reduce_scatter", send, recv, op=op, tag=tag)
        assert chunk is not None
        return info, chunk

    async def all_gather(self, send: Any, recv: Any, *, tag: int = 0) -> ReduceInfo:
        """Gather every peer's ``send`` into ``recv`` in ring (rank) order.

        ``recv`` must hold ``group_world_size * len(send)`` elements; if the group changed since the
        last call the operation fails with INVALID_ARGUMENT and ``recv`` is untouched.
        """
        info, _ = await self._collective("all_gather", send, recv, op=ReduceOp.SUM, tag=tag)
        return info

    async def broadcast(self, tensor: Any, *, root: int = 0, tag: int = 0) -> ReduceInfo:
        """Overwrite ``tensor`` on every peer with the root's contents.

        Args:
            root: rank of the root in this group's ring (see :attr:`rank`) as this peer sees it when
                it calls; the operation names that peer by id, so the same peer stays the root when
                the ring it commences on lost a member this peer did not know of yet.
            tag: the operation's tag.

        Returns:
            The operation's :class:`ReduceInfo`.

        Raises:
            InvalidArgumentError: ``root`` is not a rank of the group.
            RankConnectionLostError: the root (or another participant) was lost.
        """
        info, _ = await self._collective("broadcast", tensor, tensor, op=ReduceOp.SUM, tag=tag, root=root)
        return info

    async def reduce(
        self, send: Any, recv: Any = None, *, root: int = 0, op: ReduceOp = ReduceOp.SUM, tag: int = 0
    ) -> ReduceInfo:
        """Reduce ``send`` of every peer into ``recv`` of the root (``recv`` None: ``send`` itself).

        Only the root's ``recv`` is written; every other peer's ``recv`` keeps its bits (it must still
        have ``send``'s dtype and element count). Runs as a pipelined chain towards the root on the
        ring, or up the binomial tree rooted at the root (``PeerConfig.schedule``; "hd" runs the tree).

        Args:
            send: this peer's contribution (any buffer :meth:`all_reduce` takes).
            recv: the output on the root (may be ``send``: in place).
            root: rank of the root in this group's ring as this peer sees it when it calls (named by
                peer id on the wire, as :meth:`broadcast`'s).
            op: SUM, AVG, PROD, MIN or MAX.
            tag: the operation's tag.

        Returns:
            The operation's :class:`ReduceInfo`.

        Raises:
            InvalidArgumentError: ``root`` is not a rank of the group, or bad buffers (before voting).
            RankConnectionLostError: the root or another participant was lost; ``recv`` unchanged.
        """
        info, _ = await self._collective("reduce", send, recv, op=op, tag=tag, root=root)
        return info

    async def all_to_all(self, send: Any, recv: Any = None, *, tag: int = 0) -> ReduceInfo:
        """Exchange blocks with every peer: ``send`` and ``recv`` hold ``n`` equal blocks (``n`` the
        group size); block ``j`` of ``send`` goes to rank ``j``, block ``i`` of ``recv`` comes from rank
        ``i`` (ranks in ring order, see :attr:`rank`; this peer's own block is copied).

        Args:
            send: ``n * c`` elements (any buffer :meth:`all_reduce` takes).
            recv: ``n * c`` elements of the same dtype (None or ``send`` itself: in place).
            tag: the operation's tag.

        Returns:
            The operation's :class:`ReduceInfo`.

        Raises:
            InvalidArgumentError: sizes that are not ``n`` equal blocks, or the group changed size since
                the call (``recv`` untouched).
            RankConnectionLostError: a participant was lost; ``recv`` unchanged.
        """
        info, _ = await self._collective("all_to_all", send, recv, op=ReduceOp.SUM, tag=tag)
        return info

    async def all_reduce_multiple_with_retry(
        self,
        ops: Sequence[tuple[Any, Any, ReduceOp] | dict[str, Any]],
        *,
        max_in_flight: int = 4,
        base_tag: int = 0,
    ) -> ReduceInfo:
        """Run several all-reduces concurrently, retrying failed ones until all succeed.

        Args:
            ops: items ``(send, recv, op)`` or dicts with keys send, recv, op, tag, quantization.
            max_in_flight: cap on operations running at once.
            base_tag: tags used are ``base_tag + index`` unless a dict names its own ``tag``.

        Returns:
            Summed ReduceInfo (world size of the last successful op).

        Raises:
            TooFewPeersError: the world dropped below 2 before all succeeded.
        """
        if max_in_flight < 1:
            raise InvalidArgumentError("max_in_flight must be >= 1")
        items: list[dict[str, Any]] = []
        for i, o in enumerate(ops):
            d = dict(o) if isinstance(o, dict) else {"send": o[0], "recv": o[1], "op": o[2]}
            d.setdefault("tag", base_tag + i)
            items.append(d)
        tx = rx = world = 0
        remaining = list(range(len(items)))
        while remaining:
            results, failures = await self._round_of(items, remaining, max_in_flight)
            for info in results.values():
                tx += info.tx_bytes
                rx += info.rx_bytes
                world = info.local_world_size
            remaining = sorted(failures)
            if remaining and len(self.group_ring) < 2:
                raise TooFewPeersError("the world dropped below 2 peers before all operations succeeded")
        return ReduceInfo(local_world_size=world or len(self.group_ring), tx_bytes=tx, rx_bytes=rx)

    async def _round_of(
        self, items: list[dict[str, Any]], indexes: list[int], max_in_flight: int
    ) -> tuple[dict[int, ReduceInfo], list[int]]:
        """One round of :meth:`all_reduce_multiple_with_retry`: ``(results, indexes to retry)``."""
        failures: list[int] = []
        fatal: list[PCCLError] = []
        limiter = trio.CapacityLimiter(max_in_flight)
        results: dict[int, ReduceInfo] = {}

        async def one(i: int) -> None:
            d = items[i]
            try:
                results[i] = await self.all_reduce(
                    d["send"], d.get("recv"), op=d.get("op", ReduceOp.SUM), tag=d["tag"],
                    quantization=d.get("quantization"),
                )
            except RankConnectionLostError:
                failures.append(i)
            except PCCLError as exc:
                fatal.append(exc)
            finally:
                limiter.release_on_behalf_of(i)

        async with trio.open_nursery() as nursery:
            # Launch strictly in index order: every peer then has the same window of tags in
            # flight (random task start order could give peers disjoint windows: a deadlock).
            for i in indexes:
                await limiter.acquire_on_behalf_of(i)
                nursery.start_soon(one, i)
        if fatal:
            raise fatal[0]
        return results, failures

    # ------------------------------------------------------------------------------------------
    # one call

    async def _collective(
        self,
        kind: str,
        send: Any,
        recv: Any,
        *,
        op: ReduceOp,
        tag: int,
        root: int = 0,
        quantization: QuantizationOptions | None = None,
    ) -> tuple[ReduceInfo, slice | None]:
        """One collective call (see the module docstring). Returns its info and the range of ``recv``
        it wrote (None: nothing, a non-root of a reduce)."""
        await self._await_link()
        call = self._describe(get_kind(kind), send, recv, op, tag, root, quantization)
        t_start = time.perf_counter()
        st = self._begin(call)
        attempt: Attempt | None = None
        plane_ok = False  # this peer's data plane finished (the op may still fail elsewhere)
        staging: Staging | None = None
        committed = False
        try:
            c = await self._vote(call, st)
            root = self._core.root_position(call.descriptor, c.ring)  # the root's position in this ring
            stage, staging = self._stage(call, len(c.ring))
            cache = self._gpu_cache if call.on_gpu else self._work_cache
            send_np = stage if stage is not None else backend.as_numpy(call.send)
            work = cache.take(send_np.dtype, call.count, call.recv if call.on_gpu else None)
            attempt, tx, rx = await self._attempt(call, st, c, root, send_np, work, staging)
            plane_ok = True
            t_ring = time.perf_counter()
            # the schedule "auto" resolved to: the master judges a participant that then fails the
            # operation alone by the plans most participants report (pccl/master/op_plans.py)
            await self._confirm(st, _REPORTED.get(attempt.plan.schedule, "")
                                if call.descriptor.schedule == "auto" else "")
            t_complete = time.perf_counter()
            st.concluded = True
            # Commit: the only place the caller's buffer is written (but for a device tensor's
            # in-place result, delivered during the data plane and rolled back by staging.abort()
            # if the operation fails). Synchronous: a cancellation cannot land half-way.
            written = attempt.commit(work, call.recv, call.dtype, staging is not None and staging.delivered)
            committed = True
            self._core.op_committed(tag, st.op_seq)
            # Only buffers of successful ops are reused: a failed op's buffer may still be referenced.
            cache.give_back(work)
            if stage is not None:
                cache.give_back(stage)
            self._stats[f"{call.kind.name}_ok"] += 1
            self._stats[f"schedule_{attempt.schedule}_ok"] += 1
            self._record_phases(t_start, c.t_commence, t_ring, t_complete, time.perf_counter())
            return ReduceInfo(local_world_size=len(c.ring), tx_bytes=tx, rx_bytes=rx), written
        except PCCLError:
            self._stats[f"{call.kind.name}_failed"] += 1
            if plane_ok and attempt is not None:
                # Our data plane finished but the op failed elsewhere: the attempt's failure path.
                await attempt.fail()
            raise
        finally:
            await self._end(st, None if committed else staging)

    def _begin(self, call: _Call) -> OpState:
        """The state of a new call, registered with the core, the notices and the spinner."""
        st = OpState(tag=call.tag, commence=Waiter(), complete=Waiter())
        self._notices.begin(("op", call.tag), functools.partial(self._describe_op_wait, call.kind.name, st))
        self._core.begin_op(call.tag)
        self._spinner.begin()  # poll instead of sleeping while it runs (pccl/peer/spin.py)
        self._ops[call.tag] = st
        return st

    def _stage(self, call: _Call, world: int) -> tuple[np.ndarray | None, Staging | None]:
        """A device tensor's host stage and its staging (None, None for host tensors)."""
        if call.staging_device is None:
            return None, None
        # Host staging, pipelined with the data plane (pccl/collectives/staging.py): the ring
        # runs on a host stage of ``send`` filled block by block; an in-place result goes
        # back range by range, and is rolled back if the operation fails.
        stage = self._gpu_cache.take(backend.dtype_to_numpy(call.dtype), call.count, call.send)
        staging = Staging(
            call.staging_device, call.send, stage, recv=call.recv,
            average_over=world if call.op == ReduceOp.AVG else 0, dtype=call.dtype,
        )
        return stage, staging

    async def _end(self, st: OpState, staging: Staging | None) -> None:
        """The call ends, however it ends; ``staging``: that of a call that did not commit."""
        if not st.concluded and st.abort_error is None and self._core.lost is None \
                and not self._core.reconnecting:
            # Cancelled by the caller while voting or running: withdraw, so the master aborts the
            # op for the other participants instead of leaving them waiting for us.
            self._send_soon(m.CollectiveDone(tag=st.tag, success=False, reason="cancelled on peer"))
        self._ops.pop(st.tag, None)
        self._notices.end(("op", st.tag))
        self._core.end_op(st.tag)
        self._spinner.end()
        if staging is not None:
            # Failed or cancelled: no device copy may outlive this call, and recv gets back the
            # bits a pipelined delivery overwrote (shielded inside; raises if it cannot).
            await staging.abort()

    def _describe_op_wait(self, kind: str, st: OpState, waited: float) -> str | None:
        group = f"peer group {self.peer_group}"
        if not st.commence.done and not st.plane_done:  # (a speculative plane too: not everyone voted)
            return (f"peer {self.peer_id}: {kind} (tag {st.tag}) has waited {format_wait(waited)} for the "
                    f"other accepted peers of {group} to call it with the same tag (the master's log names "
                    f"those it waits for); MasterConfig.vote_timeout bounds it")
        if st.plane_done and not st.complete.done:
            return (f"peer {self.peer_id}: {kind} (tag {st.tag}) finished here and has waited "
                    f"{format_wait(waited)} in all for the other participants to finish it")
        return None  # moving data (PeerConfig.p2p_stall_timeout bounds a stalled transfer)

    def _describe(
        self, kind: Kind, send: Any, recv: Any, op: ReduceOp, tag: int, root: int,
        quantization: QuantizationOptions | None,
    ) -> _Call:
        """Check the call and build its descriptor, before voting (so that the other peers are not
        dragged into a failed op); a GPU ``send`` is copied to the host here."""
        self._core.check_tag(tag)
        op = ReduceOp(op)
        if recv is None:
            recv = send
        sdesc = backend.describe(send)
        rdesc = backend.describe(recv)
        if sdesc.dtype != rdesc.dtype:
            raise InvalidArgumentError(f"send is {sdesc.dtype.name} but recv is {rdesc.dtype.name}")
        device = backend.device_index(send)
        backend.check_same_device(device, backend.device_index(recv))
        q = quantization or QuantizationOptions(algorithm=QuantizationAlgorithm.NONE)
        descriptor = self._core.describe_collective(
            kind.name, tag=tag, dtype=sdesc.dtype, send_count=sdesc.count, recv_count=rdesc.count, op=op,
            root=root, quantization=q, schedule=self.config.schedule,
        )
        staging_device = device_for(send)  # None for host tensors
        return _Call(kind, send, recv, op, tag, sdesc.dtype, rdesc.count, rdesc.nbytes, descriptor, q,
                     staging_device, staging_device is not None, len(self._core.group_ring))

    async def _vote(self, call: _Call, st: OpState) -> _Commenced:
        """Vote, and learn the ring and op_seq: at once for a speculative start (docs/protocol.md
        section 4: with the op_seq the last confirmation of this tag reserved, the data plane starts
        right after the vote, on the current ring, and the master's one answer settles it), else from
        the master's commence. An op that cannot run on that ring is reported failed here."""
        # Large operations start speculatively on far links only: where a partner's round trip asks
        # for a stripe (by default over ~20 ms, pccl/peer/striping.py) or this peer stripes to it, a
        # master round trip is a visible share of the operation; on loopback or a LAN it is not.
        # Asked only where it decides (the links are looked up per partner: not on every small
        # operation's path).
        far = call.nbytes > SPECULATIVE_NEAR_MAX_BYTES and any(
            self.pool.far(p) for p in self._core.group_ring if p != self.peer_id)
        proposal = self._core.speculate(call.tag, call.nbytes, far)
        st.op_seq = proposal
        await self._send_now(m.CollectiveInitiate(tag=call.tag, descriptor=call.descriptor, op_seq=proposal))
        if proposal >= 0:
            rows = self._core.group_rows()
        else:
            commence = await st.commence.wait()
            st.op_seq = commence.op_seq
            rows = commence.peers
        t_commence = time.perf_counter()
        ring = [r.peer_id for r in rows]
        self._core.reconcile_group(rows)
        self._core.commenced(call.tag, ring)
        problem = self._core.commence_problem(call.descriptor, call.count, ring, call.called_n)
        if problem is not None:
            self.pool.forget_op(st.op_seq)  # frames others already sent must not stay stashed
            await self._report_failure(st, problem[0])
            raise problem[1]
        return _Commenced(rows, ring, proposal, t_commence)

    async def _attempt(
        self, call: _Call, st: OpState, c: _Commenced, root: int, send_np: np.ndarray, work: np.ndarray,
        staging: Staging | None,
    ) -> tuple[Attempt, int, int]:
        """Run this peer's attempt in the op's cancel scope (registered under its tag: the master's
        abort cancels it). Raises the abort, or RankConnectionLostError once the failure is reported."""
        ok, reason, tx, rx = False, "", 0, 0
        stalled_on = -1  # the partner whose frames were not taken when the data plane stalled
        attempt: Attempt | None = None
        with trio.CancelScope() as scope:
            st.scope = scope
            if st.abort_error is not None:
                # The abort arrived right behind the commence, before this task ran again, so the
                # AbortOp effect found no scope to cancel: cancel now, before the ring starts (the
                # attempt forgets the op's stashed frames and the abort is raised below).
                scope.cancel()
            try:
                attempt = Attempt(
                    self.pool, kind=call.kind, ring=c.ring, my_id=self.peer_id, tag=call.tag,
                    op_seq=st.op_seq, count=call.descriptor.element_count,
                    itemsize=backend.dtype_to_numpy(call.dtype).itemsize, op=call.op, root=root,
                    schedule=self._schedule(call, c.rows, root), quantization=call.quantization,
                )
                await attempt.connect(
                    c.rows, ride_out=self.config.p2p_stall_timeout, closed=lambda: self._closed
                )
                # A speculative data plane may wait for peers that have not voted yet: its stall
                # clock starts with the master's commence (every participant voted), which comes
                # off the critical path; the master's vote timeout bounds the wait before. Until
                # then it sends at most half a partner's stash (pccl/collectives/gate.py).
                gate = SendGate(early_send_limit(self.config.recv_stash_limit), st.commence) \
                    if c.proposal >= 0 else None
                with self._state_server.collective():  # serving a heal yields to the data plane
                    tx, rx = await self._stall.guarded(
                        functools.partial(attempt.run, send_np, work, staging, gate),
                        arm_when=(lambda: st.commence.done) if c.proposal >= 0 else None,
                    )
                ok = st.plane_done = True
                if gate is not None and gate.waited:
                    self._stats["speculative_gate_waits"] += 1
            except PCCLError as exc:
                reason = str(exc)
                stalled_on = exc.peer_id if isinstance(exc, StalledOn) else -1
        st.scope = None
        # not before the vote completed: until then the speculative gate may hold sends back
        io = self._testimony(st, attempt) if not ok and (c.proposal < 0 or st.commence.done) else []
        blocked = self.pool.op_blocked(st.op_seq) if io else []
        early = self._early(st, attempt) if io else []
        # the schedule its plan ran ("auto" resolved here): the master rebuilds the plans of the
        # schedule most participants report (pccl/master/plan_rule.py)
        ran = _REPORTED.get(attempt.plan.schedule, "") if io and attempt is not None else ""
        if st.abort_error is not None:
            if io:  # aborted while its data plane stood still: the master compares the pairs' bytes
                await self._report_failure(st, "aborted: its data plane had stalled", io=io, blocked=blocked,
                                           schedule=ran, early=early)
            raise st.abort_error
        if not ok or attempt is None:
            await self._report_failure(st, reason, stalled_on, io=io, blocked=blocked, schedule=ran,
                                      early=early)
            if c.proposal >= 0:
                # The vote may still be open (a descriptor mismatch shows up as frames of the wrong
                # size): the master's verdict names the real cause, and it is an abort.
                await st.complete.wait()
            raise RankConnectionLostError(reason)
        return attempt, tx, rx

    async def _confirm(self, st: OpState, schedule: str = "") -> None:
        """Report success and wait for the master's verdict. In doubt from here until the master
        answers: a master lost now (even while this report is being sent) leaves the op waiting for
        the decision of the master this peer reconnects to, instead of failing it (docs/concepts.md
        "Operations in doubt")."""
        self._core.op_done(st.tag)
        try:
            await self._send_now(m.CollectiveDone(tag=st.tag, success=True, op_seq=st.op_seq,
                                                  schedule=schedule))
        except RankConnectionLostError:
            if not self._core.reconnecting:
                raise
        await st.complete.wait()

    def _record_phases(self, *t: float) -> None:
        """Record a successful collective's phases from the ``len(PHASES) + 1`` instants between them."""
        phases = {name: t[i + 1] - t[i] for i, name in enumerate(PHASES)}
        self._last_phases = phases
        for name, seconds in phases.items():
            self._phase_seconds[name] += seconds

    def _testimony(self, st: OpState, attempt: Attempt | None) -> list[m.IoRow]:
        """The operation's bytes per partner, when its data plane moved nothing for at least half
        ``p2p_stall_timeout`` (issue 33 item 6: the master finds a member that does not read by
        comparing what each end of a pair counted); else empty."""
        if attempt is None or self._stall.quiet() < self.config.p2p_stall_timeout / 2:
            return []
        return [m.IoRow(p, sent, taken) for p, sent, taken in self.pool.op_io(st.op_seq)]

    def _early(self, st: OpState, attempt: Attempt | None) -> list[int]:
        """With a stall testimony: the partners whose later frame this peer took while an earlier one of
        their release order had not come (pccl/peer/early_frames.py: they sent out of order)."""
        if attempt is None or attempt.rank < 0:
            return []
        return early_partners(attempt.plan, attempt.rank, attempt.ring, attempt.tag, attempt.partner_plan,
                              self.pool.op_arrived(st.op_seq))

    async def _report_failure(self, st: OpState, reason: str, stalled_on: int = -1,
                              io: list[m.IoRow] | None = None, blocked: list[int] | None = None,
                              schedule: str = "", early: list[int] | None = None) -> None:
        st.concluded = True
        try:
            await self._send(m.CollectiveDone(tag=st.tag, success=False, reason=reason, op_seq=st.op_seq,
                                              stalled_on=stalled_on, io=io or [], blocked=blocked or [],
                                              schedule=schedule, early=early or []))
        except PCCLError:
            pass

    def _schedule(self, call: _Call, rows: list[m.PeerRow], root: int) -> str:
        """The schedule this operation runs: from the descriptor (equal on every participant, the
        master checked), the operation's group (its table, the same on every participant) and the
        link summary the master sent every member, so every participant picks the same. Without a
        summary, a group whose members all have one address (one host) is priced with
        :func:`~pccl.collectives.cost.same_host` for this host's cores (one host: the same count on
        every member), any other with the LAN defaults."""
        links = self._links
        if links is None and len({r.host for r in rows}) == 1:
            links = _SAME_HOST
        d = call.descriptor
        return schedule_for(
            d.schedule,
            d.kind,
            len(rows),
            d.element_count * backend.dtype_to_numpy(call.dtype).itemsize,
            quantized=d.quantization != int(QuantizationAlgorithm.NONE),
            links=links,
            root=root,
        )


__all__ = ["PHASES", "CollectiveCalls", "OpState"]
