"""Issue 34 item 3 on the virtual network: one master round trip for operations of every size while
membership is stable and the links are far (the peer stripes to a partner: by default a round trip
over ~20 ms; docs/protocol.md section 4). Until the master says that every participant voted, a
speculative data plane sends at most half a partner's stash (pccl/collectives/gate.py). On near links
(one connection per partner) operations over 4 MiB keep the slow path.

Message counts, not timings, show the saved round trip; an aborted large speculative operation leaves
every buffer byte for byte as it was; a peer lost mid-operation still fails it at once.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import trio
import trio.testing

import pccl
from pccl.peer.communicator import Communicator
from pccl.peer.state import SPECULATIVE_NEAR_MAX_BYTES
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster

from .test_speculative import all_reduce_all, count_received, count_sent, expect_sum, fresh

#: 16 MiB of int64 per peer: over the former 4 MiB limit, and a two-peer all-reduce of it sends more
#: than the inline limit (8 MiB), so the pipelined sender tasks run it.
LARGE = 2 << 20


async def test_a_large_all_reduce_costs_one_master_round_trip(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.025, bandwidth=125e6)  # 50 ms round trip, 1 Gbit/s
    async with open_test_cluster(2, network=net, pool_size=0) as cl:  # the default: sized from the RTT
        got = [count_received(c) for c in cl.peers]
        sent = count_sent(cl)
        for k in range(3):
            bufs = fresh(2, LARGE)
            before = [b.copy() for b in bufs]
            res = await all_reduce_all(cl, bufs)
            assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
            expect_sum(bufs, before)
            if k == 0:  # the first op of a tag: vote -> commence (with the table), done -> complete
                assert all(g == {"CollectiveCommence": 1, "CollectiveComplete": 1} for g in got), got
            else:
                # Reserved number: the data plane starts on the vote and waits for one answer; the
                # tableless go (nothing waits for it: it starts the stall clock) comes meanwhile.
                want = {"CollectiveCommence": 1, "go": k, "CollectiveComplete": k + 1}
                assert all(g == want for g in got), got
            assert sent == {"CollectiveInitiate": 2 * (k + 1), "CollectiveDone": 2 * (k + 1)}
        assert cl.master.state.statistics()["collectives_fast"] == 2
        # both voted together: the go came long before half the stash (32 MiB) was sent
        assert all(c.statistics()["speculative_starts"] == 2 for c in cl.peers)
        assert all(c.statistics().get("speculative_gate_waits", 0) == 0 for c in cl.peers)
        assert all(c.pool.stripes(c.group_ring[1 - c.rank]) > 1 for c in cl.peers)  # far


async def test_on_near_links_operations_over_4_mib_keep_the_slow_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.001), pool_size=0) as cl:
        got = [count_received(c) for c in cl.peers]
        count = SPECULATIVE_NEAR_MAX_BYTES // 8 + 1  # int64: one element over the limit
        for _ in range(2):
            bufs = fresh(2, count)
            before = [b.copy() for b in bufs]
            res = await all_reduce_all(cl, bufs)
            assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
            expect_sum(bufs, before)
        assert all(c.pool.stripes(c.group_ring[1 - c.rank]) == 1 for c in cl.peers)  # near
        assert all(g == {"CollectiveCommence": 2, "CollectiveComplete": 2} for g in got), got
        bufs = fresh(2, SPECULATIVE_NEAR_MAX_BYTES // 8)  # at the limit: fast (the last op reserved a number)
        await all_reduce_all(cl, bufs)
        assert cl.master.state.statistics()["collectives_fast"] == 1


async def test_a_late_voter_holds_a_large_speculative_sender_to_half_its_stash(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # an 8 MiB stash: the early voter may send 4 MiB (one block) before everyone voted; without the
    # gate it would fill the late voter's stash with both 4 MiB blocks of its reduce-scatter chunk
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, recv_stash_limit=8 << 20, p2p_stall_timeout=5.0)
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.001), config=cfg, pool_size=2) as cl:
        await all_reduce_all(cl, fresh(2, LARGE))
        bufs = fresh(2, LARGE)
        before = [b.copy() for b in bufs]

        async def late(i: int, c: Communicator) -> pccl.ReduceInfo:
            if i == 1:
                await trio.sleep(20)  # computes far longer than the stall timeout
            return await c.all_reduce(bufs[i], tag=1)

        res = await cl.run_all(late)
        assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
        expect_sum(bufs, before)
        assert cl.master.state.statistics()["collectives_fast"] == 1
        assert cl.peer(0).statistics()["speculative_gate_waits"] == 1
        assert cl.peer(1).statistics()["pool"]["stash_peak_bytes"] == 4 << 20
        assert all(c.statistics()["pool"]["stashed_bytes"] == 0 for c in cl.peers)


async def test_an_aborted_large_speculative_op_leaves_every_buffer_exactly_as_it_was(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.005, bandwidth=125e6)
    async with open_test_cluster(3, network=net, pool_size=2) as cl:
        await all_reduce_all(cl, fresh(3, LARGE))
        # peer 2 disagrees on the element count: the speculative planes run (and fail on frames of
        # the wrong size) before the vote completes; the master aborts everyone
        sends = fresh(3, LARGE)
        sends[2] = sends[2][: LARGE - 8].copy()
        recvs = [np.full_like(s, -7) for s in sends]
        before = [(s.copy(), r.copy()) for s, r in zip(sends, recvs, strict=True)]
        res = await cl.run_all(lambda i, c: c.all_reduce(sends[i], recvs[i], tag=1))
        assert all(isinstance(r, pccl.InvalidArgumentError) for r in res), res
        for (s, r), (s0, r0) in zip(zip(sends, recvs, strict=True), before, strict=True):
            assert s.tobytes() == s0.tobytes() and r.tobytes() == r0.tobytes()
        # the retry (slow, then fast again) is exact: no frame of the aborted attempt lands in it
        for _ in range(2):
            bufs = fresh(3, LARGE)
            before_in = [b.copy() for b in bufs]
            res = await all_reduce_all(cl, bufs)
            assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
            expect_sum(bufs, before_in)
        assert cl.master.state.statistics()["collectives_fast"] == 1  # op 4 (op 2's number was spent)
        assert all(c.statistics()["pool"]["stashed_bytes"] == 0 for c in cl.peers)


async def test_a_peer_lost_mid_way_through_a_large_speculative_op_fails_it_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 100 MB/s links: the 16 MiB op takes ~0.3 s of virtual time; the stall timeout is far away
    net = VirtualNetwork(latency=0.005, bandwidth=100e6)
    async with open_test_cluster(3, network=net, pool_size=2) as cl:
        await all_reduce_all(cl, fresh(3, LARGE))
        bufs = fresh(3, LARGE)
        before = [b.copy() for b in bufs]
        results: list[object] = [None, None]
        failed_at: list[float] = [0.0, 0.0]

        async def one(i: int) -> None:
            try:
                results[i] = await cl.peer(i).all_reduce(bufs[i], tag=1)
            except pccl.PCCLError as exc:
                results[i] = exc
            failed_at[i] = trio.current_time()

        async def doomed(victim: Communicator) -> None:
            with contextlib.suppress(pccl.PCCLError):  # killed: its host is gone
                await victim.all_reduce(bufs[2], tag=1)

        async with trio.open_nursery() as nursery:
            for i in (0, 1):
                nursery.start_soon(one, i)
            victim = cl.peer(2)
            rx0 = victim.statistics()["pool"]["rx_bytes"]
            nursery.start_soon(doomed, victim)
            while victim.statistics()["pool"]["rx_bytes"] - rx0 < LARGE * 8 // 6:  # data moves
                await trio.sleep(0.005)
            assert all(c.statistics()["ops"].get(1, -1) >= 0 for c in cl.peers)  # all speculative
            killed_at = trio.current_time()
            cl.kill(2)
        assert all(isinstance(r, pccl.RankConnectionLostError) for r in results), results
        assert max(failed_at) - killed_at < 1.0  # the stall timeout (30 s) plays no part
        assert all(b.tobytes() == b0.tobytes() for b, b0 in zip(bufs[:2], before[:2], strict=True))
        # the retry takes the slow path on the smaller ring, exactly
        res = await all_reduce_all(cl, bufs[:2])
        assert all(isinstance(r, pccl.ReduceInfo) and r.local_world_size == 2 for r in res), res
        expect_sum(bufs[:2], before[:2])
