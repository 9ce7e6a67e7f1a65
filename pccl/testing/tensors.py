"""Bit-level checks on tensors, for tests that assert results are bit-identical across peers."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["tensor_bytes"]


def tensor_bytes(t: Any) -> bytes:
    """The raw bytes (C order) of a numpy array, torch tensor (CPU or CUDA) or cupy array.

    GPU tensors are copied to the host; non-contiguous ones are read in C order. Compare two results
    with ``tensor_bytes(a) == tensor_bytes(b)``: unlike ``==`` on values it tells NaN payloads,
    ``-0.0`` and ``0.0`` apart. torch and cupy are never imported here.
    """
    if isinstance(t, np.ndarray):
        return t.tobytes()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return bytes(flat.numpy().tobytes())
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):
        return bytes(cupy.asnumpy(t).tobytes())
    raise TypeError(f"not a numpy array, torch tensor or cupy array: {type(t).__name__}")
