"""Helpers shared by the example scripts (not part of the library): the digits data split and the
parent's loop that gathers the peer processes' reports."""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
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
    if len(reports) < expected:
        give_up(procs)
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    return reports


#: Seconds a parent that gives up waits for the live peers' dumps (:func:`give_up`).
DUMP_GRACE = 5.0
#: The exit code of a peer that dumped its state on request (:func:`dump_on_request`).
DUMPED = 3


def dump_on_request(name: str, where: Callable[[], Any] | None = None) -> None:
    """In a peer process: on SIGUSR1 (which :func:`give_up` sends), print to stderr this process's
    threads and ``where()`` (say, a driver's :meth:`~pccl.torch.TrainingRun.comm_statistics`: the
    calls its communicator waits in), then end it (exit code :data:`DUMPED`). A run that hangs then says
    where each peer was, instead of being killed silently by a test's timeout."""

    def dump(signum: int, frame: Any) -> None:
        print(f"--- {name} (pid {os.getpid()}) was asked where it is:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if where is not None:
            try:
                print(f"--- {name}: {where()}", file=sys.stderr, flush=True)
            except Exception as exc:  # a driver not made yet, or closed meanwhile
                print(f"--- {name}: (no state: {exc!r})", file=sys.stderr, flush=True)
        os._exit(DUMPED)  # not sys.exit: nothing may wait on the threads of a process that was stuck

    signal.signal(signal.SIGUSR1, dump)


def give_up(procs: list[Any], grace: float = DUMP_GRACE) -> None:
    """In the parent, when a run failed or ran out of time: say which process is where, ask every live
    one to dump (:func:`dump_on_request`), then kill them (a peer left waiting, say a late joiner whose
    gate never opened, would otherwise keep the parent waiting in its joins until the deadline)."""
    for p in procs:
        state = "alive" if p.is_alive() else f"exit code {p.exitcode}"
        print(f"{p.name} (pid {p.pid}): {state}", file=sys.stderr, flush=True)
    live = [p for p in procs if p.is_alive()]
    for p in live:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:  # it ended meanwhile
            pass
    # Each peer ends once it has dumped; one whose main thread cannot run Python code (stuck in C) never
    # answers, so the wait is bounded. The dumps go to the stderr the peers share with the parent.
    end = time.monotonic() + grace
    for p in live:
        p.join(max(0.0, end - time.monotonic()))
    for p in live:
        if p.is_alive():
            p.kill()


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
