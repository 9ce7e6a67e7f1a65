#!/usr/bin/env python3
"""The blocking API with a reduce thread beside a busy main thread (the async-DiLoCo shape), polling on
and off.

usage: python benchmarks/blocking_overlap.py [--seconds 4] [--rounds 2] [--spin 0,0.001] [--kb 64]

Two peer processes join one master (``pccl.MasterNode``) through the blocking API. In each, a background
thread all-reduces a ``--kb`` KB float32 array in a loop while the main thread runs pure-Python work
(sums of squares, 1000 terms per unit) for ``--seconds``; then both reduce threads stop after the same
operation (the array's last element carries the wish to stop). Each process runs with ``PCCL_SPIN_SECONDS``
set to one of ``--spin`` (``PeerConfig.spin_seconds``: how long a collective polls instead of
sleeping); the settings are interleaved over ``--rounds`` rounds. Reported per setting: the reduce
thread's operations per second and the main thread's work units per second (the median over rounds,
mean over the two peers). What it answers: whether polling takes the GIL or the CPU from the user's own
thread (docs/history/benchmarks-allreduce.md "Polling while an operation runs").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np


def _peer(address: str, rank: int, seconds: float, count: int, out: Any) -> None:
    import pccl
    from pccl import Attribute, ReduceOp

    comm = pccl.Communicator(address, 0)
    comm.connect()
    while comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) < 2:
        if comm.are_peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.01)  # polling the join, outside the measured part
    x = np.ones(count, np.float32)
    for _ in range(20):  # warm-up
        comm.all_reduce(x, x, op=ReduceOp.SUM, tag=0)
    stop = threading.Event()
    ops = [0]

    def reducer() -> None:
        # The last element carries each peer's wish to stop, so both leave after the same operation
        # (a peer that left while the other still ran one would fail that one with TOO_FEW_PEERS).
        while True:
            x[:] = 1
            x[-1] = 1.0 if stop.is_set() else 0.0
            comm.all_reduce(x, x, op=ReduceOp.SUM, tag=0)
            ops[0] += 1
            if x[-1] > 0:
                return

    thread = threading.Thread(target=reducer, name="reducer")
    t0 = time.perf_counter()
    thread.start()
    work = 0
    while time.perf_counter() - t0 < seconds:
        s = 0
        for i in range(1000):
            s += i * i
        work += 1
    stop.set()
    thread.join()
    out.put((rank, ops[0] / seconds, work / seconds))


def run_once(spin: str, seconds: float, count: int) -> tuple[float, float]:
    """One run with ``PCCL_SPIN_SECONDS=spin``: (reduce ops/s, main-thread work/s), means over the peers."""
    import pccl

    os.environ["PCCL_SPIN_SECONDS"] = spin  # the spawned peers inherit it
    ctx = mp.get_context("spawn")
    master = pccl.MasterNode("127.0.0.1:0")
    master.run()
    try:
        out = ctx.Queue()
        procs = [ctx.Process(target=_peer, args=(master.address, r, seconds, count, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = [out.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    finally:
        master.interrupt()
    return statistics.mean(r[1] for r in results), statistics.mean(r[2] for r in results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spin", default="0,0.001", help="PCCL_SPIN_SECONDS values, comma-separated")
    p.add_argument("--kb", type=int, default=64, help="KB of float32 data per all-reduce")
    args = p.parse_args(argv)
    spins = [s.strip() for s in args.spin.split(",") if s.strip()]
    count = args.kb * 1024 // 4
    got: dict[str, list[tuple[float, float]]] = {s: [] for s in spins}
    print(f"blocking API, 2 peer processes, {args.kb} KB all-reduces in a thread beside a busy main "
          f"thread, {args.seconds:g}s per run; {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    for r in range(args.rounds):
        order = spins if r % 2 == 0 else spins[::-1]
        for s in order:
            ops, work = run_once(s, args.seconds, count)
            got[s].append((ops, work))
            print(f"  round {r + 1} spin {s}: reduce ops/s {ops:.0f}, main-thread work/s {work:.0f}",
                  flush=True)
    print()
    print("| PCCL_SPIN_SECONDS | reduce ops/s (median) | main-thread work/s (median) |")
    print("|---:|---:|---:|")
    for s in spins:
        print(f"| {s} | {statistics.median(o for o, _ in got[s]):.0f} | "
              f"{statistics.median(w for _, w in got[s]):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
