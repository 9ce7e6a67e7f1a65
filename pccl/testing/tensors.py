"""Bit-level checks on tensors, for tests that assert results are bit-identical across peers."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import backend

__all__ = ["tensor_bytes"]


def tensor_bytes(t: Any) -> bytes:
    """The raw bytes (C order) of a numpy array, torch tensor (CPU or CUDA) or cupy array.

    GPU tensors are copied to the host; non-contiguous ones are read in C order. Compare two results
    with ``tensor_bytes(a) == tensor_bytes(b)``: unlike ``==`` on values it tells NaN payloads,
    ``-0.0`` and ``0.0`` apart. torch and cupy are never imported here.
    """
    if isinstance(t, np.ndarray):
        return t.tobytes()
    if backend.is_torch_tensor(t):
        tt: Any = t
        flat = tt.detach().cpu().contiguous().reshape(-1)
        return bytes(backend.host_bytes(flat).tobytes())
    if backend.is_cupy_array(t):
        a: Any = t
        return bytes(a.get().tobytes())  # a host copy in C order
    raise TypeError(f"not a numpy array, torch tensor or cupy array: {type(t).__name__}")
