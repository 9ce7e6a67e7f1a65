"""reduce_into / finalize_avg: every op x every dtype against independent references."""

from __future__ import annotations

import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from pccl import DataType, InvalidArgumentError, ReduceOp
from pccl.kernels import backend
from pccl.kernels.reduce import finalize_avg, finalize_avg_gpu, reduce_into, reduce_into_gpu

INT_DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64]
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]


@pytest.fixture(params=["numpy", "torch"])
def half_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run float16/bfloat16 cases through both the numpy and the torch-accelerated code paths."""
    monkeypatch.setattr(backend, "_HALF_VIA_TORCH", request.param == "torch")
    return str(request.param)


def _int_values(dt: Any, n: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    info = np.iinfo(dt)
    edge = [info.min, info.max, 0, 1, info.max - 1, info.min + 1] + ([-1, -2] if info.min < 0 else [2, 3])
    rand = rng.integers(int(info.min), int(info.max), size=n - len(edge), dtype=dt, endpoint=True)
    return np.concatenate([np.array(edge, dtype=dt), rand])


def _wrap(v: int, dt: Any) -> int:
    info = np.iinfo(dt)
    bits = info.bits
    v &= (1 << bits) - 1
    if info.min < 0 and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def _py_op(op: ReduceOp, a: int, b: int) -> int:
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return a + b
    if op is ReduceOp.PROD:
        return a * b
    return min(a, b) if op is ReduceOp.MIN else max(a, b)


@pytest.mark.parametrize("dt", INT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_integer_ops_wrap_like_the_dtype(dt: Any, op: ReduceOp) -> None:
    rng = np.random.default_rng(int(op) * 100 + np.dtype(dt).num)
    a = _int_values(dt, 300, rng)
    b = rng.permutation(_int_values(dt, 300, rng))
    acc = a.copy()
    reduce_into(acc, b, op)
    expected = [_wrap(_py_op(op, int(x), int(y)), dt) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
    assert acc.tolist() == expected


def test_integer_wraparound_examples() -> None:
    a = np.array([127, -128], dtype=np.int8)
    reduce_into(a, np.array([1, -1], dtype=np.int8), ReduceOp.SUM)
    assert a.tolist() == [-128, 127]
    u = np.array([255, 16], dtype=np.uint8)
    reduce_into(u, np.array([1, 16], dtype=np.uint8), ReduceOp.PROD)
    assert u.tolist() == [255, 0]
    big = np.array([np.iinfo(np.int64).max], dtype=np.int64)
    reduce_into(big, np.array([1], dtype=np.int64), ReduceOp.SUM)
    assert big.tolist() == [np.iinfo(np.int64).min]


def _float_values(n: int, rng: np.random.Generator, scale: float) -> np.ndarray[Any, Any]:
    v = rng.standard_normal(n) * scale
    v[:6] = [0.0, -0.0, 1.0, -1.0, 0.5, 3.0]
    return v


TORCH_OF = {
    DataType.FLOAT16: torch.float16,
    DataType.BFLOAT16: torch.bfloat16,
    DataType.FLOAT32: torch.float32,
    DataType.FLOAT64: torch.float64,
}


def _np_float(values: np.ndarray[Any, Any], dt: DataType) -> np.ndarray[Any, Any]:
    t = torch.from_numpy(values).to(TORCH_OF[dt])
    if dt == DataType.BFLOAT16:
        bf16: np.ndarray[Any, Any] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        return bf16
    return t.numpy().copy()


def _torch_ref(
    a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], op: ReduceOp, dt: DataType
) -> np.ndarray[Any, Any]:
    def tv(x: np.ndarray[Any, Any]) -> torch.Tensor:
        return (
            torch.from_numpy(x.copy().view(np.int16)).view(torch.bfloat16)
            if dt == DataType.BFLOAT16
            else (torch.from_numpy(x.copy()))
        )

    ta, tb = tv(a), tv(b)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        r = ta + tb
    elif op is ReduceOp.PROD:
        r = ta * tb
    elif op is ReduceOp.MIN:
        r = torch.minimum(ta, tb)
    else:
        r = torch.maximum(ta, tb)
    return r.view(torch.int16).numpy() if dt == DataType.BFLOAT16 else r.numpy()


def _bits(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("dt", list(TORCH_OF))
@pytest.mark.parametrize("op", OPS)
def test_float_ops_match_torch_bit_for_bit(dt: DataType, op: ReduceOp, half_path: str) -> None:
    rng = np.random.default_rng(int(op) * 10 + int(dt))
    # Large magnitudes too, so float16 sums/products overflow to inf the way the dtype does.
    scale = 300.0 if dt == DataType.FLOAT16 else 1e3
    a = _np_float(_float_values(2000, rng, scale), dt)
    b = _np_float(_float_values(2000, rng, scale), dt)
    expected = _torch_ref(a, b, op, dt)
    acc = a.copy()
    reduce_into(acc, b, op)
    assert np.array_equal(_bits(acc), _bits(expected))


@pytest.mark.parametrize("op", OPS)
def test_bfloat16_bit_patterns_with_hint_match_torch(op: ReduceOp) -> None:
    rng = np.random.default_rng(7 + int(op))
    a = _np_float(_float_values(5000, rng, 50.0), DataType.BFLOAT16)
    b = _np_float(_float_values(5000, rng, 50.0), DataType.BFLOAT16)
    expected = _torch_ref(a, b, op, DataType.BFLOAT16)
    acc = a.view(np.uint16).copy()  # what as_numpy gives without ml_dtypes
    reduce_into(acc, b.view(np.uint16), op, dtype=DataType.BFLOAT16)
    assert np.array_equal(acc, expected.view(np.uint16))


def test_uint16_without_hint_is_plain_integer() -> None:
    acc = np.array([0x3F80], dtype=np.uint16)
    reduce_into(acc, np.array([0x3F80], dtype=np.uint16), ReduceOp.SUM)
    assert acc.tolist() == [0x7F00]


@pytest.mark.parametrize("dt", list(TORCH_OF))
def test_min_max_propagate_nan(dt: DataType, half_path: str) -> None:
    a = _np_float(np.array([np.nan, 1.0, 2.0]), dt)
    b = _np_float(np.array([0.0, np.nan, 1.0]), dt)
    for op in (ReduceOp.MIN, ReduceOp.MAX):
        acc = a.copy()
        reduce_into(acc, b, op)
        f = acc.astype(np.float32)
        assert np.isnan(f[0]) and np.isnan(f[1]) and f[2] == (1.0 if op is ReduceOp.MIN else 2.0)


def test_float32_sum_is_in_place_without_temporaries() -> None:
    acc = np.arange(8, dtype=np.float32).reshape(2, 4)
    ptr = acc.ctypes.data
    reduce_into(acc, np.ones(8, dtype=np.float32), ReduceOp.SUM)  # other reshaped to acc's shape
    assert acc.ctypes.data == ptr
    assert acc.ravel().tolist() == [float(i + 1) for i in range(8)]


def test_accumulator_can_be_a_strided_view() -> None:
    base = np.zeros(10, dtype=np.int32)
    reduce_into(base[::2], np.arange(5, dtype=np.int32), ReduceOp.SUM)
    assert base.tolist() == [0, 0, 1, 0, 2, 0, 3, 0, 4, 0]


def test_reduce_errors() -> None:
    a = np.zeros(4, dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="dtype mismatch"):
        reduce_into(a, np.zeros(4, dtype=np.float64), ReduceOp.SUM)
    with pytest.raises(InvalidArgumentError, match="size mismatch"):
        reduce_into(a, np.zeros(5, dtype=np.float32), ReduceOp.SUM)
    with pytest.raises(InvalidArgumentError, match="ReduceOp"):
        reduce_into(a, a.copy(), 42)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="hint"):
        reduce_into(a, a.copy(), ReduceOp.SUM, dtype=DataType.FLOAT16)
    with pytest.raises(InvalidArgumentError, match="unsupported"):
        reduce_into(np.zeros(2, bool), np.zeros(2, bool), ReduceOp.SUM)
    ro = np.zeros(4, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        reduce_into(ro, a, ReduceOp.SUM)


# ---------------------------------------------------------------------------------------------------- AVG


def _trunc_div(v: int, n: int) -> int:
    q = abs(v) // n
    return q if v >= 0 else -q


@pytest.mark.parametrize("dt", INT_DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 127, 128, 200, 255, 256, 1000])
def test_integer_avg_truncates_toward_zero(dt: Any, n: int) -> None:
    rng = np.random.default_rng(n)
    a = _int_values(dt, 200, rng)
    acc = a.copy()
    finalize_avg(acc, n)
    assert acc.tolist() == [_trunc_div(int(v), n) for v in a.tolist()]


def test_integer_avg_examples_match_c_and_torch() -> None:
    a = np.array([-7, 7, -1, -6, 6], dtype=np.int32)
    finalize_avg(a, 2)
    assert a.tolist() == [-3, 3, 0, -3, 3]
    t = torch.tensor([-7, 7, -1, -6, 6], dtype=torch.int32).div(2, rounding_mode="trunc")
    assert a.tolist() == t.tolist()


@pytest.mark.parametrize("dt", list(TORCH_OF))
@pytest.mark.parametrize("n", [2, 3, 7, 257, 3001])
def test_float_avg_matches_torch(dt: DataType, n: int, half_path: str) -> None:
    rng = np.random.default_rng(n + int(dt))
    a = _np_float(_float_values(3000, rng, 100.0), dt)
    if dt == DataType.BFLOAT16:
        expected = (
            torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).div(n).view(torch.int16).numpy()
        )
    else:
        expected = torch.from_numpy(a.copy()).div(n).numpy()
    acc = a.copy()
    finalize_avg(acc, n)
    assert np.array_equal(_bits(acc), _bits(expected))
    if dt == DataType.BFLOAT16:
        bits = a.view(np.uint16).copy()
        finalize_avg(bits, n, dtype=DataType.BFLOAT16)
        assert np.array_equal(bits, expected.view(np.uint16))


def test_avg_is_sum_then_finalize() -> None:
    parts = [np.array([1, -3, 5], dtype=np.int16), np.array([2, -4, 6], dtype=np.int16)]
    acc = parts[0].copy()
    reduce_into(acc, parts[1], ReduceOp.AVG)
    assert acc.tolist() == [3, -7, 11]
    finalize_avg(acc, 2)
    assert acc.tolist() == [1, -3, 5]


def test_finalize_avg_errors_and_identity() -> None:
    a = np.array([3, -3], dtype=np.int8)
    finalize_avg(a, 1)
    assert a.tolist() == [3, -3]
    with pytest.raises(InvalidArgumentError, match="world_size"):
        finalize_avg(a, 0)
    ro = np.zeros(2)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        finalize_avg(ro, 2)


def test_gpu_variants_reject_cpu_objects() -> None:
    with pytest.raises(InvalidArgumentError, match="CUDA"):
        reduce_into_gpu(torch.zeros(2), torch.zeros(2), ReduceOp.SUM)
    with pytest.raises(InvalidArgumentError):
        reduce_into_gpu(np.zeros(2), np.zeros(2), ReduceOp.SUM)
    with pytest.raises(InvalidArgumentError):
        finalize_avg_gpu(np.zeros(2), 2)


@pytest.mark.parametrize("np_dt", [np.float16, ml_dtypes.bfloat16])
def test_read_only_operand_on_the_torch_path(np_dt: Any, half_path: str) -> None:
    acc = np.ones(8, dtype=np_dt)
    other = np.frombuffer(np.full(8, 2.0, dtype=np_dt).tobytes(), dtype=np_dt)  # read-only memory
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reduce_into(acc, other, ReduceOp.SUM)
    assert acc.astype(np.float32).tolist() == [3.0] * 8
