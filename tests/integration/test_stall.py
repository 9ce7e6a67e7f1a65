"""A partitioned P2P link between peers that still reach the master fails the op instead of hanging."""

from __future__ import annotations

import dataclasses

import numpy as np
import trio
import trio.testing

import pccl
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster

from ._stall import fails_within_stall_timeout, succeeds_after_heal


async def test_partitioned_ring_link_fails_within_stall_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=5.0)
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=cfg) as cl:
        cl.partition(0, 1)  # peers 0 and 1 cannot talk; both still reach the master
        bufs = [np.full(1 << 16, i + 1, np.float32) for i in range(3)]
        await fails_within_stall_timeout(cl, bufs, 5.0)
        await succeeds_after_heal(cl, bufs, 6)
        # the one stall monitor per peer forgets finished data planes, failed or not
        assert all(c.statistics()["data_planes_running"] == 0 for c in cl.peers)


async def test_stall_clock_starts_with_each_data_plane(autojump_clock: trio.testing.MockClock) -> None:
    """A data plane that starts long after the pool's last progress gets its full stall timeout."""
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=5.0)
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=cfg) as cl:
        bufs = [np.full(1 << 10, i + 1, np.float32) for i in range(3)]
        results = await cl.run_all(lambda i, c: c.all_reduce(bufs[i], tag=1))
        assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
        await trio.sleep(60)  # virtual: no data moves for far longer than the stall timeout
        cl.partition(0, 1)
        t0 = trio.current_time()
        results = await cl.run_all(lambda i, c: c.all_reduce(bufs[i], tag=1))
        took = trio.current_time() - t0
        assert all(isinstance(r, pccl.RankConnectionLostError) for r in results), results
        assert 5.0 <= took <= 7.0, took
