"""Ring collectives with a stash far smaller than the early data (pccl/peer/pool.py backpressure):
concurrent tagged operations share connections, ranks start them far apart and in different orders,
inline and pipelined executors; every result is exact, no stash ever exceeds its limit, and the
readers did stop on a full stash. Virtual network, virtual time."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import trio
import trio.testing
from _ring_harness import open_ring

from pccl import PeerConfig, ReduceOp
from pccl.collectives import ring as ring_mod
from pccl.collectives.executor import run_collective
from pccl.testing import VirtualNetwork

COUNT = 192 * 1024  # int32: 768 KiB per rank and operation
BLOCK = 32 * 1024
LIMIT = 2 * BLOCK  # two frames' worth, against up to (n-1)/n of an operation arriving early
_seq = itertools.count(1000)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("pool_size", [1, 2])
@pytest.mark.parametrize("n", [2, 3])
async def test_concurrent_skewed_ops_are_exact_with_a_tiny_stash(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
    pipelined: bool, pool_size: int, n: int,
) -> None:
    if pipelined:
        monkeypatch.setattr(ring_mod, "INLINE_SEND_LIMIT", 0)
    net = VirtualNetwork(loopback=True, latency=0.0002, bandwidth=1e9)
    hosts = [net.host(f"peer{i}") for i in range(n)]
    cfg = PeerConfig(connect_timeout=5.0, recv_stash_limit=LIMIT)
    rng = np.random.default_rng(n * 10 + pool_size)
    tags = [3, 4, 8]  # 3 and 4 map to different connections when pool_size is 2; 4 and 8 to one
    seqs = [next(_seq) for _ in tags]
    sends = [[rng.integers(-1000, 1000, COUNT, dtype=np.int32) for _ in range(n)] for _ in tags]
    outs = [[np.zeros(COUNT, np.int32) for _ in range(n)] for _ in tags]
    # rank r starts operation k after delays[r][k] seconds: different orders on different ranks, and
    # skews far longer than an operation takes, so whole operations arrive before their receives
    delays = [[(0.05 * ((r + 2 * k) % 3)) for k in range(len(tags))] for r in range(n)]
    async with open_ring(n, transports=hosts, pool_size=pool_size, config=cfg) as ring:

        async def one(r: int, k: int) -> None:
            await trio.sleep(delays[r][k])
            await run_collective(
                ring.pools[r], kind="all_reduce", ring=ring.ids, my_id=ring.ids[r], tag=tags[k],
                op_seq=seqs[k], send=sends[k][r], out=outs[k][r], op=ReduceOp.SUM, block_bytes=BLOCK,
            )

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for r in range(n):
                    for k in range(len(tags)):
                        nursery.start_soon(one, r, k)
        stats = [p.statistics() for p in ring.pools]
    for k in range(len(tags)):
        ref = np.sum(sends[k], axis=0, dtype=np.int32)
        for r in range(n):
            assert np.array_equal(outs[k][r], ref), (k, r)
    assert all(s["stash_peak_bytes"] <= LIMIT for s in stats)
    assert sum(s["reader_blocks_total"] for s in stats) > 0  # the readers did stop on a full stash
    assert all(s["stashed_bytes"] == 0 and s["readers_blocked"] == 0 for s in stats)
    assert all(s["blocked_connections_dropped"] == 0 and s["connections_lost"] == 0 for s in stats)
