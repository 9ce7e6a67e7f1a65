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
from ._ops import AllReduce, Members, Op, PeersPending, Sleep, Sync, UpdateTopology, is_result
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
    """

    def __init__(self, shared: SharedModel, *, just_joined: bool, total_steps: int | None,
                 bucket_bytes: int, max_in_flight: int, min_world_size: int, poll_interval: float,
                 quantization: Any = None) -> None:
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
        self.poll_interval = poll_interval
        self.quantization = quantization
        self.rank = 0
        self.world_size = 1
        self.retries = 0  # attempts that failed because a peer was lost, over the whole run
        self.syncs = 0

    def membership(self) -> Generator[Op, Any, None]:
        """Phase 1: admit pending peers (skipped once by a newcomer); wait until enough peers."""
        while True:
            if self.just_joined:
                self.just_joined = False
            else:
                try:
                    if (yield PeersPending()):
                        yield UpdateTopology()
                except Exception as exc:
                    if not is_result(exc, "UPDATE_TOPOLOGY_FAILED", "RANK_CONNECTION_LOST"):
                        raise  # (RANK_CONNECTION_LOST: are_peers_pending's vote lost with the master)
                    continue  # every peer saw it: vote again
            self.rank, self.world_size = yield Members()
            if self.world_size >= self.min_world_size:
                return
            yield Sleep(self.poll_interval, self.min_world_size)

    def step(self, backward: Backward) -> Generator[Op, Any, StepResult | None]:
        """One training step; returns None once ``total_steps`` steps were applied."""
        attempt = 0
        while True:
            yield from self.membership()
            try:
                info = yield Sync(self.shared.state)
            except Exception as exc:
                if not is_result(exc, "RANK_CONNECTION_LOST"):
                    raise
                attempt += 1
                self.retries += 1
                continue
            self.syncs += 1
            index = self.shared.revision
            if self.total_steps is not None and index >= self.total_steps:
                return None
            self.optimizer.zero_grad(set_to_none=False)
            loss = backward(Step(index, self.rank, self.world_size, attempt))
            tx = 0
            if self.world_size > 1:
                self.buckets.pack_grads()
                try:
                    reduced = yield AllReduce(self.buckets.pairs, ReduceOp.AVG, self.quantization,
                                              self.max_in_flight)
                except Exception as exc:
                    if not is_result(exc, "RANK_CONNECTION_LOST", "TOO_FEW_PEERS"):
                        raise
                    attempt += 1  # a peer was lost: the same step again, resharded among the survivors
                    self.retries += 1
                    continue
                if reduced.local_world_size != self.world_size:
                    # A peer left between the membership phase and the reduce, which then ran without
                    # it: the shards no longer cover the global batch. Every survivor sees the same
                    # group size, so they all retry.
                    attempt += 1
                    self.retries += 1
                    continue
                self.buckets.unpack_grads()
                tx = reduced.tx_bytes
            else:
                for p in self.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.shared.keep_state_references()
            self.shared.revision = index + 1
            return StepResult(index, loss, self.world_size, attempt + 1, info.rx_bytes, tx)
