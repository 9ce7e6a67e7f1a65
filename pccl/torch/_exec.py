"""Runs the cores' requests (``_ops.py``) on an async communicator, and a background trio thread
for the blocking drivers."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from .._errors import InvalidUsageError, PCCLError, RankConnectionLostError, TooFewPeersError
from .._types import ReduceOp
from .._waits import format_wait
from ..peer.communicator import Communicator, open_communicator
from ._ops import (
    AllGather,
    AllReduce,
    AllToAll,
    Members,
    Op,
    PeersPending,
    PollAllReduce,
    Sleep,
    StartAllReduce,
    StartPeersPending,
    StartSync,
    Sync,
    SyncPlanned,
    UpdateTopology,
    WaitAllReduce,
    WaitAny,
)

__all__ = ["BackgroundThread", "Executor"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_CLOSE_TIMEOUT = 10.0
_PEERS_WAIT = ("min_world_size",)  # the key of the wait for enough peers (pccl.peer.notices)


def _describe_peers_wait(comm: Communicator, wanted: int, waited: float) -> str:
    """What a training loop waiting for ``min_world_size`` peers says (docs/torch.md)."""
    have = len(comm.group_ring)
    text = (f"peer {comm.peer_id} has waited {format_wait(waited)} for min_world_size={wanted} peers in its "
            f"group, which has {have}: start more peers (they are admitted at the next step; this loop "
            f"calls update_topology()) or lower min_world_size")
    if comm.refused_note:
        text += f"; the last shared-state sync refused peers of this group: {comm.refused_note}"
    return text


class _Background:
    """A reduce running in the background. ``finished`` (a plain attribute, set once the result or the
    error is in place) may be read from any thread; ``done`` is for the trio thread."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.finished = False
        self.info: Any = None
        self.error: PCCLError | None = None

    def settle(self, error: PCCLError | None = None) -> None:
        """The reduce ended (with ``error``, or with :attr:`info` in place): ``finished`` is set last, so a
        thread that reads it true finds the result or the error there (trio thread)."""
        if error is not None:
            self.error = error
        self.finished = True
        self.done.set()

    def result(self) -> Any:
        """The finished reduce's info, or its error raised."""
        if self.error is not None:
            raise self.error
        return self.info


class _BackgroundSync(_Background):
    """A :class:`~pccl.torch._ops.StartSync` running in the background: also whether its plan came
    (``planned``) and, when it fetches a live heal, the revision it heals to (``live``)."""

    def __init__(self) -> None:
        super().__init__()
        self.planned = trio.Event()
        self.live: int | None = None

    def on_plan(self, live: bool, revision: int) -> None:
        """The sync's plan came (or it was answered without one)."""
        if live:
            self.live = revision
        self.planned.set()


async def _wait_any(handles: tuple[_Background, ...]) -> None:
    """Return once one of ``handles`` has finished."""
    if any(h.finished for h in handles):
        return await trio.lowlevel.checkpoint()
    async with trio.open_nursery() as nursery:

        async def first(h: _Background) -> None:
            await h.done.wait()
            nursery.cancel_scope.cancel()

        for h in handles:
            nursery.start_soon(first, h)


class Executor:
    """Executes requests on ``comm`` (call it from the communicator's trio thread).

    Args:
        comm: the async communicator.
        nursery: where background reduces (``StartAllReduce``) run; required only for those.
    """

    def __init__(self, comm: Communicator, nursery: trio.Nursery | None = None) -> None:
        self.comm = comm
        self.nursery = nursery
        self.whole_retries = 0  # all-reduces over contributors run again whole after a lost peer

    async def __call__(self, op: Op) -> Any:
        comm = self.comm
        if isinstance(op, PeersPending):
            return await comm.are_peers_pending()
        if isinstance(op, UpdateTopology):
            return await comm.update_topology()
        if isinstance(op, Members):
            return comm.rank, len(comm.group_ring)
        if isinstance(op, Sleep):
            if op.min_world_size > 0 and _PEERS_WAIT not in comm.notices.board:
                describe = functools.partial(_describe_peers_wait, comm, op.min_world_size)
                comm.notices.begin(_PEERS_WAIT, describe)
            return await trio.sleep(op.seconds)
        if isinstance(op, (Sync, AllReduce, StartAllReduce, StartSync)):
            comm.notices.end(_PEERS_WAIT)  # enough peers: training goes on
        if isinstance(op, Sync):
            return await comm.sync_shared_state(op.state)
        if isinstance(op, AllReduce):
            return await self.all_reduce(op)
        if isinstance(op, AllGather):
            return await comm.all_gather(op.send, op.recv, tag=op.tag)
        if isinstance(op, AllToAll):
            return await comm.all_to_all(op.send, op.recv, tag=op.tag)
        if isinstance(op, (StartAllReduce, StartPeersPending)):
            handle = self.new_handle()
            self.start(op, handle)
            return handle
        if isinstance(op, StartSync):
            if self.nursery is None:
                raise InvalidUsageError("a background sync needs a nursery")
            sync = _BackgroundSync()
            self.nursery.start_soon(self._background_sync, op, sync)
            return sync
        if isinstance(op, SyncPlanned):
            await op.handle.planned.wait()
            return op.handle.live
        if isinstance(op, WaitAllReduce):
            await op.handle.done.wait()
            return op.handle.result()
        if isinstance(op, WaitAny):
            return await _wait_any(op.handles)
        if isinstance(op, PollAllReduce):
            # a checkpoint first: the background reduces move on (a trio program's step may await
            # nothing else)
            await trio.lowlevel.checkpoint()
            return op.handle.finished
        raise TypeError(f"unknown request {op!r}")

    def new_handle(self) -> _Background:
        """The handle of a :class:`StartAllReduce` or :class:`StartPeersPending` (may be made in any thread,
        before :meth:`start`)."""
        if self.nursery is None:
            raise InvalidUsageError("background all-reduces need a nursery")
        return _Background()

    def start(self, op: StartAllReduce | StartPeersPending, handle: _Background) -> None:
        """Launch ``op`` in the background, reporting to ``handle`` (trio thread, synchronous)."""
        assert self.nursery is not None
        if isinstance(op, StartPeersPending):
            self.nursery.start_soon(self._background, PeersPending(), handle)
            return
        self.comm.notices.end(_PEERS_WAIT)  # enough peers: training goes on
        self.nursery.start_soon(self._background, op.reduce, handle)

    async def _background(self, op: AllReduce | AllGather | AllToAll | PeersPending,
                          handle: _Background) -> None:
        error: PCCLError | None = None
        try:
            handle.info = await self(op)
        except PCCLError as exc:
            error = exc
        finally:
            handle.settle(error)

    async def _background_sync(self, op: StartSync, handle: _BackgroundSync) -> None:
        error: PCCLError | None = None
        try:
            handle.info = await self.comm.sync_shared_state(op.state, observe=handle.on_plan)
        except PCCLError as exc:
            error = exc
        finally:
            handle.planned.set()
            handle.settle(error)

    async def all_reduce(self, op: AllReduce) -> Any:
        """Every bucket of ``op``; see :class:`~pccl.torch._ops.AllReduce`."""
        comm = self.comm
        items = [(s, r, op.op, op.quantization) for s, r in op.pairs]
        items += [(s, r, ReduceOp.SUM, None) for s, r in op.exact]
        if op.retry_lost and op.exact:
            # An average over contributors: one set of contributors for every bucket and the count.
            # After a lost peer, the buckets that completed before the loss hold its part: all again.
            while True:
                try:
                    return await self._all_buckets(op, items)
                except RankConnectionLostError:
                    if len(comm.group_ring) < 2:
                        raise TooFewPeersError("the world dropped below 2 peers before the all-reduce "
                                               "succeeded") from None
                    self.whole_retries += 1
        if op.retry_lost:
            return await comm.all_reduce_multiple_with_retry(
                [{"send": s, "recv": r, "op": o, "quantization": q} for s, r, o, q in items],
                max_in_flight=op.max_in_flight, base_tag=op.base_tag)
        return await self._all_buckets(op, items)

    async def _all_buckets(self, op: AllReduce, items: list[tuple[Any, Any, ReduceOp, Any]]) -> Any:
        """One pass over ``items`` (``(send, recv, op, quantization)``, tags from ``op.base_tag``), at most
        ``op.max_in_flight`` at once; the first failure raised once all finished (a fatal one first)."""
        comm = self.comm
        limiter = trio.CapacityLimiter(op.max_in_flight)
        infos: list[Any] = []
        errors: list[PCCLError] = []

        async def one(i: int, send: Any, recv: Any, reduce: ReduceOp, quantization: Any) -> None:
            try:
                infos.append(await comm.all_reduce(send, recv, op=reduce, tag=op.base_tag + i,
                                                   quantization=quantization))
            except PCCLError as exc:
                errors.append(exc)
            finally:
                limiter.release_on_behalf_of(i)

        async with trio.open_nursery() as nursery:
            # Launched strictly in index order, so every peer has the same window of tags in flight.
            for i, (send, recv, reduce, quantization) in enumerate(items):
                await limiter.acquire_on_behalf_of(i)
                nursery.start_soon(one, i, send, recv, reduce, quantization)
        if errors:
            # A lost peer is retryable; anything else (the master lost, bad buffers) wins.
            fatal = [e for e in errors if not isinstance(e, RankConnectionLostError)]
            raise (fatal or errors)[0]
        tx = sum(i.tx_bytes for i in infos)
        rx = sum(i.rx_bytes for i in infos)
        # The smallest group any bucket ran with: the core compares it with the world it sharded for.
        world = min(i.local_world_size for i in infos)
        return type(infos[0])(local_world_size=world, tx_bytes=tx, rx_bytes=rx)


class BackgroundThread:
    """A daemon thread running trio, holding one async communicator for a blocking driver."""

    def __init__(self, name: str = "pccl-torch") -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._closing: trio.Event | None = None
        self._held: trio.Event | None = None
        self.nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        async def main() -> None:
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main)
        except BaseException as exc:  # reported to the constructor, or logged
            self._error = exc
            if self._ready.is_set():
                log.exception("the pccl.torch background thread failed")
            self._ready.set()

    def call(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``afn(*args)`` in the trio thread and return its result (or raise its error)."""
        return trio.from_thread.run(afn, *args, trio_token=self._token)

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the synchronous ``fn(*args)`` in the trio thread and return its result (or raise its error)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Have the trio thread run the synchronous ``fn(*args)`` soon, without waiting for it: requests
        run in the order they were made, so a later :meth:`call` runs after it."""
        if self._token is None:
            raise trio.RunFinishedError("the pccl.torch background thread is not running")
        self._token.run_sync_soon(fn, *args)

    def open_communicator(self, address: str, **options: Any) -> Communicator:
        """Connect a communicator (kept open until :meth:`close`)."""
        return self.call(self._open, address, options)

    async def _open(self, address: str, options: dict[str, Any]) -> Communicator:
        assert self.nursery is not None
        comm: Communicator = await self.nursery.start(self._hold, address, options)
        return comm

    async def _hold(self, address: str, options: dict[str, Any],
                    task_status: trio.TaskStatus[Communicator] = trio.TASK_STATUS_IGNORED) -> None:
        self._closing = trio.Event()
        self._held = trio.Event()
        started = False
        try:
            async with open_communicator(address, **options) as comm:
                task_status.started(comm)
                started = True
                await self._closing.wait()
        except PCCLError:
            if not started:
                raise
            log.debug("closing the communicator failed", exc_info=True)
        finally:
            self._held.set()

    async def _close(self) -> None:
        if self._closing is not None and self._held is not None:
            self._closing.set()
            with trio.move_on_after(_CLOSE_TIMEOUT):
                await self._held.wait()
        assert self._stop is not None
        self._stop.set()

    def close(self) -> None:
        """Close the communicator and stop the thread (idempotent, bounded in time)."""
        if self._thread.is_alive():
            try:
                self.call(self._close)
            except trio.RunFinishedError:
                pass
            self._thread.join(_CLOSE_TIMEOUT)
