"""``pccl.cuda``: the established bindings' CUDA query (``pccl.cuda.is_available()``)."""

from __future__ import annotations

import importlib
import importlib.util


def is_available() -> bool:
    """True when pccl can take CUDA tensors here: torch with a usable CUDA device, or cupy with one.

    The established bindings answer whether their native library was built with CUDA; pccl has no native
    build, it stages GPU tensors through host memory with torch or cupy, so the answer is whether one of
    those sees a GPU. Imports torch (or cupy) on first use.

    Returns:
        Whether a CUDA device is usable for collectives and shared state.
    """
    if importlib.util.find_spec("torch") is not None:
        torch = importlib.import_module("torch")
        if bool(torch.cuda.is_available()):
            return True
    if importlib.util.find_spec("cupy") is not None:
        try:
            cupy = importlib.import_module("cupy")
            return int(cupy.cuda.runtime.getDeviceCount()) > 0
        except Exception:
            return False
    return False


__all__ = ["is_available"]
