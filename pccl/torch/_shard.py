"""Deterministic data sharding for data-parallel training (pure: numpy only, no torch, no I/O).

Every step has one *global batch*, a function of the step index alone; the peers split it into
contiguous shards by rank. When the world changes (a peer joins, dies or leaves) the same global
batch is split among the new world, so a run with changing membership sees exactly the batches of a
single-process run on the same data.
"""

from __future__ import annotations

import numpy as np

from .._errors import InvalidArgumentError

__all__ = ["global_batch_indices", "shard_indices"]


def global_batch_indices(step: int, global_batch_size: int, dataset_size: int, *,
                         seed: int = 0) -> np.ndarray:
    """The dataset indices of step ``step``'s global batch.

    The dataset is visited in epochs: each epoch is a permutation drawn from ``(seed, epoch)``, cut
    into ``dataset_size // global_batch_size`` batches (the remainder of an epoch is skipped).

    Args:
        step: global step index (0, 1, ...).
        global_batch_size: samples per step over all peers.
        dataset_size: number of samples.
        seed: selects the permutations.

    Returns:
        An int64 array of ``global_batch_size`` distinct indices.

    Raises:
        InvalidArgumentError: a negative step, a batch size below 1 or above ``dataset_size``.
    """
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    if not 1 <= global_batch_size <= dataset_size:
        raise InvalidArgumentError(
            f"global_batch_size must be in [1, dataset_size={dataset_size}], got {global_batch_size}")
    per_epoch = dataset_size // global_batch_size
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng((seed, epoch)).permutation(dataset_size)
    return perm[k * global_batch_size:(k + 1) * global_batch_size].astype(np.int64)


def shard_indices(step: int, global_batch_size: int, dataset_size: int, rank: int, world_size: int, *,
                  seed: int = 0) -> np.ndarray:
    """This rank's contiguous share of step ``step``'s global batch.

    Shards differ in size by at most one (the first ``global_batch_size % world_size`` ranks get one
    more). Averaging per-shard mean gradients equals the global batch's mean gradient only when the
    shards are equal, so pick a global batch size divisible by the world sizes you expect.

    Args:
        step, global_batch_size, dataset_size, seed: as in :func:`global_batch_indices`.
        rank: this peer's rank, ``0 <= rank < world_size``.
        world_size: number of peers sharing the batch.

    Returns:
        An int64 array (possibly empty when ``world_size > global_batch_size``).

    Raises:
        InvalidArgumentError: bad rank or world size, or as :func:`global_batch_indices`.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    batch = global_batch_indices(step, global_batch_size, dataset_size, seed=seed)
    base, extra = divmod(global_batch_size, world_size)
    start = rank * base + min(rank, extra)
    return batch[start:start + base + (1 if rank < extra else 0)]
