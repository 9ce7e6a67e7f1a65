"""optimize_topology through the full stack on loopback TCP."""

from __future__ import annotations

import numpy as np
import trio

import pccl
from pccl.peer.communicator import Communicator

from ._cluster import loopback_cluster


async def _optimize(comms: list[Communicator]) -> None:
    async with trio.open_nursery() as n:
        for c in comms:
            n.start_soon(c.optimize_topology)


async def test_optimize_topology_three_peers_then_all_reduce() -> None:
    async with loopback_cluster(3) as cl:
        await _optimize(cl.comms)
        rings = {tuple(c.group_ring) for c in cl.comms}
        assert len(rings) == 1 and sorted(next(iter(rings))) == sorted(c.peer_id for c in cl.comms)
        st = cl.master.state
        # every directed link was measured once
        assert len(st.bandwidth) == 6 and all(bw > 0 for bw, _ in st.bandwidth.values())
        xs = [np.full(1000, i + 1, np.float32) for i in range(3)]
        async with trio.open_nursery() as n:
            for c, x in zip(cl.comms, xs, strict=True):
                n.start_soon(c.all_reduce, x)
        assert all((x == 6).all() for x in xs)
        # measurements are cached: the second optimize measures nothing new
        await _optimize(cl.comms)
        assert len(st.bandwidth) == 6


async def test_optimize_topology_with_pending_ops_refused() -> None:
    async with loopback_cluster(2) as cl:
        c0, c1 = cl.comms
        x0, x1 = np.ones(10, np.float32), np.ones(10, np.float32)
        async with trio.open_nursery() as n:
            n.start_soon(lambda: c0.all_reduce(x0, tag=3))
            while 3 not in c0.statistics()["op_tags"]:
                await trio.sleep(0.001)
            try:
                await c0.optimize_topology()
            except pccl.PendingAsyncOpsError as exc:
                assert exc.result == pccl.Result.PENDING_ASYNC_OPS
            else:
                raise AssertionError("must refuse while ops are in flight")
            n.start_soon(lambda: c1.all_reduce(x1, tag=3))
        assert (x0 == 2).all()
