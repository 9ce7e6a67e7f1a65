"""Tensor adaptation: numpy arrays, torch CPU/CUDA tensors and cupy arrays seen through one lens.

Every collective works on a flat run of elements of one :class:`~pccl.DataType`. This module turns the
caller's object into that view without copying:

* :func:`describe` says what the object is (dtype, element count, bytes, device, shape) and rejects what we
  cannot send (non-contiguous, unsupported dtype, unsupported type) with :class:`~pccl.InvalidArgumentError`.
* :func:`as_numpy` gives a flat numpy view of a CPU tensor (shares memory).
* :func:`byte_view` gives a flat ``uint8`` memoryview of a CPU tensor's bytes, for ``recv_into`` / ``send``.
* :func:`device_index`, :func:`copy_to_host` and :func:`copy_from_host` stage a GPU tensor through host memory
  (the collectives' wire is TCP, so GPU data passes through the host anyway). The copies are synchronous and
  run on the caller's current stream of the tensor's device, so they are ordered after the work already
  queued there and complete when they return.

torch and cupy are never imported here. An object can only be a torch tensor if the caller already imported
torch (the same holds for cupy), so the type checks look the module up in :data:`sys.modules`; a numpy input
therefore never triggers ``import cupy`` (which costs seconds and may initialise a CUDA context).

bfloat16: numpy has no native bfloat16. When ``ml_dtypes`` is importable its ``bfloat16`` is used; otherwise
bfloat16 data is exposed as ``uint16`` bit patterns and the kernels must be told the real dtype
(``dtype=DataType.BFLOAT16``), which they then emulate in float32 with round-to-nearest-even.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError
from .._types import DataType, DeviceType

__all__ = [
    "TensorDesc",
    "bfloat16_numpy_dtype",
    "byte_view",
    "check_same_device",
    "copy_from_host",
    "copy_to_host",
    "describe",
    "device_index",
    "dtype_to_numpy",
    "dtype_to_torch",
    "host_bytes",
    "is_cuda",
    "is_cupy_array",
    "is_torch_tensor",
    "numpy_to_dtype",
    "pinned_empty",
    "sync_current_stream",
    "torch_to_dtype",
]


@dataclass(frozen=True)
class TensorDesc:
    """What a tensor is, as far as the wire is concerned.

    Attributes:
        dtype: element type.
        count: number of elements.
        nbytes: ``count * dtype.itemsize``.
        device: CPU or CUDA.
        shape: the tensor's shape (informational; collectives work on the flat view).
    """

    dtype: DataType
    count: int
    nbytes: int
    device: DeviceType
    shape: tuple[int, ...]


# ----------------------------------------------------------------------------------------------------
# dtype tables

_ML_DTYPES_CHECKED = False
_BF16_NP: np.dtype[Any] | None = None


def bfloat16_numpy_dtype() -> np.dtype[Any] | None:
    """The numpy dtype used for bfloat16, or ``None`` when ``ml_dtypes`` is not installed.

    Returns:
        ``np.dtype(ml_dtypes.bfloat16)`` or ``None``.
    """
    global _ML_DTYPES_CHECKED, _BF16_NP
    if not _ML_DTYPES_CHECKED:
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - ml_dtypes is installed in the test environment
            _BF16_NP = None
        else:
            _BF16_NP = np.dtype(ml_dtypes.bfloat16)
        _ML_DTYPES_CHECKED = True
    return _BF16_NP


_NUMPY_OF: dict[DataType, np.dtype[Any]] = {
    DataType.UINT8: np.dtype(np.uint8),
    DataType.INT8: np.dtype(np.int8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.INT16: np.dtype(np.int16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.INT32: np.dtype(np.int32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.INT64: np.dtype(np.int64),
    DataType.FLOAT16: np.dtype(np.float16),
    DataType.FLOAT32: np.dtype(np.float32),
    DataType.FLOAT64: np.dtype(np.float64),
}
_DTYPE_OF_NUMPY: dict[np.dtype[Any], DataType] = {v: k for k, v in _NUMPY_OF.items()}


def dtype_to_numpy(dtype: DataType) -> np.dtype[Any]:
    """The numpy dtype holding elements of ``dtype``.

    Args:
        dtype: a pccl data type.

    Returns:
        The native-byte-order numpy dtype. For ``BFLOAT16`` this is ``ml_dtypes.bfloat16`` when available,
        otherwise ``uint16`` (raw bit patterns; pass ``dtype=DataType.BFLOAT16`` to the kernels).

    Raises:
        InvalidArgumentError: ``dtype`` is not a DataType.
    """
    try:
        dt = DataType(dtype)
    except ValueError:
        raise InvalidArgumentError(f"unknown DataType {dtype!r}") from None
    if dt is DataType.BFLOAT16:
        bf = bfloat16_numpy_dtype()
        return bf if bf is not None else np.dtype(np.uint16)
    return _NUMPY_OF[dt]


def numpy_to_dtype(np_dtype: Any) -> DataType:
    """The pccl data type of a numpy dtype.

    Args:
        np_dtype: anything ``np.dtype()`` accepts.

    Returns:
        The matching DataType (``ml_dtypes.bfloat16`` maps to ``BFLOAT16``; ``uint16`` to ``UINT16``).

    Raises:
        InvalidArgumentError: unsupported dtype (bool, complex, strings, ...) or non-native byte order,
            which would put the wrong bytes on the wire.
    """
    try:
        dt = np.dtype(np_dtype)
    except TypeError:
        raise InvalidArgumentError(f"not a numpy dtype: {np_dtype!r}") from None
    if dt.isnative:
        known = _DTYPE_OF_NUMPY.get(dt)
        if known is not None:
            return known
    # A bfloat16 numpy dtype exists only once ml_dtypes is imported: look for it only then. Importing it
    # here for every other dtype cost a numpy user's first collective 0.6-0.9 s (its extension's start-up).
    bf = bfloat16_numpy_dtype() if "ml_dtypes" in sys.modules else None
    if bf is not None and dt == bf:
        return DataType.BFLOAT16
    if not dt.isnative:
        raise InvalidArgumentError(
            f"non-native byte order dtype {dt.str!r} is not supported; use .astype(native)"
        )
    try:
        return _DTYPE_OF_NUMPY[dt]
    except KeyError:
        raise InvalidArgumentError(f"unsupported numpy dtype {dt!s}") from None


def _torch() -> ModuleType | None:
    # Only an already-imported torch can have produced the object we are looking at.
    return sys.modules.get("torch")


def _cupy() -> ModuleType | None:
    return sys.modules.get("cupy")


# float16/bfloat16 kernels run through torch's vectorised CPU loops when torch is already imported (numpy
# converts float16 element by element). Both paths round identically; tests switch this off to check that.
_HALF_VIA_TORCH = True


def half_torch() -> ModuleType | None:
    """torch, if already imported and allowed for float16/bfloat16 CPU kernels; else None (use numpy)."""
    return _torch() if _HALF_VIA_TORCH else None


def _torch_table(torch: ModuleType) -> dict[Any, DataType]:
    table = {
        torch.uint8: DataType.UINT8,
        torch.int8: DataType.INT8,
        torch.int16: DataType.INT16,
        torch.int32: DataType.INT32,
        torch.int64: DataType.INT64,
        torch.float16: DataType.FLOAT16,
        torch.bfloat16: DataType.BFLOAT16,
        torch.float32: DataType.FLOAT32,
        torch.float64: DataType.FLOAT64,
    }
    # torch >= 2.3 has (partially supported) unsigned types beyond uint8.
    for name, dt in (("uint16", DataType.UINT16), ("uint32", DataType.UINT32), ("uint64", DataType.UINT64)):
        tdt = getattr(torch, name, None)
        if tdt is not None:
            table[tdt] = dt
    return table


def torch_to_dtype(torch_dtype: Any) -> DataType:
    """The pccl data type of a ``torch.dtype``.

    Args:
        torch_dtype: a ``torch.dtype`` (torch must already be imported by the caller).

    Returns:
        The matching DataType.

    Raises:
        InvalidArgumentError: torch is not imported or the dtype is unsupported (bool, complex, float8, ...).
    """
    torch = _torch()
    if torch is None:
        raise InvalidArgumentError(f"not a torch dtype: {torch_dtype!r}")
    try:
        return _torch_table(torch)[torch_dtype]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unsupported torch dtype {torch_dtype!r}") from None


def dtype_to_torch(dtype: DataType) -> Any:
    """The ``torch.dtype`` for a pccl data type (imports torch).

    Args:
        dtype: a pccl data type.

    Returns:
        The torch dtype.

    Raises:
        InvalidArgumentError: torch is not installed, or this torch has no such dtype (old torch, uint16+).
    """
    try:
        import torch
    except ImportError:
        raise InvalidArgumentError("torch is not installed") from None
    for tdt, dt in _torch_table(torch).items():
        if dt == dtype:
            return tdt
    raise InvalidArgumentError(f"this torch ({torch.__version__}) has no dtype for {DataType(dtype).name}")


# ----------------------------------------------------------------------------------------------------
# classification


def is_torch_tensor(t: object) -> bool:
    """True for a torch tensor (never imports torch: only an imported torch can have made ``t``)."""
    torch = _torch()
    return torch is not None and isinstance(t, torch.Tensor)


def is_cupy_array(t: object) -> bool:
    """True for a cupy array (never imports cupy)."""
    cupy = _cupy()
    return cupy is not None and isinstance(t, cupy.ndarray)


def _check_torch_layout(t: Any) -> None:
    torch = _torch()
    assert torch is not None
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"unsupported torch layout {t.layout} (only dense strided tensors)")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"unsupported torch device {t.device} (only cpu and cuda)")
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"torch tensor of shape {tuple(t.shape)} with strides {tuple(t.stride())} is not contiguous; "
            "call .contiguous() and pass the result (collectives write into the caller's memory)"
        )


def describe(t: object) -> TensorDesc:
    """Describe a tensor the collectives can work on.

    Args:
        t: a numpy array, a torch CPU or CUDA tensor, or a cupy array. It must be C-contiguous (collectives
            write results into the caller's memory, so a hidden copy would silently lose them).

    Returns:
        Its :class:`TensorDesc`.

    Raises:
        InvalidArgumentError: unsupported type, unsupported dtype, non-native byte order, or not contiguous.
    """
    if isinstance(t, np.ndarray):
        dtype = numpy_to_dtype(t.dtype)
        if not t.flags.c_contiguous:
            raise InvalidArgumentError(
                f"numpy array of shape {t.shape} with strides {t.strides} is not C-contiguous; "
                "pass np.ascontiguousarray(x) and use the result"
            )
        return TensorDesc(dtype, int(t.size), int(t.size) * dtype.itemsize, DeviceType.CPU, tuple(t.shape))
    if is_torch_tensor(t):
        tt: Any = t
        dtype = torch_to_dtype(tt.dtype)
        _check_torch_layout(tt)
        device = DeviceType.CUDA if tt.device.type == "cuda" else DeviceType.CPU
        n = int(tt.numel())
        return TensorDesc(dtype, n, n * dtype.itemsize, device, tuple(int(s) for s in tt.shape))
    if is_cupy_array(t):
        a: Any = t
        dtype = numpy_to_dtype(a.dtype)
        if not a.flags.c_contiguous:
            raise InvalidArgumentError(
                f"cupy array of shape {a.shape} with strides {a.strides} is not C-contiguous"
            )
        n = int(a.size)
        return TensorDesc(dtype, n, n * dtype.itemsize, DeviceType.CUDA, tuple(int(s) for s in a.shape))
    raise InvalidArgumentError(
        f"unsupported tensor type {type(t).__module__}.{type(t).__qualname__}; "
        "expected a numpy array, a torch tensor or a cupy array"
    )


def is_cuda(t: object) -> bool:
    """True when ``t`` lives in GPU memory (a torch CUDA tensor or a cupy array).

    Args:
        t: any object.

    Returns:
        Whether it is a GPU tensor. Unknown types are simply not CUDA.
    """
    if is_torch_tensor(t):
        return bool(t.is_cuda)  # type: ignore[attr-defined]
    return is_cupy_array(t)


# ----------------------------------------------------------------------------------------------------
# zero-copy host views


def _torch_cpu_numpy(t: Any, dtype: DataType) -> np.ndarray[Any, Any]:
    """Flat numpy view of a contiguous torch CPU tensor, typed like ``dtype``."""
    torch = _torch()
    assert torch is not None
    flat = t.detach().reshape(-1)  # a view for contiguous tensors; detach keeps autograd out of the way
    if dtype is DataType.BFLOAT16:
        # torch cannot export bfloat16 to numpy; reinterpret the same 2-byte cells instead.
        bits: np.ndarray[Any, Any] = flat.view(torch.int16).numpy()
        return bits.view(dtype_to_numpy(DataType.BFLOAT16))
    arr: np.ndarray[Any, Any] = flat.numpy()
    return arr


def as_numpy(t: object) -> np.ndarray[Any, Any]:
    """A flat 1-D numpy view sharing memory with a CPU tensor (zero copy).

    Args:
        t: a contiguous numpy array or torch CPU tensor of a supported dtype.

    Returns:
        A 1-D array over the same memory. bfloat16 comes back as ``ml_dtypes.bfloat16`` when available,
        else as ``uint16`` bit patterns (then pass ``dtype=DataType.BFLOAT16`` to the kernels).

    Raises:
        InvalidArgumentError: GPU tensor, unsupported type or dtype, or not contiguous.
    """
    desc = describe(t)
    if desc.device is not DeviceType.CPU:
        raise InvalidArgumentError("as_numpy needs a CPU tensor; this one lives on the GPU")
    if isinstance(t, np.ndarray):
        return t.reshape(-1)
    return _torch_cpu_numpy(t, desc.dtype)


def host_bytes(t: object) -> np.ndarray[Any, Any]:
    """A flat ``uint8`` numpy view over the bytes of a CPU object (zero copy, possibly read-only).

    Wider than :func:`as_numpy`: any C-contiguous numpy array (any dtype, e.g. bool), any contiguous torch CPU
    tensor, and bytes-like objects (``bytes``, ``bytearray``, ``memoryview``) are accepted. Used for hashing.

    Args:
        t: the object.

    Returns:
        A 1-D ``uint8`` array over the object's bytes.

    Raises:
        InvalidArgumentError: GPU tensor, non-contiguous, or unsupported type.
    """
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise InvalidArgumentError(
                f"numpy array of shape {t.shape} with strides {t.strides} is not C-contiguous"
            )
        return t.reshape(-1).view(np.uint8)
    if isinstance(t, (bytes, bytearray, memoryview)):
        mv = memoryview(t)
        if not mv.c_contiguous:
            raise InvalidArgumentError("memoryview is not C-contiguous")
        return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
    if is_torch_tensor(t):
        torch = _torch()
        assert torch is not None
        tt: Any = t
        _check_torch_layout(tt)
        if tt.is_cuda:
            raise InvalidArgumentError("host_bytes needs a CPU tensor; this one lives on the GPU")
        flat = tt.detach().reshape(-1)
        u8: np.ndarray[Any, Any] = flat.view(torch.uint8).numpy()
        return u8
    if is_cupy_array(t):
        raise InvalidArgumentError("host_bytes needs a CPU tensor; this cupy array lives on the GPU")
    raise InvalidArgumentError(f"unsupported type {type(t).__module__}.{type(t).__qualname__}")


def byte_view(t: object, *, writable: bool = True) -> memoryview:
    """A flat ``uint8`` memoryview of a CPU tensor's storage (zero copy), for ``recv_into`` and ``send``.

    Args:
        t: a contiguous numpy array or torch CPU tensor of a supported dtype.
        writable: require a writable view (the default: receiving writes into it). Pass False for a view that
            is only sent.

    Returns:
        A 1-D memoryview with format ``"B"`` and ``nbytes == describe(t).nbytes``.

    Raises:
        InvalidArgumentError: GPU tensor, unsupported type or dtype, not contiguous, or read-only while
            ``writable`` is True.
    """
    arr = as_numpy(t)
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError(
            "tensor memory is read-only; a writable tensor is needed to receive into it"
        )
    return memoryview(arr.view(np.uint8))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------
# host staging of GPU tensors


def device_index(t: object) -> int:
    """The CUDA device index of a GPU tensor, or -1 for a CPU tensor.

    Args:
        t: a tensor :func:`describe` accepts.

    Returns:
        ``tensor.device.index`` (torch) or ``array.device.id`` (cupy); -1 for numpy arrays and CPU tensors.
    """
    if is_torch_tensor(t):
        tt: Any = t
        return int(tt.device.index or 0) if tt.is_cuda else -1
    if is_cupy_array(t):
        a: Any = t
        return int(a.device.id)
    return -1


def check_same_device(send_index: int, recv_index: int) -> None:
    """Refuse a send/recv pair on different devices (the CPU and a GPU, or two GPUs).

    Args:
        send_index: :func:`device_index` of ``send`` (-1: the CPU).
        recv_index: :func:`device_index` of ``recv``.

    Raises:
        InvalidArgumentError: the two live on different devices.
    """

    def name(i: int) -> str:
        return "the CPU" if i < 0 else f"CUDA device {i}"

    if send_index != recv_index:
        raise InvalidArgumentError(
            f"send is on {name(send_index)} but recv is on {name(recv_index)}; "
            "send and recv must live on the same device"
        )


def sync_current_stream(t: object) -> None:
    """Wait until the calling thread's current stream on ``t``'s device is idle (nothing for CPU tensors).

    CUDA's current stream is per thread: work that this thread queued to produce ``t`` is not ordered with
    copies another thread makes. Call this in the producing thread before handing ``t`` to another one.

    Args:
        t: a tensor :func:`describe` accepts.
    """
    if is_torch_tensor(t):
        torch = _torch()
        assert torch is not None
        tt: Any = t
        if tt.is_cuda:
            torch.cuda.current_stream(tt.device).synchronize()
    elif is_cupy_array(t):
        cupy = _cupy()
        assert cupy is not None
        a: Any = t
        with a.device:
            cupy.cuda.get_current_stream().synchronize()


def _gpu_bytes(t: object) -> Any:
    """A flat ``uint8`` view (same library, same device memory) of a contiguous GPU tensor."""
    if is_torch_tensor(t):
        torch = _torch()
        assert torch is not None
        tt: Any = t
        return tt.detach().reshape(-1).view(torch.uint8)
    if is_cupy_array(t):
        cupy = _cupy()
        assert cupy is not None
        a: Any = t
        return a.reshape(-1).view(cupy.uint8)
    raise InvalidArgumentError(f"not a GPU tensor: {type(t).__module__}.{type(t).__qualname__}")


def copy_to_host(t: object, out: np.ndarray[Any, Any]) -> None:
    """Copy all bytes of a GPU tensor into a host array; returns once the copy is complete.

    The copy runs on the current stream of the tensor's device (torch's ``copy_``; cupy's current stream,
    then synchronized), so kernels the caller queued on that stream to produce ``t`` are finished first.

    Args:
        t: a contiguous torch CUDA tensor or cupy array.
        out: a C-contiguous, writable host array of exactly ``describe(t).nbytes`` bytes (any dtype).

    Raises:
        InvalidArgumentError: ``t`` is not a GPU tensor, or ``out`` has the wrong size.
    """
    desc = describe(t)
    dst = out.reshape(-1).view(np.uint8)
    if desc.device is not DeviceType.CUDA:
        raise InvalidArgumentError("copy_to_host needs a GPU tensor")
    if dst.size != desc.nbytes:
        raise InvalidArgumentError(f"host buffer has {dst.size} bytes, the tensor {desc.nbytes}")
    if desc.nbytes == 0:
        return
    src = _gpu_bytes(t)
    if is_torch_tensor(t):
        torch = _torch()
        assert torch is not None
        # non_blocking=False: torch synchronizes the stream before returning (pinned memory or not).
        torch.from_numpy(dst).copy_(src)
        return
    cupy = _cupy()
    assert cupy is not None
    with src.device:
        stream = cupy.cuda.get_current_stream()
        src.get(stream=stream, out=dst)
        stream.synchronize()


def copy_from_host(t: object, src: np.ndarray[Any, Any], lo: int = 0, hi: int | None = None) -> None:
    """Overwrite elements ``[lo, hi)`` of a GPU tensor's flat view with the same bytes of ``src``;
    returns when done.

    The copy runs on the current stream of the tensor's device (ordered after the caller's queued work there)
    and is complete when this returns, so the caller may use ``t`` on any stream afterwards.

    Args:
        t: a contiguous torch CUDA tensor or cupy array.
        src: a C-contiguous host array of exactly ``describe(t).nbytes`` bytes (any dtype: its bytes are
            copied as they are).
        lo: first element (of ``t``) to write.
        hi: end of the written range (default: all elements).

    Raises:
        InvalidArgumentError: ``t`` is not a GPU tensor, or ``src`` / the range does not match it.
    """
    desc = describe(t)
    if desc.device is not DeviceType.CUDA:
        raise InvalidArgumentError("copy_from_host needs a GPU tensor")
    hi = desc.count if hi is None else hi
    if src.nbytes != desc.nbytes or not 0 <= lo <= hi <= desc.count:
        raise InvalidArgumentError(
            f"host array of {src.nbytes} bytes, range [{lo}, {hi}) does not match a tensor "
            f"of {desc.count} x {desc.dtype.itemsize} bytes"
        )
    size = desc.dtype.itemsize
    if hi == lo:
        return
    part = src.reshape(-1).view(np.uint8)[lo * size : hi * size]
    dst = _gpu_bytes(t)[lo * size : hi * size]
    if is_torch_tensor(t):
        torch = _torch()
        assert torch is not None
        # non_blocking=False: torch synchronizes the stream before returning (pinned memory or not).
        dst.copy_(torch.from_numpy(part))
        return
    cupy = _cupy()
    assert cupy is not None
    with dst.device:
        stream = cupy.cuda.get_current_stream()
        dst.set(part, stream=stream)
        stream.synchronize()


# Below this size a staging copy is cheap either way and page-locking a buffer is not worth it.
PINNED_MIN_BYTES = 1 << 20


def pinned_empty(count: int, dtype: np.dtype[Any], like: object) -> np.ndarray[Any, Any] | None:
    """A page-locked (pinned) host array of ``count`` elements for fast copies to and from ``like``'s GPU.

    Copies between a GPU and pinned memory run at the bus's speed (measured on an H200: 54 GB/s each
    way, against 7-11 GB/s for ordinary pageable memory). Allocated through the tensor's own library
    (torch's pinned allocator, cupy's ``alloc_pinned_memory``); the array keeps that allocation alive.

    Args:
        count: number of elements.
        dtype: numpy dtype of the array.
        like: the GPU tensor the buffer will be copied to or from (selects torch or cupy).

    Returns:
        The array, or None when ``like`` is not a GPU tensor, the buffer is smaller than
        :data:`PINNED_MIN_BYTES`, or pinned memory cannot be had (the caller then uses pageable memory).
    """
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes < PINNED_MIN_BYTES or not is_cuda(like):
        return None
    try:
        if is_torch_tensor(like):
            torch = _torch()
            assert torch is not None
            raw: np.ndarray[Any, Any] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            cupy = _cupy()
            assert cupy is not None
            raw = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), dtype=np.uint8, count=nbytes)
    except Exception:  # out of page-locked memory, driver trouble: pageable memory still works
        return None
    return raw.view(dtype)

