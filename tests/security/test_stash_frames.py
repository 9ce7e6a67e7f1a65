"""Issue 33 finding 5: a member floods its ring successor with data frames of length 0 for random
(tag, op_seq). They cost no payload bytes, so before the stash also counted frames they were stashed
without limit (400k frames, +136 MiB) and kept after the connection closed. Now the stash holds at most
``recv_stash_frames`` of them; the flooding connection stops being read and is closed after
``p2p_stall_timeout`` with a logged reason, and what it stashed is released; a connection that closes
cleanly leaves nothing behind either. Honest all-reduces stay exact. Virtual network, virtual time."""

from __future__ import annotations

import logging
import random

import pytest
import trio
import trio.testing

from pccl import PeerConfig, RankConnectionLostError
from pccl.testing import VirtualNetwork, open_test_cluster, wait_until

from ._helpers import exact_all_reduces

FRAMES = 64  # a small cap keeps the test fast; the default is 4096
PEER_CFG = PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, recv_stash_frames=FRAMES)
FLOOD_TAG = 1  # lane 0 of tag 1 is connection 1 of 2; the all-reduces below use even tags: connection 0
JUNK_OP_SEQ = 1 << 31  # the master never hands these out in this test


async def _flood(evil: object, victim_id: int, n: int, seed: int) -> None:
    rng = random.Random(seed)
    empty = memoryview(b"")
    try:
        for _ in range(n):
            await evil.pool.send(victim_id, FLOOD_TAG, JUNK_OP_SEQ + rng.randrange(1 << 30),  # type: ignore[attr-defined]
                                 rng.randrange(1 << 16), empty, conn_index=1)
    except RankConnectionLostError:
        pass  # closed under it


async def test_empty_frames_are_counted_blocked_and_released(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    stall = PEER_CFG.p2p_stall_timeout
    async with open_test_cluster(
        2, network=VirtualNetwork(latency=0.0005), config=PEER_CFG, pool_size=2
    ) as cl:
        await exact_all_reduces(cl)
        evil, victim = cl.peer(0), cl.peer(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_flood, evil, victim.peer_id, FRAMES + 16, 1)
            await wait_until(lambda: victim.pool.statistics()["readers_blocked"] == 1, timeout=5)
            t_blocked = trio.current_time()
            s = victim.pool.statistics()
            assert s["stashed_frames"] == FRAMES and s["stashed_bytes"] == 0
            for tag in (10, 12, 14):  # even tags: the other connection carries on, exact
                await exact_all_reduces(cl, rounds=1, tag=tag)
            await wait_until(lambda: victim.pool.statistics()["blocked_connections_dropped"] == 1,
                             timeout=stall + 1, interval=0.01)
            assert stall - 1e-6 <= trio.current_time() - t_blocked <= stall + 0.1
        s = victim.pool.statistics()
        assert s["stashed_frames"] == 0 and s["readers_blocked"] == 0  # released with its connection
        assert f"ring connection 1 from peer {evil.peer_id}" in caplog.text
        assert f"waited {stall:g}s (p2p_stall_timeout)" in caplog.text
        assert f"of {FRAMES} frames" in caplog.text
        assert len(cl.master.state.accepted()) == 2


async def test_a_closed_connection_leaves_no_stashed_frames(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(
        2, network=VirtualNetwork(latency=0.0005), config=PEER_CFG, pool_size=2
    ) as cl:
        await exact_all_reduces(cl)
        evil, victim = cl.peer(0), cl.peer(1)
        await _flood(evil, victim.peer_id, FRAMES // 2, 2)
        await wait_until(lambda: victim.pool.statistics()["stashed_frames"] == FRAMES // 2, timeout=5)
        await evil.pool.retire(set())  # closes its connections cleanly, between two frames
        await wait_until(lambda: victim.pool.statistics()["incoming"] == {}, timeout=5)
        assert victim.pool.statistics()["stashed_frames"] == 0
        await exact_all_reduces(cl, rounds=1, tag=20)
        await exact_all_reduces(cl, rounds=1, tag=22)
