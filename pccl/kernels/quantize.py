"""Lossy compression of all-reduce payloads to 8- or 16-bit unsigned integers.

Two algorithms, after the established system (REFERENCE_NOTES.md, "Quantization math"), with ``Q`` the largest
value of the quantized type (255 or 65535):

MIN_MAX
    ``min``/``max`` of the chunk, ``d = max - min``; ``q = floor((x - min) * (Q / d) + 0.5)`` and
    ``x' = q * (d / Q) + min``; when ``d == 0`` every ``q`` is 0 and ``x' == min`` exactly.
    **Deliberate deviation:** the established system truncates (``q = trunc(...)``), which biases every value
    down by half a step on average and doubles the worst-case error; rounding to nearest gives
    ``|x - x'| <= d / (2 Q)`` (plus float rounding, see :func:`max_abs_error`) and no systematic bias, which
    matters because every hop of the ring re-quantizes a partial sum.

ZERO_POINT_SCALE
    mean and sample standard deviation (float64); ``scale = float32(12 * std / Q)``,
    ``zp = (Q >> 1) - round(mean / scale)`` (half away from zero), ``q = clamp(round(x / scale) + zp, 0, Q)``
    (half up) and ``x' = (q - zp) * scale``. Values farther than about ``6 std`` from the mean are clipped.
    When ``std == 0`` (all values equal, or a single element; also when the spread is below ``2**-40`` of
    the mean, beneath float precision) ``zp = (Q + 1) >> 1`` and ``scale`` is ``|mean|`` (``1.0`` when the
    mean is 0), so a constant chunk is reproduced exactly (to float32 precision of the mean).
    **Deviation:** the established system always uses ``scale = 1.0`` there, which rounds a constant chunk
    to the nearest integer (0.3 becomes 0).

Non-finite input (any NaN or infinity in the chunk) cannot be scaled; the chunk is then sent as "poisoned"
(parameters NaN, all ``q`` 0) and dequantizes to all-NaN, so the NaN reaches every peer the way it would
without quantization, instead of turning into plausible-looking garbage. ZERO_POINT_SCALE carries its scale
as a float32, so float64 chunks whose mean or ``12 std / Q`` exceed float32's range are sent poisoned too
(MIN_MAX covers the whole float64 range). Dequantized values are clamped to the output dtype's finite range
(ZERO_POINT_SCALE's representable range can reach beyond it).

Metadata (sent before the quantized bytes), little-endian, fixed size per algorithm:

===========  ======  ====================================================================
offset       type    field
===========  ======  ====================================================================
0            u8      algorithm (QuantizationAlgorithm value)
1            u8      quantized dtype (DataType value: UINT8 or UINT16)
2            u8      original dtype (DataType value: FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
3            u8      reserved, 0
4            u64     element count
12 MIN_MAX   f64,f64 min, max (exact: every supported float is a float64 value)
12 ZPS       i64,f32 zero point, scale
===========  ======  ====================================================================

so ``metadata_size(MIN_MAX) == 28`` and ``metadata_size(ZERO_POINT_SCALE) == 24``.

Determinism: :func:`dequantize` is a pure function of ``(q, meta, out dtype)``; every peer that dequantizes
the same bytes gets the same bits, which is what keeps the all-gather phase bit-identical. (These kernels
run on the CPU; GPU tensors are quantized from their host staging buffers.)

bfloat16 held as ``uint16`` bit patterns (no ``ml_dtypes``): pass ``dtype=DataType.BFLOAT16`` to
:func:`quantize` and :func:`dequantize_reduce_into`, and ``out_dtype=DataType.BFLOAT16`` (or a metadata blob
that records BFLOAT16) to :func:`dequantize` with a ``uint16`` ``out``.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError
from .._types import DataType, QuantizationAlgorithm, ReduceOp
from . import _bf16
from .backend import bfloat16_numpy_dtype, dtype_to_numpy, half_torch, numpy_to_dtype
from .reduce import reduce_into

__all__ = [
    "QuantMeta",
    "dequantize",
    "dequantize_add_into",
    "dequantize_reduce_into",
    "max_abs_error",
    "metadata_size",
    "parse_metadata",
    "quantize",
]

_HEADER = struct.Struct("<BBBxQ")
_MIN_MAX = struct.Struct("<dd")
_ZPS = struct.Struct("<qf")
_QMAX = {DataType.UINT8: 255, DataType.UINT16: 65535}
_FLOATS = (DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT32, DataType.FLOAT64)
# Machine epsilon (spacing at 1.0) and smallest positive subnormal of each float type.
_EPS = {
    DataType.FLOAT16: 2.0**-10,
    DataType.BFLOAT16: 2.0**-7,
    DataType.FLOAT32: 2.0**-23,
    DataType.FLOAT64: 2.0**-52,
}
_TINY = {
    DataType.FLOAT16: 2.0**-24,
    DataType.BFLOAT16: 2.0**-133,
    DataType.FLOAT32: 2.0**-149,
    DataType.FLOAT64: 2.0**-1074,
}
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32
# Elements per block: float32 temporaries of 128 KiB stay in L2 while each pass runs over them, and torch
# conversions of this size stay single-threaded (see pccl.kernels.reduce._TORCH_CPU_BLOCK).
_BLOCK = 1 << 15
# Integer offsets up to this size are exact, with room to spare, in float32 arithmetic.
_F32_EXACT_INT = 1 << 18
# Largest |mean| / scale (in steps) a zero point may encode; beyond it the chunk is treated as constant.
_ZPS_MAX_OFFSET = float(1 << 40)


@dataclass(frozen=True)
class QuantMeta:
    """Decoded quantization metadata.

    Attributes:
        algorithm: MIN_MAX or ZERO_POINT_SCALE.
        quantized_dtype: UINT8 or UINT16.
        dtype: the original floating dtype.
        count: number of elements.
        min_value: MIN_MAX only (NaN when the chunk was not finite).
        max_value: MIN_MAX only.
        zero_point: ZERO_POINT_SCALE only.
        scale: ZERO_POINT_SCALE only (a float32 value; NaN when the chunk was not finite).
    """

    algorithm: QuantizationAlgorithm
    quantized_dtype: DataType
    dtype: DataType
    count: int
    min_value: float = 0.0
    max_value: float = 0.0
    zero_point: int = 0
    scale: float = 1.0

    @property
    def qmax(self) -> int:
        """Largest quantized value (255 or 65535)."""
        return _QMAX[self.quantized_dtype]

    @property
    def poisoned(self) -> bool:
        """True when the original chunk held NaN/inf: it dequantizes to all-NaN."""
        if self.algorithm is QuantizationAlgorithm.MIN_MAX:
            return not (math.isfinite(self.min_value) and math.isfinite(self.max_value))
        return not math.isfinite(self.scale)

    def pack(self) -> bytes:
        """Encode as the fixed-size wire blob (see the module docstring)."""
        head = _HEADER.pack(self.algorithm, self.quantized_dtype, self.dtype, self.count)
        if self.algorithm is QuantizationAlgorithm.MIN_MAX:
            return head + _MIN_MAX.pack(self.min_value, self.max_value)
        return head + _ZPS.pack(self.zero_point, self.scale)


def metadata_size(algorithm: QuantizationAlgorithm) -> int:
    """Length in bytes of the metadata blob for ``algorithm``.

    Args:
        algorithm: MIN_MAX or ZERO_POINT_SCALE.

    Returns:
        28 for MIN_MAX, 24 for ZERO_POINT_SCALE.

    Raises:
        InvalidArgumentError: NONE or an unknown algorithm.
    """
    alg = _check_algorithm(algorithm)
    return _HEADER.size + (_MIN_MAX.size if alg is QuantizationAlgorithm.MIN_MAX else _ZPS.size)


def parse_metadata(meta: bytes | bytearray | memoryview) -> QuantMeta:
    """Decode and validate a metadata blob (e.g. one received from another peer).

    Args:
        meta: the blob produced by :func:`quantize`.

    Returns:
        The decoded :class:`QuantMeta`.

    Raises:
        InvalidArgumentError: wrong length, unknown algorithm or dtype codes, non-zero reserved byte.
    """
    raw = bytes(meta)
    if len(raw) < _HEADER.size:
        raise InvalidArgumentError(f"quantization metadata too short ({len(raw)} bytes)")
    alg_code, q_code, dt_code, count = _HEADER.unpack_from(raw)
    if raw[3] != 0:
        raise InvalidArgumentError("quantization metadata: reserved byte is not zero")
    try:
        alg = _check_algorithm(QuantizationAlgorithm(alg_code))
        qdt = DataType(q_code)
        dt = DataType(dt_code)
    except ValueError:
        raise InvalidArgumentError(
            f"quantization metadata: bad codes {alg_code}/{q_code}/{dt_code}"
        ) from None
    if qdt not in _QMAX or dt not in _FLOATS:
        raise InvalidArgumentError(f"quantization metadata: unsupported dtypes {qdt.name}/{dt.name}")
    if len(raw) != metadata_size(alg):
        raise InvalidArgumentError(f"quantization metadata for {alg.name} must be {metadata_size(alg)} bytes")
    if alg is QuantizationAlgorithm.MIN_MAX:
        lo, hi = _MIN_MAX.unpack_from(raw, _HEADER.size)
        return QuantMeta(alg, qdt, dt, count, min_value=lo, max_value=hi)
    zp, scale = _ZPS.unpack_from(raw, _HEADER.size)
    return QuantMeta(alg, qdt, dt, count, zero_point=zp, scale=scale)


def _check_algorithm(algorithm: QuantizationAlgorithm) -> QuantizationAlgorithm:
    try:
        alg = QuantizationAlgorithm(algorithm)
    except ValueError:
        raise InvalidArgumentError(f"unknown quantization algorithm {algorithm!r}") from None
    if alg is QuantizationAlgorithm.NONE:
        raise InvalidArgumentError("quantization algorithm NONE has no quantized form")
    return alg


# ----------------------------------------------------------------------------------------------------
# float16/bfloat16 <-> float32 block conversion


def _float_dtype(arr: np.ndarray[Any, Any], hint: DataType | None) -> DataType:
    actual = numpy_to_dtype(arr.dtype)
    dt = actual
    if hint is not None and hint != actual:
        if not (hint == DataType.BFLOAT16 and actual == DataType.UINT16):
            raise InvalidArgumentError(
                f"dtype hint {DataType(hint).name} does not match array dtype {arr.dtype}"
            )
        dt = DataType.BFLOAT16
    if dt not in _FLOATS:
        raise InvalidArgumentError(f"quantization needs a floating dtype, got {dt.name}")
    return dt


def _torch_half(block: np.ndarray[Any, Any], dt: DataType) -> Any:
    """A torch view of a float16/bfloat16 block when torch is already imported, else None."""
    torch = half_torch()
    if torch is None:
        return None
    if dt == DataType.BFLOAT16:
        return torch.from_numpy(block.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(block)


def _load_f32(src: np.ndarray[Any, Any], dt: DataType, out: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Widen a float16/bfloat16 block into float32 ``out`` (exact)."""
    if src.flags.writeable:  # torch.from_numpy wants writable memory; conversion never writes src
        tv = _torch_half(src, dt)
        if tv is not None:
            # numpy's float16 cast goes element by element (~0.9 GB/s); torch's is vectorised. Both are exact.
            sys.modules["torch"].from_numpy(out).copy_(tv)
            return out
    if dt == DataType.BFLOAT16 and src.dtype != bfloat16_numpy_dtype():
        return _bf16.bf16_bits_to_f32(src, out=out)
    np.copyto(out, src, casting="unsafe")
    return out


def _store_f32(values: np.ndarray[Any, Any], dst: np.ndarray[Any, Any], dt: DataType) -> None:
    """Narrow float32 ``values`` into a float16/bfloat16 block, round-to-nearest-even.

    torch, numpy and the bit-level bfloat16 emulation agree bit for bit on every finite value and infinity;
    they only differ in NaN payloads, which never reach this function (poisoned chunks are filled directly).
    """
    tv = _torch_half(dst, dt)
    if tv is not None:
        tv.copy_(sys.modules["torch"].from_numpy(values))
        return
    if dt == DataType.BFLOAT16 and dst.dtype != bfloat16_numpy_dtype():
        _bf16.f32_to_bf16_bits(values, out=dst)
        return
    np.copyto(dst, values, casting="unsafe")


def _blocks(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, _BLOCK):
        yield start, min(start + _BLOCK, n)


def _nan_fill(out: np.ndarray[Any, Any], dt: DataType) -> None:
    if dt == DataType.BFLOAT16:
        out.view(np.uint16)[...] = 0x7FC0  # the canonical quiet NaN, whatever holds the bits
    else:
        out[...] = np.nan


# ----------------------------------------------------------------------------------------------------
# quantize


def quantize(
    x: np.ndarray[Any, Any],
    qdtype: DataType,
    algorithm: QuantizationAlgorithm,
    *,
    dtype: DataType | None = None,
    out: np.ndarray[Any, Any] | None = None,
) -> tuple[np.ndarray[Any, Any], bytes]:
    """Quantize a chunk of floats.

    Args:
        x: float16/bfloat16/float32/float64 values (any shape; treated as flat). Not modified.
        qdtype: UINT8 or UINT16.
        algorithm: MIN_MAX or ZERO_POINT_SCALE.
        dtype: hint, only for bfloat16 held as ``uint16`` bit patterns.
        out: optional preallocated flat quantized array (``uint8``/``uint16``, ``x.size`` elements).

    Returns:
        ``(q, meta)``: the flat quantized array (``out`` when given) and the metadata blob
        (:func:`metadata_size` bytes) to send before it.

    Raises:
        InvalidArgumentError: bad dtype, bad ``qdtype``, algorithm NONE/unknown, bad ``out``.
    """
    alg = _check_algorithm(algorithm)
    try:
        qdt = DataType(qdtype)
    except ValueError:
        raise InvalidArgumentError(f"unknown DataType {qdtype!r}") from None
    if qdt not in _QMAX:
        raise InvalidArgumentError(f"quantized dtype must be UINT8 or UINT16, got {qdt.name}")
    dt = _float_dtype(x, dtype)
    flat = x.reshape(-1)
    n = flat.size
    qnp = dtype_to_numpy(qdt)
    if out is None:
        q = np.empty(n, dtype=qnp)
    else:
        if out.dtype != qnp or out.size != n or not out.flags.writeable:
            raise InvalidArgumentError(f"out must be a writable {qnp} array of {n} elements")
        q = out.reshape(-1)
    # Overflow/invalid warnings would only restate the non-finite handling documented above.
    with np.errstate(all="ignore"):
        if alg is QuantizationAlgorithm.MIN_MAX:
            meta = _quantize_min_max(flat, dt, qdt, q)
        else:
            meta = _quantize_zps(flat, dt, qdt, q)
    return q, meta.pack()


def _min_max(flat: np.ndarray[Any, Any], dt: DataType) -> tuple[float, float]:
    if dt in (DataType.FLOAT32, DataType.FLOAT64):
        return float(np.min(flat)), float(np.max(flat))
    tmp = np.empty(min(_BLOCK, flat.size), dtype=np.float32)
    lo, hi = math.inf, -math.inf
    for start, stop in _blocks(flat.size):
        b = _load_f32(flat[start:stop], dt, tmp[: stop - start])
        blo, bhi = float(b.min()), float(b.max())
        if math.isnan(blo) or math.isnan(bhi):
            return math.nan, math.nan
        lo, hi = min(lo, blo), max(hi, bhi)
    return lo, hi


def _quantize_min_max(
    flat: np.ndarray[Any, Any], dt: DataType, qdt: DataType, q: np.ndarray[Any, Any]
) -> QuantMeta:
    n = flat.size
    if n == 0:
        return QuantMeta(QuantizationAlgorithm.MIN_MAX, qdt, dt, 0, min_value=0.0, max_value=0.0)
    lo, hi = _min_max(flat, dt)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        q[...] = 0
        return QuantMeta(QuantizationAlgorithm.MIN_MAX, qdt, dt, n, min_value=math.nan, max_value=math.nan)
    # hi - lo is exact for float16/bfloat16/float32 inputs (float64 arithmetic). float64 data may span more
    # than the largest float64: then work on halved values, x/2 - min/2, which cannot overflow.
    halve = not math.isfinite(hi - lo)
    d = hi * 0.5 - lo * 0.5 if halve else hi - lo
    qmax = _QMAX[qdt]
    inv_step = qmax / d if d > 0.0 else math.inf
    if not math.isfinite(inv_step):
        # All equal, or (float64 only) a spread so far below the subnormal range that Q / d overflows: send a
        # constant chunk; the error is then at most d, a few subnormal steps.
        q[...] = 0
        return QuantMeta(QuantizationAlgorithm.MIN_MAX, qdt, dt, n, min_value=lo, max_value=lo)
    # float32 arithmetic for 32-bit and narrower inputs, unless x - min or Q / d leave float32's normal
    # range.
    wide = dt == DataType.FLOAT64 or d > _F32_MAX / 2 or inv_step > _F32_MAX / 2 or d / qmax < _F32_TINY
    wt = np.float64 if wide else np.float32
    mn = wt(lo * 0.5 if halve else lo)
    scale = wt(inv_step)
    half = wt(0.5)
    tmp = np.empty(min(_BLOCK, n), dtype=wt)
    conv = np.empty(min(_BLOCK, n), dtype=np.float32) if dt in (DataType.FLOAT16, DataType.BFLOAT16) else None
    for start, stop in _blocks(n):
        t = tmp[: stop - start]
        xb = flat[start:stop]
        if conv is not None:
            xb = _load_f32(xb, dt, conv[: stop - start])
        if halve:
            np.multiply(xb, half, out=t)
            np.subtract(t, mn, out=t)
        else:
            np.subtract(xb, mn, out=t, casting="unsafe")  # >= 0: x >= min and rounding is monotone
        np.multiply(t, scale, out=t)
        np.add(t, half, out=t)
        # t in [0.5, Q + 0.5 + tiny): truncation is floor(v + 0.5), i.e. round half up, and stays <= Q.
        np.copyto(q[start:stop], t, casting="unsafe")
    return QuantMeta(QuantizationAlgorithm.MIN_MAX, qdt, dt, n, min_value=lo, max_value=hi)


def _mean_std(flat: np.ndarray[Any, Any], dt: DataType) -> tuple[float, float]:
    """Mean and sample standard deviation in float64, one pass of blocks (Chan et al. pairwise merge)."""
    n = flat.size
    tmp = np.empty(min(_BLOCK, n), dtype=np.float64)
    conv = np.empty(min(_BLOCK, n), dtype=np.float32) if dt in (DataType.FLOAT16, DataType.BFLOAT16) else None
    count, mean, m2 = 0, 0.0, 0.0
    for start, stop in _blocks(n):
        nb = stop - start
        xb = flat[start:stop]
        if conv is not None:
            xb = _load_f32(xb, dt, conv[:nb])
        t = tmp[:nb]
        np.copyto(t, xb, casting="unsafe")
        bmean = float(t.sum()) / nb
        t -= bmean
        # einsum, not np.dot: BLAS dot may spin up threads (1 ms per block on a busy 2-core machine).
        bm2 = float(np.einsum("i,i->", t, t))
        total = count + nb
        delta = bmean - mean
        mean += delta * nb / total
        m2 += bm2 + delta * delta * count * nb / total
        count = total
    std = (
        math.sqrt(m2 / (n - 1)) if n > 1 and math.isfinite(m2) else (0.0 if math.isfinite(mean) else math.nan)
    )
    return mean, std


def _round_half_away(v: float) -> int:
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _quantize_zps(
    flat: np.ndarray[Any, Any], dt: DataType, qdt: DataType, q: np.ndarray[Any, Any]
) -> QuantMeta:
    n = flat.size
    qmax = _QMAX[qdt]
    alg = QuantizationAlgorithm.ZERO_POINT_SCALE
    if n == 0:
        return QuantMeta(alg, qdt, dt, 0, zero_point=(qmax + 1) >> 1, scale=1.0)
    mean, std = _mean_std(flat, dt)
    if not (math.isfinite(mean) and math.isfinite(std)) or max(abs(mean), 12.0 * std / qmax) > _F32_MAX:
        # Non-finite input, or float64 data beyond float32 range: the scale is a float32 on the wire.
        q[...] = 0
        return QuantMeta(alg, qdt, dt, n, zero_point=0, scale=math.nan)
    scale = float(np.float32(12.0 * std / qmax)) if std > 0 else 0.0
    if not (0.0 < scale < math.inf) or abs(mean) / scale > _ZPS_MAX_OFFSET:
        # Constant chunk, or one whose spread is negligible next to its mean (below float precision; the
        # zero point would not even fit): q = zp +- 1 and x' = +-|mean| reproduces it.
        zp = (qmax + 1) >> 1
        scale = float(np.float32(abs(mean)))
        if not (0.0 < scale < math.inf):
            scale = 1.0
    else:
        zp = (qmax >> 1) - _round_half_away(mean / scale)
    inv_scale = 1.0 / scale
    wide = (
        dt == DataType.FLOAT64
        or abs(zp) + qmax > _F32_EXACT_INT
        or inv_scale > _F32_MAX / 2
        or scale < _F32_TINY
    )
    wt = np.float64 if wide else np.float32
    inv = wt(inv_scale)
    offset = wt(zp + 0.5)
    upper = wt(qmax + 0.5)
    zero = wt(0.0)
    tmp = np.empty(min(_BLOCK, n), dtype=wt)
    conv = np.empty(min(_BLOCK, n), dtype=np.float32) if dt in (DataType.FLOAT16, DataType.BFLOAT16) else None
    for start, stop in _blocks(n):
        t = tmp[: stop - start]
        xb = flat[start:stop]
        if conv is not None:
            xb = _load_f32(xb, dt, conv[: stop - start])
        np.multiply(xb, inv, out=t, casting="unsafe")
        np.add(t, offset, out=t)
        # clamp(floor(v), 0, Q) == floor(clamp(v, 0, Q + 0.5)) for v = x / scale + zp + 0.5 (round half up)
        np.clip(t, zero, upper, out=t)
        np.copyto(q[start:stop], t, casting="unsafe")
    return QuantMeta(alg, qdt, dt, n, zero_point=zp, scale=scale)


# ----------------------------------------------------------------------------------------------------
# dequantize


_OUT_MAX = {
    DataType.FLOAT16: 65504.0,
    DataType.BFLOAT16: float(np.array([0x7F7F0000], dtype=np.uint32).view(np.float32)[0]),  # bits 0x7F7F
    DataType.FLOAT32: _F32_MAX,
    DataType.FLOAT64: float(np.finfo(np.float64).max),
}


@dataclass(frozen=True)
class _Deq:
    """How to dequantize: ``x' = (q * mul + off) * post`` (MIN_MAX) or ``x' = (q - off) * mul`` (ZPS).

    ``work`` is the arithmetic dtype. ``post`` is 2.0 when min-max parameters are halved so that ``q * step``
    cannot overflow float64 near its largest value, else None. ``limit`` is the output dtype's largest
    finite value when the representable range reaches beyond it (results are clamped to it rather than
    rounded to infinity), else None.
    """

    work: type[np.floating[Any]]
    mul: Any
    off: Any
    subtract_first: bool
    post: Any
    limit: Any


def _dequant_params(m: QuantMeta, out_dt: DataType) -> _Deq:
    fmax = _OUT_MAX[out_dt]
    if m.algorithm is QuantizationAlgorithm.MIN_MAX:
        lo, hi = m.min_value, m.max_value
    else:
        lo, hi = -m.zero_point * m.scale, (m.qmax - m.zero_point) * m.scale
    # Slightly conservative: rounding inside the work dtype may overshoot the exact range by a few ulps.
    limit = fmax if max(abs(lo), abs(hi)) * (1 + 2**-20) >= fmax else None
    if m.algorithm is QuantizationAlgorithm.MIN_MAX:
        # Halved parameters when q * step could overflow float64 (or max - min already does).
        halve = max(abs(m.min_value), abs(m.max_value)) > _OUT_MAX[DataType.FLOAT64] / 4
        d = m.max_value * 0.5 - m.min_value * 0.5 if halve else m.max_value - m.min_value
        step = d / m.qmax
        wide = (
            out_dt == DataType.FLOAT64
            or abs(m.min_value) > _F32_MAX / 2
            or d > _F32_MAX / 2
            or (0.0 < step < _F32_TINY)
        )
        wt: type[np.floating[Any]] = np.float64 if wide else np.float32
        lo = m.min_value * 0.5 if halve else m.min_value
        return _Deq(
            wt, wt(step), wt(lo), False, wt(2.0) if halve else None, None if limit is None else wt(limit)
        )
    wide = (
        out_dt == DataType.FLOAT64
        or abs(m.zero_point) + m.qmax > _F32_EXACT_INT
        or m.scale > _F32_MAX / (2 * m.qmax)
    )
    wt = np.float64 if wide else np.float32
    return _Deq(wt, wt(m.scale), wt(m.zero_point), True, None, None if limit is None else wt(limit))


def _dequant_block(
    qb: np.ndarray[Any, Any],
    p: _Deq,
    ob: np.ndarray[Any, Any],
    out_dt: DataType,
    tmp: np.ndarray[Any, Any] | None,
) -> None:
    direct = np.dtype(p.work) == ob.dtype
    t = ob if direct else tmp
    assert t is not None
    if p.subtract_first:
        np.subtract(qb, p.off, out=t, casting="unsafe")  # exact: small integers
        np.multiply(t, p.mul, out=t)
    else:
        np.multiply(qb, p.mul, out=t, casting="unsafe")
        np.add(t, p.off, out=t)
        if p.post is not None:
            np.multiply(t, p.post, out=t)
    if p.limit is not None:
        np.clip(t, -p.limit, p.limit, out=t)
    if not direct:
        if out_dt in (DataType.FLOAT16, DataType.BFLOAT16):
            _store_f32(t, ob, out_dt)
        else:
            np.copyto(ob, t, casting="unsafe")


def _check_q(q: np.ndarray[Any, Any], m: QuantMeta) -> np.ndarray[Any, Any]:
    if q.dtype != dtype_to_numpy(m.quantized_dtype):
        raise InvalidArgumentError(f"quantized data is {q.dtype}, metadata says {m.quantized_dtype.name}")
    if q.size != m.count:
        raise InvalidArgumentError(f"quantized data has {q.size} elements, metadata says {m.count}")
    return q.reshape(-1)


def dequantize(
    q: np.ndarray[Any, Any],
    meta: bytes | bytearray | memoryview,
    out_dtype: DataType | None = None,
    out: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """Reconstruct floats from quantized data and its metadata.

    Args:
        q: the quantized values (``uint8``/``uint16``, as many as the metadata says).
        meta: the metadata blob from :func:`quantize`.
        out_dtype: floating dtype of the result; defaults to the original dtype recorded in ``meta``.
        out: optional preallocated result array (``q.size`` elements of ``out_dtype``; for bfloat16 without
            ``ml_dtypes`` a ``uint16`` array holding bit patterns).

    Returns:
        The flat dequantized array (``out``, flattened, when given).

    Raises:
        InvalidArgumentError: malformed metadata, size or dtype mismatch.
    """
    m = parse_metadata(meta)
    qf = _check_q(q, m)
    out_dt = m.dtype if out_dtype is None else DataType(out_dtype)
    if out_dt not in _FLOATS:
        raise InvalidArgumentError(f"dequantize produces floats, not {out_dt.name}")
    onp = dtype_to_numpy(out_dt)
    if out is None:
        res = np.empty(m.count, dtype=onp)
    else:
        bits_ok = out_dt == DataType.BFLOAT16 and out.dtype == np.uint16  # bfloat16 held as bit patterns
        if (out.dtype != onp and not bits_ok) or out.size != m.count or not out.flags.writeable:
            raise InvalidArgumentError(f"out must be a writable {onp} array of {m.count} elements")
        if not out.flags.c_contiguous:
            raise InvalidArgumentError("out must be contiguous")
        res = out.reshape(-1)
    if m.poisoned:
        _nan_fill(res, out_dt)
        return res
    params = _dequant_params(m, out_dt)
    tmp = None if np.dtype(params.work) == res.dtype else np.empty(min(_BLOCK, m.count), dtype=params.work)
    with np.errstate(all="ignore"):
        _dequant_all(qf, params, res, out_dt, tmp)
    return res


def _dequant_all(
    qf: np.ndarray[Any, Any],
    params: _Deq,
    res: np.ndarray[Any, Any],
    out_dt: DataType,
    tmp: np.ndarray[Any, Any] | None,
) -> None:
    for start, stop in _blocks(qf.size):
        _dequant_block(
            qf[start:stop], params, res[start:stop], out_dt, None if tmp is None else tmp[: stop - start]
        )


def dequantize_reduce_into(
    acc: np.ndarray[Any, Any],
    q: np.ndarray[Any, Any],
    meta: bytes | bytearray | memoryview,
    op: ReduceOp = ReduceOp.SUM,
    *,
    dtype: DataType | None = None,
) -> None:
    """``acc = op(acc, dequantize(q, meta, acc's dtype))``, fused block by block (no full-size temporary).

    Bit-identical to calling :func:`dequantize` then :func:`pccl.kernels.reduce.reduce_into`.

    Args:
        acc: float accumulator (written), contiguous, ``meta``'s element count.
        q: quantized data.
        meta: its metadata blob.
        op: reduction (SUM by default; AVG is SUM).
        dtype: hint, only for bfloat16 held as ``uint16`` bit patterns.

    Raises:
        InvalidArgumentError: malformed metadata, size or dtype mismatch, non-contiguous or read-only ``acc``.
    """
    m = parse_metadata(meta)
    qf = _check_q(q, m)
    acc_dt = _float_dtype(acc, dtype)
    if acc.size != m.count:
        raise InvalidArgumentError(f"acc has {acc.size} elements, metadata says {m.count}")
    if not acc.flags.c_contiguous or not acc.flags.writeable:
        raise InvalidArgumentError("acc must be contiguous and writable")
    a = acc.reshape(-1)
    scratch = np.empty(min(_BLOCK, m.count), dtype=acc.dtype)
    if m.poisoned:
        _nan_fill(scratch, acc_dt)
        for start, stop in _blocks(m.count):
            reduce_into(a[start:stop], scratch[: stop - start], op, dtype=acc_dt)
        return
    params = _dequant_params(m, acc_dt)
    tmp = None if np.dtype(params.work) == acc.dtype else np.empty(min(_BLOCK, m.count), dtype=params.work)
    with np.errstate(all="ignore"):
        for start, stop in _blocks(m.count):
            nb = stop - start
            _dequant_block(qf[start:stop], params, scratch[:nb], acc_dt, None if tmp is None else tmp[:nb])
            reduce_into(a[start:stop], scratch[:nb], op, dtype=acc_dt)


def dequantize_add_into(
    acc: np.ndarray[Any, Any],
    q: np.ndarray[Any, Any],
    meta: bytes | bytearray | memoryview,
    *,
    dtype: DataType | None = None,
) -> None:
    """``acc += dequantize(q, meta)`` in acc's dtype; shorthand for :func:`dequantize_reduce_into` with SUM.

    Args:
        acc: float accumulator (written).
        q: quantized data.
        meta: its metadata blob.
        dtype: hint, only for bfloat16 held as ``uint16`` bit patterns.

    Raises:
        InvalidArgumentError: as :func:`dequantize_reduce_into`.
    """
    dequantize_reduce_into(acc, q, meta, ReduceOp.SUM, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# error bound


def max_abs_error(meta: bytes | bytearray | memoryview, x_min: float, x_max: float) -> float:
    """Guaranteed bound on ``|x - dequantize(quantize(x))|`` for a chunk with values in ``[x_min, x_max]``.

    The bound is the quantization step term plus a float-rounding allowance:

    * MIN_MAX: ``d / (2 Q) + 8 eps_w max(d, M) + eps_out M + tiny_out`` with ``d = max - min`` from ``meta``
      (plus how far ``[x_min, x_max]`` sticks out of ``[min, max]``, for callers passing a wider range);
    * ZERO_POINT_SCALE: ``max(scale / 2, clip) + 8 eps_w M + eps_out M + tiny_out``, where ``clip`` is how far
      ``[x_min, x_max]`` sticks out of the representable range ``[(0 - zp) scale, (Q - zp) scale]``;

    ``M`` is the largest magnitude involved, ``eps_w`` the machine epsilon of the arithmetic (float32, or
    float64 for float64 data) and ``eps_out``/``tiny_out`` the epsilon and smallest subnormal of the output
    dtype.

    Args:
        meta: the metadata :func:`quantize` returned for the chunk.
        x_min: smallest value of the chunk.
        x_max: largest value of the chunk.

    Returns:
        The bound (``inf`` for a poisoned chunk, 0 for an empty one).

    Raises:
        InvalidArgumentError: malformed metadata.
    """
    m = parse_metadata(meta)
    if m.count == 0:
        return 0.0
    if m.poisoned or not (math.isfinite(x_min) and math.isfinite(x_max)):
        return math.inf
    eps_out, tiny = _EPS[m.dtype], _TINY[m.dtype]
    # float64 data is computed in float64; narrower data in float32 (or, in edge cases, float64: smaller eps).
    eps_w = _EPS[DataType.FLOAT64 if m.dtype == DataType.FLOAT64 else DataType.FLOAT32]
    if m.algorithm is QuantizationAlgorithm.MIN_MAX:
        half_d = m.max_value * 0.5 - m.min_value * 0.5  # d / 2 without overflow
        big = max(abs(m.min_value), abs(m.max_value), abs(x_min), abs(x_max))
        outside = max(0.0, x_max - m.max_value, m.min_value - x_min)
        slack = max(16 * eps_w * half_d, 8 * eps_w * big) + eps_out * big + tiny
        return half_d / m.qmax + outside + slack
    lo = (0 - m.zero_point) * m.scale
    hi = (m.qmax - m.zero_point) * m.scale
    big = max(abs(lo), abs(hi), abs(x_min), abs(x_max))
    clip = max(0.0, lo - x_min, x_max - hi)
    return max(m.scale / 2, clip) + 8 * eps_w * big + eps_out * big + tiny
