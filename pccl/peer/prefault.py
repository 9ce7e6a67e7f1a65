"""Fault in the pages a fetch will write, while it fetches (Linux ``madvise(MADV_POPULATE_WRITE)``).

A shared-state fetch applies what it received into the user's tensors only at the end (all or nothing).
Memory that was never written (``numpy.zeros`` maps zero pages lazily) then costs a page fault per page at
that copy: about 1.3 s for 192 MiB on the project's machine, against 0.06 s into written memory. Asking the
kernel to populate those pages writable while the bytes are still on the wire takes that cost off the
call's tail. The contents do not change (the kernel maps the pages as a write would, without writing).
Elsewhere (another OS, an old kernel), or for memory it refuses, nothing happens.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable

import numpy as np

MADV_POPULATE_WRITE = 23  # Linux >= 5.14

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def populate_write(buffers: Iterable[memoryview | np.ndarray]) -> int:
    """Populate the pages of each writable host buffer; returns the bytes asked for (0 where unsupported).

    Args:
        buffers: host memory that is about to be written (its contents are left as they are).
    """
    if _libc is None:
        return 0
    page = mmap.PAGESIZE
    done = 0
    for buf in buffers:
        arr = np.frombuffer(buf, dtype=np.uint8)
        if arr.size == 0 or not arr.flags.writeable:
            continue
        addr = arr.ctypes.data
        start = addr - addr % page
        end = -(-(addr + arr.size) // page) * page
        if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_WRITE) != 0:
            return done  # (EINVAL: a kernel without it; nothing else to try)
        done += arr.size
    return done


__all__ = ["populate_write"]
