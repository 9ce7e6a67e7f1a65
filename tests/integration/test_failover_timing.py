"""How soon the run finds a restarted master (virtual network, MockClock): the peers' reconnect
backoff bounds the gap across a master kill (docs/history/benchmarks-churn-soak.md "With master kills")."""

from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np
import trio
import trio.testing

from pccl import MasterConfig, PeerConfig
from pccl.master.server import MasterHandle, open_master
from pccl.peer.communicator import Communicator, failover_order, open_communicator
from pccl.testing import TestCluster, VirtualHost, VirtualNetwork, open_test_cluster

from ._traffic import RECONNECTING_PEER as CONFIG


async def _reconnected_after(cluster: TestCluster, n: int) -> float:
    """Seconds until no peer of ``cluster`` is reconnecting any more."""
    t0 = trio.current_time()
    while any(cluster.peer(i).statistics()["reconnecting"] for i in range(n)):
        await trio.sleep(0.001)
    return trio.current_time() - t0


async def test_peers_find_a_master_restarted_seconds_later_within_a_tenth_of_a_second(
        autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        x = np.ones(16, np.float32)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(cluster.peer(i).all_reduce, x, np.empty_like(x))
        # The master is down for 3 s (its connects refused), then listens again: the peers' rounds
        # were 1 s apart by then (0.05 s doubling, capped), so one waited up to a second; with the
        # cap at 0.1 s (0.25 s before) they find it within one round.
        await cluster.restart_master(delay=3.0)
        took = await _reconnected_after(cluster, 3)
        assert took <= 0.11, took
        out = np.empty_like(x)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(cluster.peer(i).all_reduce, x, out if i == 0 else np.empty_like(x))
        assert out.tolist() == [3.0] * 16
        assert cluster.master.statistics()["generation"] == 2


def test_failover_order_tries_the_other_masters_first() -> None:
    a, b, c = ("h1", 1), ("h2", 2), ("h3", 3)
    assert failover_order([a, b, c], a) == [b, c, a]
    assert failover_order([a, b, c], b) == [c, a, b]
    assert failover_order([a, b, c], c) == [a, b, c]
    assert failover_order([a], a) == [a]
    assert failover_order([a, b], ("elsewhere", 9)) == [a, b]


async def test_a_hung_master_fails_over_to_the_standby_at_the_heartbeat_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    """The serving master's host hangs (its connections stay open and silent). Each peer gives it up
    once it heard nothing for its heartbeat timeout, to the millisecond, and re-registers with the
    standby at once: trying the hung master first would cost a connect timeout (5 s) more, and a
    watchdog that polls would notice up to a poll period late."""
    with trio.fail_after(60):
        await _hung_master_run(autojump_clock)


async def _hung_master_run(clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.001)
    # One master heartbeat per second and a peer heartbeat timeout of 2 s: the watchdog's old poll
    # period (a quarter of the timeout, 0.5 s) shows.
    mcfg = MasterConfig(heartbeat_interval=1.0, heartbeat_timeout=4.0)
    pcfg = dataclasses.replace(CONFIG, heartbeat_interval=1.0, heartbeat_timeout=2.0)
    async with trio.open_nursery() as nursery:
        masters: list[MasterHandle] = []
        for name in ("m1", "m2"):
            host = net.host(name)

            async def serve(host: VirtualHost = host,
                            task_status: trio.TaskStatus[MasterHandle] = trio.TASK_STATUS_IGNORED) -> None:
                async with open_master(f"{host.address}:0", config=mcfg, transport=host) as handle:
                    task_status.started(handle)
                    await trio.sleep_forever()

            masters.append(await nursery.start(serve))
        addresses = [mh.connect_address for mh in masters]
        boxes: list[Communicator] = []
        for i in range(3):
            host = net.host(f"peer{i}")
            config = dataclasses.replace(pcfg, p2p_listen_host=host.address)
            nursery.start_soon(_peer, addresses, config, host, boxes)
            while i == 0 and not boxes:  # the first is accepted alone; it admits the others
                await trio.sleep(0.01)
        while len(masters[0].state.registered()) < 2:
            await trio.sleep(0.01)
        await boxes[0].update_topology()
        while len(boxes) < 3 or any(c.world_size < 3 for c in boxes):
            await trio.sleep(0.01)
        comms = list(boxes)
        x = np.ones(16, np.float32)
        async with trio.open_nursery() as ops:
            for comm in comms:
                ops.start_soon(comm.all_reduce, x, np.empty_like(x))
        heard = trio.current_time()  # every peer just heard the master (the all-reduce's answers)
        await trio.sleep(0.3)  # between two master heartbeats
        net.hang("m1")
        host2, port2 = addresses[1].rsplit(":", 1)
        standby = (host2, int(port2))
        assert all((c.master_host, c.master_port) != standby for c in comms)
        with trio.fail_after(20):
            while any(c.statistics()["reconnecting"] or (c.master_host, c.master_port) != standby
                      for c in comms):
                await trio.sleep(0.001)
        took = trio.current_time() - heard
        # silent for 2 s after its last message (at most 0.3 s before the hang), then one round trip
        assert 2.0 < took <= 2.0 + 0.3 + 0.05, took
        out = np.empty_like(x)
        async with trio.open_nursery() as ops:
            for i, comm in enumerate(comms):
                ops.start_soon(comm.all_reduce, x, out if i == 0 else np.empty_like(x))
        assert out.tolist() == [3.0] * 16
        assert masters[1].statistics()["generation"] == 2
        nursery.cancel_scope.cancel()


async def _peer(addresses: list[str], config: PeerConfig, host: VirtualHost,
                boxes: list[Communicator]) -> None:
    # open_communicator reads the list but takes list[str | tuple[str, int]], which a list[str] is not
    async with open_communicator(cast("list[str | tuple[str, int]]", addresses), config=config,
                                 transport=host) as comm:
        boxes.append(comm)
        await trio.sleep_forever()
