"""Stash fill (issue 17, item 6): a member floods its ring successor with data frames for receives that
are never posted. The successor's stash stays within ``recv_stash_limit`` (the 64 MiB default), the
flooding connection stops being read (backpressure) and is closed after ``p2p_stall_timeout`` with a
logged reason and its stash released; the all-reduces that run meanwhile on the other connection and
all those after it are exact and not held up. Virtual network, virtual time."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import trio
import trio.testing

from pccl import PCCLError, PeerConfig, RankConnectionLostError
from pccl._config import DEFAULT_RECV_STASH_LIMIT
from pccl.peer.communicator import Communicator
from pccl.testing import VirtualNetwork, open_test_cluster

from ._helpers import COUNT, contribution, exact_all_reduces, expected

PEER_CFG = PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0)  # stash limit and stall bound: defaults
FRAME = 1 << 20
FLOOD_FRAMES = 100  # 100 MiB of frames nobody will receive, well over the 64 MiB stash
FLOOD_TAG = 1  # lane 0 of tag 1 is connection 1 of 2; the all-reduces below use even tags: connection 0
JUNK_OP_SEQ = 1 << 31  # the master never hands these out in this test


async def test_member_flooding_early_frames_is_bounded_blocked_and_dropped(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    stall = PEER_CFG.p2p_stall_timeout
    assert PEER_CFG.recv_stash_limit == DEFAULT_RECV_STASH_LIMIT == 64 << 20
    async with open_test_cluster(
        2, network=VirtualNetwork(latency=0.0005), config=PEER_CFG, pool_size=2
    ) as cl:
        await exact_all_reduces(cl)  # both connections of both directions in use
        evil, victim = cl.peer(0), cl.peer(1)
        ids = [evil.peer_id, victim.peer_id]

        async def flood() -> None:
            junk = memoryview(b"\xee" * FRAME)
            try:
                for i in range(FLOOD_FRAMES):
                    await evil.pool.send(victim.peer_id, FLOOD_TAG, JUNK_OP_SEQ + i, 0, junk, conn_index=1)
            except RankConnectionLostError:
                pass  # closed under it

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            with trio.fail_after(1):
                while victim.pool.statistics()["readers_blocked"] != 1:
                    await trio.sleep(0.001)
            t_blocked = trio.current_time()
            s = victim.pool.statistics()
            assert DEFAULT_RECV_STASH_LIMIT - FRAME < s["stashed_bytes"] <= DEFAULT_RECV_STASH_LIMIT

            # Meanwhile the run goes on over the other connection: exact, and as fast as ever.
            for r in range(5):

                async def one(i: int, comm: Communicator, tag: int = 2 * r + 10) -> tuple[bytes, float]:
                    out = np.zeros(COUNT, np.int64)
                    t0 = trio.current_time()
                    await comm.all_reduce(contribution(comm.peer_id), out, tag=tag)
                    return out.tobytes(), trio.current_time() - t0

                for got in await cl.run_all(one):
                    assert not isinstance(got, PCCLError), got  # (unpacking one would fail as well)
                    total, took = got
                    assert total == expected(ids)
                    assert took < 0.05  # a few latencies, not a stall
            assert victim.pool.statistics()["readers_blocked"] == 1

            # The flooding connection is closed once it has been blocked for p2p_stall_timeout.
            with trio.fail_after(stall + 1):
                while victim.pool.statistics()["blocked_connections_dropped"] == 0:
                    await trio.sleep(0.01)
            assert stall <= trio.current_time() - t_blocked <= stall + 0.1
        s = victim.pool.statistics()
        assert s["stash_peak_bytes"] <= DEFAULT_RECV_STASH_LIMIT
        assert s["stashed_bytes"] == 0 and s["readers_blocked"] == 0  # its stash was released with it
        assert f"from peer {evil.peer_id}" in caplog.text
        assert "waited 30s (p2p_stall_timeout) for its receive while the stash is full" in caplog.text
        assert len(cl.master.state.accepted()) == 2

        # The flooder learns that its connection 1 was closed when it next sends on it: that one
        # operation fails like any on a lost connection (never with a wrong result), then the closed
        # connection is reopened and every operation on either connection is exact again.
        async def on_conn1(i: int, comm: Communicator) -> bytes:
            out = np.zeros(COUNT, np.int64)
            await comm.all_reduce(contribution(comm.peer_id), out, tag=41)
            return out.tobytes()

        for res in await cl.run_all(on_conn1):
            assert res == expected(ids) or isinstance(res, RankConnectionLostError), res
        await exact_all_reduces(cl, rounds=4, tag=50)
        assert len(cl.master.state.accepted()) == 2
