"""Shared pieces of the security tests: exact all-reduce checks and a hostile host on the virtual network."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from pccl import PCCLError
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


def stop_reading(monkeypatch: pytest.MonkeyPatch, evil: Communicator) -> None:
    """Make ``evil`` stop reading every ring connection (it still heartbeats and votes)."""
    assert evil.pool is not None
    readers = evil.pool.readers
    real = type(readers).read_frame

    async def stop(self: object, conn: object) -> bool:
        if self is readers:
            await trio.sleep_forever()
        waited: bool = await real(self, conn)  # type: ignore[arg-type]
        return waited

    monkeypatch.setattr(type(readers), "read_frame", stop)


def claim_took_all(monkeypatch: pytest.MonkeyPatch, cl: TestCluster, evil: Communicator) -> None:
    """``evil`` testifies it took every byte each partner says it sent it (the pairs then agree),
    whatever it read."""
    real_rows = type(evil.pool).op_io

    def lying(self: object, op_seq: int) -> list[tuple[int, int, int]]:
        rows: list[tuple[int, int, int]] = real_rows(self, op_seq)  # type: ignore[arg-type]
        if self is not evil.pool:
            return rows
        mine = {p: (s, k) for p, s, k in rows}
        for i in cl.alive:
            other = cl.peer(i)
            if other is evil or other.pool is None:
                continue
            sent = {p: s for p, s, _ in real_rows(other.pool, op_seq)}.get(evil.peer_id, 0)
            s, k = mine.get(other.peer_id, (0, 0))
            mine[other.peer_id] = (s, max(k, sent))
        return [(p, s, k) for p, (s, k) in sorted(mine.items())]

    monkeypatch.setattr(type(evil.pool), "op_io", lying)


def lie_about_reading(monkeypatch: pytest.MonkeyPatch, cl: TestCluster, evil: Communicator) -> None:
    """``evil`` stops reading and testifies it took every byte each partner says it sent it (the pairs
    then agree)."""
    stop_reading(monkeypatch, evil)
    claim_took_all(monkeypatch, cl, evil)


async def stalled_rounds(cluster: TestCluster, count: int, rounds: int,
                         members_are: list[int] | None = None) -> int:
    """Run ``rounds`` int32 all-reduces of ``count`` elements on the current members; a round that failed
    anywhere counts as stalled (the ring is rebuilt with ``update_topology``), every other result must be
    the exact sum (and its members ``members_are``, when given). Returns the stalled rounds."""
    stalls = 0
    for r in range(rounds):
        members = [i for i in cluster.alive if cluster.is_member(i)]

        async def one(i: int, comm: Communicator, r: int = r) -> bytes:
            out = np.zeros(count, np.int32)
            await comm.all_reduce(np.full(count, comm.peer_id + 1, np.int32), out, tag=r)
            return out.tobytes()

        results = await cluster.run_all(one, indexes=members)
        if any(isinstance(x, PCCLError) for x in results):
            stalls += 1
            await cluster.update_topology()
            continue
        ids = [cluster.peer(i).peer_id for i in members]
        if members_are is not None:
            assert sorted(ids) == sorted(members_are)
        want = np.full(count, sum(p + 1 for p in ids), np.int32).tobytes()
        assert all(x == want for x in results)
    return stalls
