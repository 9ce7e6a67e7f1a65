"""TLS on real loopback sockets (issue 17, item 3): mutual-TLS all-reduces exact (large buffers, several
connections per neighbour, through the P2P pool's generic path, not the raw-socket fast path), shared-state
sync and bandwidth measurement over TLS, refused certificates and a TLS/plain mismatch on real TCP, and the
blocking API with TLS. The virtual-network tests are in tests/security/test_tls.py."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import trio

from pccl import SharedStateSyncInfo
from pccl import SharedStateSyncStrategy as S
from pccl._errors import MasterConnectionError
from pccl.blocking import Communicator as BlockingCommunicator
from pccl.blocking import MasterNode, ReduceOp
from pccl.peer.communicator import Communicator, open_communicator
from pccl.peer.ring_conn import SocketConn
from pccl.peer.shared_state import SharedState, TensorInfo
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.testing.tls import Certs
from pccl.transport import TlsStream

N = 1 << 20  # float32 elements: 4 MiB per buffer, many TLS records and several 256 KiB send slices


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return Certs(tmp_path)


async def _all_reduce_exact(cluster: TestCluster, n: int = N, tag: int = 0) -> None:
    async def one(i: int, comm: Communicator) -> np.ndarray:
        x = np.arange(n, dtype=np.float32) % 251 + comm.peer_id
        await comm.all_reduce(x, tag=tag)
        return x

    results = await cluster.run_all(one)
    ids = [c.peer_id for c in cluster.live_peers]
    want = (np.arange(n, dtype=np.float32) % 251) * len(ids) + sum(ids)
    for x in results:
        assert isinstance(x, np.ndarray), x
        assert x.tobytes() == want.tobytes()


@pytest.mark.parametrize("mutual", [False, True])
async def test_all_reduce_exact_over_tls_on_loopback_without_the_fast_path(
    pccl_cluster: ClusterFactory, certs: Certs, mutual: bool
) -> None:
    master_cfg = certs.master(DEFAULT_MASTER_CONFIG, mutual=mutual)
    cluster = await pccl_cluster(3, network=None, master_config=master_cfg,
                                 config=dataclasses.replace(certs.peer(DEFAULT_PEER_CONFIG), schedule="ring"),
                                 pool_size=2)  # ring only: halving-doubling partners would add connections
    for tag in range(2):
        await _all_reduce_exact(cluster, tag=tag)
    for comm in cluster.live_peers:
        pool = comm.pool
        outgoing = (c for cs in pool.links.conns.values() for c in cs if c is not None)
        conns = [*pool.readers.conns.values(), *outgoing]
        assert len(conns) == 4  # two to the successor, two from the predecessor
        # Under TLS every byte goes through the SSL stream: never the raw-socket fast path.
        assert all(isinstance(c.stream, TlsStream) and not isinstance(c, SocketConn) for c in conns)
        assert comm._ms is not None
        assert isinstance(comm._ms.stream, TlsStream) and comm._ms.stream.handshake_done
        assert pool.statistics()["connections_lost"] == 0


async def test_shared_state_sync_and_bandwidth_measurement_over_tls(
    pccl_cluster: ClusterFactory, certs: Certs
) -> None:
    cluster = await pccl_cluster(3, network=None, master_config=certs.master(DEFAULT_MASTER_CONFIG),
                                 config=certs.peer(DEFAULT_PEER_CONFIG))
    n = 1 << 18

    def state(value: int) -> SharedState:
        return SharedState([TensorInfo.from_numpy(np.full(n, value, np.uint8), "w"),
                            TensorInfo.from_numpy(np.arange(n, dtype=np.float32) * value, "b")], revision=1)

    states = [state(3), state(3), state(9)]  # the popular state wins; peer 2 fetches it over TLS

    async def sync(i: int, comm: Communicator) -> SharedStateSyncInfo:
        return await comm.sync_shared_state(states[i], S.ENFORCE_POPULAR)

    infos = await cluster.run_all(sync)
    assert isinstance(infos[2], SharedStateSyncInfo), infos[2]
    assert infos[2].rx_bytes == n + 4 * n
    ref = [t.tensor.tobytes() for t in states[0].tensor_infos]
    assert all([t.tensor.tobytes() for t in s.tensor_infos] == ref for s in states)

    async def optimize(i: int, comm: Communicator) -> None:
        await comm.optimize_topology()

    await cluster.run_all(optimize)  # measures every directed link over TLS ("bench" channel)
    bandwidth = cluster.master.state.bandwidth
    assert len(bandwidth) == 6 and all(bw > 0 for bw, _ in bandwidth.values())
    await _all_reduce_exact(cluster, n=4096, tag=5)


async def test_refused_certificates_on_real_sockets_keep_the_run_up(
    pccl_cluster: ClusterFactory, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    peer_cfg = certs.peer(DEFAULT_PEER_CONFIG)
    cluster = await pccl_cluster(2, network=None, master_config=certs.master(DEFAULT_MASTER_CONFIG),
                                 config=peer_cfg)
    address = cluster.master_address
    intruder = certs.issue("intruder", "pccl-peer", ca=certs.other_ca)
    cases = [
        (certs.peer(peer_cfg, cert=intruder), "certificate"),  # the master refuses it
        (dataclasses.replace(peer_cfg, tls_ca=certs.other_ca_file), "certificate verify failed"),  # we refuse
        (DEFAULT_PEER_CONFIG, "closed by the other side"),  # plain TCP against TLS
    ]
    for cfg, words in cases:
        with trio.fail_after(DEFAULT_MASTER_CONFIG.hello_timeout):  # refused long before the hello timeout
            with pytest.raises(MasterConnectionError) as info:
                async with open_communicator(address, config=cfg):
                    pass
        assert words in info.value.message and "\n" not in info.value.message
    await _all_reduce_exact(cluster, n=4096)
    assert "unable to get local issuer certificate" in caplog.text  # the intruder, in the master's log
    assert "does not speak TLS" in caplog.text  # the plain peer
    assert cluster.alive == [0, 1]


def test_blocking_api_with_mutual_tls(certs: Certs) -> None:
    master = MasterNode("127.0.0.1:0", config=certs.master(DEFAULT_MASTER_CONFIG))
    master.run()
    comms: list[BlockingCommunicator] = []
    try:
        cfg = certs.peer(dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_listen_host="127.0.0.1"))
        first = BlockingCommunicator(master.address, config=cfg)
        first.connect()
        comms.append(first)
        second = BlockingCommunicator(master.address, config=cfg)
        comms.append(second)
        joining = threading.Thread(target=second.connect, daemon=True)
        joining.start()
        while not first.are_peers_pending():
            pass
        first.update_topology()
        joining.join(30)
        assert not joining.is_alive()
        xs = [np.arange(1000, dtype=np.float32), np.arange(1000, dtype=np.float32) * 2]
        threads = [threading.Thread(target=lambda c=c, x=x: c.all_reduce(x, x, op=ReduceOp.SUM), daemon=True)
                   for c, x in zip(comms, xs, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        want = np.arange(1000, dtype=np.float32) * 3
        assert all(x.tobytes() == want.tobytes() for x in xs)
        # No certificate of the run: refused with one line, MASTER_CONNECTION_FAILED.
        stranger = BlockingCommunicator(master.address, config=certs.peer(
            cfg, cert=certs.issue("stranger", "pccl-peer", ca=certs.other_ca)))
        with pytest.raises(MasterConnectionError):
            stranger.connect(n_attempts=1)
        stranger.close()
    finally:
        for c in comms:
            c.close()
        master.interrupt()
