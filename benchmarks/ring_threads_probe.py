#!/usr/bin/env python3
"""Probe: what a thread-based Python data plane reaches, next to Gloo, in the same processes.

Not pccl's data plane: pccl's ring plan (``schedule.plan_ring``: the same frames of at most
``DEFAULT_BLOCK_BYTES``, dependencies and order; float32 SUM) executed over blocking loopback
sockets, with a sender thread per process and the main thread receiving with
``MSG_WAITALL`` and reducing (``recv_into`` and numpy's add release the GIL). It answers one
question for docs/history/benchmarks-allreduce.md: would moving our trio data plane to blocking calls in
threads
(far fewer Python calls per operation) make it faster? Compare its figure with
``benchmarks/dataplane.py --world 3 --sizes 16777216 --gloo-inline`` run right before or after.

Each iteration: a token passed twice around the ring (barrier), our all-reduce, then Gloo's
(``dist.barrier()`` + ``dist.all_reduce``) on the same size. Prints per-rank medians of wall and
CPU time (``time.process_time``) for both, and checks the result against a numpy reference.

usage: python benchmarks/ring_threads_probe.py [--world 3] [--bytes 16777216] [--iters 30]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from typing import Any

import numpy as np

from pccl.collectives.ring import DEFAULT_BLOCK_BYTES as BLOCK_BYTES
from pccl.collectives.schedule import SRC_SEND, plan_ring

WARMUP = 3


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def all_reduce(
    x: np.ndarray,
    work: np.ndarray,
    tmp: np.ndarray,
    snd: socket.socket,
    rcv: socket.socket,
    rank: int,
    n: int,
) -> None:
    """Ring all-reduce of ``x`` into ``work`` (SUM) along pccl's own plan (:func:`plan_ring`: the same
    frames, dependencies and order); ``tmp`` holds one received reduce-scatter block."""
    plan = plan_ring("all_reduce", n, rank, x.size, BLOCK_BYTES // x.itemsize)
    sends = [(x if f.source == SRC_SEND else work, f.start, f.end, f.after) for f in plan.sends]
    cond = threading.Condition()
    done = [0]
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            for buf, lo, hi, dep in sends:
                with cond:
                    while done[0] <= dep:
                        cond.wait()
                snd.sendall(buf[lo:hi].data.cast("B"))
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    thread = threading.Thread(target=sender)
    thread.start()
    tview = tmp.data.cast("B")
    for i, f in enumerate(plan.recvs):
        lo, hi = f.start, f.end
        if f.reduce:
            _recv_exact(rcv, tview[: (hi - lo) * x.itemsize])
            np.add(x[lo:hi], tmp[: hi - lo], out=work[lo:hi])
        else:
            _recv_exact(rcv, work[lo:hi].data.cast("B"))
        with cond:
            done[0] = i + 1
            cond.notify()
    thread.join()
    if errors:
        raise errors[0]


def _worker(rank: int, n: int, port0: int, nbytes: int, iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    listener = socket.create_server(("127.0.0.1", port0 + rank))
    snd = None
    for _ in range(200):
        try:
            snd = socket.create_connection(("127.0.0.1", port0 + (rank + 1) % n))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)  # the successor's listener is not up yet (startup only)
    assert snd is not None, "could not reach the ring successor"
    snd.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rcv, _ = listener.accept()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port0 + 100}", rank=rank, world_size=n)
    x = np.random.default_rng(rank).random(nbytes // 4, dtype=np.float32)
    work = np.empty_like(x)
    tmp = np.empty(BLOCK_BYTES // 4, np.float32)
    xt = torch.from_numpy(x.copy())
    token = bytearray(1)

    def barrier() -> None:
        for _ in range(2):
            if rank == 0:
                snd.sendall(b"t")
                _recv_exact(rcv, memoryview(token))
            else:
                _recv_exact(rcv, memoryview(token))
                snd.sendall(b"t")

    ours: list[float] = []
    ours_cpu: list[float] = []
    gloo: list[float] = []
    gloo_cpu: list[float] = []
    for i in range(WARMUP + iters):
        barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        all_reduce(x, work, tmp, snd, rcv, rank, n)
        t1, c1 = time.perf_counter(), time.process_time()
        dist.barrier()
        c2, t2 = time.process_time(), time.perf_counter()
        dist.all_reduce(xt)
        t3, c3 = time.perf_counter(), time.process_time()
        if i >= WARMUP:
            ours.append(t1 - t0)
            ours_cpu.append(c1 - c0)
            gloo.append(t3 - t2)
            gloo_cpu.append(c3 - c2)
    want = sum(np.random.default_rng(k).random(nbytes // 4, dtype=np.float32) for k in range(n))
    ok = bool(np.allclose(work, want, rtol=1e-5))
    med = statistics.median
    out.put((rank, med(ours) * 1e3, med(ours_cpu) * 1e3, med(gloo) * 1e3, med(gloo_cpu) * 1e3, ok))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--bytes", type=int, default=16 << 20)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port0 = 31000 + os.getpid() % 3000  # this ring: port0 + rank; Gloo rendezvous: port0 + 100
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port0, args.bytes, args.iters, out))
        for r in range(args.world)
    ]
    for proc in procs:
        proc.start()
    rows = sorted(out.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    print(f"world {args.world}, {args.bytes} bytes, {args.iters} iterations (medians)")
    print("rank  threads ms  cpu ms  |  gloo ms  cpu ms  result ok")
    for rank, ms, cpu, gms, gcpu, ok in rows:
        print(f"{rank:4d}  {ms:10.2f}  {cpu:6.2f}  |  {gms:7.2f}  {gcpu:6.2f}  {ok}")
    if not all(r[-1] for r in rows):
        raise SystemExit("wrong result")


if __name__ == "__main__":
    main()
