"""Small two-peer all-reduces (the exchange plan) go out in frames of at most two TCP segments, dealt
out over the partner's connections (pccl/collectives/op_plan.py ``SMALL_FRAME_BYTES``): the frames each
plan has, and on the virtual network that they travel on different connections and still give the
exact result."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import trio
import trio.testing

from pccl.collectives.op_plan import SMALL_FRAME_BYTES, SMALL_SPLIT_MAX_BYTES, build_plan
from pccl.testing import VirtualNetwork, open_test_cluster
from pccl.testing.cluster import DEFAULT_PEER_CONFIG


def frames(n: int, rank: int, nbytes: int, itemsize: int) -> list[tuple[int, int, int]]:
    """``(elements, lane, peer)`` of each send of rank ``rank``'s all-reduce plan."""
    plan = build_plan("all_reduce", n, rank, nbytes // itemsize, itemsize)
    return [(f.end - f.start, f.lane, f.peer) for f in plan.sends]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_4_kb_exchange_is_two_frames_on_two_lanes(rank: int) -> None:
    assert SMALL_FRAME_BYTES == 2048
    assert frames(2, rank, 4096, 4) == [(512, 0, 1 - rank), (512, 1, 1 - rank)]
    assert frames(2, rank, 4096, 8) == [(256, 0, 1 - rank), (256, 1, 1 - rank)]
    plan = build_plan("all_reduce", 2, rank, 1024, 4)
    assert [(f.start, f.end) for f in plan.recvs] == [(0, 512), (512, 1024)]
    assert plan.schedule == "exchange"


def test_which_exchanges_are_split() -> None:
    # one frame up to SMALL_FRAME_BYTES: nothing to gain
    assert frames(2, 0, 2048, 4) == [(512, 0, 1)]
    assert frames(2, 0, 40, 4) == [(10, 0, 1)]
    # uneven: the last frame is shorter
    assert frames(2, 0, 3000, 1) == [(2048, 0, 1), (952, 1, 1)]
    assert [e for e, _l, _p in frames(2, 1, SMALL_SPLIT_MAX_BYTES, 4)] == [512] * 4
    # larger exchanges keep the pipelining block (one frame here), and three peers keep the ring's chunks
    assert frames(2, 0, SMALL_SPLIT_MAX_BYTES + 4, 4) == [(SMALL_SPLIT_MAX_BYTES // 4 + 1, 0, 1)]
    assert [e for e, _l, _p in frames(3, 0, 4092, 4)] == [341] * 4
    # quantized operations run the ring, unsplit
    q = build_plan("all_reduce", 2, 0, 1024, 4, quantized=True)
    assert q.schedule == "ring"
    assert [f.end - f.start for f in q.sends] == [512, 512] and {f.step for f in q.sends} == {0, 1}


async def test_a_far_partner_gets_the_frames_on_different_connections(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 50 ms round trip: four connections each way (three, and the floor; pccl/peer/striping.py)
    net = VirtualNetwork(latency=0.025)
    async with open_test_cluster(2, network=net, pool_size=0, config=DEFAULT_PEER_CONFIG) as cl:
        before = [_sent_per_connection(c) for c in cl.peers]
        xs = [np.arange(1024, dtype=np.float32) * (k + 1) for k in range(2)]
        async with trio.open_nursery() as nursery:
            for c, x in zip(cl.peers, xs, strict=True):
                nursery.start_soon(functools.partial(c.all_reduce, x))
        after = [_sent_per_connection(c) for c in cl.peers]
        assert all(c.pool.stripes(p) == 4 for c in cl.peers for p in c.pool.statistics()["stripes"])
    expected = np.arange(1024, dtype=np.float32) * 3
    assert all(np.array_equal(x, expected) for x in xs)
    for b, a in zip(before, after, strict=True):
        grew = sorted(a[k] - b.get(k, 0) for k in a if a[k] != b.get(k, 0))
        assert grew == [2048, 2048]  # two connections, one 2 KB frame each


def _sent_per_connection(comm: object) -> dict[tuple[int, int], int]:
    """Payload bytes sent so far on each outgoing ring connection, by (partner, index)."""
    links = comm.pool.links  # type: ignore[attr-defined]
    return {(p, i): c.tx_bytes for p, cs in links.conns.items() for i, c in enumerate(cs) if c is not None}
