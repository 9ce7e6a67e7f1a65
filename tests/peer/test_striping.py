"""Connections per partner sized from the round trip (``p2p_connection_pool_size`` 0, the default):
the pure count, the pool on the virtual network, and an all-reduce over a long fat link."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio
import trio.testing

from pccl import PeerConfig, RankConnectionFailedError
from pccl.peer.p2p import serve_p2p
from pccl.peer.pool import P2PPool
from pccl.peer.striping import stripe_count
from pccl.testing import VirtualNetwork, open_test_cluster, wait_until
from pccl.testing.cluster import DEFAULT_PEER_CONFIG

MIB = 1 << 20
GBIT = 125e6


def test_stripe_count_follows_the_bandwidth_delay_product() -> None:
    w = 4 * MIB
    assert stripe_count(50e-6, window_bytes=w, target_bytes_per_s=GBIT, max_stripes=16) == 1  # loopback
    assert stripe_count(1e-3, window_bytes=w, target_bytes_per_s=GBIT, max_stripes=16) == 1  # LAN
    assert stripe_count(0.05, window_bytes=w, target_bytes_per_s=GBIT, max_stripes=16) == 3
    assert stripe_count(0.1, window_bytes=w, target_bytes_per_s=GBIT, max_stripes=16) == 5
    assert stripe_count(0.1, window_bytes=w, target_bytes_per_s=10 * GBIT, max_stripes=16) == 16
    # unknown round trip or window: one connection
    for rtt in (0.0, -1.0, float("nan")):
        assert stripe_count(rtt, window_bytes=w, target_bytes_per_s=GBIT, max_stripes=16) == 1
    assert stripe_count(0.1, window_bytes=0, target_bytes_per_s=GBIT, max_stripes=16) == 1
    with pytest.raises(ValueError):
        stripe_count(0.1, window_bytes=w, target_bytes_per_s=GBIT, max_stripes=0)


def test_config_bounds() -> None:
    with pytest.raises(ValueError):
        PeerConfig(p2p_stripe_target_mbit=0)
    with pytest.raises(ValueError):
        PeerConfig(p2p_max_stripes=0)


@asynccontextmanager
async def two_pools(net: VirtualNetwork, pool_size: int, config: PeerConfig) -> AsyncIterator[
        tuple[P2PPool, P2PPool, tuple[str, int]]]:
    async with trio.open_nursery() as nursery:
        a = P2PPool(transport=net.host("a"), my_peer_id=1, pool_size=pool_size, config=config)
        b = P2PPool(transport=net.host("b"), my_peer_id=2, pool_size=pool_size, config=config)
        serve = functools.partial(serve_p2p, config=config)
        addr = await nursery.start(serve, b.transport, net.host("b").address, 0, {"ring": b.handle_incoming})
        try:
            yield a, b, addr
        finally:
            await a.aclose()
            await b.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("one_way", "pool_size", "expected"), [
    (0.0005, 0, 1),  # a LAN: one connection, as before
    (0.025, 0, 3),  # 50 ms round trip, 4 MiB windows, 1000 Mbit/s target
    (0.05, 0, 5),  # 100 ms
    (0.05, 2, 2),  # an explicit pool size is honoured
])
async def test_pool_sizes_each_partner_from_its_round_trip(
    autojump_clock: trio.testing.MockClock, one_way: float, pool_size: int, expected: int
) -> None:
    net = VirtualNetwork(latency=one_way)
    cfg = PeerConfig(connect_timeout=5.0)
    async with two_pools(net, pool_size, cfg) as (a, b, addr):
        assert a.stripes(2) == max(1, pool_size)  # before connecting: the configured size
        await a.connect(2, *addr)
        assert a.stripes(2) == expected
        assert a.is_connected(2)
        await wait_until(lambda: b.statistics()["incoming"].get(1, 0) == expected)
        # connect() again keeps them; a lost one is reopened at the same count
        await a.connect(2, *addr)
        assert a.statistics()["outgoing"][2] == expected


async def test_a_failed_first_connection_is_sized_on_the_retry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.025)
    cfg = PeerConfig(connect_timeout=1.0)
    async with two_pools(net, 0, cfg) as (a, _b, addr):
        net.partition("a", "b")
        with pytest.raises(RankConnectionFailedError):
            await a.connect(2, *addr)
        assert not a.is_connected(2)
        net.heal()
        await a.connect(2, *addr)
        assert a.stripes(2) == 3 and a.is_connected(2)


async def test_target_and_cap_come_from_the_config(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.05)
    cfg = PeerConfig(connect_timeout=5.0, p2p_stripe_target_mbit=10_000, p2p_max_stripes=7)
    async with two_pools(net, 0, cfg) as (a, _b, addr):
        await a.connect(2, *addr)
        assert a.stripes(2) == 7


async def _timed_all_reduce(pool_size: int) -> tuple[float, list[int], np.ndarray]:
    # 100 ms round trip, 1 MiB windows: one connection carries ~10 MB/s
    net = VirtualNetwork(latency=0.05, buffer_size=MIB)
    async with open_test_cluster(2, network=net, pool_size=pool_size, config=DEFAULT_PEER_CONFIG) as cl:
        xs = [np.full(8 * MIB, i + 1, np.float32) for i in range(2)]
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for c, x in zip(cl.peers, xs, strict=True):
                nursery.start_soon(functools.partial(c.all_reduce, x))
        dt = trio.current_time() - t0
        outgoing = [max(c.pool.statistics()["outgoing"].values()) for c in cl.peers]
        return dt, outgoing, xs[0]


async def test_default_all_reduce_stripes_over_a_long_fat_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    one, one_out, x1 = await _timed_all_reduce(1)
    auto, auto_out, x2 = await _timed_all_reduce(0)
    assert one_out == [1, 1]
    assert auto_out == [16, 16]  # 1000 Mbit/s * 100 ms / (0.6 MiB) > 16: the cap
    assert np.all(x1 == 3) and np.all(x2 == 3)
    # 32 MiB per peer each way over one 1 MiB window per 100 ms takes ~3.4 s; the operation's 4 MiB
    # blocks (four per step here) go out on four connections at once
    assert auto < one / 3
