"""Content hashes of tensor bytes: a 64-bit hash identical on CPU (numpy) and GPU (cupy).

``content_hash`` (64 bits)
    Written once, as array operations over an ``xp`` module (numpy or cupy) on ``uint64`` words, so both
    backends compute the same value by construction (only wrapping integer arithmetic, no floats, and every
    combination step is a sum modulo 2**64, which does not depend on summation order or threading).

    Definition, for ``n`` bytes:

    1. Words: the bytes as little-endian ``uint64`` ``w_0 .. w_{m-1}``, ``m = ceil(n / 8)``; the last word
       holds the ``n % 8`` tail bytes, zero-padded.
    2. Blocks of ``B = 4096`` words. Inside a block, word ``j`` is keyed and mixed:
       ``u = mix(w ^ key_j)`` with ``key_j = fmix64((j + 1) * 0x9E3779B97F4A7C15)`` and
       ``mix(x): x *= C1; x ^= x >> 32; x *= C2; x ^= x >> 29`` (C1, C2 odd). ``mix`` is a bijection, so
       changing any bit of any word changes ``u``; the key makes the value position dependent.
    3. ``s_b = sum(u) mod 2**64`` for block ``b``; then ``t_b = fmix64(s_b ^ fmix64((b + 1) * C3))`` so that
       blocks are position dependent too; ``H = sum(t_b) mod 2**64``.
    4. ``content_hash = fmix64(H ^ fmix64(n ^ LEN_SEED))``: the byte length is folded in, so appending zero
       bytes changes the hash. ``fmix64`` is MurmurHash3's 64-bit finalizer.

    Any single-bit change is always detected (each step is a bijection of the changed term); multi-word
    changes collide with probability about 2**-64 for unstructured data. It is not a cryptographic hash: it
    detects divergence, it does not resist an adversary.

    Throughput: 8 vectorised passes per word over 512 KiB chunks that stay in L2, split across CPU cores for
    large inputs (numpy releases the GIL); see ``benchmarks/hash_bench.py``.

``simplehash32`` (32 bits)
    The established system's "simplehash" (REFERENCE_NOTES.md), reproduced exactly, including its GPU
    reduction order, for compatibility checks. Prefer ``content_hash``.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError
from . import backend

__all__ = [
    "CHUNK_ALIGN", "HASH_BITS", "chunk_sum", "chunk_sums", "combine_chunk_sums", "content_hash",
    "hash_and_chunk_sums", "hash_bytes", "simplehash32",
]

HASH_BITS = 64

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_C3 = 0xD6E8FEB86659FD93
_F1 = 0xFF51AFD7ED558CCD
_F2 = 0xC4CEB9FE1A85EC53
_LEN_SEED = 0x243F6A8885A308D3

_B = 4096  # words per block: part of the definition, never change it
_CHUNK_ROWS = 16  # blocks per CPU chunk (512 KiB of words): an implementation detail, free to tune
_GPU_CHUNK_ROWS = 8192  # blocks per GPU chunk (256 MiB of words)
_THREAD_MIN_BYTES = 8 << 20

_U64 = np.dtype("<u8")
_S29, _S32, _S33 = np.uint64(29), np.uint64(32), np.uint64(33)
_NC1, _NC2, _NF1, _NF2 = np.uint64(_C1), np.uint64(_C2), np.uint64(_F1), np.uint64(_F2)


def _fmix64_int(k: int) -> int:
    k &= _M64
    k ^= k >> 33
    k = (k * _F1) & _M64
    k ^= k >> 33
    k = (k * _F2) & _M64
    k ^= k >> 33
    return k


def _fmix64_xp(xp: Any, x: Any) -> Any:
    """MurmurHash3 fmix64 on a uint64 array (returns a new array)."""
    x = x ^ xp.right_shift(x, _S33)
    x = xp.multiply(x, _NF1)
    x = x ^ xp.right_shift(x, _S33)
    x = xp.multiply(x, _NF2)
    return x ^ xp.right_shift(x, _S33)


def _keys(xp: Any, count: int) -> Any:
    """key_j for j in [0, count): fmix64((j + 1) * GOLDEN)."""
    j = xp.arange(1, count + 1, dtype=xp.uint64)
    return _fmix64_xp(xp, xp.multiply(j, np.uint64(_GOLDEN)))


def _mix_sum(xp: Any, w: Any, key: Any, v: Any, t: Any, rows: int, width: int) -> Any:
    """Per-block sums of mix(w ^ key): ``w``, ``key``, ``v``, ``t`` flat with ``rows * width`` words."""
    xp.bitwise_xor(w, key, out=v)
    xp.multiply(v, _NC1, out=v)
    xp.right_shift(v, _S32, out=t)
    xp.bitwise_xor(v, t, out=v)
    xp.multiply(v, _NC2, out=v)
    xp.right_shift(v, _S29, out=t)
    xp.bitwise_xor(v, t, out=v)
    return v.reshape(rows, width).sum(axis=1, dtype=xp.uint64)


def _terms(xp: Any, sums: Any, first: int = 0) -> Any:
    """t_b = fmix64(s_b ^ fmix64((b + 1) * C3)) for blocks ``first .. first + len(sums) - 1``."""
    b = xp.arange(first + 1, first + sums.size + 1, dtype=xp.uint64)
    bkey = _fmix64_xp(xp, xp.multiply(b, np.uint64(_C3)))
    return _fmix64_xp(xp, xp.bitwise_xor(sums, bkey))


def _combine(xp: Any, sums: Any, first: int = 0) -> int:
    """H = sum_b fmix64(s_b ^ fmix64((b + 1) * C3)) mod 2**64 (blocks numbered from ``first``)."""
    if sums.size == 0:
        return 0
    return int(_terms(xp, sums, first).sum(dtype=xp.uint64))


def _finish(h: int, nbytes: int) -> int:
    return _fmix64_int(h ^ _fmix64_int(nbytes ^ _LEN_SEED))


def _tail_sum(xp: Any, u8: Any, full_words: int) -> Any | None:
    """Sum for the last, partial block (full words after the last complete block, plus the padded tail)."""
    n = int(u8.size)
    nw = n // 8
    rem = n - nw * 8
    start = full_words * _B
    count = nw - start + (1 if rem else 0)
    if count == 0:
        return None
    buf = xp.zeros(count * 8, dtype=xp.uint8)
    buf[: n - start * 8] = u8[start * 8 :]
    w = buf.view(_U64)
    key = _keys(xp, count)
    v = xp.empty(count, dtype=xp.uint64)
    t = xp.empty(count, dtype=xp.uint64)
    return _mix_sum(xp, w, key, v, t, 1, count)


# ----------------------------------------------------------------------------------------------------
# CPU (numpy)

_key_tile_np: np.ndarray[Any, Any] | None = None
_tls = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_size = 0
_pool_lock = threading.Lock()


def _np_key_tile() -> np.ndarray[Any, Any]:
    global _key_tile_np
    if _key_tile_np is None:
        # Pre-tiled to a whole chunk: a plain contiguous xor runs ~1.7x faster than a broadcast one.
        _key_tile_np = np.tile(_keys(np, _B), _CHUNK_ROWS)
    return _key_tile_np


def _np_scratch() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    s = getattr(_tls, "scratch", None)
    if s is None:
        s = (np.empty(_CHUNK_ROWS * _B, dtype=np.uint64), np.empty(_CHUNK_ROWS * _B, dtype=np.uint64))
        _tls.scratch = s
    return s


def _np_block_range(words: np.ndarray[Any, Any], sums: np.ndarray[Any, Any], b0: int, b1: int) -> None:
    key = _np_key_tile()
    v, t = _np_scratch()
    for r0 in range(b0, b1, _CHUNK_ROWS):
        r1 = min(r0 + _CHUNK_ROWS, b1)
        k = (r1 - r0) * _B
        sums[r0:r1] = _mix_sum(np, words[r0 * _B : r1 * _B], key[:k], v[:k], t[:k], r1 - r0, _B)


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_pid, _pool_size
    with _pool_lock:
        # A forked child inherits the executor object but not its threads: it would wait forever. Hence the
        # pid check.
        if _pool is None or _pool_pid != os.getpid() or _pool_size < workers:
            if _pool is not None and _pool_pid == os.getpid():
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pccl-hash")
            _pool_pid, _pool_size = os.getpid(), workers
        return _pool


def _hash_numpy(u8: np.ndarray[Any, Any], threads: int | None) -> int:
    return _finish(_combine(np, _block_sums_numpy(u8, threads)), int(u8.size))


def _block_sums_numpy(u8: np.ndarray[Any, Any], threads: int | None) -> np.ndarray[Any, Any]:
    """s_b of every block of ``u8`` (the last one the padded tail, if any)."""
    n = int(u8.size)
    full = n // (8 * _B)
    sums = np.empty(full + 1, dtype=np.uint64)
    if full:
        words = u8[: full * _B * 8].view(_U64)
        nthreads = threads if threads is not None else (os.cpu_count() or 1)
        nthreads = max(1, min(nthreads, 8, -(-full // _CHUNK_ROWS)))
        if nthreads == 1 or n < _THREAD_MIN_BYTES:
            _np_block_range(words, sums, 0, full)
        else:
            # Contiguous ranges of whole chunks per thread; the sums land in their own slots, so the result is
            # independent of the split.
            per = -(-full // (nthreads * _CHUNK_ROWS)) * _CHUNK_ROWS
            pool = _get_pool(nthreads)
            futs = [
                pool.submit(_np_block_range, words, sums, b, min(b + per, full)) for b in range(0, full, per)
            ]
            for f in futs:
                f.result()
    tail = _tail_sum(np, u8, full)
    if tail is None:
        return sums[:full]
    sums[full] = tail[0]
    return sums


# ----------------------------------------------------------------------------------------------------
# GPU (cupy)


def _hash_device(xp: Any, u8: Any, address: int) -> int:
    """The device variant: whole runs of blocks per kernel call. ``xp`` is cupy (tests also run it on numpy).

    Args:
        xp: the array module.
        u8: flat uint8 array of the bytes.
        address: its data pointer (uint64 views of device memory must be 8-byte aligned).
    """
    cupy = xp
    n = int(u8.size)
    if n and address % 8:
        u8 = u8.copy()  # fresh allocations are aligned; uint64 loads must be
    full = n // (8 * _B)
    parts = []
    if full:
        words = u8[: full * _B * 8].view(cupy.uint64)
        rows = min(_GPU_CHUNK_ROWS, full)
        key = cupy.tile(_keys(cupy, _B), rows)
        v = cupy.empty(rows * _B, dtype=cupy.uint64)
        t = cupy.empty(rows * _B, dtype=cupy.uint64)
        for r0 in range(0, full, rows):
            r1 = min(r0 + rows, full)
            k = (r1 - r0) * _B
            parts.append(_mix_sum(cupy, words[r0 * _B : r1 * _B], key[:k], v[:k], t[:k], r1 - r0, _B))
    tail = _tail_sum(cupy, u8, full)
    if tail is not None:
        parts.append(tail)
    sums = cupy.concatenate(parts) if parts else cupy.zeros(0, dtype=cupy.uint64)
    return _finish(_combine(cupy, sums), n)


def _cuda_hash(t: Any) -> int:
    cupy_mod = sys.modules.get("cupy")
    if cupy_mod is not None and isinstance(t, cupy_mod.ndarray):
        if not t.flags.c_contiguous:
            raise InvalidArgumentError("cupy array is not C-contiguous")
        u8 = t.reshape(-1).view(cupy_mod.uint8)
        with t.device:
            return _hash_device(cupy_mod, u8, u8.data.ptr)
    # A torch CUDA tensor: hash on the device through cupy (zero-copy via __cuda_array_interface__) when cupy
    # is installed; otherwise copy the bytes to the host. Same value either way.
    backend.describe(t)  # contiguity / layout checks
    flat_u8 = t.detach().reshape(-1).view(sys.modules["torch"].uint8)  # type: ignore[attr-defined]
    try:
        import cupy
    except ImportError:
        return _hash_numpy(flat_u8.cpu().numpy(), None)
    with cupy.cuda.Device(flat_u8.device.index):
        u8 = cupy.asarray(flat_u8)
        return _hash_device(cupy, u8, u8.data.ptr)


# ----------------------------------------------------------------------------------------------------
# public API


def content_hash(t: object, *, threads: int | None = None) -> int:
    """64-bit content hash of a tensor's bytes; the same value on CPU and GPU.

    The hash covers the raw bytes only (not dtype or shape): two tensors with identical bytes hash the same,
    whatever their dtypes.

    Args:
        t: a contiguous numpy array (any dtype), torch tensor (CPU or CUDA), cupy array, or bytes-like object.
        threads: CPU threads to use for large inputs (default: one per core, at most 8). The value does not
            depend on it.

    Returns:
        An integer in ``[0, 2**64)``.

    Raises:
        InvalidArgumentError: unsupported type or non-contiguous tensor.
    """
    if backend.is_cuda(t):
        return _cuda_hash(t)
    return _hash_numpy(backend.host_bytes(t), threads)


def hash_bytes(data: bytes | bytearray | memoryview, *, threads: int | None = None) -> int:
    """:func:`content_hash` of a bytes-like object.

    Args:
        data: the bytes.
        threads: as in :func:`content_hash`.

    Returns:
        An integer in ``[0, 2**64)``.
    """
    return _hash_numpy(backend.host_bytes(data), threads)


#: Chunks of a tensor that :func:`chunk_sums` describes start at multiples of this many bytes (one block).
CHUNK_ALIGN = 8 * _B


def chunk_sums(t: object, chunk_bytes: int, *, threads: int | None = None) -> list[int]:
    """The :func:`content_hash` of a tensor split into chunks of ``chunk_bytes`` (the last one shorter).

    The hash is a sum of per-block terms (step 3 of the definition), so the sum of a chunk's terms, its
    *chunk sum*, describes that chunk at its place, and :func:`combine_chunk_sums` of all of them is the
    content hash: a receiver checks a list of chunk sums against an elected content hash, then every chunk
    against its sum on arrival (:func:`chunk_sum`).

    Args:
        t: as in :func:`content_hash` (GPU tensors are copied to the host).
        chunk_bytes: a positive multiple of :data:`CHUNK_ALIGN`.
        threads: as in :func:`content_hash`.

    Returns:
        ``ceil(nbytes / chunk_bytes)`` integers in ``[0, 2**64)`` (one, 0, for an empty tensor).

    Raises:
        InvalidArgumentError: ``chunk_bytes`` is not a positive multiple of :data:`CHUNK_ALIGN`, or ``t``
            is not a supported tensor.
    """
    return hash_and_chunk_sums(t, chunk_bytes, threads=threads)[1]


def hash_and_chunk_sums(t: object, chunk_bytes: int, *, threads: int | None = None) -> tuple[int, list[int]]:
    """:func:`content_hash` and :func:`chunk_sums` of ``t`` in one pass over its bytes.

    Raises:
        InvalidArgumentError: see :func:`chunk_sums`.
    """
    if chunk_bytes <= 0 or chunk_bytes % CHUNK_ALIGN:
        raise InvalidArgumentError(
            f"chunk_bytes must be a positive multiple of {CHUNK_ALIGN}, not {chunk_bytes}")
    u8 = backend.host_bytes(t) if not backend.is_cuda(t) else _cuda_host_bytes(t)
    terms = _terms(np, _block_sums_numpy(u8, threads))
    per = chunk_bytes // CHUNK_ALIGN
    if terms.size == 0:
        return _finish(0, int(u8.size)), [0]
    sums = [int(x) for x in np.add.reduceat(terms, np.arange(0, terms.size, per), dtype=np.uint64)]
    return combine_chunk_sums(sums, int(u8.size)), sums


def chunk_sum(data: object, first_block: int) -> int:
    """The chunk sum of ``data``, bytes of a tensor from block ``first_block`` on (see :func:`chunk_sums`).

    Args:
        data: the chunk's bytes (whole blocks of :data:`CHUNK_ALIGN` bytes unless it ends the tensor).
        first_block: its offset in the tensor divided by :data:`CHUNK_ALIGN`.
    """
    u8 = backend.host_bytes(data)
    sums = _block_sums_numpy(u8, 1)
    return 0 if sums.size == 0 else int(_terms(np, sums, first_block).sum(dtype=np.uint64))


def combine_chunk_sums(sums: list[int], nbytes: int) -> int:
    """The :func:`content_hash` of an ``nbytes`` tensor whose chunk sums are ``sums``."""
    return _finish(sum(sums) & _M64, nbytes)


def _cuda_host_bytes(t: Any) -> np.ndarray[Any, Any]:
    """A host copy of a GPU tensor's bytes (torch or cupy)."""
    host = np.empty(backend.describe(t).nbytes, dtype=np.uint8)
    backend.copy_to_host(t, host)
    return host


# ----------------------------------------------------------------------------------------------------
# the established system's 32-bit simplehash

_SH_LANES = 256
_SH_WARP = 32
_SH_MAX_BLOCKS = 960
_SH_K1 = np.uint32(0x9E3779B1)
_SH_K2 = np.uint32(0x85EBCA6B)


def _hc(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """hc(a, b): a ^= b + 0x9E3779B1; a = rotl32(a, 7); a *= 0x85EBCA6B (mod 2**32), element-wise."""
    x = a ^ (b + _SH_K1)
    x = (x << np.uint32(7)) | (x >> np.uint32(25))
    return x * _SH_K2


def _hc_int(a: int, b: int) -> int:
    a ^= (b + 0x9E3779B1) & 0xFFFFFFFF
    a = ((a << 7) | (a >> 25)) & 0xFFFFFFFF
    return (a * 0x85EBCA6B) & 0xFFFFFFFF


def _warp_reduce(vals: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Tree-reduce the last axis (32 lanes) like a shfl_down loop: offsets 16, 8, 4, 2, 1; lane 0 survives."""
    t = vals.copy()
    off = _SH_WARP // 2
    while off:
        t[..., :off] = _hc(t[..., :off], t[..., off : 2 * off])
        off //= 2
    return t[..., 0]


def _block_reduce(acc: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Reduce the last axis (256 lanes): 8 warps of 32, then the 8 warp results padded with zeros to 32."""
    lead = acc.shape[:-1]
    warps = _warp_reduce(acc.reshape(*lead, _SH_LANES // _SH_WARP, _SH_WARP))
    padded = np.zeros((*lead, _SH_WARP), dtype=np.uint32)
    padded[..., : _SH_LANES // _SH_WARP] = warps
    return _warp_reduce(padded)


def simplehash32(data: bytes | bytearray | memoryview | np.ndarray[Any, Any]) -> int:
    """The established PCCL "simplehash": 32 bits, reproducing its CUDA reduction order exactly.

    Vectors of 4 little-endian u32 words are spread over ``min(960, ceil(vectors / 256))`` blocks of 256
    lanes; each lane folds its vectors' words with ``hc`` (lanes stride by 256 inside their block's range),
    each block tree-reduces its lanes, block results fold into 256 accumulators which reduce the same way,
    then leftover words and leftover bytes (one little-endian word) fold in. Empty input hashes to 0.

    Args:
        data: bytes-like object or contiguous numpy array (its raw bytes are hashed).

    Returns:
        An integer in ``[0, 2**32)``.
    """
    u8 = backend.host_bytes(data)
    n = int(u8.size)
    if n == 0:
        return 0
    n_words = n // 4
    n_vec = n_words // 4
    h = 0
    grid = min(_SH_MAX_BLOCKS, -(-n_vec // _SH_LANES))
    if grid:
        per_block = -(-n_vec // grid)  # vectors per block
        steps = -(-per_block // _SH_LANES)
        vec = np.ascontiguousarray(u8[: n_vec * 16]).view("<u4").astype(np.uint32).reshape(n_vec, 4)
        acc = np.zeros((grid, _SH_LANES), dtype=np.uint32)
        blocks = np.arange(grid)
        lanes = np.arange(_SH_LANES)
        block_end = np.minimum((blocks + 1) * per_block, n_vec)[:, None]
        for s in range(steps):
            # Lane l of block b handles vector b * per_block + s * 256 + l while that is inside the block.
            idx = (blocks * per_block)[:, None] + s * _SH_LANES + lanes[None, :]
            valid = idx < block_end
            words = vec[np.where(valid, idx, 0)]
            new = acc
            for k in range(4):
                new = _hc(new, words[..., k])
            acc = np.where(valid, new, acc)
        block_hash = _block_reduce(acc)
        # Block b folds into accumulator b % 256, in increasing b (the CUDA final kernel's sections).
        finals = np.zeros(_SH_LANES, dtype=np.uint32)
        for sec in range(0, grid, _SH_LANES):
            part = block_hash[sec : sec + _SH_LANES]
            finals[: part.size] = _hc(finals[: part.size], part)
        h = int(_block_reduce(finals))
    tail_words = u8[n_vec * 16 : n_words * 4].view("<u4") if n_words > n_vec * 4 else np.zeros(0, np.uint32)
    for w in np.ascontiguousarray(tail_words).tolist():
        h = _hc_int(h, int(w))
    rem = n % 4
    if rem:
        tail = int.from_bytes(u8[n_words * 4 :].tobytes(), "little")
        h = _hc_int(h, tail)
    return h
