"""content_hash (64-bit) and simplehash32: definition, sensitivity, backend independence, test vectors."""

from __future__ import annotations

import multiprocessing
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from pccl import InvalidArgumentError
from pccl.kernels import hashing
from pccl.kernels.hashing import content_hash, hash_bytes, simplehash32

M64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------------------
# An independent, scalar, pure-Python transcription of the documented definition.


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    return k ^ (k >> 33)


def _mix(x: int) -> int:
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 32
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 29)


def reference_hash(data: bytes) -> int:
    n = len(data)
    padded = data + b"\0" * (-n % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    total = 0
    for b, start in enumerate(range(0, len(words), 4096)):
        s = 0
        for j, w in enumerate(words[start : start + 4096]):
            key = _fmix64(((j + 1) * 0x9E3779B97F4A7C15) & M64)
            s = (s + _mix(w ^ key)) & M64
        bkey = _fmix64(((b + 1) * 0xD6E8FEB86659FD93) & M64)
        total = (total + _fmix64(s ^ bkey)) & M64
    return _fmix64(total ^ _fmix64(n ^ 0x243F6A8885A308D3))


def _rand_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize(
    "n", [0, 1, 7, 8, 9, 15, 16, 100, 4096 * 8 - 1, 4096 * 8, 4096 * 8 + 1, 2 * 4096 * 8 + 13]
)
def test_matches_the_documented_definition(n: int) -> None:
    data = _rand_bytes(n, n)
    assert content_hash(np.frombuffer(data, dtype=np.uint8)) == reference_hash(data)


def test_pinned_values() -> None:
    # The hash is compared across peers and versions: its definition must never change silently.
    assert content_hash(b"") == reference_hash(b"") == 0xF5904F05C9828DD6
    assert content_hash(b"pccl") == reference_hash(b"pccl") == 0xB303E9130A9B21B8


def test_range_and_determinism() -> None:
    a = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    h = content_hash(a)
    assert 0 <= h < 2**64 and hashing.HASH_BITS == 64
    assert all(content_hash(a) == h for _ in range(3))
    assert content_hash(a.copy()) == h


def test_every_single_bit_flip_changes_the_hash() -> None:
    base = bytearray(_rand_bytes(8 * 4096 + 21, 3))  # a full block, a partial block and a tail
    h0 = hash_bytes(bytes(base))
    rng = np.random.default_rng(5)
    positions = [
        0,
        1,
        7,
        8,
        4095 * 8 + 7,
        4096 * 8,
        len(base) - 5,
        len(base) - 1,
        *rng.integers(0, len(base), 40),
    ]
    seen = {h0}
    for pos in positions:
        for bit in range(8):
            base[pos] ^= 1 << bit
            h = hash_bytes(bytes(base))
            base[pos] ^= 1 << bit
            assert h != h0, (pos, bit)
            seen.add(h)
    assert len(seen) == 1 + len(set(int(p) for p in positions)) * 8  # all distinct, not just different


def test_position_dependence() -> None:
    words = np.random.default_rng(2).integers(0, 2**63, 3 * 4096 + 10, dtype=np.uint64)
    h = content_hash(words)
    swapped = words.copy()
    swapped[[3, 10]] = swapped[[10, 3]]
    assert content_hash(swapped) != h
    across = words.copy()
    across[[5, 4096 + 5]] = across[[4096 + 5, 5]]  # same offset in two blocks
    assert content_hash(across) != h
    blocks = words.copy()
    blocks[:4096], blocks[4096:8192] = words[4096:8192].copy(), words[:4096].copy()
    assert content_hash(blocks) != h
    # Top-bit flips in two words (e.g. two sign flips) do not cancel.
    signs = words.copy()
    signs[[1, 2]] ^= np.uint64(1 << 63)
    assert content_hash(signs) != h


@pytest.mark.parametrize("n", [0, 5, 8, 4096 * 8 - 3, 4096 * 8])
def test_length_extension_with_zeros_changes_the_hash(n: int) -> None:
    data = _rand_bytes(n, 11)
    hashes = {hash_bytes(data + b"\0" * k) for k in range(17)}
    assert len(hashes) == 17
    assert hash_bytes(b"\0" * 8) != hash_bytes(b"\0" * 16)


def test_same_bytes_same_hash_across_types_and_dtype_views() -> None:
    a = np.random.default_rng(4).standard_normal((64, 33)).astype(np.float32)
    h = content_hash(a)
    assert content_hash(a.view(np.uint8)) == h
    assert content_hash(a.view(np.int16)) == h
    assert content_hash(a.reshape(-1)) == h
    assert content_hash(a.tobytes()) == h
    assert hash_bytes(memoryview(a.tobytes())) == h
    assert content_hash(torch.from_numpy(a)) == h
    assert content_hash(torch.from_numpy(a.copy()).view(torch.int32)) == h
    bf = torch.arange(1000, dtype=torch.bfloat16)
    assert content_hash(bf) == content_hash(bf.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    assert content_hash(bf) == content_hash(bf.view(torch.int16).numpy())


def test_unaligned_memory_gives_the_same_hash() -> None:
    raw = np.frombuffer(_rand_bytes(40_001, 8), dtype=np.uint8)
    for off in range(1, 8):
        part = raw[off:]  # data pointer not 8-byte aligned
        assert content_hash(part) == content_hash(part.copy()) == reference_hash(part.tobytes())


def test_threads_do_not_change_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.frombuffer(_rand_bytes(4096 * 8 * 50 + 77, 9), dtype=np.uint8)
    single = content_hash(data, threads=1)
    monkeypatch.setattr(hashing, "_THREAD_MIN_BYTES", 0)  # exercise the split on a small input
    for t in (2, 3, 5, 8):
        assert content_hash(data, threads=t) == single
    monkeypatch.setattr(hashing, "_CHUNK_ROWS", 3)  # chunking is an implementation detail too
    monkeypatch.setattr(hashing, "_key_tile_np", None)
    monkeypatch.setattr(hashing, "_tls", type(hashing._tls)())
    assert content_hash(data, threads=2) == single
    assert content_hash(data, threads=1) == single


def test_large_input_uses_the_default_split() -> None:
    data = np.frombuffer(_rand_bytes(9 << 20, 10), dtype=np.uint8)  # above the threading threshold
    assert content_hash(data) == content_hash(data, threads=1)


def test_rejects_non_contiguous_and_unknown() -> None:
    with pytest.raises(InvalidArgumentError):
        content_hash(np.arange(10)[::2])
    with pytest.raises(InvalidArgumentError):
        content_hash(torch.arange(10)[::2])
    with pytest.raises(InvalidArgumentError):
        content_hash([1, 2, 3])


# ---------------------------------------------------------------------------------------------------------
# simplehash32: the established system's test vectors


def _lcg_bytes(n: int, seed: int = 42) -> np.ndarray[Any, Any]:
    """bytes = seed % 256 after each step of seed = 1664525 * seed + 1013904223 (mod 2**32).

    Generated by doubling: if s[0:L] is known, s[L:2L] = A^L s[0:L] + C_L (mod 2**32), using uint32 wrap.
    """
    a, c, m = 1664525, 1013904223, 1 << 32
    s = np.empty(n, dtype=np.uint32)
    s[0] = (a * seed + c) % m
    length, a_l, c_l = 1, a, c
    while length < n:
        k = min(length, n - length)
        np.multiply(s[:k], np.uint32(a_l), out=s[length : length + k])
        np.add(s[length : length + k], np.uint32(c_l), out=s[length : length + k])
        a_l, c_l = (a_l * a_l) % m, (a_l * c_l + c_l) % m
        length *= 2
    return s.astype(np.uint8)


def test_lcg_generator_matches_the_scalar_recurrence() -> None:
    seed, expected = 42, []
    for _ in range(1000):
        seed = (1664525 * seed + 1013904223) % (1 << 32)
        expected.append(seed % 256)
    assert _lcg_bytes(1000).tolist() == expected


@pytest.mark.parametrize(("n", "expected"), [(1, 344386053), (4, 3765247898), (25, 3651434421)])
def test_simplehash32_small_vectors(n: int, expected: int) -> None:
    data = _lcg_bytes(n)
    assert simplehash32(data) == expected
    assert simplehash32(data.tobytes()) == expected


def test_simplehash32_large_vector() -> None:
    # 154,533,888 bytes: 960 blocks, 40 strided steps per lane, 4 final sections. About 2-3 s.
    assert simplehash32(_lcg_bytes(154_533_888)) == 3391090508


def test_simplehash32_empty_and_sensitivity() -> None:
    assert simplehash32(b"") == 0
    data = bytearray(_lcg_bytes(1000).tobytes())
    h = simplehash32(bytes(data))
    data[500] ^= 1
    assert simplehash32(bytes(data)) != h


def test_thread_pool_survives_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_THREAD_MIN_BYTES", 0)
    data = np.frombuffer(_rand_bytes(4096 * 8 * 40, 12), dtype=np.uint8)
    expected = content_hash(data, threads=2)  # the parent now holds a started pool

    def child() -> None:
        # Inherits the executor object but none of its threads; must not wait for them forever.
        raise SystemExit(0 if content_hash(data, threads=2) == expected else 3)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail("content_hash hung in a forked child")
    assert proc.exitcode == 0


@pytest.mark.parametrize("n", [0, 3, 8, 4096 * 8, 5 * 4096 * 8 + 11])
@pytest.mark.parametrize("rows", [1, 2, 8192])
def test_device_code_path_on_numpy(n: int, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU variant is written over an array module; run it with numpy to check it computes the same value
    # (the cupy-backed run is in test_kernel_gpu.py and needs a device).
    monkeypatch.setattr(hashing, "_GPU_CHUNK_ROWS", rows)
    raw = np.frombuffer(_rand_bytes(n + 1, n), dtype=np.uint8)
    for u8 in (raw[:n], raw[1:]):  # aligned and unaligned starts
        assert hashing._hash_device(np, u8, u8.ctypes.data) == content_hash(u8)
