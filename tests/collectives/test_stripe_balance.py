"""The connections of a stripe share one queue of ready frames: a slow connection carries fewer
frames instead of holding the operation up with its fixed share; and a striped ring plan takes its
receives in as they arrive, not in plan order. Virtual network, MockClock."""

from __future__ import annotations

import functools
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import trio
import trio.testing

from pccl import RankConnectionLostError
from pccl.collectives import ring as ring_mod
from pccl.collectives.schedule import SRC_OUT, SendFrame
from pccl.testing import VirtualNetwork, open_test_cluster
from pccl.testing.cluster import DEFAULT_PEER_CONFIG
from pccl.testing.network import Delay, TrafficEvent

MIB = 1 << 20
N = 8 * MIB  # float32 elements: 32 MiB, four 4 MiB blocks per ring step, over three connections


async def test_a_slow_connection_of_a_stripe_carries_fewer_frames(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.01)
    async with open_test_cluster(2, network=net, pool_size=3, config=DEFAULT_PEER_CONFIG) as cl:
        b = cl.peers[1]
        warm = [np.ones(4, np.float32) for _ in range(2)]
        async with trio.open_nursery() as nursery:  # connections open, the stripe is up
            for c, x in zip(cl.peers, warm, strict=True):
                nursery.start_soon(functools.partial(c.all_reduce, x))
        assert b.p2p_address is not None
        port = b.p2p_address[1]
        carried: Counter[int] = Counter()
        slow: list[int] = []

        def hook(ev: TrafficEvent) -> Delay | None:
            if ev.src != cl.host(0).name or ev.dst_address[1] != port:
                return None
            carried[ev.connection] += len(ev.data)
            if not slow:
                slow.append(ev.connection)
            # one connection of the three is far slower: every chunk waits 0.2 s more
            return Delay(0.2) if ev.connection == slow[0] else None

        net.add_hook(hook)  # type: ignore[arg-type]
        xs = [np.arange(N, dtype=np.float32) * (i + 1) for i in range(2)]
        async with trio.open_nursery() as nursery:
            for c, x in zip(cl.peers, xs, strict=True):
                nursery.start_soon(functools.partial(c.all_reduce, x))
        expected = np.arange(N, dtype=np.float32) * 3
        assert np.array_equal(xs[0], expected) and np.array_equal(xs[1], expected)
        assert len(carried) == 3
        others = [v for k, v in carried.items() if k != slow[0]]
        # frames dealt out by lane would give it a fixed share (2 or 4 of the 8 frames)
        assert carried[slow[0]] < min(others), carried


async def test_stripe_senders_share_one_queue_and_a_single_connection_keeps_lanes() -> None:
    frames = [SendFrame(seq=s, source=SRC_OUT, start=0, end=1, after=-1, lane=s % 4, step=0, peer=p)
              for s, p in ((0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 1))]
    queue_of, senders = ring_mod._shared_queues(frames, {0: 3, 1: 1}, tag=0)
    # partner 0 over a stripe of three: one queue, three senders on connections 0, 1, 2
    assert len({id(q) for q in queue_of[:4]}) == 1
    assert sorted(c for p, c, _q in senders if p == 0) == [0, 1, 2]
    assert all(q is queue_of[0] for p, _c, q in senders if p == 0)
    # partner 1 over one connection: one sender
    assert [(p, c) for p, c, _q in senders if p == 1] == [(1, 0)]
    assert queue_of[4] is queue_of[5] and queue_of[4] is not queue_of[0]


class _Slot:
    def __init__(self) -> None:
        self.event = trio.Event()
        self.error: Exception | None = None

    async def wait(self) -> None:
        await self.event.wait()
        if self.error is not None:
            raise self.error


class _FakeExec:
    def __init__(self, unlocks: tuple[tuple[int, ...], ...]) -> None:
        self.plan = SimpleNamespace(unlocks=unlocks)
        self.taken: list[int] = []

    def received(self, i: int) -> None:
        self.taken.append(i)


async def test_striped_ring_receives_are_taken_in_as_they_arrive() -> None:
    # receive i unlocks send 10 + i; they arrive in the order 2, 0, 1
    ex = _FakeExec(((10,), (11,), (12,)))
    slots = [_Slot() for _ in range(3)]
    released: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ring_mod._receive_in_arrival_order, ex, slots, released.append)  # type: ignore[arg-type]
        for i in (2, 0, 1):
            await trio.testing.wait_all_tasks_blocked()
            slots[i].event.set()
    assert ex.taken == [2, 0, 1]
    assert released == [12, 10, 11]  # receive 2's send left before receive 0 had arrived


async def test_a_failed_receive_is_raised_as_itself() -> None:
    ex = _FakeExec(((), ()))
    slots = [_Slot() for _ in range(2)]
    slots[1].error = RankConnectionLostError("gone")
    slots[1].event.set()
    with pytest.raises(RankConnectionLostError):
        await ring_mod._receive_in_arrival_order(ex, slots, lambda j: None)  # type: ignore[arg-type]
    assert ex.taken == []
