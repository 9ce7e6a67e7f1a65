"""The drivers: TrainingRun / DiLoCo (blocking) and AsyncTrainingRun / AsyncDiLoCo (trio)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, overload

import torch
import trio

from .._config import PeerConfig
from .._errors import InvalidArgumentError, InvalidUsageError, PCCLError, Result
from .._types import QuantizationOptions
from ..peer.communicator import Communicator
from ..transport import Transport
from ._buckets import DEFAULT_BUCKET_BYTES
from ._context import AsyncStepContext, BatchCache, StepContext
from ._diloco import DiLoCoCore, check_arguments
from ._exec import BackgroundThread, Executor
from ._model import SharedModel
from ._ops import (
    AllReduce,
    Members,
    Op,
    PollAllReduce,
    StartAllReduce,
    StartPeersPending,
    StartSync,
    Sync,
    WaitAllReduce,
    drive,
    drive_async,
)
from ._train import Backward, StepResult, TrainCore

__all__ = ["AsyncDiLoCo", "AsyncTrainingRun", "DiLoCo", "TrainingRun"]

DEFAULT_POLL_INTERVAL = 0.05


def _sync_cuda_streams(op: Op) -> None:
    """Blocking drivers: finish the caller's queued CUDA work on the tensors ``op`` reads.

    The communicator runs in another thread, whose current CUDA stream is not the caller's.
    """
    tensors: list[Any] = []
    if isinstance(op, AllReduce):
        tensors = [s for s, _ in op.pairs]
    elif isinstance(op, StartAllReduce) and isinstance(op.reduce, AllReduce):
        tensors = [s for s, _ in op.reduce.pairs]
    elif isinstance(op, (Sync, StartSync)):
        tensors = [t.tensor for t in op.state.tensor_infos]
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


class _Blocking:
    """A communicator in a background trio thread; requests are run there from the caller's thread."""

    def __init__(self, master_address: str, *, peer_group: int, config: PeerConfig | None,
                 connect_attempts: int, transport: Transport | None = None) -> None:
        self._thread = BackgroundThread()
        self.wait_by_op: dict[str, float] = {}  # network_wait_s by request kind
        try:
            delay = 0.05
            for attempt in range(max(1, connect_attempts)):
                try:
                    self.comm = self._thread.open_communicator(master_address, peer_group=peer_group,
                                                               config=config, transport=transport)
                    break
                except PCCLError as exc:
                    if exc.result != Result.MASTER_CONNECTION_FAILED or attempt + 1 >= connect_attempts:
                        raise
                    time.sleep(delay)
                    delay = min(1.0, delay * 2)
            self._executor = Executor(self.comm, self._thread.nursery)
        except BaseException:
            self._thread.close()
            raise

    network_wait_s = 0.0
    """Seconds the caller's thread spent blocked in communication requests (membership, syncs,
    all-reduces, waits for background exchanges): the time training waited on the network."""

    def execute(self, op: Op) -> Any:
        if isinstance(op, Members):
            # Two reads, no I/O: not worth a hop to the trio thread and back (under CPU contention a hop
            # costs milliseconds). The GIL makes each read atomic; a membership change the trio thread
            # is applying shows up at the next request, as it would after the hop.
            return self.comm.rank, len(self.comm.group_ring)
        if isinstance(op, PollAllReduce):
            return op.handle.finished  # one read, set last by the trio thread
        if isinstance(op, WaitAllReduce) and op.handle.finished:
            return op.handle.result()  # finished: nothing to wait for, no hop
        _sync_cuda_streams(op)
        if isinstance(op, (StartAllReduce, StartPeersPending)):
            # launched without waiting for the trio thread: the handle is made here, and requests run
            # in the order they were made, so a later wait finds the reduce started
            handle = self._executor.new_handle()
            self._thread.soon(self._start, op, handle)
            return handle
        start = time.perf_counter()
        try:
            return self._thread.call(self._executor, op)
        finally:
            spent = time.perf_counter() - start
            self.network_wait_s += spent
            name = type(op).__name__
            self.wait_by_op[name] = self.wait_by_op.get(name, 0.0) + spent

    def _start(self, op: StartAllReduce | StartPeersPending, handle: Any) -> None:
        """In the trio thread: start ``op``; a failure to start is the reduce's error (never the thread's)."""
        try:
            self._executor.start(op, handle)
        except Exception as exc:  # the nursery closed under it: the driver is closing
            handle.settle(exc if isinstance(exc, PCCLError) else InvalidUsageError(
                f"the background reduce could not start: {exc!r}"))

    def comm_statistics(self) -> dict[str, Any]:
        """The communicator's statistics, read in the trio thread (it owns the communicator's state).

        Raises:
            InvalidUsageError: the driver was closed.
        """
        try:
            stats: dict[str, Any] = self._thread.call_sync(self.comm.statistics)
        except trio.RunFinishedError:
            raise InvalidUsageError("the driver is closed") from None
        return stats

    def close(self) -> None:
        self._thread.close()


def _no_comm() -> Communicator:
    raise InvalidUsageError("this driver has no communicator")


class _RunInfo:
    """Read-only views shared by the drivers."""

    _members: Any
    shared: SharedModel

    @property
    def rank(self) -> int:
        """This peer's rank in its group, as of the latest step (its membership phase)."""
        return int(self._members.rank)

    @property
    def world_size(self) -> int:
        """The group's size, as of the latest step."""
        return int(self._members.world_size)

    @property
    def revision(self) -> int:
        """Steps applied (outer steps for DiLoCo): the shared state's revision."""
        return self.shared.revision

    def save(self, path: Any) -> None:
        """Write this peer's copy of the shared state (and its revision) to ``path`` (``torch.save``).

        Between steps, every peer holds the same shared state: any one copy is the run's checkpoint.
        DiLoCo and streaming DiLoCo add this peer's local state under ``"local"`` (the inner
        optimizer's state; streaming: the inner model and the compression residuals too), so that a
        run restarted with each peer's own checkpoint continues exactly where it stopped.
        """
        state = self.shared.state_dict()
        local = self._local_state()
        if local is not None:
            state["local"] = local
        torch.save(state, path)

    def resume(self, path: Any) -> None:
        """Load a checkpoint written by :meth:`save` before the first step.

        Restarted alone or with every peer, the run continues from the checkpoint's revision. Joining
        a running group, this peer takes the group's state instead (its first sync, whatever the
        checkpoint's revision); a checkpoint that is behind the group's is simply brought up to date.

        Raises:
            InvalidArgumentError: not a checkpoint of this model (keys, shapes, dtypes).
        """
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.shared.load_state_dict(state)
        self._resumed(state.get("local") if isinstance(state, dict) else None)

    def _local_state(self) -> dict[str, Any] | None:
        """Hook: this peer's local state that a checkpoint keeps (None: nothing)."""
        core = getattr(self, "core", None)
        return core.local_state() if core is not None and hasattr(core, "local_state") else None

    def _resumed(self, local: dict[str, Any] | None) -> None:
        """Hook: what the driver's core must redo after a resume (``local``: what :meth:`_local_state`
        saved, when the checkpoint has it)."""
        core = getattr(self, "core", None)
        if core is not None and hasattr(core, "resumed"):
            core.resumed(local)

    @property
    def network_wait_s(self) -> float:
        """Blocking drivers: seconds ``step`` spent waiting on communication (0.0 for the async ones)."""
        blocking = getattr(self, "_blocking", None)
        return blocking.network_wait_s if blocking is not None else 0.0

    def comm_statistics(self) -> dict[str, Any]:
        """Where this peer's communicator stands: :meth:`pccl.Communicator.statistics` (the operations in
        flight, the membership call or shared-state sync it waits in, the master link, the pool).

        For a program that must say where it is stuck (a supervisor's timeout, a signal handler): the
        blocking drivers read it in their background thread, so it may be called from any thread while
        :meth:`step` blocks in another.

        Raises:
            InvalidUsageError: a blocking driver that was closed.
        """
        blocking: _Blocking | None = getattr(self, "_blocking", None)
        if blocking is not None:
            return blocking.comm_statistics()
        comm: Communicator = getattr(self, "comm", None) or _no_comm()  # the async drivers'
        return comm.statistics()


class AsyncTrainingRun(_RunInfo):
    """The data-parallel driver for trio programs (and tests on ``pccl.testing`` clusters).

    Each :meth:`step`: admit pending peers; sync the shared state (a newcomer receives the model and the
    optimizer state here); run ``backward(step)``; average the gradients (bucketed all-reduces, AVG, up
    to ``max_in_flight`` buckets at once on tags 0, 1, ...); step the optimizer. When a peer is lost the
    step is retried from the top with the survivors: ``backward`` runs again, with the new rank and world
    size, on the same global batch when it uses :meth:`~pccl.torch.Step.shard`.

    Args:
        comm: an accepted async communicator (``pccl.open_communicator`` or a test cluster's peer).
        shared: the model and optimizer (:class:`SharedModel`).
        total_steps: :meth:`step` returns None once this many steps were applied (None: never).
        bucket_bytes: size of a gradient bucket.
        max_in_flight: buckets reduced at once.
        min_world_size: wait (polling every ``poll_interval`` s) while fewer peers are in the group;
            the default 1 trains alone when everyone else is gone.
        quantization: optional wire compression of the gradients.
        just_joined: this peer was admitted by running peers (it skips the membership phase once);
            default: ``comm.world_size > 1`` when the driver is made, right for a driver made as soon as
            the communicator is accepted.

    Raises:
        InvalidArgumentError: a SharedModel without an optimizer, or bad sizes.
    """

    def __init__(self, comm: Communicator, shared: SharedModel, *, total_steps: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, max_in_flight: int = 4, min_world_size: int = 1,
                 poll_interval: float = DEFAULT_POLL_INTERVAL,
                 quantization: QuantizationOptions | None = None, just_joined: bool | None = None,
                 min_world_size_timeout: float | None = None) -> None:
        self.comm = comm
        self.shared = shared
        joined = comm.world_size > 1 if just_joined is None else just_joined
        self.core = TrainCore(shared, just_joined=joined, total_steps=total_steps, bucket_bytes=bucket_bytes,
                              max_in_flight=max_in_flight, min_world_size=min_world_size,
                              poll_interval=poll_interval, quantization=quantization,
                              min_world_size_timeout=min_world_size_timeout)
        self._members = self.core
        self._execute = Executor(comm)
        self._batches = BatchCache()

    @overload
    def step(self, backward: Backward) -> Awaitable[StepResult | None]: ...

    @overload
    def step(self, backward: None = None) -> AsyncStepContext: ...

    def step(self, backward: Backward | None = None) -> Awaitable[StepResult | None] | AsyncStepContext:
        """``await run.step(backward)``: one training step (see the class), None once ``total_steps``
        were applied. Without ``backward``: ``async with run.step() as s:`` (the user-owned step, see
        :class:`~pccl.torch.StepContext`).

        Raises:
            MasterConnectionError: this peer lost the master or was removed.
            PCCLError: anything else that is not retryable.
        """
        if backward is None:
            return AsyncStepContext(self.core, self._batches, lambda gen: drive_async(gen, self._execute))
        return drive_async(self.core.step(backward), self._execute)


class TrainingRun(_RunInfo):
    """The data-parallel driver for ordinary (threaded) programs: :class:`AsyncTrainingRun`'s loop.

    It connects to the master at once (retrying ``connect_attempts`` times with a short backoff) and
    runs its communicator in a background thread; ``backward`` runs on the caller's thread. Use it as
    a context manager, or call :meth:`close`::

        with TrainingRun(master_address, SharedModel(model, optimizer), total_steps=1000) as run:
            while (result := run.step(backward)) is not None:
                ...

    Args:
        master_address: ``"HOST:PORT"`` of the master.
        shared: the model and optimizer.
        peer_group: the peer group.
        config: the communicator's :class:`~pccl.PeerConfig`.
        connect_attempts: connection attempts before MASTER_CONNECTION_FAILED is raised.
        transport: the transport seam (default TCP; benchmarks pass a shaped one).
        others: as in :class:`AsyncTrainingRun`.

    Raises:
        MasterConnectionError: the master could not be reached.
    """

    def __init__(self, master_address: str, shared: SharedModel, *, total_steps: int | None = None,
                 peer_group: int = 0, config: PeerConfig | None = None, connect_attempts: int = 10,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, max_in_flight: int = 4, min_world_size: int = 1,
                 poll_interval: float = DEFAULT_POLL_INTERVAL,
                 quantization: QuantizationOptions | None = None, just_joined: bool | None = None,
                 transport: Transport | None = None, min_world_size_timeout: float | None = None) -> None:
        self.shared = shared
        self._blocking = _Blocking(master_address, peer_group=peer_group, config=config,
                                   connect_attempts=connect_attempts, transport=transport)
        try:
            comm = self._blocking.comm
            joined = comm.world_size > 1 if just_joined is None else just_joined
            self.core = TrainCore(shared, just_joined=joined, total_steps=total_steps,
                                  bucket_bytes=bucket_bytes, max_in_flight=max_in_flight,
                                  min_world_size=min_world_size, poll_interval=poll_interval,
                                  quantization=quantization, min_world_size_timeout=min_world_size_timeout)
        except BaseException:
            self._blocking.close()
            raise
        self._members = self.core
        self._batches = BatchCache()

    @overload
    def step(self, backward: Backward) -> StepResult | None: ...

    @overload
    def step(self, backward: None = None) -> StepContext: ...

    def step(self, backward: Backward | None = None) -> StepResult | StepContext | None:
        """Run one training step (see :class:`AsyncTrainingRun`); None once ``total_steps`` were applied.

        Without ``backward`` it returns a :class:`~pccl.torch.StepContext` for a step whose update the
        caller owns::

            while True:
                with run.step() as s:
                    if s.done:
                        break
                    x, y = s.batch(lambda: next(loader))  # not pulled again on a retry
                    loss_fn(model(x), y).backward()
                    if s.all_reduce_grads():               # False: a peer was lost, retried next
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        optimizer.step()
                        scheduler.step()

        Raises:
            MasterConnectionError: this peer lost the master or was removed.
            PCCLError: anything else that is not retryable.
        """
        if backward is None:
            return StepContext(self.core, self._batches, lambda gen: drive(gen, self._blocking.execute))
        return drive(self.core.step(backward), self._blocking.execute)

    def close(self) -> None:
        """Leave the run (the others see it as a peer lost) and stop the background thread."""
        self._blocking.close()

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


OuterOptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class AsyncDiLoCo(_RunInfo):
    """DiLoCo for trio programs: local inner steps, an outer step every ``inner_steps`` steps.

    Each :meth:`step` is one inner step: ``backward(step)`` then ``inner_optimizer.step()``. A round's first
    step admits pending peers, syncs the outer state (outer parameters and outer optimizer state: the
    shared state, :attr:`shared`) and resets the model to the outer parameters; its last step all-reduces
    the pseudo-gradients ``outer - inner`` (AVG, retried with the survivors when a peer is lost) and steps
    the outer optimizer, at once (``delayed=False``) or one round late with the all-reduce running in the
    background during the next round's inner steps (``delayed=True``).

    Args:
        comm: an accepted async communicator.
        model: the model (the inner parameters); its buffers stay local.
        inner_optimizer: the model's optimizer (local state).
        outer_optimizer: ``factory(outer_params) -> optimizer``; default SGD(lr=0.7, momentum=0.9,
            nesterov=True).
        inner_steps: H, inner steps per outer step.
        delayed: one-step-delayed outer updates; needs ``nursery`` (where the background all-reduce runs).
        quantization: wire compression of the pseudo-gradients, e.g.
            ``QuantizationOptions(quantized_datatype=DataType.UINT8,
            algorithm=QuantizationAlgorithm.MIN_MAX)``.
        total_outer_steps: :meth:`step` returns None once this many outer steps were applied.
        replay_heals: a newcomer that heals live does not make the members wait for its transfer: it
            takes part in their outer all-reduces while it fetches and replays the outer steps it
            missed (issue 35 item 4; docs/concepts.md "Replaying the rounds missed"). The all-reduce
            then sums and divides by a count of contributors: every peer of a run must set it alike.
            ``delayed=False`` only; needs ``nursery`` (where the newcomer's fetch runs).
        others: as in :class:`AsyncTrainingRun`.

    Raises:
        InvalidArgumentError: ``delayed`` or ``replay_heals`` without a nursery, ``replay_heals`` with
            ``delayed``, or bad sizes.
    """

    def __init__(self, comm: Communicator, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 outer_optimizer: OuterOptimizerFactory | None = None, inner_steps: int = 50,
                 delayed: bool = False, quantization: QuantizationOptions | None = None,
                 total_outer_steps: int | None = None, nursery: trio.Nursery | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, max_in_flight: int = 4, min_world_size: int = 1,
                 poll_interval: float = DEFAULT_POLL_INTERVAL, just_joined: bool | None = None,
                 min_world_size_timeout: float | None = None, replay_heals: bool = False) -> None:
        if delayed and nursery is None:
            raise InvalidArgumentError("delayed DiLoCo needs a nursery for the background all-reduce")
        if replay_heals and nursery is None:
            raise InvalidArgumentError("replay_heals needs a nursery (a newcomer's fetch runs there)")
        joined = comm.world_size > 1 if just_joined is None else just_joined
        self.core = DiLoCoCore(model, inner_optimizer, outer_optimizer=outer_optimizer,
                               inner_steps=inner_steps, delayed=delayed, quantization=quantization,
                               just_joined=joined, total_outer_steps=total_outer_steps,
                               bucket_bytes=bucket_bytes,
                               max_in_flight=max_in_flight, min_world_size=min_world_size,
                               poll_interval=poll_interval, min_world_size_timeout=min_world_size_timeout,
                               replay_heals=replay_heals)
        self.comm = comm
        self.shared = self.core.shared
        self._members = self.core.members
        self._execute = Executor(comm, nursery)

    @property
    def outer_model(self) -> torch.nn.Module:
        """The outer parameters, as a copy of the model (identical on every peer after each sync)."""
        return self.core.outer_model

    async def step(self, backward: Backward) -> StepResult | None:
        """One inner step (see the class); None once ``total_outer_steps`` outer steps were applied."""
        return await drive_async(self.core.step(backward), self._execute)


class DiLoCo(_RunInfo):
    """:class:`AsyncDiLoCo` for ordinary programs; connects like :class:`TrainingRun`.

    Args:
        master_address, peer_group, config, connect_attempts, transport: as in :class:`TrainingRun`.
        others: as in :class:`AsyncDiLoCo` (``delayed`` needs no nursery here).
    """

    def __init__(self, master_address: str, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 outer_optimizer: OuterOptimizerFactory | None = None, inner_steps: int = 50,
                 delayed: bool = False, quantization: QuantizationOptions | None = None,
                 total_outer_steps: int | None = None, peer_group: int = 0, config: PeerConfig | None = None,
                 connect_attempts: int = 10, bucket_bytes: int = DEFAULT_BUCKET_BYTES, max_in_flight: int = 4,
                 min_world_size: int = 1, poll_interval: float = DEFAULT_POLL_INTERVAL,
                 just_joined: bool | None = None, transport: Transport | None = None,
                 min_world_size_timeout: float | None = None, replay_heals: bool = False) -> None:
        check_arguments(inner_steps, delayed=delayed, replay_heals=replay_heals)  # before connecting
        self._blocking = _Blocking(master_address, peer_group=peer_group, config=config,
                                   connect_attempts=connect_attempts, transport=transport)
        try:
            comm = self._blocking.comm
            joined = comm.world_size > 1 if just_joined is None else just_joined
            self.core = DiLoCoCore(model, inner_optimizer, outer_optimizer=outer_optimizer,
                                   inner_steps=inner_steps, delayed=delayed, quantization=quantization,
                                   just_joined=joined, total_outer_steps=total_outer_steps,
                                   bucket_bytes=bucket_bytes, max_in_flight=max_in_flight,
                                   min_world_size=min_world_size, poll_interval=poll_interval,
                                   min_world_size_timeout=min_world_size_timeout, replay_heals=replay_heals)
        except BaseException:
            self._blocking.close()
            raise
        self.shared = self.core.shared
        self._members = self.core.members

    @property
    def outer_model(self) -> torch.nn.Module:
        """The outer parameters, as a copy of the model."""
        return self.core.outer_model

    def step(self, backward: Backward) -> StepResult | None:
        """One inner step; None once ``total_outer_steps`` outer steps were applied."""
        return drive(self.core.step(backward), self._blocking.execute)

    def close(self) -> None:
        """Leave the run and stop the background thread (a running background all-reduce is abandoned)."""
        self._blocking.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
