"""Helpers shared by the example scripts (not part of the library): the digits data split and the
parent's loop that gathers the peer processes' reports."""

from __future__ import annotations

import os
import queue
import sys
import time
from typing import Any

import numpy as np


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 in [0, 1] and int64 labels, split 80/20 with a fixed permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def collect(procs: list[Any], results: Any, expected: int, timeout: float) -> list[tuple[Any, ...]]:
    """Gather ``expected`` reports; stop early if a peer process fails or the time is up."""
    deadline = time.monotonic() + timeout
    reports: list[tuple[Any, ...]] = []
    while len(reports) < expected and time.monotonic() < deadline:
        try:
            reports.append(results.get(timeout=0.2))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                print("a peer failed; stopping", file=sys.stderr)
                break
    else:
        if len(reports) < expected:
            print(f"timed out after {timeout:g}s", file=sys.stderr)
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    return reports


def launched_peer(default_world: int, min_world: int = 2) -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process was started as one peer of a run whose master runs
    elsewhere (``PCCL_MASTER`` is set, e.g. by ``pccl run``, which also sets ``PCCL_RANK`` and
    ``PCCL_WORLD_SIZE``); None when the example should start its own master and peers. A world smaller
    than ``min_world`` (``pccl run -n 1``) ends the process with one line and exit code 2: the example
    would wait for peers that never come."""
    if not os.environ.get("PCCL_MASTER", "").strip():
        return None
    rank = int(os.environ.get("PCCL_RANK", "0"))
    world = int(os.environ.get("PCCL_WORLD_SIZE", str(default_world)))
    if world < min_world:
        print(f"error: this example needs at least {min_world} peers; PCCL_WORLD_SIZE={world} "
              f"(pccl run -n {min_world} or more)", file=sys.stderr)
        sys.exit(2)
    print(f"peer {rank} of {world}: using the master at PCCL_MASTER={os.environ['PCCL_MASTER']}", flush=True)
    return rank, world


def one_report(results: queue.Queue[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The report a peer run in this process left (see :func:`launched_peer`)."""
    return results.get_nowait()
