"""pccl for torch: train a model fault-tolerantly in a few lines (see docs/torch.md).

Importing this module imports torch; nothing else in pccl does.

* :class:`SharedModel`: a model's parameters and buffers and its optimizer's state as one shared state.
* :class:`TrainingRun` (blocking) / :class:`AsyncTrainingRun` (trio): data-parallel training that
  admits newcomers, syncs them, averages gradients in buckets and retries a step when a peer is lost.
* :class:`DiLoCo` / :class:`AsyncDiLoCo`: inner steps and an outer step on averaged pseudo-gradients,
  synchronous or one step delayed, optionally quantized.
* :class:`StreamingDiLoCo` / :class:`AsyncStreamingDiLoCo`: streaming DiLoCo, the model in fragments
  synced on a staggered schedule overlapped with the inner steps, optionally compressed (8/4-bit
  min-max, top-k) with error feedback (:class:`MinMaxCodec`, :class:`DeflateCodec`, :class:`TopKCodec`).
* :func:`shard_indices`, :func:`global_batch_indices`: deterministic data sharding by step and rank.
* :mod:`pccl.torch.distributed`: the ``"pccl"`` torch.distributed backend (registered on import) and its
  fault-tolerant step :class:`~pccl.torch.distributed.Manager`.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (say how to get it, not a bare "No module named 'torch'")
except ImportError as _exc:
    raise ImportError(
        f"pccl.torch needs PyTorch, which cannot be imported here ({_exc}): install it with "
        "`pip install torch` or `pip install 'pccl[torch]'` (CUDA builds: https://pytorch.org/get-started/)",
        name="torch",
    ) from _exc

from ._buckets import DEFAULT_BUCKET_BYTES
from ._codec import Codec, DeflateCodec, ErrorFeedback, MinMaxCodec, TopKCodec, choose_codec
from ._context import AsyncStepContext, StepContext
from ._diloco import default_outer_optimizer
from ._drivers import AsyncDiLoCo, AsyncTrainingRun, DiLoCo, TrainingRun
from ._model import SharedModel, create_optimizer_state
from ._shard import global_batch_indices, shard_indices
from ._stream_drivers import AsyncStreamingDiLoCo, StreamingDiLoCo
from ._train import Step, StepResult
from .distributed import register as _register_backend

_register_backend()

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AsyncDiLoCo",
    "AsyncStepContext",
    "AsyncStreamingDiLoCo",
    "AsyncTrainingRun",
    "Codec",
    "DeflateCodec",
    "DiLoCo",
    "ErrorFeedback",
    "MinMaxCodec",
    "SharedModel",
    "Step",
    "StepContext",
    "StepResult",
    "StreamingDiLoCo",
    "TopKCodec",
    "TrainingRun",
    "choose_codec",
    "create_optimizer_state",
    "default_outer_optimizer",
    "global_batch_indices",
    "shard_indices",
]
