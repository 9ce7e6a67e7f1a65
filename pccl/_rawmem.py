"""Raw host addresses as numpy views, for the established bindings' pointer-taking constructors.

``TensorInfo(name, data_ptr, numel=..., dtype=...)`` and ``ReduceOpDescriptor(sendbuf_ptr, recvbuf_ptr, ...)``
take integer addresses there; pccl works on arrays, so it views the memory at such an address as a numpy array
(no copy: writes go to the caller's memory, which the caller keeps alive).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ._errors import InvalidBufferError
from ._types import DataType
from .kernels import backend


def is_address(x: object) -> bool:
    """True for an ``int`` (not a bool): the established bindings' raw pointer."""
    return isinstance(x, int) and not isinstance(x, bool)


def view_at(address: int, count: int, dtype: DataType) -> np.ndarray[Any, Any]:
    """A numpy view of ``count`` elements of ``dtype`` at host ``address``.

    Raises:
        InvalidBufferError: a null address or a negative count.
    """
    if address == 0:
        raise InvalidBufferError("Invalid data pointer: nullptr")
    if count < 0:
        raise InvalidBufferError(f"element count must be >= 0, got {count}")
    raw = (ctypes.c_uint8 * (count * DataType(dtype).itemsize)).from_address(address)
    flat: np.ndarray[Any, Any] = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
    view: np.ndarray[Any, Any] = flat.view(backend.dtype_to_numpy(DataType(dtype)))
    return view


def address_of(t: Any) -> int:
    """The address of the first element of a numpy array, torch tensor or cupy array."""
    if isinstance(t, np.ndarray):
        return int(t.ctypes.data)
    if backend.is_torch_tensor(t):
        return int(t.data_ptr())
    return int(t.data.ptr)  # cupy
