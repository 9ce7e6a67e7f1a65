"""The cluster harness (pccl.testing.open_test_cluster) and its pytest fixtures.

Virtual-network tests request ``autojump_clock``: heartbeat timeouts cost no real time, and the
virtual times asserted here are exact consequences of the configuration (2 s heartbeat timeout,
0.2 s interval, 1 ms links), not measurements of a machine.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import Attribute, MasterConfig, PeerConfig
from pccl.peer.communicator import Communicator
from pccl.testing import (
    DEFAULT_MASTER_CONFIG,
    DEFAULT_PEER_CONFIG,
    MASTER,
    PeerStatus,
    TestCluster,
    UnsupportedFault,
    VirtualNetwork,
    open_test_cluster,
    wait_until,
)
from pccl.testing.pytest_plugin import ClusterFactory

HB_TIMEOUT = DEFAULT_MASTER_CONFIG.heartbeat_timeout
# The tests of a final master loss opt out of reconnecting (PeerConfig's default window is 60 s).
NO_RECONNECT = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=0)
HB_INTERVAL = DEFAULT_MASTER_CONFIG.heartbeat_interval
DOCS = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


async def sum_all(
    cluster: TestCluster, indexes: list[int] | None = None, tag: int = 0
) -> dict[int, tuple[int, int] | pccl.PCCLError]:
    """All-reduce (SUM) of each peer's id on ``indexes``: returns index -> (world size, sum) or the error."""

    async def one(i: int, comm: Communicator) -> tuple[int, int]:
        buf = np.full(8, comm.peer_id, np.int64)
        info = await comm.all_reduce(buf, tag=tag)
        return info.local_world_size, int(buf[0])

    idx = cluster.alive if indexes is None else indexes
    return dict(zip(idx, await cluster.run_all(one, indexes=idx), strict=True))


def worlds(results: dict[int, tuple[int, int] | pccl.PCCLError]) -> set[int]:
    """The world sizes the calls ran with (an error counts as -1)."""
    return {r[0] if isinstance(r, tuple) else -1 for r in results.values()}


# ----------------------------------------------------------------------------------------------
# basics


async def test_virtual_cluster_layout(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.001)
    async with open_test_cluster(3, network=net) as cluster:
        assert cluster.alive == [0, 1, 2]
        ids = [c.peer_id for c in cluster.peers]
        assert ids == sorted(ids) and len(set(ids)) == 3  # registered one by one, in index order
        assert all(c.world_size == 3 for c in cluster.peers)
        assert len({tuple(c.group_ring) for c in cluster.peers}) == 1  # everyone has the same table
        names = [cluster.host(i).name for i in range(3)]
        assert names == ["peer0", "peer1", "peer2"] and cluster.host(MASTER).name == "master"
        addresses = {cluster.host(i).address for i in range(3)} | {cluster.host(MASTER).address}
        assert len(addresses) == 4  # one machine each
        assert cluster.master_address.startswith(cluster.host(MASTER).address + ":")
        for i in range(3):
            comm = cluster.peer(i)
            assert comm.transport is cluster.host(i)
            assert comm.p2p_address is not None and comm.p2p_address[0] == cluster.host(i).address
            assert comm.config.heartbeat_timeout == DEFAULT_PEER_CONFIG.heartbeat_timeout
            assert cluster.status(i) is PeerStatus.UP and cluster.is_member(i)
            assert cluster.index_of(comm) == i
        assert cluster.master.statistics()["accepted"] == 3
        assert "virtual" in repr(cluster) and "'up': 3" in repr(cluster)
        results = await sum_all(cluster)
        assert set(results.values()) == {(3, sum(ids))}


async def test_zero_peers_then_add(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(0, network=VirtualNetwork()) as cluster:
        assert cluster.peers == [] and cluster.alive == []
        assert await cluster.add_peer() == 0  # the first peer is accepted alone
        assert await cluster.add_peer() == 1  # the second is admitted by peer 0's update_topology
        assert [c.world_size for c in cluster.peers] == [2, 2]


async def test_loopback_tcp_cluster() -> None:
    """network=None: real sockets on 127.0.0.1 (real clock); kill works, hang/partition refuse clearly."""
    async with open_test_cluster(3, network=None) as cluster:
        assert cluster.network is None and cluster.master_address.startswith("127.0.0.1:")
        assert all(c.p2p_address is not None and c.p2p_address[0] == "127.0.0.1" for c in cluster.peers)
        results = await sum_all(cluster)
        ids = [c.peer_id for c in cluster.peers]
        assert set(results.values()) == {(3, sum(ids))}
        for fault in (lambda: cluster.hang(0), lambda: cluster.partition(0, 1), lambda: cluster.partition(0),
                      cluster.heal, cluster.hang_master, lambda: cluster.host(0)):
            with pytest.raises(UnsupportedFault, match="needs a virtual network"):
                fault()
        assert isinstance(UnsupportedFault("x"), NotImplementedError)
        cluster.kill(2)
        await wait_until(lambda: not cluster.is_member(2), interval=0.01)
        results = await sum_all(cluster)
        assert set(results.values()) == {(2, ids[0] + ids[1])}


# ----------------------------------------------------------------------------------------------
# faults, one at a time


async def test_kill_crashes_host_and_cancels_tasks(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(4, network=VirtualNetwork(latency=0.001)) as cluster:
        cancelled = trio.Event()

        async def victim_task() -> None:
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()

        cluster.start_soon(1, victim_task)
        await trio.sleep(0.01)
        victim = cluster.peer(1)
        cluster.kill(1)
        assert cluster.status(1) is PeerStatus.KILLED and not cluster.host(1).alive
        assert cluster.alive == [0, 2, 3]
        await cancelled.wait()
        # The crash resets its connections: the master drops it after one link latency, not a heartbeat.
        assert await wait_until(lambda: not cluster.is_member(1)) < 0.01
        with pytest.raises(pccl.PCCLError):
            await victim.all_reduce(np.ones(4, np.int64))
        with pytest.raises(RuntimeError, match="killed"):
            cluster.start_soon(1, victim_task)
        results = await sum_all(cluster)
        assert worlds(results) == {3}
        cluster.kill(1)  # idempotent
        assert cluster.peers[1] is victim  # indexes are stable


async def test_hang_is_evicted_by_heartbeat(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001), config=NO_RECONNECT) as cluster:
        cluster.hang(2)
        assert cluster.status(2) is PeerStatus.HUNG and cluster.host(2).hung and cluster.alive == [0, 1]
        waited = await wait_until(lambda: not cluster.is_member(2))
        assert HB_TIMEOUT - HB_INTERVAL <= waited <= HB_TIMEOUT + HB_INTERVAL
        results = await sum_all(cluster)
        assert worlds(results) == {2}
        # Once resumed it finds out it was dropped: its calls fail with MASTER_CONNECTION_FAILED.
        cluster.unhang(2)
        assert cluster.status(2) is PeerStatus.UP
        await wait_until(lambda: not cluster.peer(2).statistics()["master_ok"])
        with pytest.raises(pccl.MasterConnectionError):
            await cluster.peer(2).are_peers_pending()


async def test_partition_two_peers_stalls_until_heal(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001)) as cluster:
        net = cluster.network
        assert net is not None
        cluster.partition(0, 1)
        assert net.is_partitioned(cluster.host(0), cluster.host(1))
        assert net.is_partitioned(cluster.host(1), cluster.host(0))
        done: dict[int, tuple[int, int] | pccl.PCCLError] = {}

        async def run() -> None:
            done.update(await sum_all(cluster))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await trio.sleep(5.0)  # longer than the heartbeat timeout: nobody is evicted
            assert not done and all(cluster.is_member(i) for i in range(3))
            cluster.heal()
        assert net.statistics().partitions == ()
        assert worlds(done) == {3}


async def test_partition_from_master_is_evicted(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001)) as cluster:
        cluster.partition(1, MASTER)
        waited = await wait_until(lambda: not cluster.is_member(1))
        assert HB_TIMEOUT - HB_INTERVAL <= waited <= HB_TIMEOUT + HB_INTERVAL
        assert cluster.status(1) is PeerStatus.UP  # the harness only cut a link
        results = await sum_all(cluster, [0, 2])
        assert worlds(results) == {2}
        cluster.heal(1, MASTER)
        assert cluster.network is not None and cluster.network.statistics().partitions == ()


async def test_isolation_covers_peers_added_later(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001)) as cluster:
        net = cluster.network
        assert net is not None
        cluster.partition(0)
        assert net.is_partitioned(cluster.host(0), cluster.host(MASTER))
        t0 = trio.current_time()
        new = await cluster.add_peer()  # the admission vote waits until peer 0 is evicted
        assert trio.current_time() - t0 >= HB_TIMEOUT - HB_INTERVAL
        assert net.is_partitioned(cluster.host(0), cluster.host(new))
        assert not cluster.is_member(0) and cluster.is_member(new)
        results = await sum_all(cluster, [1, 2, new])
        assert worlds(results) == {3}
        cluster.heal(0)
        assert net.statistics().partitions == ()
        with pytest.raises(ValueError):
            cluster.partition(0, oneway=True)


async def test_oneway_partition(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(2, network=VirtualNetwork()) as cluster:
        net = cluster.network
        assert net is not None
        cluster.partition(0, 1, oneway=True)
        assert net.is_partitioned(cluster.host(0), cluster.host(1))
        assert not net.is_partitioned(cluster.host(1), cluster.host(0))
        cluster.heal(0, 1)
        assert not net.is_partitioned(cluster.host(0), cluster.host(1))


async def test_leave_is_graceful(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.001)) as cluster:
        await cluster.leave(2)
        assert cluster.status(2) is PeerStatus.LEFT and cluster.host(2).alive
        assert await wait_until(lambda: not cluster.is_member(2)) < 0.01  # no heartbeat wait
        results = await sum_all(cluster)
        assert worlds(results) == {2}


@pytest.mark.parametrize("how", ["kill", "hang"])
async def test_master_faults(autojump_clock: trio.testing.MockClock, how: str) -> None:
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.001), config=NO_RECONNECT) as cluster:
        t0 = trio.current_time()
        if how == "kill":
            cluster.kill_master()
            assert not cluster.host(MASTER).alive
        else:
            cluster.hang_master()
        results = await sum_all(cluster)
        took = trio.current_time() - t0
        for err in results.values():
            assert isinstance(err, pccl.MasterConnectionError)
            assert err.result == pccl.Result.MASTER_CONNECTION_FAILED
        assert took <= (0.01 if how == "kill" else HB_TIMEOUT + HB_INTERVAL)
        if how == "kill":
            assert not cluster.is_member(0)
            with pytest.raises(pccl.MasterConnectionError):
                await cluster.add_peer()


# ----------------------------------------------------------------------------------------------
# membership, groups, configuration


async def test_add_peer_admitted_by_the_harness_or_by_a_training_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.001)) as cluster:
        third = await cluster.add_peer()
        assert third == 2 and cluster.peer(2).peer_id > cluster.peer(1).peer_id
        assert all(c.world_size == 3 for c in cluster.peers)

        # admit=False: the running peers admit it themselves, like a training loop does.
        stop = trio.Event()

        async def loop(i: int) -> None:
            comm = cluster.peer(i)
            while not stop.is_set():
                if await comm.are_peers_pending():
                    await comm.update_topology()
                await trio.sleep(0.01)

        for i in cluster.alive:
            cluster.start_soon(i, loop, i)
        fourth = await cluster.add_peer(admit=False)
        stop.set()
        assert cluster.peer(fourth).world_size == 4 and cluster.is_member(fourth)


async def test_groups_and_pool_size(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.001)
    async with open_test_cluster(4, network=net, groups=[0, 1, 0, 1], pool_size=3) as cl:
        for c in cl.peers:
            assert c.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 4
            assert c.get_attribute(Attribute.PEER_GROUP_WORLD_SIZE) == 2
            assert c.get_attribute(Attribute.NUM_DISTINCT_PEER_GROUPS) == 2
            assert c.pool_size == 3
        results = await sum_all(cl)
        ids = [c.peer_id for c in cl.peers]
        assert results[0] == results[2] == (2, ids[0] + ids[2])
        assert results[1] == results[3] == (2, ids[1] + ids[3])
        assert cl.peer(0).pool.statistics()["outgoing"] == {ids[2]: 3}
        i = await cl.add_peer(group=1)
        assert cl.peer(i).get_attribute(Attribute.PEER_GROUP_WORLD_SIZE) == 3


async def test_custom_configs(autojump_clock: trio.testing.MockClock) -> None:
    master_cfg = MasterConfig(heartbeat_interval=0.5, heartbeat_timeout=5.0)
    peer_cfg = PeerConfig(heartbeat_interval=0.5, heartbeat_timeout=5.0, p2p_listen_host="0.0.0.0")
    net = VirtualNetwork()
    async with open_test_cluster(3, network=net, config=peer_cfg, master_config=master_cfg) as cl:
        assert cl.master_config is master_cfg and cl.peer_config is peer_cfg
        comm = cl.peer(0)
        assert comm.config.heartbeat_timeout == 5.0
        assert comm.config.p2p_listen_host == cl.host(0).address  # the harness binds the host's address
        cl.hang(1)
        waited = await wait_until(lambda: not cl.is_member(1))
        assert 4.5 <= waited <= 5.5
    with pytest.raises(ValueError):
        async with open_test_cluster(2, groups=[0]):
            pass
    with pytest.raises(ValueError):
        async with open_test_cluster(1, pool_size=-1):
            pass


async def test_two_clusters_share_a_network(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.001)
    async with open_test_cluster(2, network=net) as a, open_test_cluster(2, network=net) as b:
        assert b.host(MASTER).name == "c2-master" and b.host(0).name == "c2-peer0"
        assert a.host(0).name == "peer0"
        assert set((await sum_all(a)).values()) == {(2, sum(c.peer_id for c in a.peers))}
        assert set((await sum_all(b)).values()) == {(2, sum(c.peer_id for c in b.peers))}


# ----------------------------------------------------------------------------------------------
# errors surface as themselves


async def test_task_error_surfaces_unwrapped(autojump_clock: trio.testing.MockClock) -> None:
    async def broken() -> None:
        await trio.sleep(0.1)
        raise KeyError("from a peer task")

    with pytest.raises(KeyError, match="from a peer task"):
        async with open_test_cluster(2, network=VirtualNetwork()) as cluster:
            cluster.start_soon(1, broken)
            await trio.sleep_forever()


async def test_body_error_surfaces_unwrapped(autojump_clock: trio.testing.MockClock) -> None:
    with pytest.raises(ZeroDivisionError):
        async with open_test_cluster(2, network=VirtualNetwork()):
            _ = 1 / 0


async def test_run_all_returns_errors(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(1, network=VirtualNetwork()) as cluster:
        (err,) = await cluster.run_all(lambda i, c: c.all_reduce(np.ones(2, np.float32)))
        assert isinstance(err, pccl.TooFewPeersError)


# ----------------------------------------------------------------------------------------------
# the fixtures


async def test_fixtures(
    autojump_clock: trio.testing.MockClock, pccl_network: VirtualNetwork, pccl_cluster: ClusterFactory
) -> None:
    cluster = await pccl_cluster(2)
    assert cluster.network is pccl_network
    assert pccl_network.link(cluster.host(0), cluster.host(1)).latency == 0.001
    other = await pccl_cluster(3, groups=[0, 0, 1], pool_size=2)
    assert other.network is pccl_network and other.host(0).name == "c2-peer0"
    assert [c.peer_group for c in other.peers] == [0, 0, 1]


async def test_tcp_cluster_fixture(pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(2, network=None)
    assert cluster.network is None
    assert set((await sum_all(cluster)).values()) == {(2, sum(c.peer_id for c in cluster.peers))}


# --- docs/testing.md example: begin ---
import numpy as np  # noqa: E402, F811
import trio  # noqa: E402

import pccl  # noqa: E402, F811


async def test_training_survives_a_hung_peer(autojump_clock, pccl_cluster):  # type: ignore[no-untyped-def]
    cluster = await pccl_cluster(3)  # a master and 3 peers, each on its own virtual host
    results = {}

    async def train(i, comm):  # type: ignore[no-untyped-def]
        weights = np.zeros(4, np.float32)
        state = pccl.SharedState([pccl.TensorInfo.from_numpy(weights, "weights")])
        while state.revision < 20:
            try:
                if await comm.are_peers_pending():
                    await comm.update_topology()
                await comm.sync_shared_state(state)
                grad = np.ones(4, np.float32)
                info = await comm.all_reduce(grad, op=pccl.ReduceOp.AVG)
            except (pccl.RankConnectionLostError, pccl.UpdateTopologyFailedError):
                continue  # a peer died: retry the step with the survivors
            except pccl.MasterConnectionError:
                return  # this peer was evicted
            weights -= 0.1 * grad
            state.revision += 1
        results[i] = (weights.tobytes(), info.local_world_size)

    async with trio.open_nursery() as nursery:
        for i in cluster.alive:
            nursery.start_soon(train, i, cluster.peer(i))
        await trio.sleep(0.1)  # virtual time: a few steps in
        cluster.hang(2)  # peer 2 freezes; the master evicts it after the heartbeat timeout
    assert results[0] == results[1] and results[0][1] == 2
    assert 2 not in results and trio.current_time() > 2.0
# --- docs/testing.md example: end ---


def test_docs_example_is_this_test() -> None:
    """docs/testing.md shows exactly the example above (minus the lint comments)."""
    source = Path(__file__).read_text()
    example = source.split("# --- docs/testing.md example: begin ---\n")[1]
    example = example.split("# --- docs/testing.md example: end")[0]
    example = re.sub(r"  # (noqa|type: ignore)[^\n]*", "", example).strip()
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert example in [b.strip() for b in blocks], "update docs/testing.md (or this test) so they match"
    assert len(example.splitlines()) <= 40
