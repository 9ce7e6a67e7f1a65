"""bfloat16 <-> float32 in plain numpy, for when bfloat16 data is held as ``uint16`` bit patterns.

Used when ``ml_dtypes`` is missing (and by the kernels' block loops). The conversions match ``ml_dtypes``
bit for bit: widening is exact (the bf16 bits are the top half of the float32), narrowing rounds to nearest,
ties to even, overflows to infinity, and turns any NaN into the quiet NaN ``0x7FC0`` with the sign kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_QNAN = np.uint16(0x7FC0)
_SIGN = np.uint32(0x80000000)


def bf16_bits_to_f32(
    bits: np.ndarray[Any, Any], out: np.ndarray[Any, Any] | None = None
) -> np.ndarray[Any, Any]:
    """Widen bfloat16 bit patterns (``uint16``) to float32, exactly.

    Args:
        bits: ``uint16`` (or any 2-byte) array of bfloat16 bit patterns.
        out: optional float32 array of the same size to write into.

    Returns:
        The float32 values (``out`` when given).
    """
    b = bits.reshape(-1).view(np.uint16)
    if out is None:
        out = np.empty(b.size, dtype=np.float32)
    o32 = out.reshape(-1).view(np.uint32)
    np.left_shift(b, np.uint32(16), out=o32, dtype=np.uint32)
    return out


def f32_to_bf16_bits(
    values: np.ndarray[Any, Any], out: np.ndarray[Any, Any] | None = None
) -> np.ndarray[Any, Any]:
    """Narrow float32 values to bfloat16 bit patterns, round-to-nearest-even (like ``ml_dtypes``).

    Args:
        values: float32 array.
        out: optional ``uint16`` (or any 2-byte) array of the same size to write into.

    Returns:
        The ``uint16`` bit patterns (``out``, viewed as ``uint16``, when given).
    """
    f = values.reshape(-1)
    u = f.view(np.uint32)
    # RNE: add 0x7FFF plus the lowest surviving bit, then drop the low half. NaNs are patched below since the
    # addition could carry a NaN payload into the exponent (or wrap a negative NaN).
    r = np.right_shift(u, np.uint32(16))
    np.bitwise_and(r, np.uint32(1), out=r)
    np.add(r, np.uint32(0x7FFF), out=r)
    np.add(r, u, out=r)
    np.right_shift(r, np.uint32(16), out=r)
    o = (np.empty(f.size, dtype=np.uint16) if out is None else out.reshape(-1)).view(np.uint16)
    np.copyto(o, r, casting="unsafe")
    nan = np.isnan(f)
    if nan.any():
        sign = np.right_shift(np.bitwise_and(u[nan], _SIGN), np.uint32(16)).astype(np.uint16)
        o[nan] = np.bitwise_or(sign, _QNAN)
    return o
