"""The held-back tableless commence on the virtual network (MasterConfig.speculative_go_delay, default
10 ms): a steady speculative op that ends within the delay gets one master message per peer (its
CollectiveComplete), and a speculative data plane that stalls is still failed by the stall watchdog,
its clock started by the go that then does come (docs/protocol.md section 4)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import trio
import trio.testing

import pccl
from pccl.peer.communicator import Communicator
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster
from pccl.wire import messages as m

from ._stall import fails_within_stall_timeout, succeeds_after_heal


def received(comm: Communicator) -> collections.Counter[str]:
    """The collective messages ``comm`` gets from the master from now on (a commence without a table
    counts as "go")."""
    counts: collections.Counter[str] = collections.Counter()
    handle = comm.handle_master_message

    def counting(msg: m.Message) -> pccl.PCCLError | None:
        if isinstance(msg, m.CollectiveCommence) and not msg.peers:
            counts["go"] += 1
        elif type(msg).__name__.startswith("Collective"):
            counts[type(msg).__name__] += 1
        return handle(msg)

    comm.handle_master_message = counting  # type: ignore[method-assign]
    return counts


async def test_steady_short_ops_get_one_master_message_per_peer_and_op(
    autojump_clock: trio.testing.MockClock,
) -> None:
    assert DEFAULT_MASTER_CONFIG.speculative_go_delay == 0.01
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.0005)) as cl:
        bufs = [np.full(256, i + 1, np.int64) for i in range(2)]
        assert all(isinstance(r, pccl.ReduceInfo)
                   for r in await cl.run_all(lambda i, c: c.all_reduce(bufs[i], tag=1)))
        got = [received(c) for c in cl.peers]
        for k in range(5):
            bufs = [np.full(256, (k + 2) * (i + 1), np.int64) for i in range(2)]
            res = await cl.run_all(lambda i, c: c.all_reduce(bufs[i], tag=1))
            assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
            assert all((b == 3 * (k + 2)).all() for b in bufs)
        assert all(g == {"CollectiveComplete": 5} for g in got), got  # no go, no table
        stats = cl.master.state.statistics()
        assert stats["collectives_fast"] == 5 and stats["speculative_go_held"] == 5
        assert all(c.statistics()["speculative_starts"] == 5 for c in cl.peers)


async def test_a_stalled_speculative_data_plane_still_fails_within_the_stall_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=5.0)
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.0005), config=cfg) as cl:
        bufs = [np.full(1 << 10, i + 1, np.float32) for i in range(3)]
        assert all(isinstance(r, pccl.ReduceInfo)
                   for r in await cl.run_all(lambda i, c: c.all_reduce(bufs[i], tag=1)))
        got = [received(c) for c in cl.peers]
        cl.partition(0, 1)  # both still reach the master: only the stall watchdog can end the op
        bufs = [np.full(1 << 10, i + 1, np.float32) for i in range(3)]
        await fails_within_stall_timeout(cl, bufs, 5.0)
        # it ran speculatively, and the held-back go came (it started the stall clocks)
        assert all(g["go"] == 1 and g["CollectiveAbort"] == 1 for g in got), got
        await succeeds_after_heal(cl, bufs, 6)
