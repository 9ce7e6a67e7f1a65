"""What the stall-watchdog tests share: an all-reduce over a partitioned P2P link fails on every peer
within the stall timeout with every buffer untouched and nobody evicted, and succeeds exactly once the
partition heals."""

from __future__ import annotations

import numpy as np
import trio

import pccl
from pccl.testing import TestCluster


async def fails_within_stall_timeout(cl: TestCluster, bufs: list[np.ndarray], timeout: float,
                                     tag: int = 1) -> None:
    """Run ``all_reduce(bufs[i], tag)`` on every peer of ``cl`` (a P2P link cut): each fails with
    RANK_CONNECTION_LOST (one naming ``p2p_stall_timeout``) within ``timeout`` to ``timeout + 2`` virtual
    seconds, its buffer byte for byte as before, and the master still has every peer."""
    before = [b.copy() for b in bufs]
    t0 = trio.current_time()
    results = await cl.run_all(lambda i, c: c.all_reduce(bufs[i], tag=tag))
    took = trio.current_time() - t0
    assert all(isinstance(r, pccl.RankConnectionLostError) for r in results), results
    assert any("p2p_stall_timeout" in str(r) for r in results)
    assert timeout <= took <= timeout + 2.0, took
    assert all(b.tobytes() == b0.tobytes() for b, b0 in zip(bufs, before, strict=True))
    # nobody was evicted: the master still sees every peer
    assert cl.master.statistics()["accepted"] == len(bufs)


async def succeeds_after_heal(cl: TestCluster, bufs: list[np.ndarray], want: float, tag: int = 1) -> None:
    """Heal the partition; the same all-reduce then succeeds on every peer with ``want`` everywhere."""
    cl.heal()
    results = await cl.run_all(lambda i, c: c.all_reduce(bufs[i], tag=tag))
    assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
    assert all((b == want).all() for b in bufs)
