"""The user-owned step of the data-parallel drivers: ``with run.step() as s:``.

The driver runs the membership phase and the sync when the block is entered; the user computes the
loss and its gradients, calls :meth:`StepContext.all_reduce_grads`, and, when
:meth:`StepContext.should_commit` says so, does whatever its loop does with averaged gradients
(clipping, ``GradScaler``, ``optimizer.step()``, ``scheduler.step()``). Leaving the block commits the
step (revision + 1). When a peer was lost, ``should_commit()`` is False: the user skips the update
and the next ``run.step()`` retries the same step, with the same batch when it was loaded through
:meth:`StepContext.batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, TypeVar

import numpy as np

from .._errors import InvalidUsageError
from ._ops import Op
from ._train import Step, TrainCore

__all__ = ["AsyncStepContext", "BatchCache", "StepContext"]

T = TypeVar("T")


class BatchCache:
    """The batch of the step being attempted, kept until the step is committed."""

    def __init__(self) -> None:
        self._index: int | None = None
        self._value: Any = None

    def get(self, index: int, load: Callable[[], T]) -> T:
        if self._index != index:
            self._value, self._index = load(), index
        value: T = self._value
        return value

    def drop_before(self, index: int) -> None:
        if self._index is not None and self._index < index:
            self._index, self._value = None, None


class _Base:
    """What both contexts share: the attempt's step, the batch cache and the commit rule."""

    def __init__(self, core: TrainCore, cache: BatchCache) -> None:
        self._core = core
        self._cache = cache
        self.step: Step | None = None
        self._reduced: bool | None = None
        self.attempts = 0  # after a commit: the attempts the step took

    @property
    def done(self) -> bool:
        """True when the run is over (``total_steps`` applied): leave the loop."""
        return self.step is None

    def _need(self) -> Step:
        if self.step is None:
            raise InvalidUsageError("the run is over (total_steps reached)")
        return self.step

    @property
    def index(self) -> int:
        """The global step (the revision before it)."""
        return self._need().index

    @property
    def rank(self) -> int:
        return self._need().rank

    @property
    def world_size(self) -> int:
        return self._need().world_size

    @property
    def attempt(self) -> int:
        """0, then 1, 2, ... while the step is retried."""
        return self._need().attempt

    def shard(self, global_batch_size: int, dataset_size: int, *, seed: int = 0) -> np.ndarray:
        """This peer's indices of the step's global batch (see :meth:`pccl.torch.Step.shard`)."""
        return self._need().shard(global_batch_size, dataset_size, seed=seed)

    def batch(self, load: Callable[[], T]) -> T:
        """``load()``'s result, called once per step: a retried attempt gets the same object back
        (an iterator is not pulled again). The cache holds one step's batch."""
        return self._cache.get(self._need().index, load)

    def should_commit(self) -> bool:
        """True when the gradients were averaged over the whole group: apply the update now.

        Raises:
            InvalidUsageError: :meth:`all_reduce_grads` was not called.
        """
        if self._reduced is None:
            raise InvalidUsageError("call all_reduce_grads() before should_commit()")
        return self._reduced

    def _exit(self, exc: BaseException | None) -> None:
        if self.step is None or exc is not None:
            return
        if self._reduced is None:
            raise InvalidUsageError("a step block ended without all_reduce_grads()")
        if self._reduced:
            self.attempts = self._core.commit()
            self._cache.drop_before(self.step.index + 1)


class StepContext(_Base):
    """One attempt of a step for blocking drivers (:meth:`pccl.torch.TrainingRun.step` without a
    callback). Use it as a context manager."""

    def __init__(self, core: TrainCore, cache: BatchCache, run: Callable[[Generator[Op, Any, Any]], Any]
                 ) -> None:
        super().__init__(core, cache)
        self._run = run

    def __enter__(self) -> StepContext:
        self.step = self._run(self._core.begin())
        return self

    def all_reduce_grads(self) -> bool:
        """Average the gradients over the group into ``.grad``; the same as :meth:`should_commit`."""
        self._need()
        self._reduced = bool(self._run(self._core.reduce_grads()))
        return self._reduced

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._exit(exc)


class AsyncStepContext(_Base):
    """:class:`StepContext` for the trio drivers: ``async with run.step() as s:``, ``await
    s.all_reduce_grads()``."""

    def __init__(self, core: TrainCore, cache: BatchCache, run: Callable[[Generator[Op, Any, Any]], Any]
                 ) -> None:
        super().__init__(core, cache)
        self._run = run

    async def __aenter__(self) -> AsyncStepContext:
        self.step = await self._run(self._core.begin())
        return self

    async def all_reduce_grads(self) -> bool:
        """Average the gradients over the group into ``.grad``; the same as :meth:`should_commit`."""
        self._need()
        self._reduced = bool(await self._run(self._core.reduce_grads()))
        return self._reduced

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._exit(exc)
