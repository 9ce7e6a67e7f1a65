"""The blocking API with GPU tensors: torch CUDA tensors and cupy arrays pass through to the async core
(host staging there). Results must be bit-identical to the same call on host copies.

The async core runs in its own thread; CUDA's current stream is per thread, so the blocking call
synchronizes the caller's current stream before handing the tensors over (tested with a write queued
behind a long GPU sleep on a side stream). Skipped without a CUDA device (torch) or cupy and a device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from pccl.blocking import (
    Communicator,
    DataType,
    PCCLError,
    QuantizationAlgorithm,
    QuantizationOptions,
    ReduceDescriptor,
    ReduceOp,
    ReduceOpDescriptor,
    ReduceOperandDescriptor,
    Result,
    SharedState,
    SharedStateSyncStrategy,
    TensorInfo,
)
from pccl.testing import tensor_bytes as _bits
from pccl.testing.pytest_plugin import require_cupy

from ._helpers import run_threads

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")


@pytest.fixture
def cp() -> Any:
    return require_cupy()


def _data(dtype: torch.dtype, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(count, generator=g) * 10).to(dtype)
    return torch.randint(-1000, 1000, (count,), generator=g, dtype=dtype)


def _host_run(pair: list[Communicator], data: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    outs = [torch.empty_like(d) for d in data]
    run_threads([lambda r=r: pair[r].all_reduce(data[r], outs[r], op=op) for r in range(2)])
    assert _bits(outs[0]) == _bits(outs[1])
    return outs[0]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_all_reduce_cuda(pair: list[Communicator], dtype: torch.dtype) -> None:
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        data = [_data(dtype, 1001, seed=r + int(op)) for r in range(2)]
        ref = _host_run(pair, data, op)
        sends = [d.cuda() for d in data]
        recvs = [torch.full_like(s, 5) for s in sends]
        infos = run_threads([lambda r=r: pair[r].all_reduce(sends[r], recvs[r], op=op) for r in range(2)])
        for r in range(2):
            assert _bits(recvs[r]) == _bits(ref), (dtype, op)
            assert _bits(sends[r]) == _bits(data[r])
            assert infos[r].local_world_size == 2
        # in place
        xs = [d.cuda() for d in data]
        run_threads([lambda r=r: pair[r].all_reduce(xs[r], xs[r], op=op) for r in range(2)])
        assert all(_bits(x) == _bits(ref) for x in xs)


@cuda
def test_all_reduce_async_cuda(pair: list[Communicator]) -> None:
    data = [_data(torch.float32, 70_001, seed=r) for r in range(2)]
    ref = _host_run(pair, data, ReduceOp.SUM)
    xs = [d.cuda() for d in data]

    def one(r: int) -> bool:
        handle = pair[r].all_reduce_async(xs[r], xs[r], op=ReduceOp.SUM, tag=4)
        ok, status, info = handle.wait()
        assert status == Result.SUCCESS and info.rx_bytes > 0
        return ok

    assert run_threads([lambda r=r: one(r) for r in range(2)]) == [True, True]
    assert all(_bits(x) == _bits(ref) for x in xs)


@cuda
def test_quantized_all_reduce_cuda(pair: list[Communicator]) -> None:
    q = QuantizationOptions(quantized_datatype=DataType.UINT8, algorithm=QuantizationAlgorithm.MIN_MAX)
    data = [_data(torch.float32, 4096, seed=r) for r in range(2)]
    outs = [torch.empty_like(d) for d in data]
    run_threads([lambda r=r: pair[r].all_reduce(data[r], outs[r], op=ReduceOp.SUM, quantization_options=q)
                 for r in range(2)])
    xs = [d.cuda() for d in data]
    run_threads([lambda r=r: pair[r].all_reduce(xs[r], xs[r], op=ReduceOp.SUM, quantization_options=q)
                 for r in range(2)])
    assert all(_bits(x) == _bits(outs[0]) for x in xs)
    assert not torch.equal(outs[0], data[0] + data[1])  # really quantized


@cuda
def test_all_reduce_multiple_with_retry_cuda(pair: list[Communicator]) -> None:
    sizes = [1, 17, 256, 1000, 3, 64]
    data = [[_data(torch.float32, s, seed=10 * r + j) for j, s in enumerate(sizes)] for r in range(2)]
    refs = [_host_run(pair, [data[0][j], data[1][j]], ReduceOp.AVG) for j in range(len(sizes))]
    tensors = [[d.cuda() for d in data[r]] for r in range(2)]

    def descriptors(r: int) -> list[ReduceOpDescriptor]:
        return [ReduceOpDescriptor.from_torch(t, t, ReduceDescriptor(
                    count=t.numel(), op=ReduceOp.AVG, tag=tag,
                    operand_descriptor=ReduceOperandDescriptor(DataType.FLOAT32)))
                for tag, t in enumerate(tensors[r])]

    infos = run_threads([lambda r=r: pair[r].all_reduce_multiple_with_retry(descriptors(r), max_in_flight=3)
                         for r in range(2)])
    for r in range(2):
        for t, ref in zip(tensors[r], refs, strict=True):
            assert _bits(t) == _bits(ref)
        assert infos[r].local_world_size == 2


@cuda
def test_caller_side_stream_is_synchronized_before_the_core_copies(pair: list[Communicator]) -> None:
    """Each caller writes ``send`` on its own busy side stream and calls at once: the core (another thread,
    another current stream) must see the written values, and the result must be complete on return."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("this torch has no torch.cuda._sleep")
    xs = [torch.zeros(1 << 16, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()

    def one(r: int) -> bool:
        # torch.cuda.Stream's constructor and torch.cuda._sleep carry no annotations
        side, other = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            # ~0.1 s of GPU time before the write below runs
            torch.cuda._sleep(200_000_000)
            xs[r].fill_(float(r + 1))
            pair[r].all_reduce(xs[r], xs[r], op=ReduceOp.SUM)
        with torch.cuda.stream(other):
            seen = xs[r].clone()
        other.synchronize()
        return bool(torch.equal(seen, torch.full_like(seen, 3.0)))

    assert run_threads([lambda r=r: one(r) for r in range(2)]) == [True, True]


def test_all_reduce_cupy_and_multiple_with_retry(cp: Any, pair: list[Communicator]) -> None:
    data = [np.random.default_rng(r).standard_normal(5003).astype(np.float32) for r in range(2)]
    outs = [np.empty_like(d) for d in data]
    run_threads([lambda r=r: pair[r].all_reduce(data[r], outs[r], op=ReduceOp.SUM) for r in range(2)])
    sends = [cp.asarray(d) for d in data]
    recvs = [cp.zeros_like(s) for s in sends]
    run_threads([lambda r=r: pair[r].all_reduce(sends[r], recvs[r], op=ReduceOp.SUM) for r in range(2)])
    assert all(_bits(x) == outs[0].tobytes() for x in recvs)
    # async handle
    xs = [cp.asarray(d) for d in data]
    handles = run_threads([lambda r=r: pair[r].all_reduce_async(xs[r], xs[r], op=ReduceOp.SUM, tag=2)
                           for r in range(2)])
    assert [h.wait()[0] for h in handles] == [True, True]
    assert all(_bits(x) == outs[0].tobytes() for x in xs)
    # multiple with retry, through ReduceOpDescriptor.from_cupy (prefix counts included)
    ys = [cp.asarray(d) for d in data]

    def descs(r: int) -> list[ReduceOpDescriptor]:
        rd = ReduceDescriptor(count=4000, op=ReduceOp.SUM, tag=0,
                              operand_descriptor=ReduceOperandDescriptor(DataType.FLOAT32))
        return [ReduceOpDescriptor.from_cupy(ys[r], ys[r], rd)]

    run_threads([lambda r=r: pair[r].all_reduce_multiple_with_retry(descs(r)) for r in range(2)])
    for r in range(2):
        got = cp.asnumpy(ys[r])
        assert got[:4000].tobytes() == (data[0][:4000] + data[1][:4000]).tobytes()
        assert got[4000:].tobytes() == data[r][4000:].tobytes()  # beyond count: untouched


def test_cupy_argument_errors(cp: Any, pair: list[Communicator]) -> None:
    comm = pair[0]
    a = cp.zeros(8, cp.float32)
    rd = ReduceDescriptor(count=8, op=ReduceOp.SUM, tag=0,
                          operand_descriptor=ReduceOperandDescriptor(DataType.FLOAT32))
    cases: list[Callable[[], object]] = [
        lambda: comm.all_reduce(a, np.zeros(8, np.float32), op=ReduceOp.SUM),  # cupy with numpy
        lambda: comm.all_reduce(a, cp.zeros(8, cp.float64), op=ReduceOp.SUM),  # dtype mismatch
        lambda: ReduceOpDescriptor.from_cupy(np.zeros(8, np.float32), np.zeros(8, np.float32), rd),
        lambda: ReduceOpDescriptor.from_cupy(a, cp.zeros(4, cp.float32), rd),
    ]
    for case in cases:
        with pytest.raises(PCCLError) as info:
            case()
        assert info.value.result == Result.INVALID_ARGUMENT
    assert _bits(a) == bytes(32)


@cuda
def test_mixed_devices_refused(pair: list[Communicator]) -> None:
    comm = pair[0]
    g = torch.zeros(8, device="cuda")
    for send, recv in [(torch.ones(8), g), (torch.ones(8, device="cuda"), torch.zeros(8))]:
        with pytest.raises(PCCLError) as info:
            comm.all_reduce(send, recv, op=ReduceOp.SUM)
        assert info.value.result == Result.INVALID_ARGUMENT
    assert torch.equal(g, torch.zeros_like(g))


@cuda
def test_shared_state_cuda_through_the_blocking_api(pair: list[Communicator]) -> None:
    """A CPU sender and a CUDA receiver, then the other way round; the receiver's tensor is updated in
    place. Then equal content on CPU and GPU moves nothing."""
    send_only, receive_only = SharedStateSyncStrategy.SEND_ONLY, SharedStateSyncStrategy.RECEIVE_ONLY
    good = _data(torch.float32, 4099, seed=1)
    cpu = good.clone()
    gpu = torch.zeros(4099, device="cuda")
    states = [SharedState([TensorInfo.from_torch(cpu, "w")], revision=1),
              SharedState([TensorInfo.from_torch(gpu, "w")], revision=1)]
    infos = run_threads([lambda r=r: pair[r].sync_shared_state(states[r], (send_only, receive_only)[r])
                         for r in range(2)])
    assert _bits(gpu) == _bits(good)
    assert infos[0].tx_bytes == infos[1].rx_bytes == 4099 * 4
    assert states[1].tensor_infos[0].tensor is gpu
    # the GPU peer sends, the CPU peer receives
    gpu.copy_(_data(torch.float32, 4099, seed=2).cuda())
    for st in states:
        st.revision += 1
    infos = run_threads([lambda r=r: pair[r].sync_shared_state(states[r], (receive_only, send_only)[r])
                         for r in range(2)])
    assert _bits(cpu) == _bits(gpu) == _bits(_data(torch.float32, 4099, seed=2))
    assert infos[1].tx_bytes == infos[0].rx_bytes == 4099 * 4
    # equal content on both: nothing moves
    for st in states:
        st.revision += 1
    infos = run_threads([lambda r=r: pair[r].sync_shared_state(states[r]) for r in range(2)])
    assert all(i.tx_bytes == 0 and i.rx_bytes == 0 for i in infos)
