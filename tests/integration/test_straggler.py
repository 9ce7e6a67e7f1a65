"""Hung peers that hold up the others: the optional straggler timeout (MasterConfig.straggler_timeout).

Two peers hang 0.4 s apart while the group all-reduces in a loop (virtual network, MockClock). With
only the heartbeat timeout the hangs stack: the first costs a heartbeat timeout, and the retry then
waits for the second peer's own heartbeat timeout. With a straggler timeout each hung peer is evicted
once it has been silent for that long while the others wait on it, so the group is back after about
the second hang + one straggler timeout. An idle hung peer (nobody waits on it) still gets the full
heartbeat timeout.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import MasterConfig, PeerConfig
from pccl.testing import VirtualNetwork, open_test_cluster

HB_TIMEOUT = 2.0
STRAGGLER = 0.5
PEER_CFG = PeerConfig(heartbeat_interval=0.1, heartbeat_timeout=HB_TIMEOUT)


def master_cfg(straggler: float | None) -> MasterConfig:
    return MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=HB_TIMEOUT, straggler_timeout=straggler)


async def _two_hangs(straggler: float | None) -> tuple[float, list[tuple[float, int]]]:
    """Five peers loop all-reduces; peers 3 and 4 hang 0.4 s apart. Returns the time from the first
    hang until the three survivors' first all-reduce without them, and every survivor commit."""
    net = VirtualNetwork(latency=0.0005)
    async with open_test_cluster(5, network=net, config=PEER_CFG, master_config=master_cfg(straggler)) as cl:
        commits: list[tuple[float, int]] = []
        back = trio.Event()
        survivors = (0, 1, 2)

        async def loop(i: int) -> None:
            x = np.full(1000, float(i + 1), np.float32)
            while not back.is_set():
                before = x.copy()
                try:
                    info = await cl.peer(i).all_reduce(x.copy(), x, tag=0)
                except pccl.RankConnectionLostError:
                    assert x.tobytes() == before.tobytes()  # a failed call leaves the buffer alone
                    continue
                except pccl.PCCLError:
                    if i in survivors:
                        raise
                    return  # a hung peer finds itself cut off once it runs again: expected
                if i in survivors:
                    commits.append((trio.current_time(), info.local_world_size))
                    if info.local_world_size == 3:
                        back.set()
                x[:] = float(i + 1)
                await trio.sleep(0.01)

        t_hang: list[float] = []

        async def faults() -> None:
            await trio.sleep(1.0)
            t_hang.append(trio.current_time())
            cl.hang(3)
            await trio.sleep(0.4)
            cl.hang(4)

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                for i in survivors:
                    n.start_soon(loop, i)
                for i in (3, 4):
                    cl.start_soon(i, loop, i)
                n.start_soon(faults)
        assert not cl.is_member(3) and not cl.is_member(4)
        t_back = next(t for t, w in commits if w == 3)
        return t_back - t_hang[0], commits


async def test_overlapping_hangs_stack_with_heartbeat_timeout_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recovered, commits = await _two_hangs(None)
    assert any(w == 5 for _, w in commits)
    # The second hang's own timeout starts 0.4 s later and only ends ~HB_TIMEOUT after it.
    assert recovered >= 0.4 + HB_TIMEOUT - 0.1, recovered


async def test_straggler_timeout_evicts_overlapping_hangs_quickly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recovered, commits = await _two_hangs(STRAGGLER)
    assert any(w == 5 for _, w in commits)
    # Peer 4 is evicted once silent for STRAGGLER while the others wait on it (its limit may be a
    # little above STRAGGLER: twice its longest recent gap), then one retry round trip.
    assert recovered <= 0.4 + STRAGGLER + 0.3, recovered
    assert recovered < HB_TIMEOUT


async def test_idle_hung_peer_gets_the_full_heartbeat_timeout(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.0005)
    async with open_test_cluster(3, network=net, config=PEER_CFG, master_config=master_cfg(STRAGGLER)) as cl:
        await trio.sleep(0.5)
        t0 = trio.current_time()
        cl.hang(2)
        while cl.is_member(2):
            await trio.sleep(0.01)
        elapsed = trio.current_time() - t0
        # nobody waited on it: evicted by the heartbeat timeout (its last message was < 0.1 s before)
        assert HB_TIMEOUT - 0.11 <= elapsed <= HB_TIMEOUT + 0.2, elapsed


def test_straggler_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="straggler_timeout"):
        MasterConfig(heartbeat_timeout=3.0, straggler_timeout=5.0)
    with pytest.raises(ValueError, match="straggler_timeout"):
        MasterConfig(straggler_timeout=0.0)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        MasterConfig(heartbeat_interval=3.0, heartbeat_timeout=3.0)


async def test_live_slow_voter_is_not_evicted_and_the_wait_is_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that is alive (heartbeating) but late to a vote is waited for, not evicted; after
    STALL_LOG_AFTER seconds the master logs whom the vote waits for."""
    from pccl.master.server import STALL_LOG_AFTER

    net = VirtualNetwork(latency=0.0005)
    async with open_test_cluster(3, network=net, config=PEER_CFG, master_config=master_cfg(STRAGGLER)) as cl:
        late = cl.peer(2).peer_id
        xs = [np.full(10, float(i + 1), np.float32) for i in range(3)]
        done: list[int] = []

        async def call(i: int) -> None:
            await cl.peer(i).all_reduce(xs[i], tag=3)
            done.append(i)

        with caplog.at_level("WARNING", logger="pccl.master"):
            async with trio.open_nursery() as n:
                n.start_soon(call, 0)
                n.start_soon(call, 1)
                await trio.sleep(STALL_LOG_AFTER + 1.0)  # virtual: far beyond the straggler timeout
                assert done == [] and cl.is_member(2)
                n.start_soon(call, 2)
        assert sorted(done) == [0, 1, 2] and all((x == 6).all() for x in xs)
        waits = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
        assert any(f"vote waits for [{late}]" in w for w in waits), waits
