"""The ring, halving-doubling and tree schedules run by the live executor, through the public API on
the virtual network (MockClock): every op x dtype x kind x schedule on 2 to 9 peers, exact and
bit-identical on every peer; the cost model's choice per operation; a schedule mismatch between
peers fails cleanly; and a peer killed at every step of each schedule (its stream to the partner of
that step cut at the frame): every survivor's buffer restored, the retry exact.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, cast

import ml_dtypes
import msgpack
import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import ReduceOp
from pccl._errors import RemoteProtocolError
from pccl.collectives.cost import LinkModel, schedule_for
from pccl.collectives.schedule import SCHEDULES, all_plans, chunk_range
from pccl.master.state import MasterState
from pccl.peer.communicator import Communicator
from pccl.testing import DEFAULT_PEER_CONFIG, HookAction, Reset, TestCluster, TrafficEvent, VirtualNetwork
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.wire import messages as m
from pccl.wire.data import DATA_HEADER_SIZE, unpack_data_header_fields

DTYPES: list[Any] = [
    np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
]
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
_UFUNC = {
    ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum
}
COUNT = 37  # a prime: uneven chunks at every group size


def _config(schedule: str) -> pccl.PeerConfig:
    return dataclasses.replace(DEFAULT_PEER_CONFIG, schedule=schedule)


def _input(dtype: Any, op: ReduceOp, seed: int, count: int = COUNT) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "ui":
        info = np.iinfo(dt)  # the whole range: SUM and PROD wrap, exact in any order
        return rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
    if op == ReduceOp.PROD:
        return rng.uniform(0.9, 1.1, count).astype(dt)
    return rng.standard_normal(count).astype(dt)


def _reduce_ref(op: ReduceOp, xs: list[np.ndarray]) -> np.ndarray:
    """Integers in their own dtype (wrapping), floats in float64."""
    dt = xs[0].dtype
    wide = xs if dt.kind in "ui" else [x.astype(np.float64) for x in xs]
    acc = wide[0].copy()
    for x in wide[1:]:
        with np.errstate(over="ignore"):
            acc = _UFUNC[op](acc, x).astype(acc.dtype)
    return acc


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return bool((a.view(np.uint8) == b.view(np.uint8)).all())


def _cases(n: int) -> list[tuple[str, int, ReduceOp]]:
    """(kind, dtype index, op) for one group size: per dtype every op once over the two reducing
    kinds, and the ops rotate with ``n`` so that over 2..9 peers each (kind, dtype, op) appears."""
    out: list[tuple[str, int, ReduceOp]] = []
    for di in range(len(DTYPES)):
        for j in range(4):
            out.append(("all_reduce" if j % 2 == 0 else "reduce_scatter", di, OPS[(n + di + j) % 4]))
        out.append(("all_gather", di, ReduceOp.SUM))
        out.append(("broadcast", di, ReduceOp.SUM))
    return out


@pytest.mark.parametrize("n", range(2, 10))
@pytest.mark.parametrize("schedule", SCHEDULES)
async def test_every_op_dtype_and_kind_exact_and_bit_identical(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, schedule: str, n: int
) -> None:
    cluster = await pccl_cluster(n, config=_config(schedule))
    cases = _cases(n)
    inputs = {
        (t, i): _input(DTYPES[di], op, 1000 * t + i) for t, (_k, di, op) in enumerate(cases) for i in range(n)
    }
    ids = [cluster.peer(i).peer_id for i in range(n)]
    results: dict[tuple[int, int], tuple[np.ndarray, slice]] = {}

    async def peer(i: int, comm: Communicator) -> None:
        rank = comm.group_ring.index(comm.peer_id)

        async def one(t: int) -> None:
            kind, _di, op = cases[t]
            x = inputs[(t, i)]
            keep = x.copy()
            if kind == "all_reduce":
                out = np.empty_like(x)
                await comm.all_reduce(x, out, op=op, tag=t)
                results[(t, i)] = (out, slice(0, COUNT))
            elif kind == "reduce_scatter":
                out = np.empty_like(x)
                _info, chunk = await comm.reduce_scatter(x, out, op=op, tag=t)
                results[(t, i)] = (out, chunk)
            elif kind == "all_gather":
                out = np.empty(n * COUNT, x.dtype)
                await comm.all_gather(x, out, tag=t)
                results[(t, i)] = (out, slice(0, n * COUNT))
            else:
                out = x.copy()
                await comm.broadcast(out, root=t % n, tag=t)
                results[(t, i)] = (out, slice(0, COUNT))
            assert _same_bits(x, keep), "the input was modified"
            assert rank >= 0

        async with trio.open_nursery() as nursery:
            for t in range(len(cases)):
                nursery.start_soon(one, t)

    got = await cluster.run_all(peer)
    assert all(r is None for r in got), got
    by_rank = {cluster.peer(i).group_ring.index(ids[i]): i for i in range(n)}
    for t, (kind, di, op) in enumerate(cases):
        xs_by_rank = [inputs[(t, by_rank[r])] for r in range(n)]
        if kind == "all_gather":
            ref = np.concatenate(xs_by_rank)
        elif kind == "broadcast":
            ref = xs_by_rank[t % n]
        else:
            ref = _reduce_ref(op, xs_by_rank)
        exact = np.dtype(DTYPES[di]).kind in "ui" or op in (ReduceOp.MIN, ReduceOp.MAX) or kind in (
            "all_gather", "broadcast"
        )
        for r in range(n):
            out, sl = results[(t, by_rank[r])]
            if kind == "reduce_scatter":
                assert (sl.start, sl.stop) == chunk_range(COUNT, n, r)
            want = ref[sl]
            if exact:
                assert _same_bits(out[sl], want.astype(out.dtype)), (kind, DTYPES[di], op, r)
            else:
                tol = {2: 0.05, 4: 1e-4, 8: 1e-10}[out.dtype.itemsize]
                np.testing.assert_allclose(out[sl].astype(np.float64), want, rtol=tol, atol=tol * n)
        if kind != "reduce_scatter":  # the same bits on every peer, floats included
            first = results[(t, by_rank[0])][0]
            for r in range(1, n):
                assert _same_bits(results[(t, by_rank[r])][0], first), (kind, DTYPES[di], op, r)
    # every operation ran the requested schedule (a halving-doubling broadcast runs the tree)
    ran = collections.Counter(schedule_for(schedule, kind, n, COUNT) for kind, _di, _op in cases)
    for i in range(n):
        stats = cluster.peer(i).statistics()
        assert {s: stats.get(f"schedule_{s}_ok", 0) for s in ran} == ran


REDUCE_OPS = [*OPS, ReduceOp.AVG]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("schedule", SCHEDULES)
async def test_reduce_and_all_to_all_every_op_and_dtype(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, schedule: str, n: int
) -> None:
    """The two kinds added through the registry, run like the others: reduce with every op (AVG
    included) and all_to_all on every dtype, under each schedule (an "hd" reduce runs the tree, an
    all_to_all its one plan), exact on integers and MIN/MAX; the root alone gets the reduction, the
    other peers' buffers keep their bits; all_to_all in place and out of place."""
    cluster = await pccl_cluster(n, config=_config(schedule))
    cases = [(kind, di, op) for di in range(len(DTYPES)) for kind, op in
             [*(("reduce", op) for op in REDUCE_OPS), ("all_to_all", ReduceOp.SUM)]]
    count = {"reduce": COUNT, "all_to_all": n * 5}
    inputs = {
        (t, i): _input(DTYPES[di], op, 7000 * t + i, count[kind])
        for t, (kind, di, op) in enumerate(cases) for i in range(n)
    }
    ids = [cluster.peer(i).peer_id for i in range(n)]
    results: dict[tuple[int, int], np.ndarray] = {}

    async def peer(i: int, comm: Communicator) -> None:
        async def one(t: int) -> None:
            kind, _di, op = cases[t]
            x = inputs[(t, i)]
            keep = x.copy()
            if kind == "reduce":
                out = np.full_like(x, 3)
                await comm.reduce(x, out, root=t % n, op=op, tag=t)
                assert _same_bits(x, keep), "the input was modified"
            elif t % 2:  # in place
                out = x.copy()
                await comm.all_to_all(out, tag=t)
            else:
                out = np.empty_like(x)
                await comm.all_to_all(x, out, tag=t)
                assert _same_bits(x, keep), "the input was modified"
            results[(t, i)] = out

        async with trio.open_nursery() as nursery:
            for t in range(len(cases)):
                nursery.start_soon(one, t)

    got = await cluster.run_all(peer)
    assert all(r is None for r in got), got
    by_rank = {cluster.peer(i).group_ring.index(ids[i]): i for i in range(n)}
    for t, (kind, di, op) in enumerate(cases):
        xs = [inputs[(t, by_rank[r])] for r in range(n)]
        if kind == "all_to_all":
            c = count[kind] // n
            for r in range(n):
                want = np.concatenate([x[r * c : (r + 1) * c] for x in xs])
                assert _same_bits(results[(t, by_rank[r])], want), (DTYPES[di], r)
            continue
        root = t % n
        for r in range(n):
            if r != root:  # untouched
                assert _same_bits(results[(t, by_rank[r])], np.full_like(xs[r], 3)), (DTYPES[di], op, r)
        out = results[(t, by_rank[root])]
        if op == ReduceOp.AVG:
            ref = _reduce_ref(ReduceOp.SUM, xs)
            if out.dtype.kind in "ui":  # the wrapped sum divided with truncation toward zero
                ref = np.array([abs(int(v)) // n * (1 if v >= 0 else -1) for v in ref], out.dtype)
            else:
                ref = ref / n
        else:
            ref = _reduce_ref(op, xs)
        exact = np.dtype(DTYPES[di]).kind in "ui" or op in (ReduceOp.MIN, ReduceOp.MAX)
        if exact:
            assert _same_bits(out, ref.astype(out.dtype)), (DTYPES[di], op)
        else:
            tol = {2: 0.05, 4: 1e-4, 8: 1e-10}[out.dtype.itemsize]
            np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol * n)
    ran = collections.Counter(schedule_for(schedule, kind, n, count[kind]) for kind, _di, _op in cases)
    for i in range(n):
        stats = cluster.peer(i).statistics()
        assert stats.get("reduce_ok", 0) == sum(1 for k, _d, _o in cases if k == "reduce")
        assert stats.get("all_to_all_ok", 0) == sum(1 for k, _d, _o in cases if k == "all_to_all")
        assert {s: stats.get(f"schedule_{s}_ok", 0) for s in ran} == ran


async def test_auto_runs_the_cost_models_choice(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """Small operations at 8 peers run halving-doubling or the tree, large ones the ring: the choice
    the pure cost model makes from (kind, group size, bytes), the same on every peer."""
    n = 8
    cluster = await pccl_cluster(n, network=VirtualNetwork(latency=0.001, bandwidth=1e9))
    sizes = [(np.int64, 512), (np.float32, 6 << 20)]  # 4 KB and 24 MB
    for tag, (dtype, count) in enumerate(sizes):
        xs = [np.full(count, i + 1, dtype) for i in range(n)]
        before = [dict(cluster.peer(i).statistics()) for i in range(n)]
        infos = await cluster.run_all(lambda i, c: c.all_reduce(xs[i], tag=tag))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        want = schedule_for("auto", "all_reduce", n, count * np.dtype(dtype).itemsize)
        for i in range(n):
            assert (xs[i] == n * (n + 1) // 2).all()
            after = cluster.peer(i).statistics()
            key = "schedule_{}_ok".format
            ran = [s for s in SCHEDULES if after.get(key(s), 0) > before[i].get(key(s), 0)]
            assert ran == [want], (count, ran, want)
        assert want == ("hd" if count == 512 else "ring")


async def test_peers_with_different_schedules_fail_with_a_descriptor_mismatch(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """A peer configured for another schedule would wait for frames of another plan: the master's
    descriptor comparison fails the operation on every peer instead, naming the schedule."""
    cluster = await pccl_cluster(3, config=_config("hd"))
    odd = cluster.peer(cluster.alive[0])
    odd.config = dataclasses.replace(odd.config, schedule="tree")
    x = {i: np.arange(16, dtype=np.int64) + i for i in cluster.alive}
    keep = {i: a.copy() for i, a in x.items()}
    results = await cluster.run_all(lambda i, c: c.all_reduce(x[i], tag=5))
    for r in results:
        assert isinstance(r, pccl.PCCLError), r
        assert "schedule: tree on peer" in r.message, r.message
    assert all(_same_bits(x[i], keep[i]) for i in x)
    odd.config = dataclasses.replace(odd.config, schedule="hd")
    again = await cluster.run_all(lambda i, c: c.all_reduce(x[i], tag=5))
    assert all(isinstance(r, pccl.ReduceInfo) for r in again), again
    assert all((x[i] == sum(keep.values())).all() for i in x)


def test_a_bad_schedule_is_refused() -> None:
    with pytest.raises(pccl.InvalidArgumentError, match="schedule"):
        Communicator("127.0.0.1:1", config=dataclasses.replace(DEFAULT_PEER_CONFIG, schedule="butterfly"))


# ------------------------------------------------------------------------------------------------
# a fault at every step of each schedule


class StepCutter:
    """Parses the data frames a victim sends on every P2P stream; when the victim's ``k``-th frame
    overall (in the order they enter the network) has ``cut`` payload bytes out, that stream is
    reset there and ``fired`` is set (``fired_to``: the destination port of the cut stream)."""

    def __init__(self, src: str, p2p_ports: set[int], k: int, cut: int) -> None:
        self.src, self.ports, self.k, self.cut = src, p2p_ports, k, cut
        self.fired = trio.Event()
        self.fired_to = -1
        self.started = 0  # frames whose header has been seen, all streams together
        self._streams: dict[int, list[Any]] = {}  # connection -> [header bytes, left, frame index]

    def __call__(self, ev: TrafficEvent) -> HookAction | None:
        if ev.src != self.src or ev.dst_address[1] not in self.ports or self.fired.is_set():
            return None
        st = self._streams.setdefault(ev.connection, [bytearray(), 0, -1, 0])
        data, pos = ev.data, 0
        while pos < len(data):
            hdr, left = st[0], st[1]
            if left == 0:
                take = min(DATA_HEADER_SIZE - len(hdr), len(data) - pos)
                hdr += data[pos : pos + take]
                pos += take
                if len(hdr) == DATA_HEADER_SIZE:
                    st[1] = st[3] = unpack_data_header_fields(bytes(hdr))[3]
                    st[2] = self.started
                    self.started += 1
                    hdr.clear()
                    if st[2] == self.k and self.cut == 0:
                        return self._fire(ev, pos)
                continue
            if st[2] == self.k:
                done = st[3] - left
                if done + (len(data) - pos) > self.cut:
                    return self._fire(ev, pos + (self.cut - done))
            take = min(left, len(data) - pos)
            st[1] = left - take
            pos += take
        return None

    def _fire(self, ev: TrafficEvent, pos: int) -> HookAction:
        self.fired_to = ev.dst_address[1]
        self.fired.set()
        return Reset(after=pos)


def _contribution(peer_id: int, count: int) -> np.ndarray:
    return (np.arange(count, dtype=np.int64) + 1) * (1 << (4 * peer_id))


def _p2p_ports(cluster: TestCluster) -> set[int]:
    ports = set()
    for i in cluster.alive:
        address = cluster.peer(i).p2p_address
        assert address is not None
        ports.add(address[1])
    return ports


FAULT_N = 5  # not a power of two: halving-doubling folds rank 4 into rank 0 and back out
FAULT_COUNT = 1000  # int64: one frame per transfer
FAULT_ROOT = 0  # broadcasts
# (schedule, kind, victim's ring index): under halving-doubling rank 0 takes part in every round
# (and the fold), rank 1 in every round, rank 4 only in the fold; in the tree rank 0 is the root,
# rank 2 an inner node, rank 4 a leaf.
_VICTIMS = [
    ("hd", "all_reduce", 0), ("hd", "all_reduce", 1), ("hd", "all_reduce", 4),
    ("tree", "all_reduce", 0), ("tree", "all_reduce", 2), ("tree", "all_reduce", 4),
    ("hd", "reduce_scatter", 0), ("tree", "reduce_scatter", 0),
    ("hd", "all_gather", 0), ("tree", "all_gather", 0),
    ("tree", "broadcast", 0), ("tree", "broadcast", 2),
    # reduce to rank 0: the ring chain starts at rank 1 and passes rank 3; in the tree rank 2 is an
    # inner node, rank 4 a leaf (the root sends nothing); all_to_all: every rank sends to every other
    ("ring", "reduce", 1), ("ring", "reduce", 3), ("tree", "reduce", 2), ("tree", "reduce", 4),
    ("ring", "all_to_all", 0), ("ring", "all_to_all", 3),
]
# every frame each victim sends, by its plan (pure): the victim dies at each step in turn
FAULT_CASES = [
    (schedule, kind, victim, k)
    for schedule, kind, victim in _VICTIMS
    for k in range(len(all_plans(schedule, kind, FAULT_N, FAULT_COUNT, 1 << 20, FAULT_ROOT)[victim].sends))
]


@pytest.mark.parametrize(("schedule", "kind", "victim_rank", "k"), FAULT_CASES)
async def test_a_peer_killed_at_every_step_of_each_schedule(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, schedule: str, kind: str,
    victim_rank: int, k: int,
) -> None:
    """The victim's stream to the partner of its ``k``-th frame is reset mid-payload and the victim
    killed: every survivor fails with RANK_CONNECTION_LOST, its buffer as it was; the survivors'
    retry gives exactly the survivors' result."""
    cluster = await pccl_cluster(FAULT_N, config=_config(schedule))
    ring = cluster.peer(cluster.alive[0]).group_ring
    index_of = {cluster.peer(i).peer_id: i for i in cluster.alive}
    victim = index_of[ring[victim_rank]]
    everyone = list(cluster.alive)
    survivors = [i for i in everyone if i != victim]
    n = len(everyone)
    sends = {i: _contribution(cluster.peer(i).peer_id, FAULT_COUNT) for i in everyone}
    if kind == "broadcast":
        recvs = {i: sends[i].copy() for i in everyone}
    elif kind == "all_to_all":  # n blocks of 200 elements (250 once a peer is gone)
        recvs = {i: np.full(FAULT_COUNT, -7, np.int64) for i in everyone}
    else:
        size = n * FAULT_COUNT if kind == "all_gather" else FAULT_COUNT
        recvs = {i: np.full(size, -7, np.int64) for i in everyone}

    async def call(i: int, comm: Communicator) -> Any:
        if kind == "all_reduce":
            return await comm.all_reduce(sends[i], recvs[i], tag=1)
        if kind == "reduce_scatter":
            return await comm.reduce_scatter(sends[i], recvs[i], tag=1)
        if kind == "all_gather":
            return await comm.all_gather(sends[i], recvs[i], tag=1)
        if kind == "reduce":
            return await comm.reduce(sends[i], recvs[i], root=FAULT_ROOT, tag=1)
        if kind == "all_to_all":
            return await comm.all_to_all(sends[i], recvs[i], tag=1)
        return await comm.broadcast(recvs[i], root=FAULT_ROOT, tag=1)

    # one operation first, so that every connection the plans use is open (the cutter parses data
    # frames only, not the hellos of connections opened on first use)
    warm = await cluster.run_all(call, indexes=everyone)
    assert all(not isinstance(r, pccl.PCCLError) for r in warm), warm
    if kind == "broadcast":
        recvs = {i: sends[i].copy() for i in everyone}
    before = {i: recvs[i].tobytes() for i in everyone}
    cutter = StepCutter(cluster.host(victim).name, _p2p_ports(cluster), k, 100)
    assert cluster.network is not None
    cluster.network.add_hook(cutter)

    async def killer() -> None:
        await cutter.fired.wait()
        cluster.kill(victim)

    with trio.fail_after(60):  # virtual seconds: a plan that waits for a dead peer fails here
        async with trio.open_nursery() as nursery:
            nursery.start_soon(killer)
            results = dict(zip(everyone, await cluster.run_all(call, indexes=everyone), strict=True))
    assert cutter.fired.is_set(), f"the victim never sent frame {k}"
    for i in survivors:
        err = results[i]
        assert isinstance(err, pccl.RankConnectionLostError), (i, err)
        assert recvs[i].tobytes() == before[i], f"peer {i}: buffer modified by a failed {kind}"
        assert sends[i].tobytes() == _contribution(cluster.peer(i).peer_id, FAULT_COUNT).tobytes()

    if kind == "all_to_all":
        # as all_gather's below: the group size its blocks were cut for is gone
        changed = await cluster.run_all(call, indexes=survivors)
        assert all(isinstance(r, pccl.InvalidArgumentError) for r in changed), changed
        assert all(recvs[i].tobytes() == before[i] for i in survivors)
    if kind == "all_gather":
        # the survivors still see 5 peers: the master's table of the next op tells them the group
        # has 4 now, and that op fails as documented, leaving recv untouched
        changed = await cluster.run_all(call, indexes=survivors)
        assert all(isinstance(r, pccl.InvalidArgumentError) for r in changed), changed
        assert all(recvs[i].tobytes() == before[i] for i in survivors)
        recvs = {i: np.full((n - 1) * FAULT_COUNT, -7, np.int64) for i in survivors}
    if kind == "broadcast" and victim_rank == FAULT_ROOT:
        # the survivors still name the dead root by its rank: the master's table of the failed
        # op's successor tells them the root is gone (the group they see is updated by it)
        lost = await cluster.run_all(call, indexes=survivors)
        assert all(isinstance(r, pccl.RankConnectionLostError) and "root" in r.message for r in lost), lost
        assert all(recvs[i].tobytes() == before[i] for i in survivors)
    retry = await cluster.run_all(call, indexes=survivors)
    assert all(not isinstance(r, pccl.PCCLError) for r in retry), retry
    order = [index_of[p] for p in cluster.peer(survivors[0]).group_ring]
    assert sorted(order) == survivors
    xs = [sends[i] for i in order]
    for pos, i in enumerate(order):
        if kind == "all_reduce":
            assert (recvs[i] == sum(xs)).all()
        elif kind == "reduce_scatter":
            a, e = chunk_range(FAULT_COUNT, len(order), pos)
            assert (recvs[i][a:e] == cast("np.ndarray[Any, Any]", sum(xs))[a:e]).all()  # (sum of arrays)
        elif kind == "all_gather":
            assert (recvs[i] == np.concatenate(xs)).all()
        elif kind == "reduce":  # the root alone holds the sum; the others' buffers kept their bits
            want = sum(xs) if pos == FAULT_ROOT else np.frombuffer(before[i], np.int64)
            assert (recvs[i] == want).all()
        elif kind == "all_to_all":
            c = FAULT_COUNT // len(order)
            assert (recvs[i] == np.concatenate([x[pos * c : (pos + 1) * c] for x in xs])).all()
        else:  # every survivor holds the new root's (unchanged) contents
            assert (recvs[i] == xs[FAULT_ROOT]).all()
    for i in survivors:  # the warm-up and the retry ran the schedule, the failed op did not count
        assert cluster.peer(i).statistics().get(f"schedule_{schedule}_ok", 0) == 2


# ------------------------------------------------------------------------------------------------
# the link summary the master distributes, and what the choice makes of it


def test_the_master_summarizes_the_measured_links_of_a_group() -> None:
    state = MasterState()
    assert state.link_summary([1, 2, 3]) == []  # nothing measured: the defaults
    state.bandwidth = {(1, 2): (100e6, 0.0), (2, 3): (400e6, 0.0), (3, 9): (1.0, 0.0), (2, 1): (0.0, 0.0)}
    assert state.link_summary([1, 2, 3]) == [100e6, 4.0]  # peer 9 is in no member pair; 0 = failed


def test_establish_carries_the_summary_and_old_bytes_stay_old() -> None:
    row = m.PeerRow(peer_id=3, host="h", port=1, group=0)
    plain = m.EstablishP2P(epoch=7, peers=[row])
    assert msgpack.unpackb(m.encode(plain)) == [m.EstablishP2P.TAG, [7, [[3, "h", 1, 0]]]]
    with_links = m.EstablishP2P(epoch=7, peers=[row], links=[1e8, 3.0])
    assert msgpack.unpackb(m.encode(with_links))[1][2] == [1e8, 3.0]
    assert m.decode(m.encode(with_links)) == with_links
    assert m.decode(m.encode(plain)) == plain
    with pytest.raises(RemoteProtocolError):
        m.decode(msgpack.packb([m.EstablishP2P.TAG, [7]]))  # a required field missing
    with pytest.raises(RemoteProtocolError):
        m.decode(msgpack.packb([m.EstablishP2P.TAG, [7, [], [], 1]]))  # one too many


def test_heterogeneous_links_keep_large_operations_on_the_ring() -> None:
    n, big, small = 64, 16 << 20, 4 << 10
    uniform = LinkModel.from_summary([125e6, 1.5])
    skewed = LinkModel.from_summary([125e6, 10.0])
    assert uniform is not None and skewed is not None
    assert schedule_for("auto", "all_reduce", n, big, links=uniform) == "hd"
    assert schedule_for("auto", "all_reduce", n, big, links=skewed) == "ring"
    assert schedule_for("auto", "all_reduce", n, small, links=skewed) == "hd"  # latency-bound still
    for bad in ([], [1.0], [0.0, 2.0], [1e8, 0.5], [float("nan"), 2.0]):
        assert LinkModel.from_summary(bad) is None
    assert schedule_for("auto", "all_reduce", 2, small, links=skewed) == "ring"  # 2 peers: the exchange
    assert schedule_for("auto", "all_reduce", n, small, quantized=True) == "ring"
    assert schedule_for("hd", "broadcast", n, small) == "tree"
    with pytest.raises(ValueError, match="schedule"):
        schedule_for("butterfly", "all_reduce", n, small)


async def test_peers_choose_with_the_summary_they_were_sent(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """Once the master has measured heterogeneous links, the next topology update's EstablishP2P
    tells every member, and a bandwidth-bound all-reduce at 8 peers keeps the ring on every peer;
    before, with the defaults, it ran halving-doubling."""
    n, count = 8, 1 << 18  # float32: 1 MB
    cluster = await pccl_cluster(n - 1, network=VirtualNetwork(latency=0.0005, bandwidth=None))
    skewed = LinkModel.from_summary([125e6, 10.0])
    want = {"defaults": schedule_for("auto", "all_reduce", n, count * 4),
            "skewed": schedule_for("auto", "all_reduce", n, count * 4, links=skewed)}
    assert want == {"defaults": "hd", "skewed": "ring"}
    for tag, case in enumerate(["defaults", "skewed"]):
        if case == "skewed":
            ids = [cluster.peer(i).peer_id for i in cluster.alive]
            # as if optimize_topology had measured them: one slow pair, the rest 10x faster
            slow = (ids[0], ids[1])
            cluster.master.state.bandwidth = {
                (a, b): (125e6 if (a, b) == slow else 1.25e9, 0.0) for a in ids for b in ids if a != b
            }
        await cluster.add_peer()  # an update round: EstablishP2P to every member
        assert all(cluster.peer(i)._links == (None if case == "defaults" else skewed) for i in cluster.alive)
        xs = {i: np.ones(count, np.float32) for i in cluster.alive}
        before = {i: dict(cluster.peer(i).statistics()) for i in cluster.alive}
        infos = await cluster.run_all(lambda i, c: c.all_reduce(xs[i], tag=tag))
        assert all(isinstance(r, pccl.ReduceInfo) for r in infos), infos
        size = len(cluster.alive)
        assert size == n + tag
        links = None if case == "defaults" else skewed
        got = schedule_for("auto", "all_reduce", size, count * 4, links=links)
        assert got == want[case]
        for i in cluster.alive:
            assert (xs[i] == size).all()
            after = cluster.peer(i).statistics()
            key = f"schedule_{got}_ok"
            assert after.get(key, 0) == before[i].get(key, 0) + 1


@pytest.mark.parametrize(("schedule", "n"), [("hd", 5), ("tree", 4)])
async def test_large_operations_pipeline_over_several_connections(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, schedule: str, n: int
) -> None:
    """Above the inline limit the executor runs one sender task per (partner, connection): several
    4 MiB blocks per transfer, striped over 2 connections per partner, exact."""
    cluster = await pccl_cluster(n, config=_config(schedule), pool_size=2)
    count = (12 << 20) // 8  # int64: 12 MB, three blocks per peer's input
    xs = {i: _contribution(cluster.peer(i).peer_id, count) for i in cluster.alive}
    outs = {i: np.empty(count, np.int64) for i in cluster.alive}
    infos = await cluster.run_all(lambda i, c: c.all_reduce(xs[i], outs[i], tag=2))
    assert all(isinstance(r, pccl.ReduceInfo) for r in infos), infos
    want = sum(xs.values())
    assert all((outs[i] == want).all() for i in cluster.alive)
    root_id = cluster.peer(cluster.alive[0]).group_ring[1]
    bcast = {i: xs[i].copy() for i in cluster.alive}
    infos = await cluster.run_all(lambda i, c: c.broadcast(bcast[i], root=1, tag=3))
    assert all(isinstance(r, pccl.ReduceInfo) for r in infos), infos
    root = next(i for i in cluster.alive if cluster.peer(i).peer_id == root_id)
    assert all((bcast[i] == xs[root]).all() for i in cluster.alive)
    for i in cluster.alive:
        stats = cluster.peer(i).statistics()
        assert stats.get("schedule_tree_ok", 0) + stats.get("schedule_hd_ok", 0) == 2
