"""Shared state on the peer: declaring tensors, the sync call, serving and fetching tensors.

A sync is a group vote (see :mod:`pccl.master.election` for the rules). The master sends each
peer a plan: the keys it must fetch and which peers hold the elected bytes. Fetched bytes are
staged, re-hashed and applied only after the master confirms that every participant succeeded,
so a failed sync leaves every tensor exactly as it was (**atomic apply**). The price is staging
memory equal to the bytes fetched (a newcomer briefly holds its state twice).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from .._errors import (
    InvalidArgumentError,
    InvalidBufferError,
    InvalidUsageError,
    MasterConnectionError,
    PCCLError,
    Result,
    SharedStateSyncError,
)
from .._rawmem import address_of, view_at
from .._types import DataType, DeviceType, SharedStateSyncInfo, SharedStateSyncStrategy
from ..kernels import backend, hashing
from ..transport import StreamBroken
from ..wire import limits
from ..wire import messages as m
from ..wire.stream import MessageStream
from . import heal, prefault, swarm
from .links import Dialer, MasterLink
from .ratecap import RateCap
from .serve_pace import ServePace
from .state import error_from_code

log = logging.getLogger("pccl.shared_state")

ProgressCallback = Callable[[int, int], None]
"""``callback(bytes_done, bytes_total)`` called as a fetch progresses."""

_HASH_IN_THREAD_BYTES = 8 * 1024 * 1024
_TOTALS = ("heal_fetches", "heal_bytes", "heal_chunks", "heal_donors_failed", "heal_donors_excluded",
           "heal_bad_bytes", "heal_duplicate_bytes", "heal_stolen", "heal_served_bytes")
_PROGRESS_LOG_BYTES = 64 * 1024 * 1024
#: Snapshots a holder keeps pinned for live heals at once (each holds a copy of the keys fetched).
PINS_KEPT = 4
#: Seconds between two ``SharedStateProgress`` reports of a running fetch to the master (its status page
#: shows each receiver's bytes, rate and ETA; issue 37 item 5). None is sent when no byte came since.
PROGRESS_EVERY = 1.0


class _Seen:
    """The fetch's progress callback: keeps its last values (for the master's reports) and passes them
    on to the caller's callback, if any."""

    def __init__(self, chained: ProgressCallback | None) -> None:
        self.chained = chained
        self.done = 0
        self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self.chained is not None:
            self.chained(done, total)


async def _report_progress(link: MasterLink, sync_seq: int, seen: _Seen,
                           fetch: Callable[[], heal.SwarmFetch | None] = lambda: None) -> None:
    """Tell the master every :data:`PROGRESS_EVERY` seconds how far the fetch is: bytes, and the swarm
    fetch's chunks and donors (``fetch()``: the running one, if any) (until cancelled, when the fetch ends:
    its ``SharedStateDone`` follows, never a report after it)."""
    sent = 0
    while True:
        await trio.sleep(PROGRESS_EVERY)
        if seen.total <= 0 or seen.done == sent:
            continue
        sent = seen.done
        job = fetch()
        st = job.schedule.statistics() if job is not None else None
        msg = m.SharedStateProgress(  # (bytes fetched twice count twice in ``done``: capped)
            sync_seq=sync_seq, rx_bytes=min(seen.done, seen.total), total_bytes=seen.total,
            **({} if st is None else {
                "chunks_done": st["chunks_done"], "chunks_total": st["chunks_total"],
                "donors": st["donors_active"],
                "donors_lost": len(st["donors"]) - st["donors_active"]}))
        try:
            # Shielded: a frame cut by the fetch's end would break the master link. A control frame of
            # a few bytes; a master that stops reading is found by the link's watchdog, which closes it.
            with trio.CancelScope(shield=True):
                await link.send(msg)
        except PCCLError:
            return  # best effort: the fetch and the sync's outcome report a lost master


class TensorInfo:
    """One named tensor of a shared state.

    Two forms:

    * ``TensorInfo(name, tensor, *, allow_content_inequality=False)`` (pccl): ``tensor`` is a contiguous
      numpy array, torch tensor (CPU or CUDA) or cupy array, referenced (kept alive) and updated in place;
    * ``TensorInfo(name, data_ptr, *, numel, dtype, device_type, allow_content_inequality)`` (the
      established bindings): a raw address of ``numel`` elements of ``dtype`` in host memory
      (``DeviceType.CPU``). The memory is not kept alive: it must outlive the shared state, as there.

    :meth:`from_numpy` and :meth:`from_torch` build the first form.

    Args:
        name: unique key within the state.
        data_ptr: the tensor, or a raw host address (an ``int``).
        numel: element count (raw address only; checked against a tensor when given).
        dtype: element type (raw address only; checked against a tensor when given).
        device_type: where the memory is (raw address: CPU only; checked against a tensor when given).
        allow_content_inequality: not compared between up-to-date peers (newcomers and outdated
            peers still receive it).

    Attributes:
        tensor: what pccl reads and writes (for a raw address: a numpy view of that memory).
        data_ptr, numel, dtype, device_type: as in the established bindings.

    Raises:
        InvalidBufferError: not a usable tensor (type, dtype, contiguity), a null address, a raw address
            without ``numel``/``dtype``, a raw device address, or a mismatch with ``numel``/``dtype``/
            ``device_type`` (also a ValueError and an AssertionError, like the established checks).
    """

    def __init__(self, name: str, data_ptr: Any, *, numel: int | None = None, dtype: DataType | None = None,
                 device_type: DeviceType | None = None, allow_content_inequality: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("a TensorInfo needs a non-empty string name")
        if isinstance(data_ptr, int) and not isinstance(data_ptr, bool):
            tensor: Any = _view_of_address(data_ptr, numel, dtype, device_type)
        else:
            tensor = data_ptr
        try:
            d = backend.describe(tensor)  # validates type, dtype and contiguity now, not at sync time
        except InvalidArgumentError as exc:
            raise InvalidBufferError(exc.message) from None
        where = DeviceType.CUDA if backend.is_cuda(tensor) else DeviceType.CPU
        if numel is not None and int(numel) != d.count:
            raise InvalidBufferError(
                f"TensorInfo {name!r}: numel={numel} but the tensor has {d.count} elements")
        if dtype is not None and DataType(dtype) != d.dtype:
            raise InvalidBufferError(f"TensorInfo {name!r}: dtype={DataType(dtype).name} but the tensor is "
                                     f"{d.dtype.name}")
        if device_type is not None and DeviceType(device_type) != where:
            raise InvalidBufferError(f"TensorInfo {name!r}: device_type={DeviceType(device_type).name} "
                                     f"but the tensor is on {where.name}")
        self.name = name
        self.tensor = tensor
        self.allow_content_inequality = bool(allow_content_inequality)
        self.numel = d.count
        self.dtype = d.dtype
        self.device_type = where
        self.data_ptr = address_of(tensor)

    @classmethod
    def from_numpy(
        cls, tensor: np.ndarray, name: str, *, allow_content_inequality: bool = False
    ) -> TensorInfo:
        """Wrap a contiguous numpy array (referenced, updated in place).

        Raises:
            InvalidBufferError: not a contiguous numpy array of a supported dtype.
        """
        if not isinstance(tensor, np.ndarray):
            raise InvalidBufferError(
                f"TensorInfo.from_numpy needs a numpy array, got {type(tensor).__name__}")
        return cls(name, tensor, allow_content_inequality=allow_content_inequality)

    @classmethod
    def from_torch(cls, tensor: Any, name: str, *, allow_content_inequality: bool = False) -> TensorInfo:
        """Wrap a contiguous torch tensor (CPU or CUDA; referenced, updated in place).

        Raises:
            InvalidBufferError: not a torch tensor, a distributed ``DTensor`` (pass its local shard), not
                contiguous, or an unsupported dtype.
        """
        if not backend.is_torch_tensor(tensor):
            raise InvalidBufferError(
                f"TensorInfo.from_torch needs a torch tensor, got {type(tensor).__name__}")
        if _is_dtensor(tensor):
            raise InvalidBufferError("Input tensor must not be a distributed tensor (DTensor); "
                                     "pass its local shard (tensor.to_local())")
        return cls(name, tensor, allow_content_inequality=allow_content_inequality)

    def __repr__(self) -> str:
        d = backend.describe(self.tensor)
        return f"<TensorInfo {self.name!r} {d.dtype.name}{list(d.shape)}>"


def _view_of_address(address: int, numel: int | None, dtype: DataType | None,
                     device_type: DeviceType | None) -> np.ndarray:
    """A numpy view of ``numel`` elements of ``dtype`` at a raw host ``address`` (the established form)."""
    if address == 0:
        raise InvalidBufferError("Invalid data pointer: nullptr")
    if numel is None or dtype is None:
        raise InvalidBufferError("a TensorInfo from a raw address needs numel= and dtype=")
    if device_type is not None and DeviceType(device_type) != DeviceType.CPU:
        raise InvalidBufferError(
            "raw device addresses are not supported; use TensorInfo.from_torch(tensor, name)")
    return view_at(address, int(numel), DataType(dtype))


def _is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(t, dtensor)


class SharedState:
    """A list of named tensors plus a revision that goes up by one per sync.

    Args:
        tensor_infos: the tensors (at least one); names must be unique.
        revision: the starting revision.

    Raises:
        InvalidBufferError: an empty list (also an AssertionError, as the established bindings assert).
        InvalidArgumentError: duplicate names.
    """

    def __init__(self, tensor_infos: list[TensorInfo], revision: int = 0) -> None:
        if not tensor_infos:
            raise InvalidBufferError("At least one tensor info must be provided")
        names = [t.name for t in tensor_infos]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"duplicate tensor names in shared state: {names}")
        self.tensor_infos = list(tensor_infos)
        self.revision = int(revision)

    def push_revision(self) -> None:
        """Increment :attr:`revision` by one (what a training step does after a sync)."""
        self.revision += 1

    def __repr__(self) -> str:
        return f"<SharedState revision={self.revision} tensors={len(self.tensor_infos)}>"


@dataclass
class SyncContext:
    """A sync in progress on this peer: what it serves to others and what it received."""

    state: SharedState
    hashes: dict[str, int]
    seq: int = -1
    plan: m.SharedStatePlan | None = None
    plan_ready: trio.Event = field(default_factory=trio.Event)
    tx: int = 0
    error: PCCLError | None = None
    fetch: heal.SwarmFetch | None = None  # this peer's own fetch, while it runs
    sums: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (key, chunk bytes) -> chunk sums
    host: dict[str, memoryview] = field(default_factory=dict)  # host copies of GPU tensors served

    def abort(self, error: PCCLError) -> None:
        """Fail the sync: holders stop serving it."""
        self.error = error
        self.plan_ready.set()


class StateServer:
    """The sync this peer serves tensors from (the "state" P2P channel), if one is running.

    Args:
        plan_timeout: how long a request may wait for this peer's own plan to arrive.
        stall_timeout: how long a fetch waits for a donor that moves no byte before it asks the others.
        serve_rate: ``PeerConfig.state_serve_rate`` (None: serving is not paced).
        serve_idle_rate: ``PeerConfig.state_serve_idle_rate`` (serving yields to this peer's
            collectives: :meth:`collective`).

    Attributes:
        totals: counters over this peer's fetches (see :meth:`count`).
        last: the statistics of this peer's last fetch (:meth:`pccl.peer.heal.SwarmFetch.statistics`),
            None before the first.
    """

    def __init__(self, plan_timeout: float, stall_timeout: float = 30.0,
                 serve_rate: float | None = None, serve_idle_rate: float | None = None) -> None:
        self.plan_timeout = plan_timeout
        self.stall_timeout = stall_timeout
        self.ctx: SyncContext | None = None
        # Live heals this peer serves (issue 35 item 4): sync_seq -> the snapshot pinned for its fetchers
        self.pins: dict[int, SyncContext] = {}
        self.pinning: set[int] = set()  # live heals whose snapshot is being copied now
        self.cap = RateCap(serve_rate, idle_rate=serve_idle_rate) if serve_rate is not None else None
        # the trio side: senders' sleeps, this peer's collectives' reports, the connections' pacing
        self.pace = ServePace(self.cap) if self.cap is not None else None
        self.totals: dict[str, int] = dict.fromkeys(_TOTALS, 0)
        self.last: dict[str, Any] | None = None

    def count(self, fetch: dict[str, Any]) -> None:
        """Add a finished (or failed) fetch's statistics to :attr:`totals`: ``heal_fetches``,
        ``heal_bytes`` (verified), ``heal_chunks``, ``heal_donors_failed``, ``heal_donors_excluded``
        (bad bytes), ``heal_bad_bytes``, ``heal_duplicate_bytes`` (fetched twice), ``heal_stolen``.
        (``heal_served_bytes``, the tensor bytes this peer sent to fetchers, from a running sync or a
        pinned snapshot, is counted as it serves.)"""
        self.last = fetch
        t = self.totals
        t["heal_fetches"] += 1
        t["heal_bytes"] += fetch["bytes_done"]
        t["heal_chunks"] += fetch["chunks_done"]
        t["heal_donors_failed"] += len(fetch["donors_failed"])
        t["heal_donors_excluded"] += len(fetch["donors_excluded"])
        t["heal_bad_bytes"] += fetch["bad_bytes"]
        t["heal_duplicate_bytes"] += fetch["duplicate_bytes"]
        t["heal_stolen"] += fetch["stolen"]

    def abort(self, error: PCCLError) -> None:
        """Fail the running sync, if any."""
        if self.ctx is not None:
            self.ctx.abort(error)

    def pin(self, ctx: SyncContext) -> None:
        """Serve snapshot ``ctx`` under its ``seq`` until :meth:`release` (at most :data:`PINS_KEPT`:
        the oldest goes first, with a warning: its fetchers then ask the other holders)."""
        self.pins[ctx.seq] = ctx
        while len(self.pins) > PINS_KEPT:
            old = next(iter(self.pins))
            log.warning("shared state: dropping the snapshot pinned for live heal %d (more than %d pinned)",
                        old, PINS_KEPT)
            self.release(old)

    def release(self, seq: int) -> None:
        """The master released live heal ``seq``: drop its snapshot, refuse its requests from now on."""
        ctx = self.pins.pop(seq, None)
        if ctx is not None:
            ctx.abort(SharedStateSyncError(f"live heal {seq} ended"))

    @contextmanager
    def collective(self) -> Iterator[None]:
        """One of this peer's collectives moves data in this block: serving yields to it
        (``PeerConfig.state_serve_idle_rate``; :mod:`pccl.peer.ratecap`). Nothing without a cap."""
        if self.pace is None:
            yield
            return
        with self.pace.collective():
            yield

    def release_all(self, why: str) -> None:
        """Drop every pinned snapshot (``why``: logged), as if the master had released each."""
        if self.pins:
            log.warning("shared state: dropping the snapshot(s) pinned for live heal(s) %s: %s",
                        sorted(self.pins), why)
        for seq in list(self.pins):
            self.release(seq)

    def context_for(self, seq: int) -> SyncContext | None:
        """The sync or pinned snapshot that serves requests for ``seq`` (None: neither)."""
        pinned = self.pins.get(seq)
        return pinned if pinned is not None else self.ctx

    def pin_statistics(self) -> dict[int, dict[str, int]]:
        """Per live heal this peer serves a pinned snapshot for: its ``bytes`` held and ``tx_bytes``
        served so far (a holder's call returned before it served; this is where its serving shows)."""
        return {seq: {"bytes": sum(backend.describe(i.tensor).nbytes for i in c.state.tensor_infos),
                      "tx_bytes": c.tx} for seq, c in self.pins.items()}

    def pinned_bytes(self) -> int:
        """Bytes held by pinned snapshots."""
        return sum(backend.describe(i.tensor).nbytes
                   for c in self.pins.values() for i in c.state.tensor_infos)

    def statistics(self) -> dict[str, Any] | None:
        """The running sync as this peer sees it, or None: its ``sync_seq`` (-1 until the plan
        arrived), ``tx_bytes`` served so far, ``fetch``, the plan's ``{key: holder ids}``, and
        ``progress``: this peer's fetch (None when it fetches nothing), see
        :meth:`pccl.peer.heal.SwarmFetch.statistics`."""
        ctx = self.ctx
        if ctx is None:
            return None
        fetch = {} if ctx.plan is None else {str(r[0]): [int(h) for h in r[2]] for r in ctx.plan.fetch}
        progress = None if ctx.fetch is None else ctx.fetch.statistics()
        return {"sync_seq": ctx.seq, "tx_bytes": ctx.tx, "fetch": fetch, "progress": progress}

    def __repr__(self) -> str:
        ctx = self.ctx
        return "<StateServer idle>" if ctx is None else f"<StateServer sync={ctx.seq} tx={ctx.tx}>"


def _host_bytes(t: Any) -> memoryview:
    """Bytes of a tensor for sending (a zero-copy view on CPU, a host copy for GPU tensors)."""
    if backend.is_cuda(t):
        host = np.empty(backend.describe(t).nbytes, dtype=np.uint8)
        backend.copy_to_host(t, host)  # complete when it returns
        return memoryview(host)  # type: ignore[arg-type]  # ndarray implements the buffer protocol
    return backend.byte_view(t)


def _apply(t: Any, data: np.ndarray) -> None:
    """Overwrite tensor ``t`` with raw bytes ``data`` (uint8), in place.

    GPU tensors are written on their device's current stream and the copy is complete when this
    returns, so the caller's later work on any stream (and any thread) sees the new bytes.
    """
    if backend.is_cuda(t):
        backend.copy_from_host(t, data)
        return
    view = backend.byte_view(t)
    np.frombuffer(view, dtype=np.uint8)[:] = data


def _entries(state: SharedState) -> tuple[list[list[Any]], dict[str, int], dict[tuple[str, int], list[int]]]:
    """The vote's rows, the hashes, and the chunk sums of large CPU tensors (the same pass over their
    bytes: what a fetcher compares its own chunks with, and what a holder serves as manifests)."""
    rows: list[list[Any]] = []
    hashes: dict[str, int] = {}
    sums: dict[tuple[str, int], list[int]] = {}
    for info in state.tensor_infos:
        d = backend.describe(info.tensor)
        if d.nbytes > swarm.CHUNK_BYTES and not backend.is_cuda(info.tensor):
            h, chunks = hashing.hash_and_chunk_sums(info.tensor, swarm.CHUNK_BYTES)
            sums[(info.name, swarm.CHUNK_BYTES)] = chunks
        else:
            h = hashing.content_hash(info.tensor)
        hashes[info.name] = h
        rows.append([info.name, int(d.dtype), list(d.shape), d.nbytes, h, info.allow_content_inequality])
    return rows, hashes, sums


async def _fetch_watching(
    link: MasterLink, dialer: Dialer, ctx: SyncContext, plan: m.SharedStatePlan,
    progress: ProgressCallback | None, server: StateServer,
) -> tuple[dict[str, np.ndarray], int, str, list[m.Message]]:
    """Fetch what ``plan`` says this peer fetches, while watching the inbox: the master fails the sync
    without waiting for us when another participant is lost, and then the fetch stops at once instead
    of trying holders that moved on. Meanwhile the master hears how far the fetch is
    (:func:`_report_progress`).

    Returns:
        ``(staged tensors, bytes received, failure reason ("" if none), the master's early messages)``.

    Raises:
        MasterConnectionError, InvalidUsageError: the master is lost, or the communicator closed.
    """
    fetched: list[tuple[dict[str, np.ndarray], int]] = []
    errors: list[PCCLError] = []
    early: list[m.Message] = []
    inbox = link.inbox
    seen = _Seen(progress)
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            try:
                early.append(await inbox.get())
            except PCCLError as exc:
                errors.append(exc)
            nursery.cancel_scope.cancel()

        async def fetch() -> None:
            try:
                fetched.append(await _fetch_all(dialer, ctx, plan, seen, server))
            except PCCLError as exc:
                errors.append(exc)
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        nursery.start_soon(fetch)
        nursery.start_soon(_report_progress, link, plan.sync_seq, seen, lambda: ctx.fetch)
    staged: dict[str, np.ndarray] = {}
    rx, reason = 0, ""
    if fetched:
        staged, rx = fetched[0]
    elif errors and not early:
        reason = str(errors[0]) or "fetch failed"
    if errors and isinstance(errors[0], (MasterConnectionError, InvalidUsageError)):
        raise errors[0]
    return staged, rx, reason, early


async def run_sync(
    link: MasterLink,
    dialer: Dialer,
    server: StateServer,
    state: SharedState,
    strategy: SharedStateSyncStrategy,
    progress: ProgressCallback | None = None,
    observe: Callable[[bool, int], None] | None = None,
) -> SharedStateSyncInfo:
    """The body of :meth:`pccl.peer.communicator.Communicator.sync_shared_state` (see docs/protocol.md).

    Args:
        link: the master link; its inbox receives this sync's SharedStatePlan and SharedStateResult.
        dialer: opens the "state" connections to holders.
        server: publishes this sync so that other peers can fetch from us while it runs.
        state: the tensors.
        strategy: this peer's role in the vote.
        progress: optional ``callback(bytes_done, bytes_total)``.
        observe: issue 35 item 4, replay (docs/concepts.md "Replaying the rounds missed"): this peer's
            vote says it observes its group's collectives should it fetch live, and
            ``observe(live, revision)`` is called once the plan came (``live``: this peer fetches a live
            heal of ``revision``; it then returns with the healed revision as soon as it has it) or the
            call was answered without one (False, -1).

    Returns:
        Bytes sent to and received from other peers.

    Raises:
        SharedStateSyncError, NoSharedStateAvailableError, RankConnectionLostError,
        MasterConnectionError: see the communicator's method.
    """
    if not isinstance(state, SharedState):
        raise InvalidArgumentError("sync_shared_state needs a pccl.SharedState")
    tx = rx = 0
    while True:
        # A live heal (catch_up) applied its revision: vote again, in this call, to join the group at its
        # next sync and fetch what changed since (docs/concepts.md "Live heals").
        round_tx, round_rx, again = await _sync_round(link, dialer, server, state, strategy, progress,
                                                      observe)
        tx, rx = tx + round_tx, rx + round_rx
        if not again:
            return SharedStateSyncInfo(tx_bytes=tx, rx_bytes=rx)
        log.info("shared state: healed to revision %d (live); joining the group at its next sync",
                 state.revision)
        revote = getattr(link, "revote", None)
        if revote is not None:
            revote()


async def _sync_round(
    link: MasterLink, dialer: Dialer, server: StateServer, state: SharedState,
    strategy: SharedStateSyncStrategy, progress: ProgressCallback | None,
    observe: Callable[[bool, int], None] | None = None,
) -> tuple[int, int, bool]:
    """One vote and its plan: ``(tx bytes, rx bytes, catch up)``; catch up: a live heal ended at a
    revision the group has left (applied: the caller votes again)."""
    total = sum(backend.describe(i.tensor).nbytes for i in state.tensor_infos)
    on_gpu = any(backend.is_cuda(i.tensor) for i in state.tensor_infos)
    if total >= _HASH_IN_THREAD_BYTES and not on_gpu:
        # Hash off the trio thread so heartbeats keep flowing while large states are hashed.
        rows, hashes, sums = await trio.to_thread.run_sync(_entries, state)
    else:
        rows, hashes, sums = _entries(state)
    ctx = SyncContext(state=state, hashes=hashes, sums=sums)
    inbox = link.inbox
    server.ctx = ctx
    try:
        # The rows go in frames the master decodes in a few milliseconds each (issue 17 item 4): all but
        # the last chunk as SharedStateEntries, the last one in the vote itself.
        *ahead, last = limits.split_rows(rows)
        for chunk in ahead:
            await link.send(m.SharedStateEntries(entries=chunk))
        await link.send(m.SharedStateSync(revision=state.revision, strategy=int(strategy), entries=last,
                                          observe=observe is not None))
        first = await inbox.get()
        if observe is not None:
            live = isinstance(first, m.SharedStatePlan) and first.live and bool(first.fetch)
            observe(live, first.revision if isinstance(first, m.SharedStatePlan) else -1)
        if isinstance(first, m.SharedStateResult):
            if first.success:
                # An observer's join vote answered at once: it replayed to the group's revision and
                # holds its content (the master compared the hashes); nothing moves.
                state.revision = first.revision
                return 0, 0, False
            # Refused before any transfer (revision skip, key mismatch, no state available...).
            raise error_from_code(first.code, first.reason)
        assert isinstance(first, m.SharedStatePlan)
        if first.live and first.pin:
            # A live heal: our part ends now; first a copy of what its fetchers fetch, served from here on.
            server.pinning.add(first.sync_seq)
            try:
                server.pin(await _snapshot(ctx, first))
            finally:
                server.pinning.discard(first.sync_seq)
        ctx.seq = first.sync_seq
        ctx.plan = first
        ctx.plan_ready.set()
        staged: dict[str, np.ndarray] = {}
        ok, reason, rx = True, "", 0
        early: list[m.Message] = []
        if first.fetch:
            staged, rx, reason, early = await _fetch_watching(link, dialer, ctx, first, progress, server)
            ok = not reason
        if not early and not (first.live and not first.fetch):  # a live holder's result comes unasked
            await link.send(m.SharedStateDone(sync_seq=ctx.seq, success=ok, rx_bytes=rx, reason=reason))
        result = early[0] if early else await inbox.get()
        if not isinstance(result, m.SharedStateResult) or result.sync_seq != ctx.seq:
            raise error_from_code(int(Result.INTERNAL_ERROR), f"unexpected message in sync: {result!r:.80}")
        if not result.success:
            raise error_from_code(result.code, result.reason)
        if result.reason:
            # Peers of the group were refused (another layout, a revision ahead...): they fail and
            # will most likely leave; say why here too, where their absence is felt next.
            log.warning("shared-state sync of revision %d went on without refused peers: %s",
                        result.revision, result.reason)
        # Atomic apply: only now, after every participant succeeded, do tensors change.
        by_name = {i.name: i for i in state.tensor_infos}
        for key, data in staged.items():
            _apply(by_name[key].tensor, data)
        state.revision = result.revision
        return ctx.tx, rx, result.catch_up
    finally:
        server.ctx = None


async def _snapshot(ctx: SyncContext, plan: m.SharedStatePlan) -> SyncContext:
    """A copy of the keys ``plan.pin`` names, at this revision, as a context that serves them under the
    plan's ``sync_seq`` (its chunk sums and hashes are those of the vote: the same bytes)."""
    by_name = {i.name: i for i in ctx.state.tensor_infos}
    keys = [k for k in plan.pin if k in by_name]
    on_gpu = any(backend.is_cuda(by_name[k].tensor) for k in keys)

    def copy() -> list[TensorInfo]:
        return [TensorInfo(k, np.frombuffer(_host_bytes(by_name[k].tensor), dtype=np.uint8).copy())
                for k in keys]

    nbytes = sum(backend.describe(by_name[k].tensor).nbytes for k in keys)
    infos = await trio.to_thread.run_sync(copy) if nbytes >= _HASH_IN_THREAD_BYTES and not on_gpu else copy()
    pinned = SyncContext(state=SharedState(infos) if infos else ctx.state, hashes=dict(ctx.hashes),
                         sums={k: v for k, v in ctx.sums.items() if k[0] in keys}, seq=plan.sync_seq,
                         plan=plan)
    if not infos:
        pinned.abort(SharedStateSyncError("nothing pinned"))
    pinned.plan_ready.set()
    return pinned


async def _fetch_all(
    dialer: Dialer, ctx: SyncContext, plan: m.SharedStatePlan, progress: ProgressCallback | None,
    server: StateServer,
) -> tuple[dict[str, np.ndarray], int]:
    """Fetch every planned key from all its holders, chunk by chunk (:class:`pccl.peer.heal.SwarmFetch`)."""
    addresses = {r.peer_id: (r.host, r.port) for r in plan.peers}
    fetch = [(str(row[0]), int(row[1]), [int(h) for h in row[2]]) for row in plan.fetch]
    by_name = {i.name: i for i in ctx.state.tensor_infos}
    missing = [k for k, _, _ in fetch if k not in by_name]
    if missing:
        raise SharedStateSyncError(f"plan names unknown keys {missing}")
    sizes = {k: backend.describe(by_name[k].tensor).nbytes for k, _, _ in fetch}
    large = [k for k, _, _ in fetch if sizes[k] > swarm.CHUNK_BYTES]
    own = {k: np.frombuffer(_host_bytes(by_name[k].tensor), dtype=np.uint8) for k in large}

    # Our own chunk sums, from the vote's hashing pass (GPU tensors: computed now, on a host copy).
    todo = [k for k in large if (k, swarm.CHUNK_BYTES) not in ctx.sums]

    def local() -> None:
        for k in todo:
            ctx.sums[(k, swarm.CHUNK_BYTES)] = hashing.chunk_sums(own[k], swarm.CHUNK_BYTES)

    if sum(sizes[k] for k in todo) >= _HASH_IN_THREAD_BYTES:
        await trio.to_thread.run_sync(local)  # off the trio thread when large, inline when small
    else:
        local()
    local_sums = {k: ctx.sums[(k, swarm.CHUNK_BYTES)] for k in large}
    total = sum(sizes.values())
    counter = {"done": 0, "logged": 0}
    started = trio.current_time()

    def on_bytes(n: int) -> None:
        counter["done"] += n
        if progress is not None:
            progress(min(counter["done"], total), total)
        if counter["done"] - counter["logged"] >= _PROGRESS_LOG_BYTES:
            counter["logged"] = counter["done"]
            el = max(trio.current_time() - started, 1e-9)
            st = job.schedule.statistics()
            log.info("shared state: %d / %d bytes, %d / %d chunks, %d donor(s) (%.1f MB/s)", st["bytes_done"],
                     st["bytes_total"], st["chunks_done"], st["chunks_total"], st["donors_active"],
                     counter["done"] / el / 1e6)

    job = heal.SwarmFetch(dialer, plan.sync_seq, addresses, fetch, sizes, own, local_sums, on_bytes,
                          server.stall_timeout)
    ctx.fetch = job
    # The pages the apply will write, faulted in while the bytes are on the wire (pccl/peer/prefault.py);
    # the apply waits for it. A failed fetch leaves the thread to finish alone (it changes no byte).
    targets = [backend.byte_view(by_name[k].tensor) for k in sizes if not backend.is_cuda(by_name[k].tensor)]
    populating = None
    if sum(len(t) for t in targets) >= _HASH_IN_THREAD_BYTES:
        populating = threading.Thread(target=prefault.populate_write, args=(targets,), daemon=True,
                                      name="pccl-prefault")
        populating.start()
    try:
        staged, rx = await job.run()
    finally:
        server.count(job.statistics())
    if populating is not None:
        # cancellable: a cancelled heal leaves the thread to finish alone, as a failed one does
        await trio.to_thread.run_sync(populating.join, abandon_on_cancel=True)
    if progress is not None:
        progress(total, total)
    return staged, rx


async def serve_state_requests(server: StateServer, ms: MessageStream, hello: m.Hello) -> None:
    """The "state" P2P channel: send requested tensors, chunk sums and chunks of the sync ``server``
    publishes (StateRequest, StateManifestRequest, StateChunkRequest; docs/protocol.md). Under a serving
    cap the kernel paces the connection too, at the rate in force, with at most about a piece unsent in
    it (:class:`pccl.peer.serve_pace.ServePace`)."""
    if server.pace is None:
        await _serve_requests(server, ms)
        return
    with server.pace.serving(ms.stream):
        await _serve_requests(server, ms)


async def _serve_requests(server: StateServer, ms: MessageStream) -> None:
    """Answer one fetcher's requests until it closes or one is refused."""
    while True:
        try:
            req = await ms.receive()
        except StreamBroken:
            return
        if not isinstance(req, (m.StateRequest, m.StateManifestRequest, m.StateChunkRequest)):
            await ms.send(m.Refused(reason=f"expected StateRequest, got {type(req).__name__}"))
            return
        ctx = server.context_for(req.sync_seq)
        if ctx is not None and ctx.seq == -1:
            # The requester may have received its plan before we processed ours.
            with trio.move_on_after(server.plan_timeout):
                await ctx.plan_ready.wait()
            if req.sync_seq in server.pinning:
                # Its plan came: the snapshot is being copied (a large state on a busy host can take longer
                # than plan_timeout); wait for it as long as a fetcher waits for a silent donor.
                with trio.move_on_after(server.stall_timeout):
                    await ctx.plan_ready.wait()
            ctx = server.context_for(req.sync_seq)  # (a live heal's plan pins a snapshot before it is ready)
        if ctx is None or ctx.seq != req.sync_seq or ctx.error is not None:
            await ms.send(m.Refused(reason=f"no shared-state sync {req.sync_seq} in progress here"))
            return
        by_name = {i.name: i for i in ctx.state.tensor_infos}
        sent = ctx.tx
        try:
            refusal = await _serve_one(ctx, by_name, ms, req, server.pace)
        except StreamBroken:
            # The fetcher closed: it has everything (a copy of a chunk it took from a faster donor
            # too) or gave up on us. Normal at the end of a swarm fetch.
            log.debug("shared state: a fetcher closed its connection while we sent")
            return
        finally:
            server.totals["heal_served_bytes"] += ctx.tx - sent
        if refusal:
            await ms.send(m.Refused(reason=refusal))
            return


async def _serve_one(ctx: SyncContext, by_name: dict[str, TensorInfo], ms: MessageStream,
                     req: m.StateRequest | m.StateManifestRequest | m.StateChunkRequest,
                     cap: ServePace | None = None) -> str:
    """Answer one request; returns a refusal reason ("" when served)."""
    if isinstance(req, m.StateRequest):
        for key in req.keys:
            info = by_name.get(key)
            if info is None:
                return f"unknown key {key!r}"
            data = _host_bytes(info.tensor)
            await _send_capped(ms, m.StateTensor(key=key, nbytes=len(data), hash=ctx.hashes[key]), data, cap)
            ctx.tx += len(data)
        return ""
    if isinstance(req, m.StateManifestRequest):
        info = by_name.get(req.key)
        if info is None:
            return f"unknown key {req.key!r}"
        cb = req.chunk_bytes
        if (cb <= 0 or cb % hashing.CHUNK_ALIGN or req.first < 0
                or not 0 <= req.count <= heal.MANIFEST_SUMS_PER_REQUEST):
            return f"bad manifest request (chunk_bytes {cb}, first {req.first}, count {req.count})"
        sums = ctx.sums.get((req.key, cb))
        if sums is None:
            data = _served_bytes(ctx, info)
            if len(data) >= _HASH_IN_THREAD_BYTES:
                sums = await trio.to_thread.run_sync(hashing.chunk_sums, data, cb)
            else:
                sums = hashing.chunk_sums(data, cb)
            ctx.sums[(req.key, cb)] = sums
        part = sums[req.first : req.first + req.count]
        await ms.send(m.StateManifest(key=req.key, first=req.first, sums=part))
        return ""
    for row in req.pieces:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in row[1:])):
            return f"bad chunk row {row!r:.80}"
        key, offset, n = row
        info = by_name.get(key)
        if info is None:
            return f"unknown key {key!r}"
        data = _served_bytes(ctx, info)
        if offset < 0 or n < 0 or offset + n > len(data):
            return f"chunk {offset}+{n} outside tensor {key!r} of {len(data)} bytes"
        raw = chunk_bytes(ctx, info, offset, n)
        await _send_capped(ms, m.StateChunk(key=key, offset=offset, nbytes=n), raw, cap)
        ctx.tx += n
    return ""


async def _send_capped(ms: MessageStream, msg: m.Message, raw: memoryview, cap: ServePace | None) -> None:
    """Send ``msg`` and its raw bytes, paced by ``cap`` (``PeerConfig.state_serve_rate``): in pieces of
    ``cap.cap.piece`` bytes, each after the bucket grants it (at the rate in force: lower while a
    collective of this peer runs), so that serving never fills the uplink's queue with a whole chunk at
    once (:mod:`pccl.peer.ratecap`). No cap: at once."""
    if cap is None:
        await ms.send_with_raw(msg, raw)
        return
    await ms.send_with_raw(msg, raw, pace=cap.pace, piece=cap.cap.piece)


def _served_bytes(ctx: SyncContext, info: TensorInfo) -> memoryview:
    """The bytes of a tensor to serve (GPU tensors: a host copy, made once per sync)."""
    if not backend.is_cuda(info.tensor):
        return backend.byte_view(info.tensor)
    data = ctx.host.get(info.name)
    if data is None:
        data = ctx.host[info.name] = _host_bytes(info.tensor)
    return data


def chunk_bytes(ctx: SyncContext, info: TensorInfo, offset: int, nbytes: int) -> memoryview:
    """The bytes a holder sends for a chunk request (a seam for tests that make a donor lie)."""
    return _served_bytes(ctx, info)[offset : offset + nbytes]


__all__ = [
    "ProgressCallback",
    "SharedState",
    "StateServer",
    "SyncContext",
    "TensorInfo",
    "run_sync",
    "serve_state_requests",
]
