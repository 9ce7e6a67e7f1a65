"""Deadlocks through the full stack (virtual network, MockClock): the master fails the calls of a group
whose peers wait in calls that can never complete each other, with one message naming each call."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl.peer.shared_state import SharedState, TensorInfo
from pccl.testing import DEFAULT_MASTER_CONFIG, VirtualNetwork, open_test_cluster

REASON = (
    "deadlock in peer group 0: peer 1 waits in sync_shared_state; peer 2 in all_reduce tag 0. These calls "
    "can never complete each other: every accepted peer of a group must make the same call (same tag and "
    "arguments)"
)


@pytest.mark.parametrize("grace", [0.0, 1.0])
async def test_sync_against_all_reduce_fails_both_with_the_calls_named(
    autojump_clock: trio.testing.MockClock, grace: float
) -> None:
    cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, deadlock_grace=grace)
    async with open_test_cluster(2, network=VirtualNetwork(), master_config=cfg) as cl:
        a, b = cl.peer(0), cl.peer(1)
        assert (a.peer_id, b.peer_id) == (1, 2)
        state = SharedState([TensorInfo.from_numpy(np.ones(8, np.float32), "w")], revision=1)
        x = np.arange(8, dtype=np.float32)
        errors: dict[str, pccl.PCCLError] = {}
        t0 = trio.current_time()

        async def sync() -> None:
            with pytest.raises(pccl.InvalidUsageError) as ei:
                await a.sync_shared_state(state)
            errors["sync"] = ei.value

        async def reduce() -> None:
            await trio.sleep(0.01)
            with pytest.raises(pccl.InvalidUsageError) as ei:
                await b.all_reduce(x, tag=0)
            errors["all_reduce"] = ei.value

        async with trio.open_nursery() as n:
            n.start_soon(sync)
            n.start_soon(reduce)
        elapsed = trio.current_time() - t0
        assert {k: (e.result, e.message) for k, e in errors.items()} == {
            "sync": (pccl.Result.INVALID_USAGE, REASON),
            "all_reduce": (pccl.Result.INVALID_USAGE, REASON),
        }
        assert grace <= elapsed < grace + 0.5  # well before any heartbeat timeout
        np.testing.assert_array_equal(x, np.arange(8, dtype=np.float32))  # the buffer is untouched
        # the run goes on: the same calls on both peers now succeed
        async with trio.open_nursery() as n:
            n.start_soon(a.all_reduce, np.ones(8, np.float32))
            n.start_soon(b.all_reduce, x)
        np.testing.assert_array_equal(x, np.arange(8, dtype=np.float32) + 1)
        assert cl.master.statistics()["accepted"] == 2
