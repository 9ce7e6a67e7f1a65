"""All-reduce through the blocking API: numpy and torch buffers, async handles, multiple-with-retry."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pccl.blocking import (
    Attribute,
    Communicator,
    DataType,
    DistributionHint,
    PCCLError,
    QuantizationAlgorithm,
    QuantizationOptions,
    ReduceDescriptor,
    ReduceOp,
    ReduceOpDescriptor,
    ReduceOperandDescriptor,
    Result,
    SharedState,
    TensorInfo,
)

from ._helpers import JOIN_TIMEOUT, run_threads

Cluster = Callable[..., list[Communicator]]


def _peer_values(rank: int, n: int, dtype: type) -> np.ndarray:
    # Distinct per peer and per element, small enough that PROD stays exact.
    return ((np.arange(n) % 3) + rank + 1).astype(dtype)


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (ReduceOp.SUM, lambda a, b: a + b),
        (ReduceOp.AVG, lambda a, b: (a + b) / 2),
        (ReduceOp.PROD, lambda a, b: a * b),
        (ReduceOp.MAX, np.maximum),
        (ReduceOp.MIN, np.minimum),
    ],
)
def test_all_reduce_numpy_ops(pair: list[Communicator], op: ReduceOp,
                              expected: Callable[..., np.ndarray]) -> None:
    n = 1001  # not a multiple of the world size: uneven chunks
    sends = [_peer_values(r, n, np.float32) for r in range(2)]
    recvs = [np.full(n, -1, dtype=np.float32) for _ in range(2)]
    infos = run_threads([lambda r=r: pair[r].all_reduce(sends[r], recvs[r], op=op) for r in range(2)])
    want = expected(sends[0], sends[1]).astype(np.float32)
    for r in range(2):
        np.testing.assert_array_equal(recvs[r], want)
        assert infos[r].local_world_size == 2
        assert infos[r].tx_bytes > 0 and infos[r].rx_bytes > 0
    # send buffers are inputs only
    np.testing.assert_array_equal(sends[0], _peer_values(0, n, np.float32))


def test_all_reduce_numpy_in_place_int32_and_float64(pair: list[Communicator]) -> None:
    ints = [np.arange(64, dtype=np.int32) * (r + 1) for r in range(2)]
    floats = [np.linspace(0, 1, 33) + r for r in range(2)]

    def work(r: int) -> None:
        pair[r].all_reduce(ints[r], ints[r], op=ReduceOp.SUM)
        pair[r].all_reduce(floats[r], floats[r], op=ReduceOp.MAX, tag=1)

    run_threads([lambda r=r: work(r) for r in range(2)])
    np.testing.assert_array_equal(ints[0], np.arange(64, dtype=np.int32) * 3)
    np.testing.assert_array_equal(ints[0], ints[1])
    np.testing.assert_array_equal(floats[0], np.linspace(0, 1, 33) + 1)
    assert floats[0].tobytes() == floats[1].tobytes()


def test_all_reduce_three_peers(cluster_factory: Cluster) -> None:
    comms = cluster_factory(3)
    assert all(c.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 3 for c in comms)
    bufs = [np.full(10, r + 1, dtype=np.int64) for r in range(3)]
    infos = run_threads([lambda r=r: comms[r].all_reduce(bufs[r], bufs[r], op=ReduceOp.SUM)
                         for r in range(3)])
    for b in bufs:
        np.testing.assert_array_equal(b, np.full(10, 6))
    assert [i.local_world_size for i in infos] == [3, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_all_reduce_torch(pair: list[Communicator], dtype: torch.dtype) -> None:
    sends = [(torch.arange(300) % 7 + r).to(dtype) for r in range(2)]
    recvs = [torch.zeros(300, dtype=dtype) for _ in range(2)]
    run_threads([lambda r=r: pair[r].all_reduce(sends[r], recvs[r], op=ReduceOp.SUM) for r in range(2)])
    want = ((torch.arange(300) % 7) * 2 + 1).to(dtype)
    for r in range(2):
        assert torch.equal(recvs[r], want)


def test_all_reduce_torch_2d_in_place_avg(pair: list[Communicator]) -> None:
    ts = [torch.full((4, 5), float(r * 2)) for r in range(2)]
    run_threads([lambda r=r: pair[r].all_reduce(ts[r], ts[r], op=ReduceOp.AVG) for r in range(2)])
    assert torch.equal(ts[0], torch.full((4, 5), 1.0))
    assert torch.equal(ts[0], ts[1])


def test_quantized_all_reduce_is_close_and_bit_identical(pair: list[Communicator]) -> None:
    rng = np.random.default_rng(7)
    sends = [rng.standard_normal(4096).astype(np.float32) for _ in range(2)]
    recvs = [np.empty(4096, dtype=np.float32) for _ in range(2)]
    q = QuantizationOptions(quantized_datatype=DataType.UINT8, algorithm=QuantizationAlgorithm.MIN_MAX)
    infos = run_threads([
        lambda r=r: pair[r].all_reduce(sends[r], recvs[r], op=ReduceOp.SUM, quantization_options=q,
                                       operand_descriptor=ReduceOperandDescriptor(DataType.FLOAT32,
                                                                                  DistributionHint.NORMAL))
        for r in range(2)
    ])
    assert recvs[0].tobytes() == recvs[1].tobytes()
    exact = sends[0] + sends[1]
    assert np.max(np.abs(recvs[0] - exact)) < 0.2
    # one byte per element on the wire instead of four
    assert infos[0].tx_bytes < 4096 * 4 // 2


def test_all_reduce_argument_errors(pair: list[Communicator]) -> None:
    comm = pair[0]
    a = np.zeros(8, dtype=np.float32)
    cases: list[Callable[[], object]] = [
        lambda: comm.all_reduce(a, torch.zeros(8), op=ReduceOp.SUM),  # numpy with torch
        lambda: comm.all_reduce(a, np.zeros(8, dtype=np.float64), op=ReduceOp.SUM),  # dtype mismatch
        lambda: comm.all_reduce(a, np.zeros(9, dtype=np.float32), op=ReduceOp.SUM),  # size mismatch
        lambda: comm.all_reduce(np.zeros((4, 4), dtype=np.float32).T, np.zeros((4, 4), dtype=np.float32),
                                op=ReduceOp.SUM),  # not contiguous
        lambda: comm.all_reduce(a, a, op=ReduceOp.SUM,
                                operand_descriptor=ReduceOperandDescriptor(DataType.INT32)),
        lambda: comm.all_reduce(a, a, op=ReduceOp.SUM, tag=-1),
        lambda: comm.all_reduce([1.0, 2.0], [1.0, 2.0], op=ReduceOp.SUM),
    ]
    for case in cases:
        with pytest.raises(PCCLError) as info:
            case()
        assert info.value.result == Result.INVALID_ARGUMENT
        assert isinstance(info.value, ValueError)


def test_lone_peer_gets_too_few_peers(cluster_factory: Cluster) -> None:
    (comm,) = cluster_factory(1)
    x = np.ones(4, dtype=np.float32)
    with pytest.raises(PCCLError) as info:
        comm.all_reduce(x, x, op=ReduceOp.SUM)
    assert info.value.result == Result.TOO_FEW_PEERS
    # as the established bindings: the async launch itself raises (issue 16), nothing runs
    with pytest.raises(PCCLError) as launch:
        comm.all_reduce_async(x, x, op=ReduceOp.SUM)
    assert launch.value.result == Result.TOO_FEW_PEERS
    np.testing.assert_array_equal(x, np.ones(4, dtype=np.float32))
    # the tag was not left registered: a later launch with it fails the same way, not with "tag running"
    with pytest.raises(PCCLError) as again:
        comm.all_reduce_async(x, x, op=ReduceOp.SUM)
    assert again.value.result == Result.TOO_FEW_PEERS


# ---------------------------------------------------------------------------------------------------------
# async handles


def test_async_reduces_with_distinct_tags_run_concurrently(pair: list[Communicator]) -> None:
    n_ops = 5
    bufs = [[np.full(100 + i, float(r + i), dtype=np.float32) for i in range(n_ops)] for r in range(2)]

    def work(r: int) -> list[tuple[bool, Result, int]]:
        handles = [pair[r].all_reduce_async(bufs[r][i], bufs[r][i], op=ReduceOp.SUM, tag=i)
                   for i in range(n_ops)]
        return [(ok, st, info.local_world_size) for ok, st, info in (h.wait() for h in handles)]

    results = run_threads([lambda r=r: work(r) for r in range(2)])
    for r in range(2):
        assert results[r] == [(True, Result.SUCCESS, 2)] * n_ops
        for i in range(n_ops):
            np.testing.assert_array_equal(bufs[r][i], np.full(100 + i, float(2 * i + 1)))


def test_async_handle_waited_from_another_thread(pair: list[Communicator]) -> None:
    bufs = [np.full(16, float(r), dtype=np.float32) for r in range(2)]
    handles = run_threads([lambda r=r: pair[r].all_reduce_async(bufs[r], bufs[r], op=ReduceOp.SUM)
                           for r in range(2)])
    outcomes = run_threads([h.wait for h in handles])
    assert [o[0] for o in outcomes] == [True, True]
    assert handles[0].wait() is outcomes[0]  # waiting again returns the same outcome
    np.testing.assert_array_equal(bufs[0], np.ones(16))


def test_topology_changes_and_syncs_refused_while_async_op_runs(pair: list[Communicator]) -> None:
    a, b = pair
    xa = np.full(32, 1.0, dtype=np.float32)
    xb = np.full(32, 2.0, dtype=np.float32)
    state = SharedState([TensorInfo.from_numpy(np.zeros(4, dtype=np.float32), "w")])
    # Only `a` launches: its operation waits for `b`, so it is certainly still running.
    handle = a.all_reduce_async(xa, xa, op=ReduceOp.SUM, tag=7)
    assert not handle.done()
    for call in (a.update_topology, a.optimize_topology, lambda: a.sync_shared_state(state)):
        with pytest.raises(PCCLError) as info:
            call()
        assert info.value.result == Result.PENDING_ASYNC_OPS
    with pytest.raises(PCCLError) as dup:
        a.all_reduce_async(xa, xa, op=ReduceOp.SUM, tag=7)
    assert dup.value.result == Result.INVALID_USAGE
    # are_peers_pending is allowed while collectives run (both peers vote).
    assert run_threads([a.are_peers_pending, b.are_peers_pending]) == [False, False]
    assert b.all_reduce(xb, xb, op=ReduceOp.SUM, tag=7).local_world_size == 2
    ok, status, _ = handle.wait()
    assert ok and status == Result.SUCCESS
    np.testing.assert_array_equal(xa, np.full(32, 3.0))
    # Once waited for, topology calls are allowed again.
    run_threads([a.update_topology, b.update_topology])


def test_close_fails_running_async_ops_without_hanging(pair: list[Communicator]) -> None:
    a, _ = pair
    x = np.ones(8, dtype=np.float32)
    handle = a.all_reduce_async(x, x, op=ReduceOp.SUM)
    waiter_result: list[tuple[bool, Result, object]] = []
    waiter = threading.Thread(target=lambda: waiter_result.append(handle.wait()), daemon=True)
    waiter.start()
    a.close()
    waiter.join(JOIN_TIMEOUT)
    assert not waiter.is_alive()
    ok, status, _ = waiter_result[0]
    assert not ok
    assert status in (Result.INVALID_USAGE, Result.MASTER_CONNECTION_FAILED)
    np.testing.assert_array_equal(x, np.ones(8, dtype=np.float32))


# ---------------------------------------------------------------------------------------------------------
# all_reduce_multiple_with_retry


def _descriptors(tensors: list[torch.Tensor], op: ReduceOp) -> list[ReduceOpDescriptor]:
    return [
        ReduceOpDescriptor.from_torch(
            send=t, recv=t,
            reduce_descriptor=ReduceDescriptor(
                count=t.numel(), op=op, tag=tag,
                operand_descriptor=ReduceOperandDescriptor(datatype=DataType.FLOAT32,
                                                           distribution_hint=DistributionHint.NORMAL),
                quantization_options=QuantizationOptions(quantized_datatype=DataType.FLOAT32,
                                                         algorithm=QuantizationAlgorithm.NONE)))
        for tag, t in enumerate(tensors)
    ]


def test_all_reduce_multiple_with_retry_torch(pair: list[Communicator]) -> None:
    sizes = [1, 17, 256, 1000, 3, 64]
    tensors = [[torch.full((s,), float(r + 1)) for s in sizes] for r in range(2)]
    infos = run_threads([
        lambda r=r: pair[r].all_reduce_multiple_with_retry(_descriptors(tensors[r], ReduceOp.AVG),
                                                           max_in_flight=len(sizes))
        for r in range(2)
    ])
    for r in range(2):
        for t in tensors[r]:
            assert torch.equal(t, torch.full_like(t, 1.5))
        assert infos[r].local_world_size == 2
        assert infos[r].tx_bytes >= sum(sizes) * 4 // 2


def test_all_reduce_multiple_with_retry_window_smaller_than_ops(pair: list[Communicator]) -> None:
    for _ in range(10):
        tensors = [[torch.full((8,), float(r)) for _ in range(6)] for r in range(2)]
        run_threads([
            lambda r=r: pair[r].all_reduce_multiple_with_retry(_descriptors(tensors[r], ReduceOp.SUM),
                                                               max_in_flight=2)
            for r in range(2)
        ], timeout=3.0)
        for r in range(2):
            assert all(torch.equal(t, torch.ones(8)) for t in tensors[r])


def test_all_reduce_multiple_with_retry_numpy_prefix_count(pair: list[Communicator]) -> None:
    arrays = [[np.full(10, float(r + 1), dtype=np.float32), np.full(6, float(r), dtype=np.float32)]
              for r in range(2)]

    f32 = ReduceOperandDescriptor(DataType.FLOAT32)

    def descs(r: int) -> list[ReduceOpDescriptor]:
        return [
            ReduceOpDescriptor.from_numpy(arrays[r][0], arrays[r][0], ReduceDescriptor(
                count=4, op=ReduceOp.SUM, tag=0, operand_descriptor=f32)),
            ReduceOpDescriptor.from_numpy(arrays[r][1], arrays[r][1], ReduceDescriptor(
                count=6, op=ReduceOp.MAX, tag=1, operand_descriptor=f32)),
        ]

    run_threads([lambda r=r: pair[r].all_reduce_multiple_with_retry(descs(r)) for r in range(2)])
    for r in range(2):
        # only the first `count` elements take part
        np.testing.assert_array_equal(arrays[r][0], [3, 3, 3, 3] + [r + 1] * 6)
        np.testing.assert_array_equal(arrays[r][1], np.ones(6))


def test_all_reduce_multiple_with_retry_survives_a_peer_leaving(cluster_factory: Cluster) -> None:
    a, b, c = cluster_factory(3)
    c.close()
    tensors = [[torch.full((50 * (i + 1),), float(r)) for i in range(4)] for r in range(2)]
    infos = run_threads([
        lambda r=r, comm=comm: comm.all_reduce_multiple_with_retry(_descriptors(tensors[r], ReduceOp.SUM))
        for r, comm in enumerate((a, b))
    ])
    assert [i.local_world_size for i in infos] == [2, 2]
    for r in range(2):
        for t in tensors[r]:
            assert torch.equal(t, torch.ones_like(t))


def test_all_reduce_multiple_with_retry_alone_raises_too_few_peers(cluster_factory: Cluster) -> None:
    (comm,) = cluster_factory(1)
    t = torch.ones(4)
    with pytest.raises(PCCLError) as info:
        comm.all_reduce_multiple_with_retry(_descriptors([t], ReduceOp.SUM))
    assert info.value.result == Result.TOO_FEW_PEERS
    assert torch.equal(t, torch.ones(4))


def test_reduce_op_descriptor_validation() -> None:
    rd = ReduceDescriptor(count=4, op=ReduceOp.SUM, tag=0,
                          operand_descriptor=ReduceOperandDescriptor(DataType.FLOAT32))
    bad: list[Callable[[], object]] = [
        lambda: ReduceOpDescriptor.from_torch(torch.zeros(4), torch.zeros(4, dtype=torch.float64), rd),
        lambda: ReduceOpDescriptor.from_torch(torch.zeros(4, 4).T, torch.zeros(4, 4).T, rd),
        lambda: ReduceOpDescriptor.from_torch(np.zeros(4), np.zeros(4), rd),
        lambda: ReduceOpDescriptor.from_numpy(np.zeros(4), np.zeros(5), rd),
        lambda: ReduceOpDescriptor.from_numpy(np.zeros(3), np.zeros(3), rd),  # count > numel
    ]
    for case in bad:
        with pytest.raises(PCCLError) as info:
            case()
        assert info.value.result == Result.INVALID_ARGUMENT
