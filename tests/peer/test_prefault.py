"""pccl/peer/prefault.py: populating the pages a fetch will write leaves every byte as it was."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pccl.peer.prefault import populate_write


def test_contents_unchanged_zeros_random_slices_and_empty() -> None:
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 3 * 4096 + 17, dtype=np.uint8)
    zeros = np.zeros(1 << 20, np.float32)  # pages never written: mapped lazily
    before = data.copy()
    part = data[5:-3]  # a view that starts and ends inside pages shared with its neighbours
    n = populate_write([zeros, part, np.zeros(0, np.uint8)])
    assert np.array_equal(data, before) and not zeros.any()
    if sys.platform.startswith("linux"):
        assert n in (0, zeros.nbytes + part.nbytes)  # 0: a kernel without MADV_POPULATE_WRITE


def test_read_only_memory_is_skipped() -> None:
    ro = np.frombuffer(b"x" * 10000, dtype=np.uint8)
    assert populate_write([ro]) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_a_large_fetch_applies_into_prefaulted_pages() -> None:
    """What _fetch_all starts in a thread: afterwards the pages are there (the write costs no faults;
    timing is benchmarks' business, so this checks the contents and the count only)."""
    dst = np.zeros(4 << 20, np.uint8)
    assert populate_write([dst]) in (0, dst.nbytes)
    dst[:] = 7
    assert (dst == 7).all()
