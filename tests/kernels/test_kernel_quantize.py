"""quantize / dequantize: error bounds, edge cases, metadata, fused dequantize-reduce."""

from __future__ import annotations

import math
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pccl import DataType, InvalidArgumentError, QuantizationAlgorithm, ReduceOp
from pccl.kernels import backend
from pccl.kernels.quantize import (
    dequantize,
    dequantize_add_into,
    dequantize_reduce_into,
    max_abs_error,
    metadata_size,
    parse_metadata,
    quantize,
)
from pccl.kernels.reduce import reduce_into

MM = QuantizationAlgorithm.MIN_MAX
ZPS = QuantizationAlgorithm.ZERO_POINT_SCALE
ALGS = [MM, ZPS]
QDTYPES = [DataType.UINT8, DataType.UINT16]
FLOATS = {
    DataType.FLOAT16: np.float16,
    DataType.BFLOAT16: ml_dtypes.bfloat16,
    DataType.FLOAT32: np.float32,
    DataType.FLOAT64: np.float64,
}
QMAX = {DataType.UINT8: 255, DataType.UINT16: 65535}


@pytest.fixture(params=["numpy", "torch"])
def half_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(backend, "_HALF_VIA_TORCH", request.param == "torch")
    return str(request.param)


def _f64(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x.astype(np.float64)


def _check_roundtrip(x: np.ndarray[Any, Any], qdt: DataType, alg: QuantizationAlgorithm) -> float:
    q, meta = quantize(x, qdt, alg)
    assert len(meta) == metadata_size(alg)
    assert q.dtype == (np.uint8 if qdt == DataType.UINT8 else np.uint16) and q.size == x.size
    y = dequantize(q, meta)
    assert y.dtype == x.dtype and y.size == x.size
    assert np.array_equal(y.view(np.uint8), dequantize(q, meta).view(np.uint8))  # deterministic
    if x.size == 0:
        return 0.0
    xs = _f64(x).ravel()
    if parse_metadata(meta).poisoned:
        # Only for non-finite input, or (zero-point-scale) float64 data beyond the float32 scale's reach.
        f32max = float(np.finfo(np.float32).max)
        assert not np.isfinite(xs).all() or (alg is ZPS and float(np.max(np.abs(xs))) > f32max / 1e3)
        assert np.isnan(_f64(y)).all()
        return math.nan
    err = float(np.max(np.abs(_f64(y) - xs)))
    bound = max_abs_error(meta, float(xs.min()), float(xs.max()))
    assert err <= bound, (err, bound)
    return err


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("qdt", QDTYPES)
@pytest.mark.parametrize("alg", ALGS)
def test_roundtrip_within_bound(
    dt: DataType, qdt: DataType, alg: QuantizationAlgorithm, half_path: str
) -> None:
    rng = np.random.default_rng(int(dt) * 7 + int(qdt) + 3 * int(alg))
    x = (rng.standard_normal(20_000) * 3.0 + 1.5).astype(FLOATS[dt])
    _check_roundtrip(x, qdt, alg)


@pytest.mark.parametrize("qdt", QDTYPES)
def test_min_max_bound_is_tight_and_met(qdt: DataType) -> None:
    rng = np.random.default_rng(5)
    x = rng.uniform(-2.0, 6.0, 100_000).astype(np.float32)
    q, meta = quantize(x, qdt, MM)
    d = float(x.max()) - float(x.min())
    step_half = d / (2 * QMAX[qdt])
    bound = max_abs_error(meta, float(x.min()), float(x.max()))
    # The float allowance is small next to the half-step (float32 epsilon vs 1/Q): the bound says something.
    assert step_half <= bound <= step_half * (1.01 if qdt == DataType.UINT8 else 1.2)
    err = float(np.max(np.abs(_f64(dequantize(q, meta)) - _f64(x))))
    # Rounding to nearest, not truncating: dense data reaches almost half a step but never a whole one.
    assert 0.9 * step_half <= err <= bound
    assert q.min() == 0 and q.max() == QMAX[qdt]  # min maps to 0, max to Q


def test_min_max_rounds_half_up_and_is_unbiased() -> None:
    x = np.linspace(0.0, 1.0, 1001, dtype=np.float64)
    q, meta = quantize(x, DataType.UINT8, MM)
    y = dequantize(q, meta)
    assert abs(float(np.mean(y - x))) < 1e-4  # truncation would bias by about -step/2 = -0.002
    assert q[0] == 0 and q[-1] == 255


def test_zps_parameters_follow_the_formula() -> None:
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(10_000) * 2.0 + 10.0).astype(np.float32)
    _, meta = quantize(x, DataType.UINT8, ZPS)
    m = parse_metadata(meta)
    std = float(np.std(x.astype(np.float64), ddof=1))
    mean = float(np.mean(x.astype(np.float64)))
    assert m.scale == pytest.approx(float(np.float32(12 * std / 255)), rel=1e-6)
    assert m.scale == float(np.float32(m.scale))
    assert m.zero_point == (255 >> 1) - round(mean / m.scale)


def test_zps_clips_outliers_and_bound_accounts_for_it() -> None:
    x = np.zeros(1000, dtype=np.float32)
    x[::2] = 1.0
    x[7] = 1e4  # far outside mean +- 6 std
    q, meta = quantize(x, DataType.UINT8, ZPS)
    y = dequantize(q, meta)
    assert q[7] == 255
    err = float(np.max(np.abs(_f64(y) - _f64(x))))
    assert err > 1e3  # clipped, as the algorithm does
    assert err <= max_abs_error(meta, float(x.min()), float(x.max()))


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("qdt", QDTYPES)
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("value", [0.0, 1.0, -3.25, 0.3, 1234.5])
def test_constant_chunk_is_reproduced(
    dt: DataType, qdt: DataType, alg: QuantizationAlgorithm, value: float
) -> None:
    x = np.full(37, value, dtype=FLOATS[dt])
    q, meta = quantize(x, qdt, alg)
    y = dequantize(q, meta)
    # d == 0 (min-max): exact. std == 0 (zero-point-scale): the scale is |mean| as a float32, exact for
    # every input of 32 bits or fewer, float32-rounded for float64 input.
    expected = _f64(x)
    if alg is ZPS and dt == DataType.FLOAT64:
        expected = _f64(x.astype(np.float32))
    assert np.array_equal(_f64(y), expected)


def test_std_zero_zero_point_matches_notes() -> None:
    _, meta = quantize(np.zeros(5, np.float32), DataType.UINT8, ZPS)
    m = parse_metadata(meta)
    assert (m.zero_point, m.scale) == (128, 1.0)
    _, meta16 = quantize(np.full(3, 2.0, np.float32), DataType.UINT16, ZPS)
    assert parse_metadata(meta16).zero_point == 32768


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("dt", list(FLOATS))
def test_single_and_empty(alg: QuantizationAlgorithm, dt: DataType) -> None:
    one = np.array([2.5], dtype=FLOATS[dt])
    q, meta = quantize(one, DataType.UINT8, alg)
    assert _f64(dequantize(q, meta)).tolist() == [2.5]
    empty = np.zeros(0, dtype=FLOATS[dt])
    q, meta = quantize(empty, DataType.UINT16, alg)
    assert q.size == 0 and len(meta) == metadata_size(alg)
    assert dequantize(q, meta).size == 0
    assert max_abs_error(meta, 0.0, 0.0) == 0.0
    acc = np.zeros(0, dtype=FLOATS[dt])
    dequantize_add_into(acc, q, meta)


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_chunk_dequantizes_to_nan(alg: QuantizationAlgorithm, dt: DataType, bad: float) -> None:
    x = np.array([1.0, bad, 3.0, 4.0], dtype=FLOATS[dt])
    q, meta = quantize(x, DataType.UINT8, alg)
    assert parse_metadata(meta).poisoned
    y = dequantize(q, meta)
    assert np.isnan(_f64(y)).all()
    assert max_abs_error(meta, 1.0, 4.0) == math.inf
    acc = np.ones(4, dtype=FLOATS[dt])
    dequantize_add_into(acc, q, meta)
    assert np.isnan(_f64(acc)).all()


@pytest.mark.parametrize("alg", ALGS)
def test_extreme_ranges(alg: QuantizationAlgorithm) -> None:
    f32max = float(np.finfo(np.float32).max)
    cases: list[np.ndarray[Any, Any]] = [
        np.array([-f32max, f32max, 0.0, 1e38], dtype=np.float32),  # max - min overflows float32
        np.array([1e-45, 2e-45, 3e-45, 0.0], dtype=np.float32),  # subnormal spread
        np.array([1e6, 1e6 + 0.0625, 1e6 + 0.125], dtype=np.float32),  # tiny spread, large mean
        np.array([-1e300, 1e300, 5.0], dtype=np.float64),
        np.array([5e-324, 1e-323, 0.0], dtype=np.float64),
        np.array([60000.0, -60000.0, 1.0], dtype=np.float16),
    ]
    for x in cases:
        for qdt in QDTYPES:
            q, meta = quantize(x, qdt, alg)
            y = dequantize(q, meta)
            xs = _f64(x)
            bound = max_abs_error(meta, float(xs.min()), float(xs.max()))
            assert np.all(np.abs(_f64(y) - xs) <= bound), (x, qdt, y, bound)


_BIG32 = float(np.float32(1e30))
finite32 = st.floats(min_value=-_BIG32, max_value=_BIG32, allow_nan=False, width=32)


@settings(max_examples=150, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.integers(0, 300), elements=finite32),
    qdt=st.sampled_from(QDTYPES),
    alg=st.sampled_from(ALGS),
)
def test_property_bound_holds_float32(
    x: np.ndarray[Any, Any], qdt: DataType, alg: QuantizationAlgorithm
) -> None:
    _check_roundtrip(x, qdt, alg)


@settings(max_examples=80, deadline=None)
@given(
    x=hnp.arrays(np.float16, st.integers(1, 200), elements=st.floats(-6e4, 6e4, width=16)),
    alg=st.sampled_from(ALGS),
)
def test_property_bound_holds_float16(x: np.ndarray[Any, Any], alg: QuantizationAlgorithm) -> None:
    _check_roundtrip(x, DataType.UINT8, alg)


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PROD])
def test_fused_dequantize_reduce_matches_two_steps(
    dt: DataType, alg: QuantizationAlgorithm, op: ReduceOp, half_path: str
) -> None:
    rng = np.random.default_rng(int(dt) + 13 * int(alg))
    n = 150_000  # several internal blocks
    x = rng.standard_normal(n).astype(FLOATS[dt])
    acc0 = rng.standard_normal(n).astype(FLOATS[dt])
    q, meta = quantize(x, DataType.UINT8, alg)
    two_step = acc0.copy()
    reduce_into(two_step, dequantize(q, meta, backend.numpy_to_dtype(acc0.dtype)), op)
    fused = acc0.copy()
    dequantize_reduce_into(fused, q, meta, op)
    assert np.array_equal(fused.view(np.uint8), two_step.view(np.uint8))
    if op is ReduceOp.SUM:
        added = acc0.copy()
        dequantize_add_into(added, q, meta)
        assert np.array_equal(added.view(np.uint8), two_step.view(np.uint8))


@pytest.mark.parametrize("alg", ALGS)
def test_numpy_and_torch_paths_agree(alg: QuantizationAlgorithm, monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.random.default_rng(9).standard_normal(70_000) * 5
    results = []
    for flag in (False, True):
        monkeypatch.setattr(backend, "_HALF_VIA_TORCH", flag)
        per = []
        for np_dt in (np.float16, ml_dtypes.bfloat16):
            q, meta = quantize(values.astype(np_dt), DataType.UINT16, alg)
            per.append((q.tobytes(), meta, dequantize(q, meta).view(np.uint16).tobytes()))
        results.append(per)
    assert results[0] == results[1]


@pytest.mark.parametrize("alg", ALGS)
def test_bfloat16_bit_patterns_with_hint(alg: QuantizationAlgorithm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "_HALF_VIA_TORCH", False)
    x = (np.random.default_rng(4).standard_normal(70_000) * 3).astype(ml_dtypes.bfloat16)
    q_ref, meta_ref = quantize(x, DataType.UINT8, alg)
    bits = x.view(np.uint16)
    q, meta = quantize(bits, DataType.UINT8, alg, dtype=DataType.BFLOAT16)
    assert meta == meta_ref and np.array_equal(q, q_ref)
    out = np.empty(x.size, dtype=np.uint16)
    dequantize(q, meta, DataType.BFLOAT16, out=out)
    assert np.array_equal(out, dequantize(q_ref, meta_ref).view(np.uint16))
    acc = np.ones(x.size, dtype=ml_dtypes.bfloat16)
    acc_bits = acc.view(np.uint16).copy()
    dequantize_add_into(acc, q, meta)
    dequantize_add_into(acc_bits, q, meta, dtype=DataType.BFLOAT16)
    assert np.array_equal(acc.view(np.uint16), acc_bits)


def test_dequantize_into_other_dtype_and_out() -> None:
    x = np.linspace(-1, 1, 100, dtype=np.float32)
    q, meta = quantize(x, DataType.UINT16, MM)
    out = np.empty((10, 10), dtype=np.float64)
    res = dequantize(q, meta, DataType.FLOAT64, out=out)
    assert np.shares_memory(res, out)
    assert np.max(np.abs(out.ravel() - x)) <= max_abs_error(meta, -1.0, 1.0)
    qo = np.empty(100, dtype=np.uint16)
    q2, _ = quantize(x, DataType.UINT16, MM, out=qo)
    assert q2 is qo or np.shares_memory(q2, qo)


def test_metadata_layout_and_validation() -> None:
    x = np.array([1.0, 2.0, 4.0], dtype=np.float32)
    _, meta = quantize(x, DataType.UINT16, MM)
    assert metadata_size(MM) == 28 and metadata_size(ZPS) == 24
    alg, qdt, dt, pad, count = struct.unpack_from("<BBBBQ", meta)
    assert (alg, qdt, dt, pad, count) == (MM, DataType.UINT16, DataType.FLOAT32, 0, 3)
    assert struct.unpack_from("<dd", meta, 12) == (1.0, 4.0)
    m = parse_metadata(meta)
    assert m.pack() == meta and m.qmax == 65535
    _, zmeta = quantize(x, DataType.UINT8, ZPS)
    zp, scale = struct.unpack_from("<qf", zmeta, 12)
    assert parse_metadata(zmeta).zero_point == zp and parse_metadata(zmeta).scale == scale

    bad = [
        meta[:5],
        meta + b"\0",
        bytes([9]) + meta[1:],
        meta[:1] + bytes([DataType.INT32]) + meta[2:],
        meta[:2] + bytes([DataType.INT8]) + meta[3:],
        meta[:3] + b"\1" + meta[4:],
        bytes([0]) + meta[1:],
    ]
    for b in bad:
        with pytest.raises(InvalidArgumentError):
            parse_metadata(b)


def test_argument_errors() -> None:
    x = np.zeros(4, dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="NONE"):
        quantize(x, DataType.UINT8, QuantizationAlgorithm.NONE)
    with pytest.raises(InvalidArgumentError, match="UINT8 or UINT16"):
        quantize(x, DataType.INT8, MM)
    with pytest.raises(InvalidArgumentError, match="floating"):
        quantize(np.zeros(4, np.int32), DataType.UINT8, MM)
    with pytest.raises(InvalidArgumentError):
        quantize(x, DataType.UINT8, MM, out=np.empty(3, np.uint8))
    q, meta = quantize(x, DataType.UINT8, MM)
    with pytest.raises(InvalidArgumentError, match="elements"):
        dequantize(q[:3], meta)
    with pytest.raises(InvalidArgumentError, match="metadata says"):
        dequantize(q.astype(np.uint16), meta)
    with pytest.raises(InvalidArgumentError):
        dequantize(q, meta, DataType.INT32)
    with pytest.raises(InvalidArgumentError):
        dequantize(q, meta, out=np.empty(4, np.float64))
    with pytest.raises(InvalidArgumentError):
        dequantize_add_into(np.zeros(5, np.float32), q, meta)
    with pytest.raises(InvalidArgumentError):
        dequantize_add_into(np.zeros(8, np.float32)[::2], q, meta)
