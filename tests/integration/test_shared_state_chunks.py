"""Shared states too large for one 32 KiB frame travel in chunks (issue 17 item 4), virtual network."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import SharedStateSyncStrategy as S
from pccl.peer.communicator import Communicator
from pccl.peer.shared_state import SharedState, TensorInfo
from pccl.testing import TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.wire import limits
from pccl.wire import messages as m

from ._traffic import array_sum

KEYS = 20000


async def _exact_sums(cluster: TestCluster, indexes: list[int]) -> None:
    """An all-reduce of distinct contributions on ``indexes``: every result is their exact sum."""
    ids = [cluster.peer(i).peer_id for i in indexes]
    want = array_sum((np.arange(64, dtype=np.int64) + 1) << (4 * p) for p in ids)

    async def one(i: int, comm: Communicator) -> bytes:
        out = np.zeros(64, np.int64)
        await comm.all_reduce((np.arange(64, dtype=np.int64) + 1) << (4 * comm.peer_id), out, tag=7)
        return out.tobytes()

    assert await cluster.run_all(one, indexes=indexes) == [want.tobytes()] * len(indexes)


def _state(value: int, keys: int = KEYS) -> SharedState:
    name = "model.layers.{}.self_attention.query_projection.weight"
    infos = [TensorInfo.from_numpy(np.full(4, value + i % 7, np.uint8), name.format(i)) for i in range(keys)]
    return SharedState(infos, revision=1)


async def test_many_keys_sync_exactly_through_chunks(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    cluster = await pccl_cluster(3)
    states = [_state(10), _state(10), _state(50)]
    # The vote's rows are more than the old 1 MiB frame cap, many 32 KiB frames.
    rows = [[i.name, 1, [4], 4, 0, False] for i in states[0].tensor_infos]
    whole = m.encode(m.SharedStateSync(revision=1, strategy=0, entries=rows))
    assert len(whole) > 1 << 20
    # The odd peer's every key differs: it fetches all of them, many StateRequests per holder.
    keys = [i.name for i in states[2].tensor_infos]
    assert len(limits.split_rows(keys)) > 16

    async def sync(i: int, comm: Communicator) -> pccl.SharedStateSyncInfo:
        return await comm.sync_shared_state(states[i], S.ENFORCE_POPULAR)

    infos = await cluster.run_all(sync)
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in infos), infos
    synced = [r for r in infos if isinstance(r, pccl.SharedStateSyncInfo)]  # all of them, as asserted
    assert synced[2].rx_bytes == 4 * KEYS
    assert sum(i.tx_bytes for i in synced) == 4 * KEYS
    want = [np.full(4, 10 + i % 7, np.uint8).tobytes() for i in range(KEYS)]
    for s in states:
        assert [i.tensor.tobytes() for i in s.tensor_infos] == want
        assert s.revision == 1
    # And the next revision again, with nothing to move.
    for s in states:
        s.revision += 1
    infos = await cluster.run_all(sync)
    assert all(isinstance(r, pccl.SharedStateSyncInfo) and r.rx_bytes == 0 for r in infos), infos


async def test_a_chunk_flood_is_refused_and_the_others_go_on(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    cluster = await pccl_cluster(3)
    await _exact_sums(cluster, [0, 1, 2])
    flooder = cluster.peer(0)
    evil = flooder.peer_id
    # An accepted member streams vote rows without ever voting.
    chunk = [[f"k{i}", 1, [1], 1, 0, False] for i in range(1000)]
    for _ in range(limits.SHARED_STATE_MAX_FRAMES + 1):
        await flooder._send(m.SharedStateEntries(entries=chunk))
    with trio.fail_after(30):
        while evil in cluster.master.state.peers:
            await trio.sleep(0.01)
    assert f"peer {evil} kicked: SharedStateEntries: shared-state vote over its bound" in caplog.text
    assert cluster.master.state._sync_rows == {}
    # The other members sync their state and reduce exactly, without the flooder.
    small = [_state(3, keys=5), _state(4, keys=5)]

    async def sync(k: int, comm: Communicator) -> pccl.SharedStateSyncInfo:
        return await comm.sync_shared_state(small[k - 1], S.ENFORCE_POPULAR)

    with trio.fail_after(60):
        infos = await cluster.run_all(sync, indexes=[1, 2])
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in infos), infos
    got = [[i.tensor.tobytes() for i in s.tensor_infos] for s in small]
    assert got[0] == got[1]
    await _exact_sums(cluster, [1, 2])
