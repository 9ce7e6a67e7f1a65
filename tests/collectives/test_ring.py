"""Ring collectives between in-process pools over real loopback TCP, no master."""

from __future__ import annotations

import functools
import itertools
from typing import Any, cast

import ml_dtypes
import numpy as np
import pytest
import trio
from _ring_harness import open_ring, run_ranks

from pccl import InvalidArgumentError, RankConnectionLostError, ReduceOp, TooFewPeersError
from pccl.collectives import op_plan as op_plan_mod
from pccl.collectives import ring as ring_mod
from pccl.collectives.executor import run_collective
from pccl.collectives.ring import owned_range
from pccl.collectives.schedule import cached_plan, chunk_range
from pccl.testing import BareTransport, wait_until

DTYPES: list[Any] = [
    np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
]
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
_UFUNC = {
    ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum
}
_seq = itertools.count(1)


def make_input(rng: np.random.Generator, dtype: Any, op: ReduceOp, count: int) -> np.ndarray:
    """Inputs whose reduction is exact in any order, so the reference is bit-exact too."""
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dt)  # wraps exactly
    if op == ReduceOp.SUM:
        return rng.integers(-8, 9, size=count).astype(dt)
    if op == ReduceOp.PROD:
        return rng.choice(np.array([-2, -1, -0.5, 0.5, 1, 2]), size=count).astype(dt)
    return rng.standard_normal(count).astype(dt)


def reference(sends: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    acc = sends[0].copy()
    for s in sends[1:]:
        _UFUNC[op](acc, s, out=acc)
    return acc


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


async def check_reduce(ring: Any, kind: str, dtype: Any, op: ReduceOp, count: int, block_bytes: int,
                       rng: np.random.Generator) -> None:
    n = len(ring.ids)
    sends = [make_input(rng, dtype, op, count) for _ in range(n)]
    originals = [s.copy() for s in sends]
    outs = [np.zeros(count, dtype) for _ in range(n)]
    res = await run_ranks(ring, kind=kind, sends=sends, outs=outs, tag=3, op_seq=next(_seq), op=op,
                          block_bytes=block_bytes)
    ref = reference(sends, op)
    itemsize = np.dtype(dtype).itemsize
    for r in range(n):
        assert same_bits(sends[r], originals[r]), "send must never be modified"
        if kind == "all_reduce":
            assert same_bits(outs[r], ref), (r, dtype, op, count)
            assert same_bits(outs[r], outs[0])
            size = [e - a for a, e in (chunk_range(count, n, c) for c in range(n))]
            # sends every chunk but r (reduce-scatter), then every chunk but r+1 (all-gather)
            tx = (2 * count - size[r] - size[(r + 1) % n]) * itemsize
            rx = (2 * count - size[(r - 1) % n] - size[r]) * itemsize
            assert res[r] == (tx, rx)
        else:
            a, e = chunk_range(count, n, r)
            assert owned_range(kind, n, r, count) == (a, e)
            assert same_bits(outs[r][a:e], ref[a:e]), (r, dtype, op, count)


# Two peers' small all-reduces take the one-step exchange plan; "ring" forces the ring for them too.
WORLDS = [(2, "exchange"), (2, "ring"), (3, "ring"), (4, "ring")]


def use_algorithm(monkeypatch: pytest.MonkeyPatch, algorithm: str) -> None:
    monkeypatch.setattr(op_plan_mod, "EXCHANGE_MAX_BYTES", 1 << 62 if algorithm == "exchange" else -1)


@pytest.mark.parametrize(("n", "algorithm"), WORLDS)
async def test_every_kind_op_and_dtype_is_exact_and_bit_identical(
    n: int, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_algorithm(monkeypatch, algorithm)
    rng = np.random.default_rng(n)
    count = 37  # not a multiple of any n: uneven chunks
    async with open_ring(n) as ring:
        for dtype in DTYPES:
            for op in OPS:
                for kind in ("all_reduce", "reduce_scatter"):
                    await check_reduce(ring, kind, dtype, op, count, 1 << 20, rng)
            # all-gather: ring order
            sends = [make_input(rng, dtype, ReduceOp.MAX, 5) for _ in range(n)]
            outs = [np.zeros(5 * n, dtype) for _ in range(n)]
            res = await run_ranks(ring, kind="all_gather", sends=sends, outs=outs, tag=4, op_seq=next(_seq))
            expected = np.concatenate(sends)
            assert all(same_bits(o, expected) for o in outs)
            assert res[0] == ((n - 1) * 5 * np.dtype(dtype).itemsize,) * 2
            # broadcast from every root
            for root in range(n):
                sends = [make_input(rng, dtype, ReduceOp.MAX, 11) for _ in range(n)]
                outs = [np.zeros(11, dtype) for _ in range(n)]
                await run_ranks(ring, kind="broadcast", sends=sends, outs=outs, tag=5, op_seq=next(_seq),
                                root=root)
                assert all(same_bits(o, sends[root]) for o in outs), (dtype, root)


@pytest.mark.parametrize(("n", "algorithm"), WORLDS)
async def test_small_and_empty_counts(n: int, algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_algorithm(monkeypatch, algorithm)
    rng = np.random.default_rng(7)
    async with open_ring(n) as ring:
        for count in [0, 1, n - 1, n, n + 1]:
            for kind in ("all_reduce", "reduce_scatter"):
                await check_reduce(ring, kind, np.float32, ReduceOp.SUM, count, 1 << 20, rng)
                await check_reduce(ring, kind, np.int64, ReduceOp.PROD, count, 1 << 20, rng)
            sends = [np.arange(count, dtype=np.int16) + 100 * r for r in range(n)]
            outs = [np.zeros(count * n, np.int16) for _ in range(n)]
            await run_ranks(ring, kind="all_gather", sends=sends, outs=outs, tag=1, op_seq=next(_seq))
            assert all(same_bits(o, np.concatenate(sends)) for o in outs)
            outs = [np.zeros(count, np.int16) for _ in range(n)]
            res = await run_ranks(ring, kind="broadcast", sends=sends, outs=outs, tag=1, op_seq=next(_seq),
                                  root=n - 1)
            assert all(same_bits(o, sends[n - 1]) for o in outs)
        # count 0 moves nothing
        z = [np.zeros(0, np.float32) for _ in range(n)]
        res = await run_ranks(ring, kind="all_reduce", sends=z, outs=[np.zeros(0, np.float32)] * n, tag=1,
                              op_seq=next(_seq))
        assert res == [(0, 0)] * n


@pytest.mark.parametrize("algorithm", ["exchange", "ring"])
@pytest.mark.parametrize("op", OPS)
async def test_two_peers_agree_bit_for_bit_where_op_order_matters(
    algorithm: str, op: ReduceOp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaNs with different payloads and signed zeros: ``op(x0, x1)`` and ``op(x1, x0)`` differ in
    their bits (np.minimum(0.0, -0.0) is -0.0, np.minimum(-0.0, 0.0) is 0.0; a + b keeps a's NaN
    payload), so both peers must evaluate the same operand order."""
    use_algorithm(monkeypatch, algorithm)
    spy: list[bool] = []
    real = cached_plan  # the function op_plan imported (which it does not re-export)

    def recording(*args: Any, exchange: bool = False, **kw: Any) -> Any:
        spy.append(exchange)
        return real(*args, exchange=exchange, **kw)

    monkeypatch.setattr(op_plan_mod, "cached_plan", recording)
    nan_a = np.array([0x7FC00001], np.uint32).view(np.float32)[0]
    nan_b = np.array([0x7FC00002], np.uint32).view(np.float32)[0]
    x0 = np.array([0.0, -0.0, nan_a, nan_a, 1.0, -0.0, 3.0], np.float32)
    x1 = np.array([-0.0, 0.0, nan_b, 2.0, nan_b, -0.0, -3.0], np.float32)
    async with open_ring(2) as ring:
        outs = [np.zeros(7, np.float32) for _ in range(2)]
        await run_ranks(ring, kind="all_reduce", sends=[x0, x1], outs=outs, tag=2, op_seq=next(_seq), op=op)
    assert spy == [algorithm == "exchange"] * 2
    assert outs[0].tobytes() == outs[1].tobytes()
    if algorithm == "exchange":
        with np.errstate(invalid="ignore"):
            assert outs[0].tobytes() == _UFUNC[op](x0, x1).tobytes()


@pytest.fixture(params=["inline", "pipelined"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once with every operation inline, once with sender tasks for every operation."""
    monkeypatch.setattr(ring_mod, "INLINE_SEND_LIMIT", 1 << 62 if request.param == "inline" else -1)
    return str(request.param)


async def test_multi_block_pipeline_with_striping_over_several_connections(path: str) -> None:
    rng = np.random.default_rng(11)
    async with open_ring(3, pool_size=3) as ring:
        # many blocks per step: they stripe over all 3 connections per neighbour
        count = 120_001
        cases = [(np.float64, ReduceOp.SUM), (np.int32, ReduceOp.PROD), (ml_dtypes.bfloat16, ReduceOp.MAX)]
        for dtype, op in cases:
            await check_reduce(ring, "all_reduce", dtype, op, count, 16 * 1024, rng)
        await check_reduce(ring, "reduce_scatter", np.float32, ReduceOp.MIN, count, 10_000, rng)
        sends = [make_input(rng, np.uint8, ReduceOp.SUM, 300_001) for _ in range(3)]
        outs = [np.zeros(300_001, np.uint8) for _ in range(3)]
        await run_ranks(ring, kind="broadcast", sends=sends, outs=outs, tag=9, op_seq=next(_seq), root=1,
                        block_bytes=4096)
        assert all(same_bits(o, sends[1]) for o in outs)
        sends = [make_input(rng, np.int64, ReduceOp.SUM, 50_000) for _ in range(3)]
        outs = [np.zeros(150_000, np.int64) for _ in range(3)]
        await run_ranks(ring, kind="all_gather", sends=sends, outs=outs, tag=9, op_seq=next(_seq),
                        block_bytes=8192)
        assert all(same_bits(o, np.concatenate(sends)) for o in outs)
        for pool in ring.pools:
            stats = pool.statistics()
            assert stats["outgoing"] and all(v == 3 for v in stats["outgoing"].values())
            assert stats["pending_receives"] == 0 and stats["stashed_frames"] == 0


async def test_tiny_blocks_inline_path() -> None:
    rng = np.random.default_rng(5)
    async with open_ring(4) as ring:
        # one element per block
        await check_reduce(ring, "all_reduce", np.float16, ReduceOp.SUM, 1001, 2, rng)
        await check_reduce(ring, "reduce_scatter", np.uint16, ReduceOp.MAX, 1001, 64, rng)


async def test_large_float32_all_reduce() -> None:
    rng = np.random.default_rng(3)
    async with open_ring(3) as ring:
        await check_reduce(ring, "all_reduce", np.float32, ReduceOp.SUM, 3_000_000, 1 << 20, rng)


async def test_generic_stream_path() -> None:
    """Non-TCP streams (no socket to drive directly) take the bounce-buffer path."""
    rng = np.random.default_rng(2)
    async with open_ring(3, transport_factory=BareTransport, pool_size=2) as ring:
        await check_reduce(ring, "all_reduce", np.float32, ReduceOp.SUM, 200_003, 64 * 1024, rng)
        await check_reduce(ring, "all_reduce", np.int8, ReduceOp.MIN, 7, 1 << 20, rng)


@pytest.mark.parametrize("pool_size", [1, 2])
async def test_concurrent_tags_are_independent_and_exact(pool_size: int, path: str) -> None:
    rng = np.random.default_rng(pool_size)
    n = 3
    async with open_ring(n, pool_size=pool_size) as ring:
        jobs = []
        for tag, (count, dtype, op) in enumerate([(150_000, np.float32, ReduceOp.SUM),
                                                   (90_001, np.int64, ReduceOp.PROD),
                                                   (17, np.uint8, ReduceOp.MAX)]):
            sends = [make_input(rng, dtype, op, count) for _ in range(n)]
            outs = [np.zeros(count, dtype) for _ in range(n)]
            jobs.append((tag, sends, outs, op, next(_seq)))
        async with trio.open_nursery() as nursery:
            for tag, sends, outs, op, seq in jobs:
                nursery.start_soon(functools.partial(
                    run_ranks, ring, kind="all_reduce", sends=sends, outs=outs, tag=tag, op_seq=seq, op=op,
                    block_bytes=32 * 1024))
        for _tag, sends, outs, op, _ in jobs:
            ref = reference(sends, op)
            assert all(same_bits(o, ref) for o in outs)


async def test_frames_arriving_before_the_receive_is_registered_are_stashed() -> None:
    rng = np.random.default_rng(9)
    n = 2
    async with open_ring(n) as ring:
        sends = [make_input(rng, np.float32, ReduceOp.SUM, 1000) for _ in range(n)]
        outs = [np.zeros(1000, np.float32) for _ in range(n)]
        seq = next(_seq)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run_ranks(ring, kind="all_reduce", sends=sends, outs=outs, tag=2,
                                                 op_seq=seq, ranks=[0]))
            # 4000 bytes: the exchange sends them as two frames (op_plan.SMALL_FRAME_BYTES)
            await wait_until(lambda: ring.pools[1].statistics()["stashed_frames"] == 2)
            await run_ranks(ring, kind="all_reduce", sends=sends, outs=outs, tag=2, op_seq=seq, ranks=[1])
        assert all(same_bits(o, sends[0] + sends[1]) for o in outs)
        assert ring.pools[1].statistics()["stashed_bytes"] == 0


async def test_bad_arguments_are_rejected_before_anything_is_sent() -> None:
    async with open_ring(2) as ring:
        pool, ids = ring.pools[0], ring.ids
        x = np.zeros(10, np.float32)
        kw: dict[str, Any] = dict(kind="all_reduce", ring=ids, my_id=ids[0], tag=1, op_seq=1, send=x,
                                  out=np.zeros(10, np.float32), op=ReduceOp.SUM)
        with pytest.raises(TooFewPeersError):
            await run_collective(pool, **{**kw, "ring": [ids[0]]})
        bad: list[dict[str, Any]] = [
            {"kind": "scatter"},
            {"my_id": 999},
            {"ring": [ids[0], ids[0]]},
            {"out": np.zeros(9, np.float32)},
            {"out": np.zeros(10, np.float64)},
            {"out": x},
            {"out": np.zeros((2, 5), np.float32)},
            {"op": ReduceOp.AVG},
            {"tag": -1},
            {"kind": "broadcast", "root": 2},
            {"block_bytes": 0},
        ]
        for change in bad:
            with pytest.raises(InvalidArgumentError):
                await run_collective(pool, **{**kw, **change})
        assert pool.statistics()["frames_sent"] == 0


async def test_lost_peer_fails_the_others_cleanly_and_out_is_not_written_afterwards(path: str) -> None:
    rng = np.random.default_rng(4)
    n, count = 3, 400_000
    async with open_ring(n) as ring:
        sends = [make_input(rng, np.float32, ReduceOp.SUM, count) for _ in range(n)]
        outs = [np.zeros(count, np.float32) for _ in range(n)]
        errors: dict[int, BaseException] = {}
        snapshots: dict[int, bytes] = {}
        seq = next(_seq)

        async def participant(i: int) -> None:
            try:
                await run_collective(ring.pools[i], kind="all_reduce", ring=ring.ids,
                                     my_id=ring.ids[i], tag=1, op_seq=seq, send=sends[i],
                                     out=outs[i], op=ReduceOp.SUM, block_bytes=16 * 1024)
            except BaseException as exc:
                errors[i] = exc
                snapshots[i] = outs[i].tobytes()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(participant, 0)
            nursery.start_soon(participant, 1)
            # peer 2 never joins; once the others are under way, it dies
            await wait_until(lambda: ring.pools[0].statistics()["frames_received"] > 0
                             or ring.pools[2].statistics()["frames_stashed_total"] > 2)
            await ring.pools[2].aclose()
        assert set(errors) == {0, 1}
        for i in (0, 1):
            assert type(errors[i]) is RankConnectionLostError, repr(errors[i])
        # let every reader notice the closed connections, then make sure nothing wrote into out
        await wait_until(lambda: all(not p.statistics()["incoming"] for p in ring.pools[:2]))
        for i in (0, 1):
            assert outs[i].tobytes() == snapshots[i]
            assert ring.pools[i].statistics()["pending_receives"] == 0


async def test_cancelled_participant_stops_writing_and_the_others_fail(
    path: str, autojump_clock: trio.abc.Clock
) -> None:
    # A bandwidth-limited virtual network: the victim cannot have received (and so forwarded)
    # everything by the time it is cancelled, so the survivor must fail.
    rng = np.random.default_rng(8)
    n, count = 2, 2_000_000
    _net, hosts = _vnet_ring(n, latency=0.001, bandwidth=200e6)
    async with open_ring(n, transports=hosts) as ring:
        sends = [make_input(rng, np.float32, ReduceOp.SUM, count) for _ in range(n)]
        outs = [np.zeros(count, np.float32) for _ in range(n)]
        seq = next(_seq)
        other_error: list[BaseException] = []
        snapshot: list[bytes] = []

        async def survivor() -> None:
            try:
                await run_collective(ring.pools[1], kind="all_reduce", ring=ring.ids,
                                     my_id=ring.ids[1], tag=1, op_seq=seq, send=sends[1],
                                     out=outs[1], op=ReduceOp.SUM, block_bytes=64 * 1024)
            except RankConnectionLostError as exc:
                other_error.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(survivor)
            with trio.CancelScope() as scope:
                async def cancel_midway() -> None:
                    # checked every virtual microsecond: cancel right after the 3rd of 128 frames
                    await wait_until(lambda: ring.pools[0].statistics()["frames_received"] >= 3,
                                     interval=1e-6)
                    scope.cancel()
                nursery.start_soon(cancel_midway)
                await run_collective(ring.pools[0], kind="all_reduce", ring=ring.ids,
                                     my_id=ring.ids[0], tag=1, op_seq=seq, send=sends[0],
                                     out=outs[0], op=ReduceOp.SUM, block_bytes=64 * 1024)
            assert scope.cancelled_caught
            snapshot.append(outs[0].tobytes())
        assert len(other_error) == 1
        await wait_until(lambda: not ring.pools[0].statistics()["incoming"])
        assert outs[0].tobytes() == snapshot[0]
        assert not ring.pools[0].is_connected(ring.ids[1])
        # the pools recover: reconnect and run again
        await ring.connect_ring()
        await check_reduce(ring, "all_reduce", np.float32, ReduceOp.SUM, 1000, 1 << 20, rng)


async def test_missing_connection_is_reported_as_lost() -> None:
    async with open_ring(2, connect=False) as ring:
        x = np.ones(10, np.float32)
        with pytest.raises(RankConnectionLostError):
            await run_collective(ring.pools[0], kind="all_reduce", ring=ring.ids, my_id=ring.ids[0], tag=1,
                                 op_seq=next(_seq), send=x, out=np.zeros(10, np.float32))




# ---------------------------------------------------------------------------------------------
# Over the in-memory virtual network (generic stream path, virtual time, fault injection)


def _vnet_ring(n: int, **net_kw: Any) -> tuple[Any, list[Any]]:
    from pccl.testing.network import VirtualNetwork

    net = VirtualNetwork(loopback=True, **net_kw)
    return net, [net.host(f"peer{i}") for i in range(n)]


async def test_virtual_network_with_latency_and_bandwidth(autojump_clock: trio.abc.Clock) -> None:
    rng = np.random.default_rng(12)
    _net, hosts = _vnet_ring(3, latency=0.02, bandwidth=50e6)
    async with open_ring(3, transports=hosts, pool_size=2) as ring:
        t0 = trio.current_time()
        await check_reduce(ring, "all_reduce", np.float32, ReduceOp.SUM, 300_000, 64 * 1024, rng)
        elapsed = trio.current_time() - t0
        # 4 steps of 400 KB over 50 MB/s links with 20 ms latency: bounded, virtual time
        assert 0.04 < elapsed < 1.0
        await check_reduce(ring, "reduce_scatter", np.int16, ReduceOp.MIN, 1001, 1 << 20, rng)


async def test_virtual_host_crash_mid_op_fails_survivors(autojump_clock: trio.abc.Clock, path: str) -> None:
    rng = np.random.default_rng(13)
    n, count = 3, 1_000_000
    net, hosts = _vnet_ring(n, latency=0.001, bandwidth=100e6)
    async with open_ring(n, transports=hosts) as ring:
        sends = [make_input(rng, np.float32, ReduceOp.SUM, count) for _ in range(n)]
        outs = [np.zeros(count, np.float32) for _ in range(n)]
        errors: dict[int, BaseException] = {}
        seq = next(_seq)

        async def participant(i: int) -> None:
            try:
                await run_collective(ring.pools[i], kind="all_reduce", ring=ring.ids, my_id=ring.ids[i],
                                     tag=1, op_seq=seq, send=sends[i], out=outs[i], block_bytes=64 * 1024)
            except BaseException as exc:
                errors[i] = exc

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(participant, i)
            await wait_until(lambda: ring.pools[2].statistics()["frames_received"] >= 4)
            t_crash = trio.current_time()
            net.crash(hosts[2])
        assert trio.current_time() - t_crash < 1.0  # survivors fail promptly, no timeout involved
        assert type(errors[0]) is RankConnectionLostError
        assert type(errors[1]) is RankConnectionLostError


async def test_connection_reset_in_the_middle_of_a_frame(autojump_clock: trio.abc.Clock) -> None:
    from pccl.testing.network import reset_after

    rng = np.random.default_rng(14)
    n, count = 2, 500_000
    net, hosts = _vnet_ring(n, latency=0.001)
    async with open_ring(n, transports=hosts) as ring:
        port = ring.addresses[1][1]
        # the ring connection from peer0 to peer1's listener dies 100 KB + 3 bytes into its stream
        net.add_hook(reset_after(100_003, port=port, src=hosts[0].name))
        sends = [make_input(rng, np.float32, ReduceOp.SUM, count) for _ in range(n)]
        outs = [np.zeros(count, np.float32) for _ in range(n)]
        errors: list[BaseException] = []

        async def participant(i: int) -> None:
            try:
                await run_collective(ring.pools[i], kind="all_reduce", ring=ring.ids, my_id=ring.ids[i],
                                     tag=1, op_seq=77, send=sends[i], out=outs[i], block_bytes=256 * 1024)
            except BaseException as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(participant, i)
        assert len(errors) == 2 and all(type(e) is RankConnectionLostError for e in errors), errors
        # both sides dropped the broken connections; a reconnect brings the ring back
        await ring.connect_ring()
        await check_reduce(ring, "all_reduce", np.float32, ReduceOp.SUM, 10_000, 1 << 20, rng)


# ---------------------------------------------------------------------------------------------
# Quantized all-reduce / reduce-scatter


@pytest.mark.parametrize("n", [2, 3])
async def test_quantized_all_reduce_is_bit_identical_and_close(n: int) -> None:
    from pccl import DataType, QuantizationAlgorithm, QuantizationOptions

    rng = np.random.default_rng(21 + n)
    async with open_ring(n) as ring:
        for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
            for alg in (QuantizationAlgorithm.MIN_MAX, QuantizationAlgorithm.ZERO_POINT_SCALE):
                for qdt, qmax in ((DataType.UINT8, 255), (DataType.UINT16, 65535)):
                    count = 3001
                    sends = [rng.standard_normal(count).astype(dtype) for _ in range(n)]
                    outs = [np.zeros(count, dtype) for _ in range(n)]
                    q = QuantizationOptions(quantized_datatype=qdt, algorithm=alg)
                    results: list[Any] = [None] * n

                    async def one(i: int, sends: Any = sends, outs: Any = outs, q: Any = q,
                                  results: Any = results, seq: int = next(_seq)) -> None:
                        results[i] = await run_collective(
                            ring.pools[i], kind="all_reduce", ring=ring.ids, my_id=ring.ids[i], tag=1,
                            op_seq=seq, send=sends[i], out=outs[i], block_bytes=2048, quantization=q)

                    async with trio.open_nursery() as nursery:
                        for i in range(n):
                            nursery.start_soon(one, i)
                    assert all(same_bits(o, outs[0]) for o in outs), (dtype, alg, qdt)
                    ref = cast("np.ndarray[Any, Any]", sum(s.astype(np.float64) for s in sends))
                    err = np.abs(outs[0].astype(np.float64) - ref).max()
                    spread = 12 * n  # generous: every hop re-quantizes a partial sum
                    assert err <= spread * (ref.max() - ref.min()) / qmax + 0.05 * (dtype != np.float64), err
                    if qdt == DataType.UINT8:
                        assert err > 0  # the payload really was quantized
                    itemsize, qsize = np.dtype(dtype).itemsize, 1 if qdt == DataType.UINT8 else 2
                    plain_tx = (2 * count - 2 * (count // n)) * itemsize  # upper bound without quantization
                    if qsize < itemsize:
                        assert results[0][0] < plain_tx * (qsize + 0.5) / itemsize


async def test_quantized_multi_block_and_reduce_scatter(path: str) -> None:
    from pccl import DataType, QuantizationAlgorithm, QuantizationOptions

    rng = np.random.default_rng(31)
    n, count = 3, 900_001
    q = QuantizationOptions(quantized_datatype=DataType.UINT16, algorithm=QuantizationAlgorithm.MIN_MAX)
    async with open_ring(n, pool_size=2) as ring:
        for kind in ("all_reduce", "reduce_scatter"):
            sends = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
            outs = [np.zeros(count, np.float32) for _ in range(n)]
            seq = next(_seq)
            res: list[Any] = [None] * n

            async def one(i: int, kind: str = kind, sends: Any = sends, outs: Any = outs, seq: int = seq,
                          res: Any = res) -> None:
                res[i] = await run_collective(ring.pools[i], kind=kind, ring=ring.ids, my_id=ring.ids[i],
                                              tag=2, op_seq=seq, send=sends[i], out=outs[i],
                                              block_bytes=256 * 1024, quantization=q)

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            ref = cast("np.ndarray[Any, Any]", sum(s.astype(np.float64) for s in sends))
            for r in range(n):
                a, e = (0, count) if kind == "all_reduce" else chunk_range(count, n, r)
                assert np.abs(outs[r][a:e] - ref[a:e]).max() < 1e-3
            if kind == "all_reduce":
                assert all(same_bits(o, outs[0]) for o in outs)
                assert res[0][0] < (2 * count * 4) * 2 // 3  # ~half of the float32 bytes


async def test_quantization_argument_checks() -> None:
    from pccl import DataType, QuantizationAlgorithm, QuantizationOptions

    q = QuantizationOptions(quantized_datatype=DataType.UINT8, algorithm=QuantizationAlgorithm.MIN_MAX)
    async with open_ring(2) as ring:
        base: dict[str, Any] = dict(ring=ring.ids, my_id=ring.ids[0], tag=1, op_seq=next(_seq),
                                    quantization=q)
        with pytest.raises(InvalidArgumentError, match="floating"):
            await run_collective(ring.pools[0], kind="all_reduce", send=np.zeros(4, np.int32),
                                 out=np.zeros(4, np.int32), **base)
        with pytest.raises(InvalidArgumentError, match="applies to"):
            await run_collective(ring.pools[0], kind="all_gather", send=np.zeros(4, np.float32),
                                 out=np.zeros(8, np.float32), **base)
        bad = QuantizationOptions(quantized_datatype=DataType.INT8, algorithm=QuantizationAlgorithm.MIN_MAX)
        with pytest.raises(InvalidArgumentError, match="UINT8 or UINT16"):
            await run_collective(ring.pools[0], kind="all_reduce", send=np.zeros(4, np.float32),
                                 out=np.zeros(4, np.float32), **{**base, "quantization": bad})
        # NONE means plain
        none = QuantizationOptions(algorithm=QuantizationAlgorithm.NONE)
        sends = [np.full(4, 1.5, np.float32), np.full(4, 2.0, np.float32)]
        outs = [np.zeros(4, np.float32) for _ in range(2)]
        seq = next(_seq)
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(functools.partial(
                    run_collective, ring.pools[i], kind="all_reduce", ring=ring.ids, my_id=ring.ids[i], tag=1,
                    op_seq=seq, send=sends[i], out=outs[i], quantization=none))
        assert all(same_bits(o, np.full(4, 3.5, np.float32)) for o in outs)


@pytest.mark.parametrize("n", [2, 3])  # 2: the exchange plan (240 KB), 3: the ring
@pytest.mark.parametrize("after_frames", [0, 1, 4, 9])
async def test_cancel_at_any_point_then_recover(after_frames: int, n: int, path: str) -> None:
    rng = np.random.default_rng(after_frames)
    count = 60_000
    async with open_ring(n) as ring:
        sends = [make_input(rng, np.float32, ReduceOp.SUM, count) for _ in range(n)]
        outs = [np.zeros(count, np.float32) for _ in range(n)]
        seq = next(_seq)
        outcome: dict[int, str] = {}
        snapshots: dict[int, bytes] = {}
        base = ring.pools[1].statistics()["frames_received"]

        async def participant(i: int, scope: trio.CancelScope | None = None) -> None:
            try:
                with scope or trio.CancelScope():
                    await run_collective(ring.pools[i], kind="all_reduce", ring=ring.ids, my_id=ring.ids[i],
                                         tag=4, op_seq=seq, send=sends[i], out=outs[i], block_bytes=4096)
                    outcome[i] = "ok"
                if i not in outcome:
                    outcome[i] = "cancelled"
            except RankConnectionLostError:
                outcome[i] = "lost"
            snapshots[i] = outs[i].tobytes()

        victim_scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(participant, i, victim_scope if i == 1 else None)
            await wait_until(lambda: ring.pools[1].statistics()["frames_received"] - base >= after_frames,
                             interval=0)
            victim_scope.cancel()
        # 80 frames per peer in the ring: the victim is always cancelled mid-way, and every other
        # peer fails. The exchange (59 frames each way) has no dependencies: each side sends all of
        # its frames at once, so either side may already hold everything when the cancellation
        # lands, and then its data plane completes (in a communicator, the vote on completion is
        # what aborts the operation there). Whoever completed holds the exact sum.
        if n == 3:
            assert outcome == {0: "lost", 1: "cancelled", 2: "lost"}
        else:
            assert outcome[1] in ("cancelled", "ok") and outcome[0] in ("lost", "ok")
            assert "cancelled" in outcome.values() or outcome == {0: "ok", 1: "ok"}
            for i in range(n):
                if outcome[i] == "ok":
                    assert same_bits(outs[i], sends[0] + sends[1])
        await wait_until(lambda: all(not p.statistics()["pending_receives"] for p in ring.pools))
        for i in range(n):
            assert outs[i].tobytes() == snapshots[i]  # nothing written after the call returned
        await ring.connect_ring()
        await check_reduce(ring, "all_reduce", np.float32, ReduceOp.SUM, count, 4096, rng)


async def test_ready_frames_earlier_steps_first() -> None:
    from pccl.collectives.schedule import SRC_OUT, SendFrame

    frames = [SendFrame(seq=s, source=SRC_OUT, start=0, end=1, after=-1, lane=0, step=st)
              for s, st in ((0, 0), (1, 0), (2, 1), (3, 1), (4, 2))]
    q = ring_mod._ReadyFrames()
    for j in (4, 2, 1, 3, 0):
        q.push(frames[j], j)
    q.close()
    order = [await q.pop() for _ in range(6)]
    # earlier ring steps first (the reduce-scatter is never overtaken), then seq order; None once drained
    assert order == [0, 1, 2, 3, 4, None]


def test_scratch_reuse_is_bounded() -> None:
    ring_mod._scratch.clear()
    a = ring_mod._take_scratch(1000)
    ring_mod._give_back_scratch(a)
    assert ring_mod._take_scratch(1000) is a  # same size: reused
    assert ring_mod._take_scratch(1000) is not a  # handed out once only
    bufs = [ring_mod._take_scratch(100 + i) for i in range(ring_mod._SCRATCH_KEEP + 2)]
    for b in bufs:
        ring_mod._give_back_scratch(b)
    assert len(ring_mod._scratch) == ring_mod._SCRATCH_KEEP
    # the two oldest were dropped
    assert ring_mod._take_scratch(100) is not bufs[0] and ring_mod._take_scratch(101) is not bufs[1]
    assert ring_mod._take_scratch(100 + ring_mod._SCRATCH_KEEP + 1) is bufs[-1]  # the newest is kept
    ring_mod._scratch.clear()


async def test_quantized_ops_reuse_scratch_and_stay_identical(path: str) -> None:
    from pccl import DataType, QuantizationAlgorithm, QuantizationOptions

    rng = np.random.default_rng(5)
    n, count = 2, 200_000
    q = QuantizationOptions(quantized_datatype=DataType.UINT8, algorithm=QuantizationAlgorithm.MIN_MAX)
    ring_mod._scratch.clear()
    async with open_ring(n) as ring:
        sends = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
        results = []
        for _ in range(2):
            outs = [np.full(count, np.nan, np.float32) for _ in range(n)]
            seq = next(_seq)

            async def one(i: int, outs: Any = outs, seq: int = seq) -> None:
                await run_collective(ring.pools[i], kind="all_reduce", ring=ring.ids, my_id=ring.ids[i],
                                     tag=3, op_seq=seq, send=sends[i], out=outs[i],
                                     block_bytes=64 * 1024, quantization=q)

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            assert same_bits(outs[0], outs[1])
            results.append(outs[0])
            # both ranks' scratch buffers were handed back (same size: a 2-rank all-reduce is symmetric)
            assert len(ring_mod._scratch) == n
        # the second op ran in the first one's (dirty) scratch and produced the same bits
        assert same_bits(results[0], results[1])
    ring_mod._scratch.clear()


async def test_quantized_blocks_are_a_fraction_of_block_bytes(path: str) -> None:
    from pccl import DataType, QuantizationAlgorithm, QuantizationOptions

    n, count, block_bytes = 2, 64 * 1024, 64 * 1024  # float32: 4 plain blocks per chunk
    q = QuantizationOptions(quantized_datatype=DataType.UINT8, algorithm=QuantizationAlgorithm.MIN_MAX)
    sends = [np.ones(count, np.float32) for _ in range(n)]
    async with open_ring(n) as ring:
        for quant, split in ((None, 1), (q, op_plan_mod.QUANTIZED_BLOCK_DIVISOR)):
            outs = [np.zeros(count, np.float32) for _ in range(n)]
            before = ring.pools[0].statistics()["frames_sent"]
            seq = next(_seq)

            async def one(i: int, outs: Any = outs, seq: int = seq, quant: Any = quant) -> None:
                await run_collective(ring.pools[i], kind="all_reduce", ring=ring.ids, my_id=ring.ids[i],
                                     tag=4, op_seq=seq, send=sends[i], out=outs[i],
                                     block_bytes=block_bytes, quantization=quant)

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            assert (outs[0] == 2).all() and (outs[1] == 2).all()
            # 2 steps (reduce-scatter, all-gather) of one chunk each; quantized blocks are 1/split as long
            per_step = (count // n) * 4 // block_bytes * split
            assert ring.pools[0].statistics()["frames_sent"] - before == 2 * per_step
