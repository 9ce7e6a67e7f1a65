#!/usr/bin/env python3
"""Data-plane benchmark: ring all-reduce (float32 SUM) between OS processes on loopback, no master.

Each process runs a P2P pool and listener on 127.0.0.1, connects to its ring successor, and times
``run_collective("all_reduce")``; a one-element all-reduce before every timed call lines the
processes up (like ``dist.barrier()`` in ``gloo_bench.py``). Prints medians per world size and
buffer size; with ``--gloo PATH`` it also runs torch.distributed Gloo through the shared
``gloo_bench.py`` in the same session and prints the ratio (machines are noisy: only compare
numbers measured together).

usage: python benchmarks/dataplane.py [--suite | --world 2 --sizes 65536,1048576] [--iters 20]
           [--pool-size 1] [--block-bytes N] [--gloo /work/shared/bench/gloo_bench.py] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from typing import Any

from pccl.collectives.ring import DEFAULT_BLOCK_BYTES
from pccl.peer.pool import DEFAULT_SOCKET_BUFFER

DEFAULT_SIZES = [65536, 1048576, 16777216, 67108864]
SUITE = [(2, DEFAULT_SIZES), (3, [16777216]), (4, [16777216])]


def _worker(rank: int, world: int, sizes: list[int], iters: int, pool_size: int, block_bytes: int,
            socket_buffer: int | None, addr_q: Any, table_q: Any, result_q: Any) -> None:
    import numpy as np
    import trio

    from pccl import PeerConfig, ReduceOp
    from pccl.collectives.ring import run_collective
    from pccl.peer.p2p import serve_p2p
    from pccl.peer.pool import P2PPool
    from pccl.transport import TcpTransport

    async def main() -> None:
        config = PeerConfig()
        transport = TcpTransport()
        pool = P2PPool(transport=transport, my_peer_id=rank, pool_size=pool_size, config=config,
                       socket_buffer_bytes=socket_buffer)
        async with trio.open_nursery() as nursery:
            serve = functools.partial(serve_p2p, config=config)
            addr = await nursery.start(serve, transport, "127.0.0.1", 0, {"ring": pool.handle_incoming})
            addr_q.put((rank, addr))
            table = await trio.to_thread.run_sync(table_q.get)
            nxt = (rank + 1) % world
            await pool.connect(nxt, *table[nxt])
            ring = list(range(world))
            op_seq = 0

            async def op(send: Any, out: Any) -> None:
                nonlocal op_seq
                op_seq += 1
                await run_collective(pool, kind="all_reduce", ring=ring, my_id=rank, tag=0, op_seq=op_seq,
                                     send=send, out=out, op=ReduceOp.SUM, block_bytes=block_bytes)

            one, one_out = np.ones(1, np.float32), np.empty(1, np.float32)
            for _ in range(3):  # all incoming connections up, caches warm
                await op(one, one_out)
            results: dict[int, float] = {}
            for nbytes in sizes:
                x = np.random.default_rng(rank).random(nbytes // 4, dtype=np.float32)
                out = np.empty_like(x)
                times = []
                for _ in range(iters + 3):
                    await op(one, one_out)
                    t = time.perf_counter()
                    await op(x, out)
                    times.append(time.perf_counter() - t)
                results[nbytes] = statistics.median(times[3:])
            await op(one, one_out)
            if rank == 0:
                result_q.put(results)
            await pool.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


def run_world(world: int, sizes: list[int], iters: int, pool_size: int, block_bytes: int,
              socket_buffer: int | None = DEFAULT_SOCKET_BUFFER) -> dict[int, float]:
    """Run one world size in fresh processes; median seconds per size."""
    ctx = mp.get_context("spawn")
    addr_q, result_q = ctx.Queue(), ctx.Queue()
    table_qs = [ctx.Queue() for _ in range(world)]
    procs = [
        ctx.Process(target=_worker, args=(r, world, sizes, iters, pool_size, block_bytes, socket_buffer,
                                          addr_q, table_qs[r], result_q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    table: dict[int, tuple[str, int]] = {}
    for _ in range(world):
        rank, addr = addr_q.get(timeout=120)
        table[rank] = tuple(addr)  # type: ignore[assignment]
    for q in table_qs:
        q.put(table)
    res: dict[int, float] = result_q.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    return res


def run_gloo(path: str, world: int, sizes: list[int], iters: int) -> dict[int, float]:
    """Run the shared Gloo reference; median seconds per size."""
    import os
    import tempfile

    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    subprocess.run([sys.executable, path, "--world", str(world), "--sizes", ",".join(map(str, sizes)),
                    "--iters", str(iters), "--json", out], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return {int(k): float(v) for k, v in data["median_s"].items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--suite", action="store_true", help="world 2 at all sizes, worlds 3 and 4 at 16 MB")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--pool-size", type=int, default=1)
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES)
    p.add_argument("--socket-buffer", type=int, default=DEFAULT_SOCKET_BUFFER or 0,
                   help="SO_SNDBUF/SO_RCVBUF of ring connections; 0 keeps the kernel's autotuning")
    p.add_argument("--gloo", help="path of gloo_bench.py to run side by side")
    p.add_argument("--json")
    a = p.parse_args(argv)
    plan = SUITE if a.suite else [(a.world, [int(s) for s in a.sizes.split(",")])]
    rows: list[dict[str, Any]] = []
    for world, sizes in plan:
        ours = run_world(world, sizes, a.iters, a.pool_size, a.block_bytes, a.socket_buffer or None)
        gloo = run_gloo(a.gloo, world, sizes, a.iters) if a.gloo else {}
        for nbytes in sizes:
            rows.append({"world": world, "bytes": nbytes, "pccl_s": ours[nbytes], "gloo_s": gloo.get(nbytes)})
    print(f"{'world':>5} {'bytes':>10} {'pccl ms':>9} {'GB/s':>6} {'gloo ms':>9} {'gloo/pccl':>9}"
          f"   (pool_size={a.pool_size}, block_bytes={a.block_bytes}, socket_buffer={a.socket_buffer})")
    for r in rows:
        g = r["gloo_s"]
        gl = f"{g * 1e3:9.3f} {g / r['pccl_s']:9.2f}" if g else f"{'-':>9} {'-':>9}"
        gbps = r["bytes"] / r["pccl_s"] / 1e9
        print(f"{r['world']:>5} {r['bytes']:>10} {r['pccl_s'] * 1e3:9.3f} {gbps:6.2f} {gl}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
