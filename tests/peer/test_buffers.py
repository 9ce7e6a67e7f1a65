"""The host-buffer cache that collectives reuse between operations."""

from __future__ import annotations

import numpy as np
import pytest

from pccl.kernels.buffers import BufferCache


def test_take_reuses_a_returned_buffer_of_the_same_dtype_and_count() -> None:
    cache = BufferCache()
    a = cache.take(np.dtype(np.float32), 100)
    assert a.dtype == np.float32 and a.shape == (100,)
    cache.give_back(a)
    assert len(cache) == 1 and cache.nbytes == 400
    assert cache.take(np.dtype(np.float32), 100) is a
    assert len(cache) == 0 and cache.nbytes == 0
    # another dtype or count gets a fresh array
    cache.give_back(a)
    assert cache.take(np.dtype(np.int32), 100) is not a
    assert cache.take(np.dtype(np.float32), 99) is not a
    assert cache.take(np.dtype(np.float32), 100) is a


def test_entry_bound_evicts_the_least_recently_returned() -> None:
    cache = BufferCache(max_entries=2)
    bufs = [np.empty(n, np.uint8) for n in (10, 20, 30)]
    for b in bufs:
        cache.give_back(b)
    assert len(cache) == 2 and cache.nbytes == 50
    assert cache.take(np.dtype(np.uint8), 10) is not bufs[0]  # evicted
    assert cache.take(np.dtype(np.uint8), 30) is bufs[2]


def test_byte_bound_keeps_at_least_the_newest_buffer() -> None:
    cache = BufferCache(max_bytes=100)
    small = np.empty(60, np.uint8)
    cache.give_back(small)
    huge = np.empty(1000, np.uint8)
    cache.give_back(huge)
    # over the byte bound: the older buffer goes, the newest stays even though it alone exceeds it
    assert len(cache) == 1 and cache.nbytes == 1000
    assert cache.take(np.dtype(np.uint8), 1000) is huge
    cache.give_back(small)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_gpu_tensor_hint_falls_back_to_pageable_memory_for_host_tensors() -> None:
    a = BufferCache().take(np.dtype(np.float64), 1 << 20, gpu_tensor=np.zeros(3))
    assert a.dtype == np.float64 and a.size == 1 << 20


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        BufferCache(max_entries=0)
