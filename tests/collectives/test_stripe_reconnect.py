"""A lost connection in a stripe is reopened within the operation (its frames resent, copies of
frames that had arrived dropped), without failing it while the peer is alive; a dead peer still
fails the operation fast. Virtual network, MockClock."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import trio
import trio.testing

from pccl import PCCLError
from pccl.testing import VirtualNetwork, open_test_cluster
from pccl.testing.cluster import DEFAULT_PEER_CONFIG
from pccl.testing.network import Reset, TrafficEvent

MIB = 1 << 20
N = 8 * MIB  # float32 elements: 32 MiB, four 4 MiB blocks per ring step, over three connections


def _reset_one_connection(src: str, port: int, after: int) -> tuple[list[int], object]:
    """A hook resetting the first connection from ``src`` to ``port`` once ``after`` bytes went."""
    chosen: list[int] = []

    def hook(ev: TrafficEvent) -> Reset | None:
        if ev.src != src or ev.dst_address[1] != port:
            return None
        if not chosen:
            chosen.append(ev.connection)
        if len(chosen) > 1 or ev.connection != chosen[0] or ev.offset + len(ev.data) < after:
            return None
        chosen.append(-1)  # fired
        return Reset(max(0, after - ev.offset))

    return chosen, hook


@pytest.mark.parametrize("after", [1 * MIB, 6 * MIB])  # within the first frame; within the second
async def test_a_reset_connection_of_a_stripe_does_not_fail_the_operation(
    autojump_clock: trio.testing.MockClock, after: int
) -> None:
    net = VirtualNetwork(latency=0.01)
    async with open_test_cluster(2, network=net, pool_size=3, config=DEFAULT_PEER_CONFIG) as cl:
        a, b = cl.peers
        warm = [np.ones(4, np.float32) for _ in range(2)]
        async with trio.open_nursery() as nursery:  # connections open, the stripe is up
            for c, x in zip(cl.peers, warm, strict=True):
                nursery.start_soon(functools.partial(c.all_reduce, x))
        assert b.p2p_address is not None
        chosen, hook = _reset_one_connection(cl.host(0).name, b.p2p_address[1], after)
        net.add_hook(hook)  # type: ignore[arg-type]
        xs = [np.arange(N, dtype=np.float32) * (i + 1) for i in range(2)]
        async with trio.open_nursery() as nursery:
            for c, x in zip(cl.peers, xs, strict=True):
                nursery.start_soon(functools.partial(c.all_reduce, x))
        assert chosen[-1] == -1, "the hook did not fire"
        expected = np.arange(N, dtype=np.float32) * 3
        assert np.array_equal(xs[0], expected) and np.array_equal(xs[1], expected)
        assert b.pool.statistics()["connections_lost"] >= 1
        assert a.pool.statistics()["outgoing"][b.peer_id] == 3
        # and the next operation runs on the reopened stripe
        ys = [np.full(N, i + 1, np.float32) for i in range(2)]
        async with trio.open_nursery() as nursery:
            for c, y in zip(cl.peers, ys, strict=True):
                nursery.start_soon(functools.partial(c.all_reduce, y))
        assert np.all(ys[0] == 3) and np.all(ys[1] == 3)


async def test_a_dead_peer_still_fails_the_operation_fast(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.01)
    async with open_test_cluster(2, network=net, pool_size=3, config=DEFAULT_PEER_CONFIG) as cl:
        a, b = cl.peers
        assert b.p2p_address is not None
        port = b.p2p_address[1]
        killed = trio.Event()

        def hook(ev: TrafficEvent) -> None:
            if ev.src == cl.host(0).name and ev.dst_address[1] == port and ev.offset > 6 * MIB:
                killed.set()

        net.add_hook(hook)  # type: ignore[arg-type]
        x = np.ones(N, np.float32)
        before = x.copy()
        failed_after: list[float] = []

        async def run_a() -> None:
            t0 = trio.current_time()
            with pytest.raises(PCCLError):
                await a.all_reduce(x)
            failed_after.append(trio.current_time() - t0)

        async def run_b() -> None:
            with pytest.raises(PCCLError):  # killed under it
                await b.all_reduce(np.ones(N, np.float32))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_a)
            nursery.start_soon(run_b)
            await killed.wait()
            cl.kill(1)
        assert np.array_equal(x, before)  # the failed call left the buffer as it was
        # well before p2p_stall_timeout: the reopen is refused by the dead host
        assert failed_after[0] < DEFAULT_PEER_CONFIG.p2p_stall_timeout / 2
