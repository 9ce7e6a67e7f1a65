"""A process that does not run for a while (an overloaded host) does not blame its partners' silence
(pccl/_stalls.py; virtual network, MockClock).

Under load 15-20 on 2 cores the benchmark's master woke from its monitor's sleep seconds late and, before
its readers had run, evicted every peer "silent for more than 3s" (the heartbeats were in its socket
buffers); a peer's watchdog did the same to the master. ``MockClock.jump`` is such a stall of the whole
process: every timer is past due at once and no message of that time has been read.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import trio
import trio.testing

from pccl import ReduceOp
from pccl.testing import VirtualNetwork, open_test_cluster


async def _all_reduce_everywhere(cl: object, tag: int) -> list[float]:
    from pccl.testing import TestCluster

    assert isinstance(cl, TestCluster)
    out: list[float] = []

    async def one(comm: object) -> None:
        x = np.ones(64, np.float32)
        await comm.all_reduce(x, op=ReduceOp.SUM, tag=tag)  # type: ignore[attr-defined]
        out.append(float(x[0]))

    async with trio.open_nursery() as nursery:
        for comm in cl.peers:
            nursery.start_soon(one, comm)
    return out


async def test_a_stall_of_the_whole_process_evicts_nobody(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    net = VirtualNetwork(latency=0.0005)
    async with open_test_cluster(3, network=net) as cl:
        assert await _all_reduce_everywhere(cl, 1) == [3.0] * 3
        await trio.sleep(0.7)
        autojump_clock.jump(5.0)  # nothing runs for 5 s (heartbeat timeouts: 3 s on both sides)
        await trio.sleep(1.0)
        # Nobody was evicted and no link given up (and taken back: is_member alone would not tell).
        lines = [r.getMessage() for r in caplog.records]
        assert not [t for t in lines if "evicted" in t or "master silent" in t], lines
        assert any("did not run for" in t for t in lines)  # the master says why it waited
        assert all(cl.is_member(i) for i in range(3))
        assert await _all_reduce_everywhere(cl, 2) == [3.0] * 3


async def test_a_peer_gone_during_the_stall_is_still_evicted(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.0005)
    async with open_test_cluster(3, network=net) as cl:
        await trio.sleep(0.7)
        cl.hang(2)  # silent from now on (its connections stay open)
        autojump_clock.jump(5.0)
        t0 = trio.current_time()
        while cl.is_member(2):
            await trio.sleep(0.01)
        # Once the stall's credit ends (a heartbeat timeout after it), silence counts in full again.
        assert trio.current_time() - t0 <= 3.0 + 0.1
        assert cl.is_member(0) and cl.is_member(1)
