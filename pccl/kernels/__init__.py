"""Pure compute kernels: tensor adaptation, reductions, quantization and content hashing.

No trio, no sockets, no clocks. torch and cupy are only touched when the caller hands in one of their objects.

Modules:
    backend: describe / as_numpy / byte_view / dtype tables for numpy, torch and cupy objects.
    reduce: reduce_into / finalize_avg (CPU) and reduce_into_gpu / finalize_avg_gpu.
    quantize: quantize / dequantize / dequantize_reduce_into and the metadata blob.
    hashing: content_hash (64-bit, identical on CPU and GPU) and simplehash32 (established system's hash).
"""

from __future__ import annotations

from . import backend, hashing, quantize, reduce

__all__ = ["backend", "hashing", "quantize", "reduce"]
