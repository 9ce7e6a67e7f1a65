"""Swarm heal (issue 35): chunked, verified, many-donor, resumable shared-state fetches (virtual network,
MockClock)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl.peer import heal, swarm
from pccl.peer import shared_state as ss
from pccl.peer.shared_state import SharedState, TensorInfo
from pccl.testing import DEFAULT_MASTER_CONFIG, TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.testing.waiting import wait_until

MIB = 1 << 20
BIG = 6 * MIB  # six chunks
BLOCKING = dataclasses.replace(DEFAULT_MASTER_CONFIG, live_heal_rounds=0)  # every sync holds its participants
LIVE = dataclasses.replace(DEFAULT_MASTER_CONFIG, live_heal_rounds=1)  # docs/concepts.md "Live heals"


def _content(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, BIG, dtype=np.uint8), rng.integers(0, 256, 1000, dtype=np.uint8)


def _state(big: np.ndarray, small: np.ndarray) -> SharedState:
    return SharedState(
        [TensorInfo.from_numpy(big.copy(), "big"), TensorInfo.from_numpy(small.copy(), "small")], revision=1)


def _slow_links(cluster: TestCluster, receivers: list[int], donors: list[int], rate: float = 8 * MIB) -> None:
    """Donor -> receiver links at ``rate`` bytes/s (so that the transfer takes virtual time)."""
    net = cluster.network
    assert net is not None
    for r in receivers:
        for d in donors:
            net.set_link(cluster.host(d), cluster.host(r), bandwidth=rate, latency=0.005)


Result = pccl.SharedStateSyncInfo | pccl.PCCLError


async def _sync(cluster: TestCluster, states: dict[int, SharedState],
                progress: dict[int, Any] | None = None) -> dict[int, Result]:
    results: dict[int, Result] = {}

    async def one(i: int) -> None:
        try:
            results[i] = await cluster.peer(i).sync_shared_state(states[i], progress=(progress or {}).get(i))
        except pccl.PCCLError as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        for i in states:
            nursery.start_soon(one, i)
    return results


def _bits(state: SharedState) -> list[bytes]:
    return [bytes(backend_bytes(i.tensor)) for i in state.tensor_infos]


def backend_bytes(t: Any) -> bytes:
    return np.asarray(t).tobytes()


def _serves(cluster: TestCluster, i: int) -> Any:
    """Whether a context is one that peer ``i`` serves from: its running sync or a snapshot it pinned for a
    live heal (docs/concepts.md "Live heals")."""
    server = cluster.peer(i)._state_server
    return lambda ctx: ctx is server.ctx or any(ctx is c for c in server.pins.values())


MODES = pytest.mark.parametrize("config", [BLOCKING, LIVE], ids=["blocking", "live"])


async def _running(cluster: TestCluster, members: int, big: np.ndarray, small: np.ndarray) -> int:
    """The members run (their first sync, holding the same content, and a collective), then a newcomer
    joins (admitted by them) and is returned: a newcomer to a running group, which a live heal is for
    (a group's first sync, or holders that have not run without the fetcher, are never live)."""
    res = await _sync(cluster, {i: _state(big, small) for i in range(members)})
    assert all(isinstance(r, pccl.SharedStateSyncInfo) and r.rx_bytes == 0 for r in res.values()), res
    async with trio.open_nursery() as nursery:
        for i in range(members):
            nursery.start_soon(cluster.peer(i).all_reduce, np.ones(4, np.float32))
    return await cluster.add_peer()


@MODES
async def test_only_differing_chunks_move_and_every_holder_serves(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, config: pccl.MasterConfig
) -> None:
    """Blocking or live (the default), the holders serve exactly the two differing chunks; a blocking
    holder's call counts them in its ``tx_bytes``, a live holder's call returned before it served (0
    there) and its serving shows in its ``heal_served_bytes``."""
    cluster = await pccl_cluster(3, master_config=config)
    big, small = _content(1)
    assert await _running(cluster, 3, big, small) == 3
    states = {i: _state(big, small) for i in range(3)}
    mine = _state(big, small)
    odd = mine.tensor_infos[0].tensor
    odd[2 * MIB + 5] ^= 0xFF  # chunk 2
    odd[5 * MIB + 7] ^= 0x01  # chunk 5
    states[3] = mine
    untouched = odd[: 2 * MIB].copy()
    res = await _sync(cluster, states)
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res.values()), res
    info = res[3]
    assert isinstance(info, pccl.SharedStateSyncInfo)
    assert info.rx_bytes == 2 * MIB  # two chunks, not the 6 MiB tensor
    assert _bits(mine) == _bits(states[0])
    assert mine.tensor_infos[0].tensor is odd and odd[: 2 * MIB].tobytes() == untouched.tobytes()
    last = cluster.peer(3).statistics()["heal_last"]
    assert last["chunks_total"] == 2 and last["chunks_done"] == 2 and last["bytes_done"] == 2 * MIB
    sent = [r.tx_bytes for r in res.values() if isinstance(r, pccl.SharedStateSyncInfo)]
    assert sum(sent) == (2 * MIB if config is BLOCKING else 0)
    # what the holders served, counted as they send (a live holder's last send may complete after the
    # newcomer's call returned: its counter moves when it does)
    def served() -> int:
        return sum(int(cluster.peer(i).statistics()["heal_served_bytes"]) for i in range(3))

    await wait_until(lambda: served() == 2 * MIB)
    assert cluster.peer(3).statistics()["heal_served_bytes"] == 0
    assert cluster.master.state.statistics()["heals"]["started"] == (config is LIVE)


async def test_a_large_tensor_comes_from_every_donor_in_proportion(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    cluster = await pccl_cluster(4)
    big, small = _content(2)
    states = {i: _state(big, small) for i in range(3)}
    states[3] = _state(np.zeros(BIG, np.uint8), np.zeros(1000, np.uint8))
    net = cluster.network
    assert net is not None
    # donor 0 is three times as fast as donors 1 and 2
    for d, rate in ((0, 12 * MIB), (1, 4 * MIB), (2, 4 * MIB)):
        net.set_link(cluster.host(d), cluster.host(3), bandwidth=rate, latency=0.005)
    seen: list[dict[str, Any]] = []

    def on_progress(done: int, total: int) -> None:
        sync = cluster.peer(3).statistics()["sync"]
        if sync is not None and sync["progress"] is not None:
            seen.append(sync["progress"])

    res = await _sync(cluster, states, {3: on_progress})
    assert isinstance(res[3], pccl.SharedStateSyncInfo), res
    assert _bits(states[3]) == _bits(states[0])
    last = cluster.peer(3).statistics()["heal_last"]
    ids = {i: cluster.peer(i).peer_id for i in range(3)}
    got = {i: last["donors"][ids[i]] for i in range(3)}
    assert all(v > 0 for v in got.values()), got  # every holder served part of the one large tensor
    assert got[0] > got[1] and got[0] > got[2], got
    assert seen and seen[-1]["donors_active"] == 3 and seen[-1]["rate"] > 0
    assert seen[-1]["chunks_total"] == 7  # six chunks of "big" and one batch holding "small"


@pytest.mark.parametrize("after_chunks", range(6))
async def test_a_donor_killed_mid_transfer_costs_only_its_chunks(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, after_chunks: int
) -> None:
    cluster = await pccl_cluster(3)
    big, small = _content(3)
    states = {0: _state(big, small), 1: _state(big, small), 2: _state(np.zeros(BIG, np.uint8), small)}
    _slow_links(cluster, [2], [0, 1])
    killed: list[int] = []

    def on_progress(done: int, total: int) -> None:
        if not killed and done >= after_chunks * MIB:
            killed.append(1)
            cluster.kill(1)

    res = await _sync(cluster, states, {2: on_progress})
    assert killed
    assert isinstance(res[2], pccl.SharedStateSyncInfo), res
    assert isinstance(res[0], pccl.SharedStateSyncInfo), res  # no member's call failed
    assert _bits(states[2]) == _bits(states[0])
    st = cluster.peer(2).statistics()
    # Killed at its first bytes it had items in flight; later, all it had to send may already be on the
    # wire (the network delivers what a crashed host had sent) and its loss costs nothing.
    assert st["heal_donors_failed"] == 1 if after_chunks == 0 else st["heal_donors_failed"] <= 1
    # bytes fetched twice: at most the dead donor's items in flight (the pipeline depth), in chunks
    assert res[2].rx_bytes - BIG <= swarm.DEPTH * MIB


@MODES
async def test_a_corrupting_donor_is_excluded_and_its_chunk_refetched(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, config: pccl.MasterConfig
) -> None:
    """The donor corrupts what it serves, from its running sync (blocking) or from the snapshot it pinned
    (live, the default)."""
    cluster = await pccl_cluster(3, master_config=config)
    big, small = _content(4)
    assert await _running(cluster, 3, big, small) == 3
    states = {i: _state(big, small) for i in range(3)}
    states[3] = _state(np.zeros(BIG, np.uint8), np.zeros(1000, np.uint8))
    _slow_links(cluster, [3], [0, 1, 2])
    liar = _serves(cluster, 1)
    honest = ss.chunk_bytes

    def lying(ctx: ss.SyncContext, info: TensorInfo, offset: int, nbytes: int) -> memoryview:
        data = honest(ctx, info, offset, nbytes)
        if not liar(ctx) or nbytes == 0:
            return data
        bad = bytearray(data)
        bad[nbytes // 2] ^= 0x10
        return memoryview(bytes(bad))

    monkeypatch.setattr(ss, "chunk_bytes", lying)
    res = await _sync(cluster, states)
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res.values()), res
    assert _bits(states[3]) == _bits(states[0])
    st = cluster.peer(3).statistics()
    liar_id = cluster.peer(1).peer_id
    assert st["heal_donors_excluded"] == 1 and st["heal_bad_bytes"] > 0
    assert liar_id in st["heal_last"]["donors_excluded"]
    said = [r.getMessage() for r in caplog.records]
    assert any("fail their hash" in s and f"peer {liar_id}" in s for s in said), said
    assert cluster.master.state.statistics()["heals"]["started"] == (config is LIVE)


@MODES
async def test_chunks_verified_in_worker_threads_over_tcp(
    pccl_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch, config: pccl.MasterConfig
) -> None:
    """Real sockets and the real clock: each chunk lands in place and is verified in a worker thread
    while the next ones arrive (what a fetch of 8 MiB or more does); a corrupting donor's chunk is
    still refused and fetched again (served from its running sync, or from its pinned snapshot when the
    heal is live), and what the newcomer applies is exact."""
    monkeypatch.setattr(heal, "VERIFY_IN_THREAD_BYTES", 0)
    cluster = await pccl_cluster(3, network=None, master_config=config)
    big, small = _content(8)
    assert await _running(cluster, 3, big, small) == 3
    states = {i: _state(big, small) for i in range(3)}
    states[3] = _state(np.zeros(BIG, np.uint8), np.zeros(1000, np.uint8))
    liar = _serves(cluster, 2)
    honest = ss.chunk_bytes

    def lying(ctx: ss.SyncContext, info: TensorInfo, offset: int, nbytes: int) -> memoryview:
        data = honest(ctx, info, offset, nbytes)
        if not liar(ctx) or nbytes == 0:
            return data
        bad = bytearray(data)
        bad[-1] ^= 0x01
        return memoryview(bytes(bad))

    monkeypatch.setattr(ss, "chunk_bytes", lying)
    res = await _sync(cluster, states)
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res.values()), res
    assert _bits(states[3]) == _bits(states[0])
    last = cluster.peer(3).statistics()["heal_last"]
    assert last["chunks_done"] == last["chunks_total"] == 7 and last["bytes_done"] == BIG + 1000
    liar_id = cluster.peer(2).peer_id
    assert last["donors"][liar_id] == 0  # none of its bytes was taken
    # (it is excluded at its first chunk, unless the others had sent everything before it sent one)
    assert (liar_id in last["donors_excluded"]) == (last["bad_bytes"] > 0)


async def test_two_newcomers_heal_at_once(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    cluster = await pccl_cluster(4)
    big, small = _content(5)
    states = {0: _state(big, small), 1: _state(big, small),
              2: _state(np.zeros(BIG, np.uint8), small), 3: _state(np.ones(BIG, np.uint8), small)}
    _slow_links(cluster, [2, 3], [0, 1])
    res = await _sync(cluster, states)
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res.values()), res
    for i in (2, 3):
        assert _bits(states[i]) == _bits(states[0])
        last = cluster.peer(i).statistics()["heal_last"]
        assert all(v > 0 for v in last["donors"].values()), last


async def test_every_donor_lost_fails_cleanly_with_old_bits(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    cluster = await pccl_cluster(3)
    big, small = _content(6)
    states = {0: _state(big, small), 1: _state(big, small), 2: _state(np.zeros(BIG, np.uint8), small)}
    _slow_links(cluster, [2], [0, 1])

    def on_progress(done: int, total: int) -> None:
        if done >= 2 * MIB:
            cluster.kill(0)
            cluster.kill(1)

    res = await _sync(cluster, states, {2: on_progress})
    assert isinstance(res[2], pccl.PCCLError), res
    assert not states[2].tensor_infos[0].tensor.any()  # nothing applied


async def test_a_newcomer_killed_mid_heal_leaves_the_members_as_they_were(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """Without live heals (``live_heal_rounds=0``, pinned here: the mode must keep working whatever the
    default) the newcomer is a fetcher of the group's sync: its loss fails the sync (RankConnectionLost;
    with live heals it fails nobody else: the test below and tests/integration/test_live_heal.py);
    the members' tensors are untouched and their next sync, without it, succeeds and moves nothing."""
    cluster = await pccl_cluster(3, master_config=BLOCKING)
    big, small = _content(7)
    states = {0: _state(big, small), 1: _state(big, small), 2: _state(np.zeros(BIG, np.uint8), small)}
    _slow_links(cluster, [2], [0, 1])

    def on_progress(done: int, total: int) -> None:
        if done >= 3 * MIB:
            cluster.kill(2)

    res = await _sync(cluster, states, {2: on_progress})
    for i in (0, 1):
        r = res[i]
        assert isinstance(r, pccl.PCCLError) and r.result == pccl.Result.RANK_CONNECTION_LOST, res
        assert _bits(states[i]) == [big.tobytes(), small.tobytes()]
    again = await _sync(cluster, {0: states[0], 1: states[1]})
    assert all(isinstance(r, pccl.SharedStateSyncInfo) and r.rx_bytes == 0 for r in again.values()), again


async def test_with_live_heals_a_newcomer_killed_mid_heal_fails_no_member(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """The counterpart with live heals (``live_heal_rounds=1``): the members' sync returns at once,
    successful and moving nothing, the newcomer's loss mid-transfer fails only its own call, the snapshots
    the members pinned for it are released, and their next sync succeeds and moves nothing."""
    cluster = await pccl_cluster(2, master_config=LIVE)
    big, small = _content(7)
    assert await _running(cluster, 2, big, small) == 2
    states = {0: _state(big, small), 1: _state(big, small), 2: _state(np.zeros(BIG, np.uint8), small)}
    _slow_links(cluster, [2], [0, 1])
    pinned: list[int] = []

    def on_progress(done: int, total: int) -> None:
        if done >= 3 * MIB and not pinned:
            pinned.extend(len(cluster.peer(i)._state_server.pins) for i in (0, 1))
            cluster.kill(2)

    res = await _sync(cluster, states, {2: on_progress})
    assert isinstance(res[2], pccl.PCCLError), res
    assert pinned == [1, 1]  # both members served it from a pinned snapshot, their calls long returned
    for i in (0, 1):
        r = res[i]
        assert isinstance(r, pccl.SharedStateSyncInfo) and r.rx_bytes == 0, res
        assert _bits(states[i]) == [big.tobytes(), small.tobytes()]
    again = await _sync(cluster, {0: states[0], 1: states[1]})
    assert all(isinstance(r, pccl.SharedStateSyncInfo) and r.rx_bytes == 0 for r in again.values()), again
    # the master counts the fetcher lost once its link is (the heartbeat timeout) and releases the pins
    await wait_until(lambda: cluster.master.state.statistics()["heals"]["lost_fetchers"] == 1)
    await wait_until(lambda: all(not cluster.peer(i)._state_server.pins for i in (0, 1)))


async def test_a_snapshot_slower_than_the_plan_timeout_is_waited_for(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live heal's holders copy their snapshot before serving; on a busy host a large one takes longer
    than ``connect_timeout`` (the wait for a holder's plan): the newcomer's requests wait for it (found on
    the WAN emulator, a 256 MiB copy at load 24: every donor refused, the heal failed)."""
    cluster = await pccl_cluster(2, master_config=LIVE)
    big, small = _content(9)
    newcomer = await _running(cluster, 2, big, small)
    slow = ss._snapshot

    async def slower(ctx: ss.SyncContext, plan: Any) -> ss.SyncContext:
        await trio.sleep(3 * cluster.peer(0).config.connect_timeout)
        return await slow(ctx, plan)

    monkeypatch.setattr(ss, "_snapshot", slower)
    states = {0: _state(big, small), 1: _state(big, small), newcomer: _state(np.zeros(BIG, np.uint8), small)}
    res = await _sync(cluster, states)
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res.values()), res
    assert _bits(states[newcomer]) == _bits(states[0])
    assert cluster.master.state.statistics()["heals"]["started"] == 1
