"""Issue 21 item 3 on the virtual network: one master round trip per collective while membership is
stable (the speculative start), and what happens when it does not hold (docs/protocol.md section 4).

Message counts, not timings, show the saved round trip; every failure leaves the buffers as they were
and the retry is exact.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import trio
import trio.testing

import pccl
from pccl.peer.communicator import Communicator
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster
from pccl.testing.cluster import TestCluster
from pccl.wire import messages as m

#: The tableless commence at once (MasterConfig.speculative_go_delay 0), for the tests that count it on
#: ops shorter than the default delay (tests/integration/test_speculative_go.py tests the delay).
GO_AT_ONCE = dataclasses.replace(DEFAULT_MASTER_CONFIG, speculative_go_delay=0.0)

_COLLECTIVE = (m.CollectiveInitiate, m.CollectiveCommence, m.CollectiveDone, m.CollectiveComplete,
               m.CollectiveAbort)


def count_received(comm: Communicator) -> collections.Counter[str]:
    """Count the collective messages ``comm`` gets from the master from now on.

    A commence without a table is counted as "go": it tells a speculative start that everyone voted
    (nothing waits for it; it starts the stall clock). The one with the table is what the slow path
    waits for: one master round trip.
    """
    counts: collections.Counter[str] = collections.Counter()
    handle: Callable[[m.Message], pccl.PCCLError | None] = comm.handle_master_message

    def counting(msg: m.Message) -> pccl.PCCLError | None:
        if isinstance(msg, m.CollectiveCommence) and not msg.peers:
            counts["go"] += 1
        elif isinstance(msg, _COLLECTIVE):
            counts[type(msg).__name__] += 1
        return handle(msg)

    comm.handle_master_message = counting  # type: ignore[method-assign]
    return counts


def count_sent(cl: TestCluster) -> collections.Counter[str]:
    """Count the collective messages the master gets from its peers from now on."""
    counts: collections.Counter[str] = collections.Counter()
    state = cl.master.state
    handle = state.handle

    def counting(peer_id: int, msg: m.Message, now: float) -> list[object]:
        if isinstance(msg, _COLLECTIVE):
            counts[type(msg).__name__] += 1
        return handle(peer_id, msg, now)  # type: ignore[return-value]

    state.handle = counting  # type: ignore[assignment, method-assign]
    return counts


def fresh(n: int, count: int = 1024) -> list[np.ndarray]:
    return [np.arange(count, dtype=np.int64) * (i + 1) for i in range(n)]


async def all_reduce_all(cl: TestCluster, bufs: list[np.ndarray],
                         tag: int = 1) -> list[pccl.ReduceInfo | pccl.PCCLError]:
    return await cl.run_all(lambda i, c: c.all_reduce(bufs[i], tag=tag), indexes=list(range(len(bufs))))


def expect_sum(bufs: list[np.ndarray], before: list[np.ndarray]) -> None:
    total = sum(before)
    assert all(np.array_equal(b, total) for b in bufs)


async def test_a_steady_4k_all_reduce_costs_one_master_round_trip_instead_of_two(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(4, network=VirtualNetwork(latency=0.025)) as cl:
        got = [count_received(c) for c in cl.peers]
        sent = count_sent(cl)
        took: list[float] = []
        for k in range(3):
            bufs = fresh(4)
            before = [b.copy() for b in bufs]
            t0 = trio.current_time()
            res = await all_reduce_all(cl, bufs)
            took.append(trio.current_time() - t0)
            assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
            expect_sum(bufs, before)
            if k == 0:
                # the first op of a tag: vote -> commence, done -> complete (two round trips)
                assert all(g == {"CollectiveCommence": 1, "CollectiveComplete": 1} for g in got), got
            else:
                # reserved number: the data plane starts on the vote and waits for one answer (one
                # round trip); the tableless go comes meanwhile
                want = {"CollectiveCommence": 1, "go": k, "CollectiveComplete": k + 1}
                assert all(g == want for g in got), got
            assert sent == {"CollectiveInitiate": 4 * (k + 1), "CollectiveDone": 4 * (k + 1)}
        assert cl.master.state.statistics()["collectives_fast"] == 2
        assert all(c.statistics()["speculative_starts"] == 2 for c in cl.peers)
        # (virtual: 250 ms, then 200 ms: the ring's 6 steps of 25 ms plus one master round trip of 50 ms)
        assert took[1] < took[0] and took[1] == took[2]


async def test_a_member_leaving_during_a_speculative_op_aborts_it_buffers_intact_and_the_retry_is_exact(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.005), master_config=GO_AT_ONCE) as cl:
        bufs = fresh(3)
        await all_reduce_all(cl, bufs)  # reserves the next number of tag 1
        got = [count_received(c) for c in cl.peers]
        bufs = fresh(3)
        before = [b.copy() for b in bufs]
        results: list[object] = [None, None]

        async def one(i: int) -> None:
            try:
                results[i] = await cl.peer(i).all_reduce(bufs[i], tag=1)
            except pccl.PCCLError as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            for i in (0, 1):
                nursery.start_soon(one, i)
            await trio.sleep(0.5)  # peers 0 and 1 run speculatively, waiting for peer 2's data
            assert all(c.statistics()["ops"] == {1: c.statistics()["ops"][1]} for c in cl.peers[:2])
            assert all(c.statistics()["ops"][1] >= 0 for c in cl.peers[:2])  # started under the number
            cl.kill(2)
        assert all(isinstance(r, pccl.RankConnectionLostError) for r in results), results
        assert all(np.array_equal(b, b0) for b, b0 in zip(bufs[:2], before[:2], strict=True))
        # the retry takes the slow path on the smaller ring, exactly
        res = await all_reduce_all(cl, bufs[:2])
        assert all(isinstance(r, pccl.ReduceInfo) and r.local_world_size == 2 for r in res), res
        expect_sum(bufs[:2], before[:2])
        assert all(g["CollectiveCommence"] == 1 for g in got[:2]), got
        # and the one after is fast again
        res = await all_reduce_all(cl, bufs[:2])
        assert all(isinstance(r, pccl.ReduceInfo) for r in res)
        assert all(g["CollectiveCommence"] == 1 and g["go"] == 1 and g["CollectiveComplete"] == 2
                   for g in got[:2]), got
        assert all(c.statistics()["pool"]["stashed_bytes"] == 0 for c in cl.peers[:2])


async def test_a_newcomer_during_a_speculative_op_waits_and_its_admission_resets_to_the_slow_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.005), master_config=GO_AT_ONCE) as cl:
        bufs = fresh(3)
        await all_reduce_all(cl, bufs)
        got = [count_received(c) for c in cl.peers]
        bufs = fresh(3)
        before = [b.copy() for b in bufs]
        newcomer: list[int] = []

        async def late(i: int, c: Communicator) -> pccl.ReduceInfo:
            if i == 2:
                # the newcomer registers while peers 0 and 1 already run speculatively
                while cl.master.state.statistics()["registered"] == 0:
                    await trio.sleep(0.01)
            return await c.all_reduce(bufs[i], tag=1)

        async with trio.open_nursery() as nursery:

            async def join() -> None:
                newcomer.append(await cl.add_peer(admit=False))

            nursery.start_soon(join)
            res = await cl.run_all(late, indexes=[0, 1, 2])
            assert all(isinstance(r, pccl.ReduceInfo) and r.local_world_size == 3 for r in res), res
            expect_sum(bufs, before)
            assert all(g == {"go": 1, "CollectiveComplete": 1} for g in got), got  # it ran fast
            # admitting it changes the epoch: the next op takes the slow path, with four peers
            await cl.run_all(lambda i, c: c.update_topology(), indexes=[0, 1, 2])
        assert len(newcomer) == 1
        got.append(count_received(cl.peer(newcomer[0])))
        bufs = fresh(4)
        before = [b.copy() for b in bufs]
        for _ in range(2):
            res = await all_reduce_all(cl, bufs)
            assert all(isinstance(r, pccl.ReduceInfo) and r.local_world_size == 4 for r in res), res
            expect_sum(bufs, before)
            before = [b.copy() for b in bufs]
        assert all(g["CollectiveCommence"] == 1 for g in got), got  # slow once, then fast


async def test_a_descriptor_mismatch_during_a_speculative_op_aborts_it_and_no_frame_lands_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.005)) as cl:
        await all_reduce_all(cl, fresh(3))
        bufs = fresh(3)
        bufs[2] = bufs[2][:512].copy()  # peer 2 disagrees on the element count
        before = [b.copy() for b in bufs]
        res = await all_reduce_all(cl, bufs)
        assert all(isinstance(r, pccl.InvalidArgumentError) for r in res), res
        assert all(np.array_equal(b, b0) for b, b0 in zip(bufs, before, strict=True))
        # the frames the speculative attempts sent before the abort never reach the retry's buffers
        bufs = fresh(3, count=1024)
        before = [b.copy() for b in bufs]
        for _ in range(2):  # slow, then fast
            res = await all_reduce_all(cl, bufs)
            assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
            expect_sum(bufs, before)
            before = [b.copy() for b in bufs]
        assert cl.master.state.statistics()["collectives_fast"] == 1  # op 4 (op 2's number was spent)
        assert all(c.statistics()["pool"]["stashed_bytes"] == 0 for c in cl.peers)


async def test_a_peer_that_votes_long_after_the_others_is_no_stall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=5.0)
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=cfg) as cl:
        bufs = fresh(3)
        await all_reduce_all(cl, bufs)
        bufs = fresh(3)
        before = [b.copy() for b in bufs]

        async def late(i: int, c: Communicator) -> pccl.ReduceInfo:
            if i == 1:
                await trio.sleep(60)  # computes far longer than the stall timeout
            return await c.all_reduce(bufs[i], tag=1)

        res = await cl.run_all(late)
        assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
        expect_sum(bufs, before)
        assert cl.master.state.statistics()["collectives_fast"] == 1


async def test_concurrent_tags_each_run_on_their_own_reserved_numbers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.002)) as cl:
        for rnd in range(3):
            bufs = [[np.full(300 + 7 * t, (i + 1) * (t + 1) + rnd, np.int64) for t in range(4)]
                    for i in range(3)]
            before = [[b.copy() for b in row] for row in bufs]
            res = await cl.run_all(lambda i, c: c.all_reduce_multiple_with_retry(
                [(b, b, pccl.ReduceOp.SUM) for b in bufs[i]], max_in_flight=4, base_tag=10))
            assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
            for t in range(4):
                total = sum(before[i][t] for i in range(3))
                assert all(np.array_equal(bufs[i][t], total) for i in range(3))
        assert cl.master.state.statistics()["collectives_fast"] == 8  # rounds 2 and 3, 4 tags each


async def test_a_peer_that_missed_the_last_confirmation_joins_the_others_under_their_number(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.005)) as cl:
        await all_reduce_all(cl, fresh(3))
        # as if peer 1 had cancelled its call after reporting success: it holds no reservation
        cl.peer(1)._core.drop_reservations()
        got = [count_received(c) for c in cl.peers]
        bufs = fresh(3)
        before = [b.copy() for b in bufs]
        res = await all_reduce_all(cl, bufs)
        assert all(isinstance(r, pccl.ReduceInfo) for r in res), res
        expect_sum(bufs, before)
        assert got[1] == {"CollectiveCommence": 1, "CollectiveComplete": 1}  # commenced under the number
        assert got[0] == got[2] == {"go": 1, "CollectiveComplete": 1}  # the others never waited
        assert cl.master.state.statistics()["collectives_fast"] == 1


async def test_a_member_lost_between_operations_costs_the_next_call_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.005)) as cl:
        await all_reduce_all(cl, fresh(3))
        cl.kill(2)
        while cl.is_member(2):
            await trio.sleep(0.01)
        await trio.sleep(0.1)  # the revocation reaches the survivors
        assert all(c.statistics()["reserved_tags"] == 0 for c in cl.peers[:2])
        got = [count_received(c) for c in cl.peers[:2]]
        bufs = fresh(2)
        before = [b.copy() for b in bufs]
        res = await all_reduce_all(cl, bufs)
        assert all(isinstance(r, pccl.ReduceInfo) and r.local_world_size == 2 for r in res), res
        expect_sum(bufs, before)
        # the slow path, and no abort
        assert all(g == {"CollectiveCommence": 1, "CollectiveComplete": 1} for g in got), got
