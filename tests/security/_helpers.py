"""Shared pieces of the security tests: exact all-reduce checks and a hostile host on the virtual network."""

from __future__ import annotations

import numpy as np

from pccl.peer.communicator import Communicator
from pccl.testing import TestCluster, VirtualHost

COUNT = 4096


def contribution(peer_id: int) -> np.ndarray:
    """Distinct per peer, so a SUM names exactly who took part."""
    return (np.arange(COUNT, dtype=np.int64) + 1) * (1 << (4 * peer_id))


def expected(peer_ids: list[int]) -> bytes:
    total = np.zeros(COUNT, np.int64)
    for p in peer_ids:
        total += contribution(p)
    return total.tobytes()


async def exact_all_reduces(cluster: TestCluster, rounds: int = 3, tag: int = 0) -> None:
    """Run ``rounds`` all-reduces on every live peer and assert every result is the exact sum."""
    ids = [cluster.peer(i).peer_id for i in cluster.alive]
    for r in range(rounds):

        async def one(i: int, comm: Communicator, r: int = r) -> bytes:
            out = np.zeros(COUNT, np.int64)
            await comm.all_reduce(contribution(comm.peer_id), out, tag=tag + r)
            return out.tobytes()

        results = await cluster.run_all(one)
        for res in results:
            assert res == expected(ids)


def hostile(cluster: TestCluster, name: str = "evil") -> VirtualHost:
    """A host on the cluster's virtual network that is no member of the run."""
    assert cluster.network is not None
    return cluster.network.host(name)


def master_port(cluster: TestCluster) -> tuple[str, int]:
    host, port = cluster.master_address.rsplit(":", 1)
    return host, int(port)


def p2p_address(cluster: TestCluster, index: int) -> tuple[str, int]:
    address = cluster.peer(index).p2p_address
    assert address is not None
    return address
