"""Element-wise reductions, in place, in the tensor's own dtype.

Semantics (the same on every peer, so results are bit-reproducible):

* Accumulation happens in the tensor's dtype. Integers wrap modulo ``2**bits`` exactly like the dtype does
  (two's complement for signed types). float16 and bfloat16 results are rounded to the dtype after every
  pairwise operation (computed in float32, rounded to nearest even): no hidden wider accumulator.
* ``SUM``, ``PROD``, ``MIN``, ``MAX`` as usual. ``AVG`` is reduced as ``SUM`` during the ring; call
  :func:`finalize_avg` once at the end to divide by the world size.
* ``finalize_avg`` divides in the dtype: floats divide (one rounding); integers divide with truncation toward
  zero, like C integer division (``-7 / 2 == -3``), which is what torch's ``rounding_mode="trunc"`` does.
* ``MIN``/``MAX`` with NaN: NaN propagates (``np.minimum`` semantics): any NaN operand gives NaN.
  Deterministic (NaN payload bits may differ between the numpy and torch code paths; NaN-ness does not).

CPU kernels take numpy arrays (see :func:`pccl.kernels.backend.as_numpy`). When bfloat16 is held as ``uint16``
bit patterns (``ml_dtypes`` missing), pass ``dtype=DataType.BFLOAT16`` and the kernels emulate bfloat16 in
float32 with the same rounding as ``ml_dtypes``/torch.

GPU kernels (:func:`reduce_into_gpu`, :func:`finalize_avg_gpu`) take torch CUDA tensors or cupy arrays and
run on the device; torch/cupy are only touched when such an object is passed.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError
from .._types import DataType, ReduceOp
from . import _bf16
from .backend import bfloat16_numpy_dtype, half_torch, numpy_to_dtype

__all__ = ["finalize_avg", "finalize_avg_gpu", "reduce_into", "reduce_into_gpu"]

# bfloat16 emulation works on blocks small enough for the float32 temporaries to stay in cache.
_BF16_BLOCK = 1 << 16

_NP_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # AVG is a SUM until finalize_avg
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def _check_op(op: ReduceOp) -> ReduceOp:
    try:
        return ReduceOp(op)
    except ValueError:
        raise InvalidArgumentError(f"unknown ReduceOp {op!r}") from None


def _resolve_dtype(arr: np.ndarray[Any, Any], dtype: DataType | None) -> DataType:
    """The element type of ``arr``, honouring a bfloat16-as-uint16 hint."""
    actual = numpy_to_dtype(arr.dtype)
    if dtype is None or dtype == actual:
        return actual
    if dtype == DataType.BFLOAT16 and actual == DataType.UINT16:
        return DataType.BFLOAT16
    raise InvalidArgumentError(f"dtype hint {DataType(dtype).name} does not match array dtype {arr.dtype}")


def _bf16_as_bits(arr: np.ndarray[Any, Any], dtype: DataType) -> bool:
    """True when bfloat16 data must be emulated through uint16 bit patterns."""
    return dtype == DataType.BFLOAT16 and arr.dtype != bfloat16_numpy_dtype()


def reduce_into(
    acc: np.ndarray[Any, Any], other: np.ndarray[Any, Any], op: ReduceOp, *, dtype: DataType | None = None
) -> None:
    """``acc = op(acc, other)`` element-wise, in place, in the arrays' dtype.

    Args:
        acc: accumulator (written). Any shape; need not be contiguous.
        other: operand, same dtype and same number of elements (reshaped to ``acc.shape`` if needed).
        op: SUM, PROD, MIN, MAX, or AVG (treated as SUM; see :func:`finalize_avg`).
        dtype: optional element-type hint; only needed for bfloat16 stored as ``uint16`` bit patterns.

    Raises:
        InvalidArgumentError: dtype mismatch, size mismatch, unsupported dtype, read-only ``acc``, unknown op.
    """
    op = _check_op(op)
    if acc.dtype != other.dtype:
        raise InvalidArgumentError(f"dtype mismatch: acc is {acc.dtype}, other is {other.dtype}")
    if acc.shape != other.shape:
        if acc.size != other.size:
            raise InvalidArgumentError(f"size mismatch: acc has {acc.size} elements, other has {other.size}")
        other = other.reshape(acc.shape)
    if not acc.flags.writeable:
        raise InvalidArgumentError("acc is read-only")
    dt = _resolve_dtype(acc, dtype)
    if dt in (DataType.FLOAT16, DataType.BFLOAT16):
        pair = _torch_half_views(acc, other, dt=dt)
        if pair is not None:
            _reduce_torch_cpu(pair[0], pair[1], op)
            return
    ufunc = _NP_UFUNC[op]
    if _bf16_as_bits(acc, dt):
        _reduce_bf16_bits(acc, other, ufunc)
        return
    # Integer ufuncs on arrays wrap silently modulo 2**bits; float16/bfloat16 loops compute each pair in
    # float32 and round back, so no temporaries are made and no wider accumulator sneaks in. Overflow to inf
    # and NaN results are the dtype's normal behaviour, not something to warn about.
    with np.errstate(over="ignore", invalid="ignore"):
        ufunc(acc, other, out=acc)


def _torch_half_views(*arrays: np.ndarray[Any, Any], dt: DataType) -> list[Any] | None:
    """Zero-copy torch views of float16/bfloat16 numpy arrays, or None when torch is not already imported.

    numpy's float16 loops convert one element at a time (~0.2 GB/s here) and ml_dtypes' bfloat16 loops reach
    ~1.2 GB/s; torch's vectorised CPU kernels are 5-30x faster and round identically (each pair is computed
    in float32 and rounded to nearest even). torch is only used if the application already imported it.
    """
    torch = half_torch()
    if torch is None or not all(a.flags.c_contiguous for a in arrays):
        return None
    views = []
    for a in arrays:
        flat = a.reshape(-1)
        if not flat.flags.writeable:
            # torch.from_numpy warns about read-only memory (e.g. a buffer over received bytes); a copy at
            # memory speed is cheaper than numpy's float16 loop and needs no global warning filters.
            flat = flat.copy()
        if dt == DataType.BFLOAT16:
            views.append(torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16))
        else:
            views.append(torch.from_numpy(flat))
    return views


# torch runs an element-wise op on more elements than its grain size (32768) through OpenMP; waking the pool
# costs milliseconds when the other cores are busy (measured: 16 ms for 65536 float16 additions on the 2-core
# CI machine next to other processes, 8 us for 32768). CPU half-precision kernels therefore feed torch blocks
# of at most this many elements, which run single-threaded at memory speed.
_TORCH_CPU_BLOCK = 1 << 15


def _reduce_torch_cpu(a: Any, b: Any, op: ReduceOp) -> None:
    n = int(a.numel())
    for start in range(0, n, _TORCH_CPU_BLOCK):
        stop = min(start + _TORCH_CPU_BLOCK, n)
        _reduce_torch(a[start:stop], b[start:stop], op)


def _reduce_torch(a: Any, b: Any, op: ReduceOp) -> None:
    import torch

    if op in (ReduceOp.SUM, ReduceOp.AVG):
        a.add_(b)
    elif op is ReduceOp.PROD:
        a.mul_(b)
    elif op is ReduceOp.MIN:
        torch.minimum(a, b, out=a)
    else:
        torch.maximum(a, b, out=a)


def _reduce_bf16_bits(acc: np.ndarray[Any, Any], other: np.ndarray[Any, Any], ufunc: np.ufunc) -> None:
    a = acc.reshape(-1)
    if not np.shares_memory(a, acc):  # pragma: no cover - defensive: reshape of a non-contiguous acc copies
        raise InvalidArgumentError("bfloat16 bit-pattern accumulator must be contiguous")
    b = other.reshape(-1)
    fa = np.empty(min(_BF16_BLOCK, a.size), dtype=np.float32)
    fb = np.empty_like(fa)
    for start in range(0, a.size, _BF16_BLOCK):
        stop = min(start + _BF16_BLOCK, a.size)
        n = stop - start
        xa, xb = fa[:n], fb[:n]
        _bf16.bf16_bits_to_f32(a[start:stop], out=xa)
        _bf16.bf16_bits_to_f32(b[start:stop], out=xb)
        with np.errstate(over="ignore", invalid="ignore"):
            ufunc(xa, xb, out=xa)
        _bf16.f32_to_bf16_bits(xa, out=a[start:stop])


def _trunc_div_inplace(xp: Any, arr: Any, n: int) -> None:
    """Integer division by ``n > 0`` rounding toward zero, in place, for numpy or cupy arrays."""
    info = np.iinfo(arr.dtype)
    if n > info.max:
        # n is not representable in the dtype (e.g. int8 with 200 peers); work in 64 bits, results fit.
        wide = arr.astype(xp.uint64 if info.min == 0 else xp.int64)
        _trunc_div_inplace(xp, wide, n)
        arr[...] = wide.astype(arr.dtype)
        return
    d = arr.dtype.type(n)
    if info.min == 0:
        xp.floor_divide(arr, d, out=arr)  # floor == trunc for non-negative values
        return
    # floor division rounds down; trunc differs exactly where the value is negative and not a multiple of n.
    # (Plain operators only, so the same code runs on cupy arrays.)
    fix = (xp.remainder(arr, d) != 0) & (arr < 0)
    xp.floor_divide(arr, d, out=arr)
    arr += fix.astype(arr.dtype)


def finalize_avg(arr: np.ndarray[Any, Any], world_size: int, *, dtype: DataType | None = None) -> None:
    """Turn a summed buffer into an average, in place, in the array's dtype.

    Floats divide by ``world_size`` (one rounding to the dtype). Integers divide with truncation toward zero
    (C semantics: ``-7 // 2`` gives ``-3``, not ``-4``).

    Args:
        arr: the summed values (written).
        world_size: number of contributions, >= 1.
        dtype: optional hint, only for bfloat16 stored as ``uint16`` bit patterns.

    Raises:
        InvalidArgumentError: ``world_size < 1``, read-only array, unsupported dtype.
    """
    if world_size < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
    if not arr.flags.writeable:
        raise InvalidArgumentError("array is read-only")
    dt = _resolve_dtype(arr, dtype)
    if world_size == 1:
        return
    if dt in (DataType.FLOAT16, DataType.BFLOAT16):
        views = _torch_half_views(arr, dt=dt)
        if views is not None:
            t = views[0]
            for start in range(0, int(t.numel()), _TORCH_CPU_BLOCK):
                t[start : start + _TORCH_CPU_BLOCK].div_(world_size)
            return
    if _bf16_as_bits(arr, dt):
        flat = arr.reshape(-1)
        tmp = np.empty(min(_BF16_BLOCK, flat.size), dtype=np.float32)
        for start in range(0, flat.size, _BF16_BLOCK):
            stop = min(start + _BF16_BLOCK, flat.size)
            x = tmp[: stop - start]
            _bf16.bf16_bits_to_f32(flat[start:stop], out=x)
            np.divide(x, np.float32(world_size), out=x)
            _bf16.f32_to_bf16_bits(x, out=flat[start:stop])
        return
    if dt.is_floating:
        # Divide by the exact world size: for 16-bit floats the divisor is a float32 (a large n may not be
        # representable in float16/bfloat16) and each quotient is rounded once to the dtype, like torch does.
        divisor = np.float64(world_size) if dt == DataType.FLOAT64 else np.float32(world_size)
        with np.errstate(over="ignore", invalid="ignore"):
            np.divide(arr, divisor, out=arr, casting="unsafe")
        return
    _trunc_div_inplace(np, arr, world_size)


# ----------------------------------------------------------------------------------------------------
# GPU variants (torch CUDA tensors or cupy arrays). Not exercised on machines without a GPU.


def _gpu_kind(t: object) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        if not t.is_cuda:
            raise InvalidArgumentError("reduce_into_gpu needs CUDA tensors; use reduce_into for CPU data")
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):
        return "cupy"
    raise InvalidArgumentError(f"expected a torch CUDA tensor or a cupy array, got {type(t).__qualname__}")


_TORCH_UNSIGNED_SIGNED = {"uint16": "int16", "uint32": "int32", "uint64": "int64"}


def reduce_into_gpu(acc: Any, other: Any, op: ReduceOp) -> None:
    """``acc = op(acc, other)`` element-wise on the GPU, in place, in the tensors' dtype.

    Same semantics as :func:`reduce_into`. Both operands must be of the same kind (two torch CUDA tensors or
    two cupy arrays), same dtype, same number of elements, on the same device.

    Args:
        acc: accumulator (written).
        other: operand.
        op: SUM, PROD, MIN, MAX, or AVG (treated as SUM).

    Raises:
        InvalidArgumentError: mixed kinds, CPU tensors, dtype or size mismatch, unknown op.
    """
    op = _check_op(op)
    kind = _gpu_kind(acc)
    if _gpu_kind(other) != kind:
        raise InvalidArgumentError("acc and other must both be torch tensors or both cupy arrays")
    if acc.dtype != other.dtype:
        raise InvalidArgumentError(f"dtype mismatch: acc is {acc.dtype}, other is {other.dtype}")
    if acc.shape != other.shape:
        if _numel(acc) != _numel(other):
            raise InvalidArgumentError("size mismatch between acc and other")
        other = other.reshape(acc.shape)
    if kind == "cupy":
        import cupy

        ufunc = {
            ReduceOp.SUM: cupy.add,
            ReduceOp.AVG: cupy.add,
            ReduceOp.PROD: cupy.multiply,
            ReduceOp.MIN: cupy.minimum,
            ReduceOp.MAX: cupy.maximum,
        }[op]
        ufunc(acc, other, out=acc)
        return
    import torch

    name = str(acc.dtype).removeprefix("torch.")
    signed_name = _TORCH_UNSIGNED_SIGNED.get(name)
    if signed_name is not None:
        # torch implements few kernels for uint16/32/64. Addition and multiplication modulo 2**bits give the
        # same bits for signed and unsigned views; min/max keep the order if the sign bit is flipped first.
        sdt = getattr(torch, signed_name)
        a, b = acc.view(sdt), other.view(sdt)
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            a.add_(b)
        elif op is ReduceOp.PROD:
            a.mul_(b)
        else:
            flip = torch.iinfo(sdt).min
            a.bitwise_xor_(flip)
            fb = torch.bitwise_xor(b, flip)
            (torch.minimum if op is ReduceOp.MIN else torch.maximum)(a, fb, out=a)
            a.bitwise_xor_(flip)
        return
    _reduce_torch(acc, other, op)


def _numel(t: Any) -> int:
    return int(t.numel()) if hasattr(t, "numel") else int(t.size)


def finalize_avg_gpu(arr: Any, world_size: int) -> None:
    """GPU counterpart of :func:`finalize_avg` (torch CUDA tensor or cupy array), same semantics.

    Args:
        arr: the summed values (written).
        world_size: number of contributions, >= 1.

    Raises:
        InvalidArgumentError: ``world_size < 1`` or not a GPU tensor.
    """
    if world_size < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
    kind = _gpu_kind(arr)
    if world_size == 1:
        return
    if kind == "cupy":
        import cupy

        if arr.dtype.kind == "f":
            # Same rounding as the CPU path: a float32 (float64) divisor, one rounding to the dtype.
            divisor = np.float64(world_size) if arr.dtype == np.float64 else np.float32(world_size)
            cupy.divide(arr, divisor, out=arr)
        else:
            _trunc_div_inplace(cupy, arr, world_size)
        return
    import torch

    if arr.dtype.is_floating_point:
        # Not ``arr.div_(world_size)``: with a host scalar divisor torch's CUDA kernel multiplies by the
        # reciprocal, which is off by one ulp for some values (float32/float64; measured on an H200).
        # A device tensor divisor takes the true-division path, one correctly rounded quotient, as on the
        # CPU. 16-bit floats divide in float32 by a float32 divisor (like the CPU path) and round once more.
        if arr.dtype in (torch.float32, torch.float64):
            arr.div_(torch.tensor(world_size, dtype=arr.dtype, device=arr.device))
        else:
            wide = arr.to(torch.float32)
            wide.div_(torch.tensor(world_size, dtype=torch.float32, device=arr.device))
            arr.copy_(wide)
        return
    if str(arr.dtype) == "torch.uint64":
        # No unsigned 64-bit division kernel in torch (and no wider type): through the host.
        host = arr.cpu().numpy()
        _trunc_div_inplace(np, host, world_size)
        arr.copy_(torch.from_numpy(host))
        return
    if arr.dtype == torch.int64:
        arr.div_(world_size, rounding_mode="trunc")
        return
    # Narrower integers divide in int64 (uint16/uint32 have no division kernels at all): torch casts a
    # host scalar divisor to the tensor's dtype, so a world size beyond it (257 peers and int8) would
    # divide by a wrapped value (found on an H200).
    wide = arr.to(torch.int64)
    wide.div_(world_size, rounding_mode="trunc")
    arr.copy_(wide.to(arr.dtype))
