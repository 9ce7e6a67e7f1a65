"""Faults injected through the transport seam: a virtual network under MockClock(autojump_threshold=0).

* A peer crashes at every ring step k of an all-reduce, cut at an exact byte of its outgoing ring
  stream: the survivors raise RankConnectionLostError, their buffers hold the pre-call bits, and
  their retry yields exactly the survivors' reduction.
* A peer that hangs mid-operation is evicted by heartbeat; the survivors' retry succeeds within
  the heartbeat timeout plus a small bound of virtual time.
* A lost master (crashed, hung or cut off) fails calls with MASTER_CONNECTION_FAILED within the
  heartbeat timeout.
* A partitioned peer is evicted; a transient partition between two peers only delays the ring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl.peer.communicator import Communicator
from pccl.testing import (
    DEFAULT_PEER_CONFIG,
    MASTER,
    HookAction,
    Reset,
    TestCluster,
    TrafficEvent,
    VirtualNetwork,
    reset_after,
)
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.wire.data import DATA_HEADER_SIZE, unpack_data_header_fields

N = 4
COUNT = 4 * 1000  # int64 elements: 4 chunks of 1000, one 8000-byte frame per ring step
FRAMES = 2 * (N - 1)  # frames each peer sends per all-reduce (reduce-scatter + all-gather)
HB_TIMEOUT = 2.0  # DEFAULT_MASTER_CONFIG / DEFAULT_PEER_CONFIG
# The tests of a final master loss opt out of reconnecting (PeerConfig's default window is 60 s).
NO_RECONNECT = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=0)
HB_INTERVAL = 0.2
# The frame cutters below follow the ring (frames on the victim's stream to its successor); the
# other schedules' faults at every step: tests/collectives/test_live_schedules.py.
RING = dataclasses.replace(DEFAULT_PEER_CONFIG, schedule="ring")


def contribution(peer_id: int) -> np.ndarray:
    """Distinct per peer, so a SUM names exactly who took part."""
    return (np.arange(COUNT, dtype=np.int64) + 1) * (1 << (4 * peer_id))


def expected_sum(peer_ids: list[int]) -> np.ndarray:
    total = np.zeros(COUNT, np.int64)
    for p in peer_ids:
        total += contribution(p)
    return total


class Buffers:
    """One in-place (even index) or out-of-place (odd index) all-reduce buffer pair per peer."""

    def __init__(self, cluster: TestCluster) -> None:
        self.send = {i: contribution(cluster.peer(i).peer_id) for i in cluster.alive}
        self.recv = {
            i: (self.send[i] if i % 2 == 0 else np.full(COUNT, -7, np.int64)) for i in cluster.alive
        }

    def snapshot(self) -> dict[int, bytes]:
        return {i: self.recv[i].tobytes() for i in self.recv}

    async def all_reduce(self, i: int, comm: Communicator) -> pccl.ReduceInfo:
        recv = None if self.recv[i] is self.send[i] else self.recv[i]
        return await comm.all_reduce(self.send[i], recv, tag=3)


class FrameCutter:
    """Traffic hook on one ring stream (src host -> dst P2P port) that parses the data frames.

    When frame ``k`` (0-based, counted from the first byte seen) reaches ``cut`` bytes of its
    payload (``cut=-1``: before its header), the stream is reset there and ``fired`` is set; with
    ``k == FRAMES`` it only reports once the last frame is fully sent.
    """

    def __init__(self, src: str, dst_port: int, k: int, cut: int) -> None:
        self.src, self.dst_port, self.k, self.cut = src, dst_port, k, cut
        self.fired = trio.Event()
        self.cut_offset: int | None = None
        self.frames_before_cut = -1
        self._conn: int | None = None
        self._hdr = bytearray()
        self._frame = 0  # frames fully sent
        self._len = 0  # payload length of the current frame
        self._left = 0  # payload bytes of the current frame still to come

    def __call__(self, ev: TrafficEvent) -> HookAction | None:
        if ev.src != self.src or ev.dst_address[1] != self.dst_port or self.fired.is_set():
            return None
        if self._conn is None:
            self._conn = ev.connection
        if ev.connection != self._conn:
            return None
        data, pos = ev.data, 0
        while pos < len(data):
            if self._left == 0:
                if self._frame == self.k and self.cut < 0 and not self._hdr:
                    return self._fire(ev, pos)
                take = min(DATA_HEADER_SIZE - len(self._hdr), len(data) - pos)
                self._hdr += data[pos : pos + take]
                pos += take
                if len(self._hdr) == DATA_HEADER_SIZE:
                    self._len = self._left = unpack_data_header_fields(bytes(self._hdr))[3]
                    self._hdr.clear()
                continue
            if self._frame == self.k and self.cut >= 0:
                done_in_frame = self._len - self._left
                if done_in_frame + (len(data) - pos) > self.cut:
                    return self._fire(ev, pos + (self.cut - done_in_frame))
            take = min(self._left, len(data) - pos)
            self._left -= take
            pos += take
            if self._left == 0:
                self._frame += 1
                if self._frame == FRAMES and self.k == FRAMES:
                    self.fired.set()
        return None

    def _fire(self, ev: TrafficEvent, pos: int) -> HookAction:
        self.cut_offset = ev.offset + pos
        self.frames_before_cut = self._frame
        self.fired.set()
        return Reset(after=pos)


async def run_ops(
    cluster: TestCluster, bufs: Buffers, indexes: list[int]
) -> dict[int, pccl.ReduceInfo | pccl.PCCLError]:
    results = await cluster.run_all(bufs.all_reduce, indexes=indexes)
    return dict(zip(indexes, results, strict=True))


def p2p_port(cluster: TestCluster, index: int) -> int:
    address = cluster.peer(index).p2p_address
    assert address is not None
    return address[1]


def network(cluster: TestCluster) -> VirtualNetwork:
    assert cluster.network is not None
    return cluster.network


def successor(cluster: TestCluster, index: int) -> int:
    comm = cluster.peer(index)
    ring = comm.group_ring
    nxt = ring[(ring.index(comm.peer_id) + 1) % len(ring)]
    return next(i for i in cluster.alive if cluster.peer(i).peer_id == nxt)


@pytest.mark.parametrize("cut", [-1, 4000], ids=["before-header", "mid-payload"])
@pytest.mark.parametrize("k", range(FRAMES))
async def test_peer_crash_at_every_ring_step(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, k: int, cut: int) -> None:
    cluster = await pccl_cluster(N, config=RING)
    victim = 1
    survivors = [i for i in cluster.alive if i != victim]
    bufs = Buffers(cluster)
    before = bufs.snapshot()
    send_before = {i: bufs.send[i].tobytes() for i in survivors}
    nxt = successor(cluster, victim)
    cutter = FrameCutter(cluster.host(victim).name, p2p_port(cluster, nxt), k, cut)
    network(cluster).add_hook(cutter)

    async def killer() -> None:
        await cutter.fired.wait()
        cluster.kill(victim)

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(killer)
        results = await run_ops(cluster, bufs, cluster.alive)
    failed_at = trio.current_time()
    assert cutter.frames_before_cut == k, "the stream was not cut at ring step k"
    for i in survivors:
        err = results[i]
        assert isinstance(err, pccl.RankConnectionLostError), (i, err)
        assert err.result == pccl.Result.RANK_CONNECTION_LOST
        assert bufs.recv[i].tobytes() == before[i], f"peer {i}: buffer modified by a failed all-reduce"
        assert bufs.send[i].tobytes() == send_before[i]
    # A crash is seen at once (the RST and the master's abort travel a few 1 ms links), not by heartbeat.
    assert failed_at - t0 < 0.1

    infos = await run_ops(cluster, bufs, survivors)
    want = expected_sum([cluster.peer(i).peer_id for i in survivors])
    for i in survivors:
        info = infos[i]
        assert isinstance(info, pccl.ReduceInfo), info
        assert info.local_world_size == N - 1
        assert bufs.recv[i].tobytes() == want.tobytes()


async def test_peer_crash_after_its_last_frame(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """The victim sent every frame, then died: the op cannot complete without its vote; all survivors fail."""
    cluster = await pccl_cluster(N, config=RING)
    victim = 2
    bufs = Buffers(cluster)
    before = bufs.snapshot()
    nxt = successor(cluster, victim)
    cutter = FrameCutter(cluster.host(victim).name, p2p_port(cluster, nxt), FRAMES, 0)
    network(cluster).add_hook(cutter)

    async def killer() -> None:
        await cutter.fired.wait()
        cluster.kill(victim)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(killer)
        results = await run_ops(cluster, bufs, cluster.alive)
    survivors = [i for i in cluster.alive]
    outcomes = {type(results[i]).__name__ for i in survivors}
    # All-or-nothing: either every survivor committed (the master had every vote) or none did.
    assert len(outcomes) == 1, results
    if outcomes == {"RankConnectionLostError"}:
        assert all(bufs.recv[i].tobytes() == before[i] for i in survivors)
    else:
        want = expected_sum([cluster.peer(i).peer_id for i in range(N)])
        assert all(bufs.recv[i].tobytes() == want.tobytes() for i in survivors)
    infos = await run_ops(cluster, bufs, survivors)
    assert all(isinstance(infos[i], pccl.ReduceInfo) for i in survivors), infos


async def test_peer_hung_mid_operation_is_evicted_and_retry_succeeds(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(N, config=RING)
    victim = 1
    survivors = [i for i in cluster.alive if i != victim]
    bufs = Buffers(cluster)
    before = bufs.snapshot()
    nxt = successor(cluster, victim)
    # The victim freezes in the middle of ring step 2 (it stays connected but says nothing more).
    cutter = FrameCutter(cluster.host(victim).name, p2p_port(cluster, nxt), 2, 10_000_000)
    hang_at: list[float] = []

    def spy(ev: TrafficEvent) -> HookAction | None:
        # Hang the victim the moment frame 2 starts flowing (the cutter only parses; cut is never reached).
        cutter(ev)
        if cutter._frame == 2 and not hang_at and ev.src == cutter.src:
            hang_at.append(ev.time)
            cluster.hang(victim)
        return None

    network(cluster).add_hook(spy)
    results = await run_ops(cluster, bufs, [*survivors, victim])
    assert hang_at, "the victim never reached ring step 2"
    for i in survivors:
        assert isinstance(results[i], pccl.RankConnectionLostError), results[i]
        assert bufs.recv[i].tobytes() == before[i]
    assert not cluster.is_member(victim)

    infos = await run_ops(cluster, bufs, survivors)
    recovered = trio.current_time() - hang_at[0]
    want = expected_sum([cluster.peer(i).peer_id for i in survivors])
    for i in survivors:
        info = infos[i]
        assert isinstance(info, pccl.ReduceInfo) and info.local_world_size == N - 1, info
        assert bufs.recv[i].tobytes() == want.tobytes()
    # Evicted after the heartbeat timeout (its last heartbeat was at most one interval before the
    # hang), checked every interval; the failed op and the retry then take a few 1 ms round trips.
    assert HB_TIMEOUT - HB_INTERVAL <= recovered <= HB_TIMEOUT + HB_INTERVAL + 0.1, recovered


async def _all_fail_with_master_lost(cluster: TestCluster, lose: Callable[[], None]) -> float:
    """Start an all-reduce on every peer except one (so it waits for the vote), lose the master,
    return how long (virtual) until every call failed with MASTER_CONNECTION_FAILED."""
    bufs = Buffers(cluster)
    waiting = cluster.alive[:-1]
    t_lost: list[float] = []

    async def lose_soon() -> None:
        await trio.sleep(0.05)
        t_lost.append(trio.current_time())
        lose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lose_soon)
        results = await run_ops(cluster, bufs, waiting)
    elapsed = trio.current_time() - t_lost[0]
    for i in waiting:
        err = results[i]
        assert isinstance(err, pccl.MasterConnectionError), err
        assert err.result == pccl.Result.MASTER_CONNECTION_FAILED
    # Later calls fail at once, on every peer.
    for i in cluster.alive:
        with pytest.raises(pccl.MasterConnectionError):
            with trio.fail_after(HB_TIMEOUT + 1):
                await cluster.peer(i).all_reduce(bufs.send[i], tag=4)
    return elapsed


async def test_master_crash_fails_calls(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(3, config=NO_RECONNECT)
    elapsed = await _all_fail_with_master_lost(cluster, cluster.kill_master)
    assert elapsed < 0.1  # the crash resets the connections: no need to wait for heartbeats


async def test_master_hang_fails_calls_within_heartbeat_timeout(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(3, config=NO_RECONNECT)
    elapsed = await _all_fail_with_master_lost(cluster, cluster.hang_master)
    assert HB_TIMEOUT - HB_INTERVAL <= elapsed <= HB_TIMEOUT + HB_INTERVAL + 0.1, elapsed


async def test_master_cut_off_fails_calls_within_heartbeat_timeout(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(3, config=NO_RECONNECT)
    elapsed = await _all_fail_with_master_lost(cluster, lambda: cluster.partition(MASTER))
    assert HB_TIMEOUT - HB_INTERVAL <= elapsed <= HB_TIMEOUT + HB_INTERVAL + 0.1, elapsed


@pytest.mark.parametrize("cut", ["isolated", "from-master"])
async def test_partitioned_peer_is_evicted(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, cut: str) -> None:
    cluster = await pccl_cluster(N, config=NO_RECONNECT)  # the victim's loss of the master is final
    victim = 2
    survivors = [i for i in cluster.alive if i != victim]
    bufs = Buffers(cluster)
    before = bufs.snapshot()

    async def cut_soon() -> None:
        await trio.sleep(0.003)  # inside the all-reduce
        if cut == "isolated":
            cluster.partition(victim)
        else:
            cluster.partition(victim, MASTER)

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cut_soon)
        results = await run_ops(cluster, bufs, cluster.alive)
    for i in survivors:
        assert isinstance(results[i], pccl.RankConnectionLostError), results[i]
        assert bufs.recv[i].tobytes() == before[i]
    assert isinstance(results[victim], pccl.MasterConnectionError), results[victim]
    assert not cluster.is_member(victim)
    assert trio.current_time() - t0 <= HB_TIMEOUT + HB_INTERVAL + 0.1

    infos = await run_ops(cluster, bufs, survivors)
    want = expected_sum([cluster.peer(i).peer_id for i in survivors])
    assert all(isinstance(infos[i], pccl.ReduceInfo) for i in survivors), infos
    assert all(bufs.recv[i].tobytes() == want.tobytes() for i in survivors)


async def test_transient_partition_between_peers_only_delays_the_ring(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """Heartbeats keep flowing, so nobody is evicted; the stalled bytes are retransmitted after heal."""
    cluster = await pccl_cluster(N)
    bufs = Buffers(cluster)
    a = 0
    b = successor(cluster, a)

    async def blip() -> None:
        await trio.sleep(0.003)
        cluster.partition(a, b)
        await trio.sleep(1.0)
        cluster.heal()

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(blip)
        results = await run_ops(cluster, bufs, cluster.alive)
    took = trio.current_time() - t0
    want = expected_sum([c.peer_id for c in cluster.live_peers])
    for i in cluster.alive:
        info = results[i]
        assert isinstance(info, pccl.ReduceInfo) and info.local_world_size == N, info
        assert bufs.recv[i].tobytes() == want.tobytes()
    assert 1.0 <= took < 1.1
    assert all(cluster.is_member(i) for i in range(N))


async def test_immediate_retry_is_not_aborted_by_the_old_ops_abort(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """Peers that see a failure locally and retry at once must not be hit by the master's late abort.

    Slow peer<->master links (20 ms) and fast ring links (1 ms) make the old abort arrive after the
    retry registered its tag, every time.
    """
    cluster = await pccl_cluster(3)
    net = network(cluster)
    for i in range(3):
        net.set_link(cluster.host(i), cluster.host(MASTER), latency=0.02)
    cut = reset_after(100, src=cluster.host(0).name, dst=cluster.host(1).name, port=p2p_port(cluster, 1))
    fired: list[float] = []

    def once(ev: TrafficEvent) -> HookAction | None:
        if fired:
            return None
        action = cut(ev)
        if action is not None:
            fired.append(ev.time)
        return action

    net.add_hook(once)
    failures: dict[int, list[str]] = {i: [] for i in range(3)}
    bufs = [np.full(30_000, i + 1, np.int64) for i in range(3)]

    async def loop(i: int) -> None:
        while True:
            try:
                await cluster.peer(i).all_reduce(bufs[i], tag=7)
                return
            except pccl.PCCLError as exc:
                failures[i].append(type(exc).__name__)
                if not isinstance(exc, pccl.RankConnectionLostError) or len(failures[i]) > 3:
                    return

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(loop, i)
    assert fired
    # One real failure (the reset), then the retry succeeds with everyone.
    assert failures == {i: ["RankConnectionLostError"] for i in range(3)}, failures
    assert all((b == 6).all() for b in bufs)


async def test_two_evictions_in_one_tick_during_a_sync_fail_it(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """C never votes, D voted; both hang and are evicted. Losing C completes the vote (D included),
    losing D fails the sync: the survivors must see RANK_CONNECTION_LOST, not wait forever.

    The master now evicts at each peer's exact heartbeat deadline, so the two evictions may land in
    separate passes; the back-to-back case (plan and failure in one batch of effects) is pinned by
    ``tests/master/test_state.py::test_sync_two_losses_in_one_batch`` and the peer side by
    ``tests/peer/test_mailbox.py``.
    """
    cluster = await pccl_cluster(N)
    states = [pccl.SharedState([pccl.TensorInfo.from_numpy(np.zeros(8, np.int64), "w")]) for _ in range(N)]
    await trio.sleep(0.3)  # virtual time: hang C and D at a fixed phase of their heartbeats
    results: dict[int, object] = {}

    async def sync(i: int) -> None:
        try:
            results[i] = await cluster.peer(i).sync_shared_state(states[i])
        except pccl.PCCLError as exc:
            results[i] = exc

    async with trio.open_nursery() as outer:
        outer.start_soon(sync, 3)  # D: hung below, never returns
        with trio.move_on_after(HB_TIMEOUT + 10) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sync, 0)
                nursery.start_soon(sync, 1)
                await trio.sleep(0.0005)  # the three votes are on the wire
                cluster.hang(2)
                cluster.hang(3)
        outer.cancel_scope.cancel()
    assert not scope.cancelled_caught, "the survivors' sync_shared_state never returned"
    assert all(isinstance(results[i], pccl.RankConnectionLostError) for i in (0, 1)), results
    assert all(s.revision == 0 and not s.tensor_infos[0].tensor.any() for s in states[:2])
