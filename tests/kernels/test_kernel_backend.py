"""Tensor adaptation: describe / as_numpy / byte_view / dtype tables, for numpy and torch CPU objects."""

from __future__ import annotations

import ast
import builtins
import pathlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

import pccl
from pccl import DataType, DeviceType, InvalidArgumentError
from pccl.kernels import backend, hashing, quantize, reduce
from pccl.kernels.backend import (
    as_numpy,
    byte_view,
    describe,
    dtype_to_numpy,
    dtype_to_torch,
    host_bytes,
    is_cuda,
    numpy_to_dtype,
    torch_to_dtype,
)

NUMPY_DTYPES = {
    DataType.UINT8: np.uint8,
    DataType.INT8: np.int8,
    DataType.UINT16: np.uint16,
    DataType.INT16: np.int16,
    DataType.UINT32: np.uint32,
    DataType.INT32: np.int32,
    DataType.UINT64: np.uint64,
    DataType.INT64: np.int64,
    DataType.FLOAT16: np.float16,
    DataType.BFLOAT16: ml_dtypes.bfloat16,
    DataType.FLOAT32: np.float32,
    DataType.FLOAT64: np.float64,
}
TORCH_DTYPES = {
    DataType.UINT8: torch.uint8,
    DataType.INT8: torch.int8,
    DataType.UINT16: torch.uint16,
    DataType.INT16: torch.int16,
    DataType.UINT32: torch.uint32,
    DataType.INT32: torch.int32,
    DataType.UINT64: torch.uint64,
    DataType.INT64: torch.int64,
    DataType.FLOAT16: torch.float16,
    DataType.BFLOAT16: torch.bfloat16,
    DataType.FLOAT32: torch.float32,
    DataType.FLOAT64: torch.float64,
}


@pytest.mark.parametrize("dt", list(DataType))
def test_describe_numpy_every_dtype(dt: DataType) -> None:
    a = np.zeros((3, 5), dtype=NUMPY_DTYPES[dt])
    d = describe(a)
    assert d == backend.TensorDesc(dt, 15, 15 * dt.itemsize, DeviceType.CPU, (3, 5))


@pytest.mark.parametrize("dt", list(DataType))
def test_describe_torch_every_dtype(dt: DataType) -> None:
    t = torch.zeros((2, 7), dtype=TORCH_DTYPES[dt])
    d = describe(t)
    assert d == backend.TensorDesc(dt, 14, 14 * dt.itemsize, DeviceType.CPU, (2, 7))
    assert torch_to_dtype(TORCH_DTYPES[dt]) is dt
    assert dtype_to_torch(dt) is TORCH_DTYPES[dt]


@pytest.mark.parametrize("dt", list(DataType))
def test_numpy_dtype_roundtrip(dt: DataType) -> None:
    assert dtype_to_numpy(dt) == np.dtype(NUMPY_DTYPES[dt])
    assert numpy_to_dtype(dtype_to_numpy(dt)) is dt


def test_describe_scalar_and_empty() -> None:
    assert describe(np.array(1.5, dtype=np.float32)).shape == ()
    assert describe(np.zeros(0, np.int32)).count == 0
    assert describe(torch.tensor(3.0)).count == 1
    assert describe(torch.zeros(0, 4)).nbytes == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(10, dtype=np.float32)[::2],
        lambda: np.arange(12, dtype=np.float32).reshape(3, 4).T,
        lambda: np.broadcast_to(np.float32(1), (4,)),
        lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        lambda: torch.arange(10, dtype=torch.float32)[::2],
        lambda: torch.zeros(1).expand(4),
    ],
)
def test_non_contiguous_rejected(make: Any) -> None:
    t = make()
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        describe(t)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        byte_view(t)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        as_numpy(t)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        host_bytes(t)


@pytest.mark.parametrize(
    "obj",
    [
        np.zeros(3, dtype=bool),
        np.zeros(3, dtype=np.complex64),
        np.zeros(3, dtype="U3"),
        np.zeros(3, dtype=">f4"),
        torch.zeros(3, dtype=torch.bool),
        torch.zeros(3, dtype=torch.complex64),
        [1.0, 2.0],
        b"abc",
        3.0,
    ],
)
def test_unsupported_rejected(obj: object) -> None:
    with pytest.raises(InvalidArgumentError):
        describe(obj)
    with pytest.raises(InvalidArgumentError):
        byte_view(obj)


def test_error_messages_are_clear() -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported numpy dtype bool"):
        describe(np.zeros(3, dtype=bool))
    with pytest.raises(InvalidArgumentError, match="byte order"):
        describe(np.zeros(3, dtype=">f4"))
    with pytest.raises(InvalidArgumentError, match=r"unsupported tensor type builtins\.list"):
        describe([1.0])
    assert issubclass(InvalidArgumentError, pccl.PCCLError)


def test_sparse_torch_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="layout"):
        describe(torch.zeros(3, 3).to_sparse())


def test_as_numpy_shares_memory_numpy() -> None:
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    v = as_numpy(a)
    assert v.shape == (12,) and v.dtype == np.int32
    v[5] = -1
    assert a[1, 1] == -1


@pytest.mark.parametrize("dt", list(DataType))
def test_as_numpy_shares_memory_torch(dt: DataType) -> None:
    t = torch.zeros((2, 3), dtype=TORCH_DTYPES[dt])
    v = as_numpy(t)
    assert v.shape == (6,)
    assert v.dtype == dtype_to_numpy(dt)
    v[4] = 1
    assert t.view(-1)[4].item() == 1


def test_as_numpy_torch_bfloat16_values_and_grad() -> None:
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16, requires_grad=True)
    v = as_numpy(t)
    assert v.dtype == ml_dtypes.bfloat16
    assert v.astype(np.float32).tolist() == [1.5, -2.25, 3.0]
    v[0] = 7.0
    assert t[0].item() == 7.0


def test_as_numpy_bfloat16_without_ml_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "_ML_DTYPES_CHECKED", True)
    monkeypatch.setattr(backend, "_BF16_NP", None)
    assert dtype_to_numpy(DataType.BFLOAT16) == np.uint16
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    v = as_numpy(t)
    assert v.dtype == np.uint16
    assert v.tolist() == [0x3F80, 0xC000]


def test_as_numpy_offset_view_of_torch() -> None:
    base = torch.arange(10, dtype=torch.float32)
    part = base[3:7]  # contiguous, storage offset 3
    v = as_numpy(part)
    assert v.tolist() == [3.0, 4.0, 5.0, 6.0]
    v[0] = 100.0
    assert base[3].item() == 100.0


def test_byte_view_numpy_and_torch_zero_copy() -> None:
    a = np.zeros(4, dtype=np.float32)
    mv = byte_view(a)
    assert mv.format == "B" and mv.nbytes == 16 and not mv.readonly and mv.ndim == 1
    mv[0:4] = np.float32(2.5).tobytes()
    assert a[0] == 2.5

    t = torch.zeros(3, dtype=torch.bfloat16)
    tv = byte_view(t)
    assert tv.nbytes == 6
    tv[2:4] = np.array([0x4040], dtype=np.uint16).tobytes()  # bfloat16 3.0
    assert t[1].item() == 3.0


def test_byte_view_read_only() -> None:
    a = np.zeros(4, dtype=np.float32)
    a.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        byte_view(a)
    mv = byte_view(a, writable=False)
    assert mv.readonly and mv.nbytes == 16


def test_host_bytes_accepts_more() -> None:
    assert host_bytes(b"abc").tolist() == [97, 98, 99]
    assert host_bytes(bytearray(b"xy")).tolist() == [120, 121]
    # .data: memoryview(array) (numpy declares the buffer protocol to typing only from Python 3.12 on)
    assert host_bytes(np.arange(2, dtype=np.uint16).data).tolist() == [0, 0, 1, 0]
    assert host_bytes(np.array([True, False])).tolist() == [1, 0]
    assert host_bytes(torch.tensor([True, False])).tolist() == [1, 0]
    assert host_bytes(torch.tensor([1.0], dtype=torch.bfloat16)).tolist() == [0x80, 0x3F]


def test_is_cuda_cpu_objects() -> None:
    assert not is_cuda(np.zeros(2))
    assert not is_cuda(torch.zeros(2))
    assert not is_cuda("nope")


def test_dtype_helpers_errors() -> None:
    with pytest.raises(InvalidArgumentError):
        numpy_to_dtype("not-a-dtype-xyz")
    with pytest.raises(InvalidArgumentError):
        torch_to_dtype(torch.complex128)
    with pytest.raises(InvalidArgumentError):
        dtype_to_numpy(99)  # type: ignore[arg-type]


def test_cpu_paths_never_try_to_import_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__
    attempts: list[str] = []

    def guarded(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "cupy":
            attempts.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)
    for obj in (np.arange(1000, dtype=np.float32), torch.arange(1000, dtype=torch.float32)):
        describe(obj)
        arr = as_numpy(obj)
        byte_view(obj)
        is_cuda(obj)
        hashing.content_hash(obj)
        reduce.reduce_into(arr, arr.copy(), pccl.ReduceOp.SUM)
        q, meta = quantize.quantize(arr, DataType.UINT8, pccl.QuantizationAlgorithm.MIN_MAX)
        quantize.dequantize(q, meta)
    assert attempts == []


def test_kernels_import_neither_trio_nor_socket() -> None:
    root = pathlib.Path(backend.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) >= 5
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in {"trio", "socket", "asyncio", "selectors"}, f"{f.name} imports {name}"


_NUMPY_ONLY_RUN = """
import sys
import numpy as np
import trio
from pccl.testing import VirtualNetwork, open_test_cluster


async def main():
    async with open_test_cluster(2, network=VirtualNetwork()) as cluster:
        xs = [np.arange(8, dtype=dt) for dt in (np.float32, np.int64, np.float16) for _ in range(2)]
        for i in range(0, len(xs), 2):
            async with trio.open_nursery() as nursery:
                for comm, x in zip(cluster.peers, xs[i:i + 2]):
                    nursery.start_soon(comm.all_reduce, x)
            assert (xs[i] == 2 * np.arange(8)).all()
    print("ml_dtypes imported:", "ml_dtypes" in sys.modules)


trio.run(main)
"""


def test_numpy_collectives_do_not_import_ml_dtypes() -> None:
    """Regression: the dtype lookup imported ml_dtypes (0.6-0.9 s of extension start-up) for every
    dtype, so a numpy user's first collective took about a second. Only bfloat16 needs it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NUMPY_ONLY_RUN], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ml_dtypes imported: False" in out.stdout


def test_bfloat16_numpy_arrays_are_still_recognized() -> None:
    assert backend.numpy_to_dtype(np.dtype(ml_dtypes.bfloat16)) == DataType.BFLOAT16
    assert backend.dtype_to_numpy(DataType.BFLOAT16) == np.dtype(ml_dtypes.bfloat16)
