"""Chunk sums (pccl.kernels.hashing.chunk_sums): they combine into the content hash and catch changes."""

from __future__ import annotations

import numpy as np
import pytest

from pccl import InvalidArgumentError
from pccl.kernels import hashing as h

CB = 64 * 1024


@pytest.mark.parametrize("n", [0, 1, 8, CB - 3, CB, 3 * CB + 17, 5 * CB])
def test_chunk_sums_combine_into_the_content_hash(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    sums = h.chunk_sums(data, CB)
    assert len(sums) == max(1, -(-n // CB))
    assert h.combine_chunk_sums(sums, n) == h.content_hash(data)
    for i, s in enumerate(sums):
        assert h.chunk_sum(data[i * CB : (i + 1) * CB], i * CB // h.CHUNK_ALIGN) == s


def test_a_chunk_sum_depends_on_every_bit_and_on_the_place() -> None:
    data = np.random.default_rng(7).integers(0, 256, 2 * CB, dtype=np.uint8)
    first = h.chunk_sum(data[:CB], 0)
    for pos in (0, 5, CB - 1):
        bad = data[:CB].copy()
        bad[pos] ^= 1
        assert h.chunk_sum(bad, 0) != first
    # the same bytes at another place sum differently (a donor cannot answer with the wrong chunk)
    assert h.chunk_sum(data[:CB], CB // h.CHUNK_ALIGN) != first


def test_chunk_bytes_must_be_whole_blocks() -> None:
    with pytest.raises(InvalidArgumentError, match="multiple"):
        h.chunk_sums(np.zeros(10, np.uint8), 1000)
