"""GPU kernels (cupy arrays, torch CUDA tensors) against the CPU kernels. Skipped without a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pccl import DataType, DeviceType, InvalidArgumentError, ReduceOp
from pccl.kernels import backend
from pccl.kernels.hashing import content_hash
from pccl.kernels.reduce import finalize_avg, finalize_avg_gpu, reduce_into, reduce_into_gpu
from pccl.testing.pytest_plugin import require_cupy

cuda_torch = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")

HASH_SIZES = [0, 1, 7, 8, 9, 4096 * 8 - 1, 4096 * 8, 3 * 4096 * 8 + 5, (20 << 20) + 3]
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
INT_NP: list[type[np.generic]] = [
    np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
]
FLOAT_NP: list[type[np.generic]] = [np.float16, np.float32, np.float64]


_cupy = require_cupy


def _values(dt: Any, n: int, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    if np.dtype(dt).kind in "ui":
        info = np.iinfo(dt)
        return rng.integers(int(info.min), int(info.max), n, dtype=dt, endpoint=True)
    return (rng.standard_normal(n) * 100).astype(dt)


@pytest.mark.parametrize("n", HASH_SIZES)
def test_cupy_hash_equals_numpy_hash(n: int) -> None:
    cupy = _cupy()
    host = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert content_hash(cupy.asarray(host)) == content_hash(host)


def test_cupy_unaligned_and_typed_views() -> None:
    cupy = _cupy()
    host = np.random.default_rng(1).integers(0, 256, 100_003, dtype=np.uint8)
    dev = cupy.asarray(host)
    for off in range(1, 8):
        assert content_hash(dev[off:]) == content_hash(host[off:])
    f = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
    assert content_hash(cupy.asarray(f)) == content_hash(f)


def test_cupy_describe_and_views() -> None:
    cupy = _cupy()
    a = cupy.zeros((4, 5), dtype=cupy.float32)
    assert backend.describe(a) == backend.TensorDesc(DataType.FLOAT32, 20, 80, DeviceType.CUDA, (4, 5))
    assert backend.is_cuda(a)
    with pytest.raises(InvalidArgumentError):
        backend.as_numpy(a)
    with pytest.raises(InvalidArgumentError):
        backend.byte_view(a)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        backend.describe(a.T)


@pytest.mark.parametrize("dt", INT_NP + FLOAT_NP)
@pytest.mark.parametrize("op", OPS)
def test_cupy_reduce_matches_cpu(dt: Any, op: ReduceOp) -> None:
    cupy = _cupy()
    a, b = _values(dt, 10_000, 1), _values(dt, 10_000, 2)
    expected = a.copy()
    reduce_into(expected, b, op)
    acc = cupy.asarray(a)
    reduce_into_gpu(acc, cupy.asarray(b), op)
    assert np.array_equal(cupy.asnumpy(acc).view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("dt", INT_NP + FLOAT_NP)
@pytest.mark.parametrize("n", [2, 3, 300])
def test_cupy_finalize_avg_matches_cpu(dt: Any, n: int) -> None:
    cupy = _cupy()
    a = _values(dt, 5000, n)
    expected = a.copy()
    finalize_avg(expected, n)
    dev = cupy.asarray(a)
    finalize_avg_gpu(dev, n)
    assert np.array_equal(cupy.asnumpy(dev).view(np.uint8), expected.view(np.uint8))


TORCH_ALL = [
    torch.uint8,
    torch.int8,
    torch.uint16,
    torch.int16,
    torch.uint32,
    torch.int32,
    torch.uint64,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def _torch_values(tdt: Any, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if tdt.is_floating_point:
        return (torch.randn(n, generator=g) * 100).to(tdt)
    info = torch.iinfo(tdt)
    hi = min(int(info.max), 2**62)
    lo = max(int(info.min), -(2**62))
    raw = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64)
    return (
        raw.to(tdt)
        if tdt in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
        else (torch.from_numpy(raw.numpy().astype(backend.dtype_to_numpy(backend.torch_to_dtype(tdt)))))
    )


@cuda_torch
@pytest.mark.parametrize("tdt", TORCH_ALL)
@pytest.mark.parametrize("op", OPS)
def test_torch_cuda_reduce_matches_cpu(tdt: Any, op: ReduceOp) -> None:
    a, b = _torch_values(tdt, 10_000, 1), _torch_values(tdt, 10_000, 2)
    expected = backend.as_numpy(a.clone())
    reduce_into(expected, backend.as_numpy(b), op)
    acc = a.cuda()
    reduce_into_gpu(acc, b.cuda(), op)
    assert np.array_equal(backend.as_numpy(acc.cpu()).view(np.uint8), expected.view(np.uint8))


@cuda_torch
@pytest.mark.parametrize("tdt", TORCH_ALL)
@pytest.mark.parametrize("world", [2, 3, 7, 257, 1000])
def test_torch_cuda_finalize_avg_matches_cpu(tdt: Any, world: int) -> None:
    a = _torch_values(tdt, 5000, 3)
    expected = backend.as_numpy(a.clone())
    finalize_avg(expected, world)
    dev = a.cuda()
    finalize_avg_gpu(dev, world)
    assert np.array_equal(backend.as_numpy(dev.cpu()).view(np.uint8), expected.view(np.uint8))


@cuda_torch
@pytest.mark.parametrize("n", HASH_SIZES)
def test_torch_cuda_hash_equals_cpu_hash(n: int) -> None:
    host = torch.from_numpy(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
    assert content_hash(host.cuda()) == content_hash(host)
    bf = torch.arange(1001, dtype=torch.bfloat16)
    assert content_hash(bf.cuda()) == content_hash(bf)


@cuda_torch
def test_torch_cuda_describe() -> None:
    t = torch.zeros(3, 4, device="cuda", dtype=torch.bfloat16)
    assert backend.describe(t) == backend.TensorDesc(DataType.BFLOAT16, 12, 24, DeviceType.CUDA, (3, 4))
    assert backend.is_cuda(t)
    with pytest.raises(InvalidArgumentError):
        backend.byte_view(t)


def test_pinned_empty_is_none_for_host_tensors() -> None:
    assert backend.pinned_empty(1 << 20, np.dtype(np.float32), np.zeros(4, np.float32)) is None
    assert backend.pinned_empty(1 << 20, np.dtype(np.float32), torch.zeros(4)) is None


@cuda_torch
def test_torch_pinned_empty_is_page_locked_and_outlives_its_allocation() -> None:
    import gc

    dev = torch.zeros(4, device="cuda")
    assert backend.pinned_empty(10, np.dtype(np.float32), dev) is None  # below PINNED_MIN_BYTES
    arr = backend.pinned_empty(1 << 20, np.dtype(np.float32), dev)
    assert arr is not None and arr.dtype == np.float32 and arr.shape == (1 << 20,)
    assert torch.from_numpy(arr).is_pinned()
    gc.collect()
    arr[:] = np.arange(arr.size, dtype=np.float32)  # still backed by live memory
    back = torch.from_numpy(arr).cuda()
    assert torch.equal(back.cpu(), torch.arange(arr.size, dtype=torch.float32))


def test_cupy_pinned_empty_is_page_locked() -> None:
    cupy = _cupy()
    dev = cupy.zeros(4, dtype=cupy.float32)
    arr = backend.pinned_empty(1 << 19, np.dtype(np.float64), dev)
    assert arr is not None and arr.dtype == np.float64 and arr.size == 1 << 19
    attrs = cupy.cuda.runtime.pointerGetAttributes(arr.ctypes.data)
    assert attrs.type == 1  # cudaMemoryTypeHost: page-locked host memory
    arr[:] = 1.5
    assert float(cupy.asarray(arr).sum()) == 1.5 * arr.size
