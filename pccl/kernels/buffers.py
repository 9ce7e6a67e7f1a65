"""Host buffers that collectives reuse from one operation to the next.

A collective writes its result into a host buffer and copies it into the caller's tensor only at the
commit (and GPU tensors are staged through host buffers). Allocating those afresh costs page faults
(about 20 ms for 64 MB here) on every call, so the buffers of successful operations are kept, keyed by
dtype and element count, in a small least-recently-used cache bounded by entries and bytes. Buffers of
failed operations are never reused: a reader of the aborted operation may still refer to them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from . import backend

DEFAULT_MAX_ENTRIES = 8
DEFAULT_MAX_BYTES = 1 << 30


class BufferCache:
    """Reusable host arrays, keyed by ``(dtype, count)``, least recently returned evicted first.

    Holds at most ``max_entries`` arrays and ``max_bytes`` bytes, except that the most recently
    returned array is always kept (so a training loop that all-reduces one 4 GB tensor every step
    still reuses its buffer).
    """

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 1 or max_bytes < 0:
            raise ValueError("max_entries must be >= 1 and max_bytes >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._free: OrderedDict[tuple[str, int], list[np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._count = 0

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self._bytes

    def __len__(self) -> int:
        return self._count

    def take(self, dtype: np.dtype[Any], count: int, gpu_tensor: Any = None) -> np.ndarray:
        """An array of ``count`` elements of ``dtype`` (contents unspecified): a kept one, else a new one.

        Args:
            dtype: numpy dtype.
            count: number of elements.
            gpu_tensor: for staging to or from this GPU tensor: a new array is page-locked when
                possible (see :func:`pccl.kernels.backend.pinned_empty`).
        """
        key = (np.dtype(dtype).str, count)
        free = self._free.get(key)
        if free:
            buf = free.pop()
            if not free:
                del self._free[key]
            self._bytes -= buf.nbytes
            self._count -= 1
            return buf
        if gpu_tensor is not None:
            pinned = backend.pinned_empty(count, np.dtype(dtype), gpu_tensor)
            if pinned is not None:
                return pinned
        return np.empty(count, dtype=dtype)

    def give_back(self, buf: np.ndarray) -> None:
        """Keep ``buf`` for a later :meth:`take` (only buffers nothing else refers to any more)."""
        key = (buf.dtype.str, buf.size)
        self._free.setdefault(key, []).append(buf)
        self._free.move_to_end(key)
        self._bytes += buf.nbytes
        self._count += 1
        while self._count > 1 and (self._count > self.max_entries or self._bytes > self.max_bytes):
            oldest_key = next(iter(self._free))
            oldest = self._free[oldest_key]
            dropped = oldest.pop(0)
            if not oldest:
                del self._free[oldest_key]
            self._bytes -= dropped.nbytes
            self._count -= 1

    def clear(self) -> None:
        """Drop every kept array."""
        self._free.clear()
        self._bytes = 0
        self._count = 0
