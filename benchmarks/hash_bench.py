"""Throughput of the pure kernels: content hash, reduce_into, quantize/dequantize.

Run: ``python benchmarks/hash_bench.py [--repeat N] [--quick]``

Prints one table. Each figure is the best of ``--repeat`` runs (the machine is shared and noisy: the best run
is the closest to what the kernel itself can do) with the median alongside. Sizes are in bytes of input.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from pccl import DataType, QuantizationAlgorithm, ReduceOp
from pccl.kernels.hashing import content_hash, simplehash32
from pccl.kernels.quantize import dequantize, dequantize_add_into, quantize
from pccl.kernels.reduce import reduce_into

MB = 1 << 20


def _time(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    fn()  # warm up: allocations, caches, thread pool
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _row(name: str, nbytes: int, best: float, median: float) -> str:
    rates = f"{nbytes / best / 1e6:>10.0f} | {nbytes / median / 1e6:>10.0f}"
    return f"| {name:<48} | {nbytes / MB:>6.0f} | {rates} |"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        Process exit status (0).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per case (default 7)")
    parser.add_argument("--quick", action="store_true", help="skip the 256 MB hash case")
    args = parser.parse_args(argv)
    rep = args.repeat
    rng = np.random.default_rng(0)

    print(f"pccl kernels, numpy {np.__version__}, {os.cpu_count()} CPUs, best/median of {rep} runs")
    print(f"| {'case':<48} | {'MB':>6} | {'best MB/s':>10} | {'med MB/s':>10} |")
    print(f"|{'-' * 50}|{'-' * 8}|{'-' * 12}|{'-' * 12}|")

    def case(name: str, nbytes: int, fn: Callable[[], object], repeat: int = rep) -> None:
        print(_row(name, nbytes, *_time(fn, repeat)), flush=True)

    sizes = [1 * MB, 16 * MB] + ([] if args.quick else [256 * MB])
    big = rng.integers(0, 256, max(sizes), dtype=np.uint8)
    for size in sizes:
        data = big[:size]
        r = max(3, rep if size <= 16 * MB else rep // 2)
        case("content_hash (64-bit, default threads)", size, partial(content_hash, data), r)
        case("content_hash (64-bit, 1 thread)", size, partial(content_hash, data, threads=1), r)
    case("simplehash32 (established, for comparison)", 16 * MB, partial(simplehash32, big[: 16 * MB]), 3)

    for size in (16 * MB, 64 * MB):
        acc = rng.standard_normal(size // 4).astype(np.float32)
        other = rng.standard_normal(size // 4).astype(np.float32)
        case("reduce_into float32 SUM", size, partial(reduce_into, acc, other, ReduceOp.SUM))

    x = rng.standard_normal(16 * MB // 4).astype(np.float32)
    out = np.empty_like(x)
    acc = x.copy()
    for alg in (QuantizationAlgorithm.MIN_MAX, QuantizationAlgorithm.ZERO_POINT_SCALE):
        for qdt in (DataType.UINT8, DataType.UINT16):
            q, meta = quantize(x, qdt, alg)
            tag = f"{alg.name.lower()} f32->{qdt.name.lower()}"
            case(f"quantize {tag}", x.nbytes, partial(quantize, x, qdt, alg, out=q))
            case(f"dequantize {tag}", x.nbytes, partial(dequantize, q, meta, out=out))
            case(f"dequantize_add_into {tag}", x.nbytes, partial(dequantize_add_into, acc, q, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
