"""The data-parallel training step, as a generator of communication requests (see ``_ops.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import torch

from .._errors import InvalidArgumentError
from .._types import ReduceOp
from ._buckets import Buckets
from ._model import SharedModel
from ._ops import AllReduce, Op, Sync, is_result, wait_for_members
from ._shard import shard_indices

__all__ = ["Step", "StepResult", "TrainCore"]


@dataclasses.dataclass(frozen=True)
class Step:
    """What the user's ``backward`` callback gets: where this step stands.

    Attributes:
        index: the global step (the shared state's revision: steps applied before this one).
        rank: this peer's rank in the group for this attempt.
        world_size: the group's size for this attempt.
        attempt: 0, then 1, 2, ... when the step is retried after a peer was lost.
    """

    index: int
    rank: int
    world_size: int
    attempt: int = 0

    def shard(self, global_batch_size: int, dataset_size: int, *, seed: int = 0) -> np.ndarray:
        """This peer's indices of the step's global batch (see :func:`pccl.torch.shard_indices`).

        The global batch depends on the step index alone; it is split among the current world, so a
        retried step (with fewer peers) reshards the same global batch among the survivors.
        """
        return shard_indices(self.index, global_batch_size, dataset_size, self.rank, self.world_size,
                             seed=seed)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a finished step reports.

    Attributes:
        index: the step just applied (the revision before it).
        loss: what ``backward`` returned on the successful attempt.
        world_size: the group size the step was averaged over.
        attempts: 1, or more when peers were lost and the step was retried.
        sync_rx_bytes: bytes this peer received in the step's shared-state sync (non-zero for a
            newcomer's first step, zero afterwards while the peers agree).
        reduce_tx_bytes: bytes sent by the gradient all-reduce.
    """

    index: int
    loss: Any
    world_size: int
    attempts: int
    sync_rx_bytes: int
    reduce_tx_bytes: int


Backward = Callable[[Step], Any]


class TrainCore:
    """Per-peer state of the data-parallel loop and its step generator (driver-independent).

    Args:
        shared: the model, its optimizer and their shared state.
        just_joined: this peer was admitted by the running peers' ``update_topology`` (it skips the
            membership phase once).
        total_steps: stop (``step`` returns None) once this many steps were applied; None: never.
        bucket_bytes, max_in_flight: gradient buckets and how many are reduced at once.
        min_world_size: train only with at least this many peers (wait otherwise); 1 trains alone.
        poll_interval: seconds between membership checks while waiting for peers.
        quantization: optional wire compression of the gradients.
        min_world_size_timeout: give up (TooFewPeersError) once the waits for ``min_world_size`` peers
            of one membership phase add up to this many seconds (counted as ``poll_interval`` per
            wait); None: wait for ever.
    """

    def __init__(self, shared: SharedModel, *, just_joined: bool, total_steps: int | None,
                 bucket_bytes: int, max_in_flight: int, min_world_size: int, poll_interval: float,
                 quantization: Any = None, min_world_size_timeout: float | None = None) -> None:
        if shared.optimizer is None:
            raise InvalidArgumentError("TrainingRun needs a SharedModel with an optimizer")
        if min_world_size < 1 or max_in_flight < 1:
            raise InvalidArgumentError("min_world_size and max_in_flight must be >= 1")
        self.shared = shared
        self.optimizer: torch.optim.Optimizer = shared.optimizer
        self.params = shared.trainable_parameters()
        self.buckets = Buckets(self.params, bucket_bytes)
        self.just_joined = just_joined
        self.total_steps = total_steps
        self.max_in_flight = max_in_flight
        self.min_world_size = min_world_size
        self.min_world_size_timeout = min_world_size_timeout
        self.poll_interval = poll_interval
        self.quantization = quantization
        self.rank = 0
        self.world_size = 1
        self.retries = 0  # attempts that failed because a peer was lost, over the whole run
        self.syncs = 0
        self.joined = just_joined  # admitted by running peers: its first sync takes the group's state
        self.first_sync = True
        self.attempt = 0  # failed attempts of the current step
        self.current: Step | None = None
        self.last_sync_rx = 0
        self.last_tx = 0

    def membership(self) -> Generator[Op, Any, None]:
        """Phase 1: admit pending peers (skipped once by a newcomer); wait until enough peers."""
        self.rank, self.world_size = yield from wait_for_members(
            self, self.min_world_size, self.min_world_size_timeout, self.poll_interval)

    def begin(self) -> Generator[Op, Any, Step | None]:
        """Phases 1-2 of an attempt: membership and sync; then the gradients are zeroed.

        Returns:
            The attempt's :class:`Step`, or None once ``total_steps`` steps were applied.
        """
        while True:
            yield from self.membership()
            if self.first_sync and self.joined:
                # A newcomer takes the group's state, whatever revision its own copy has (a checkpoint
                # newer than the group's would otherwise be refused as skipping ahead).
                self.shared.revision = 0
            self.shared.before_sync()
            try:
                info = yield Sync(self.shared.state)
            except Exception as exc:
                if not is_result(exc, "RANK_CONNECTION_LOST"):
                    raise
                self.attempt += 1
                self.retries += 1
                continue
            break
        self.first_sync = False
        self.shared.after_sync()
        self.syncs += 1
        self.last_sync_rx = info.rx_bytes
        index = self.shared.revision
        if self.total_steps is not None and index >= self.total_steps:
            return None
        self.optimizer.zero_grad(set_to_none=False)
        self.current = Step(index, self.rank, self.world_size, self.attempt)
        return self.current

    def reduce_grads(self) -> Generator[Op, Any, bool]:
        """Phase 4: average the gradients into ``.grad``.

        Returns:
            True when they were averaged over the whole group the step was sharded for; False when a
            peer was lost (the attempt must not be applied: the next attempt retries the step).
        """
        self.last_tx = 0
        if self.world_size > 1:
            self.buckets.pack_grads()
            try:
                reduced = yield AllReduce(self.buckets.pairs, ReduceOp.AVG, self.quantization,
                                          self.max_in_flight)
            except Exception as exc:
                if not is_result(exc, "RANK_CONNECTION_LOST", "TOO_FEW_PEERS"):
                    raise
                self.attempt += 1  # a peer was lost: the same step again, resharded among the survivors
                self.retries += 1
                return False
            if reduced.local_world_size != self.world_size:
                # A peer left between the membership phase and the reduce, which then ran without
                # it: the shards no longer cover the global batch. Every survivor sees the same
                # group size, so they all retry.
                self.attempt += 1
                self.retries += 1
                return False
            self.buckets.unpack_grads()
            self.last_tx = reduced.tx_bytes
        else:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        return True

    def commit(self) -> int:
        """Phase 5's bookkeeping, after the optimizer step: returns the attempts the step took."""
        assert self.current is not None
        self.shared.keep_state_references()
        self.shared.revision = self.current.index + 1
        attempts, self.attempt, self.current = self.attempt + 1, 0, None
        return attempts

    def step(self, backward: Backward) -> Generator[Op, Any, StepResult | None]:
        """One training step; returns None once ``total_steps`` steps were applied."""
        while True:
            step = yield from self.begin()
            if step is None:
                return None
            loss = backward(step)
            if (yield from self.reduce_grads()):
                self.optimizer.step()
                attempts = self.commit()
                return StepResult(step.index, loss, self.world_size, attempts, self.last_sync_rx,
                                  self.last_tx)
