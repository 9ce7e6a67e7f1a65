#!/usr/bin/env python3
"""Data-plane benchmark: ring all-reduce (float32 SUM) between OS processes on loopback, no master.

Each process runs a P2P pool and listener on 127.0.0.1, connects to its ring successor, and times
``run_collective("all_reduce")``, with a barrier before every timed call (like ``gloo_bench.py``).

Two ways to compare with torch.distributed Gloo (machines are noisy: only compare numbers taken
together):

* ``--gloo-inline``: the same worker processes also join a Gloo process group, and every iteration
  times one Gloo all-reduce right after ours, behind the same barrier, on the same data size. Both
  see the same background load, so the ratio is the most trustworthy number. Also reports the
  median CPU time per call of each (``time.process_time``, all threads of the process).
* ``--gloo PATH``: afterwards, run the shared ``gloo_bench.py`` in fresh processes.

usage: python benchmarks/dataplane.py [--suite | --world 2 --sizes 65536,1048576] [--iters 20]
           [--pool-size 1] [--block-bytes N] [--socket-buffer N] [--gloo-inline]
           [--gloo /work/shared/bench/gloo_bench.py] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import HostSteal

from pccl.collectives.ring import DEFAULT_BLOCK_BYTES
from pccl.peer.pool import DEFAULT_SOCKET_BUFFER

DEFAULT_SIZES = [65536, 1048576, 16777216, 67108864]
SUITE = [(2, DEFAULT_SIZES), (3, [16777216]), (4, [16777216])]


def _worker(rank: int, world: int, sizes: list[int], iters: int, opts: dict[str, Any],
            addr_q: Any, table_q: Any, result_q: Any) -> None:
    import numpy as np
    import trio

    from pccl import PeerConfig, ReduceOp
    from pccl.collectives.executor import run_collective
    from pccl.peer.p2p import serve_p2p
    from pccl.peer.pool import P2PPool
    from pccl.transport import TcpTransport

    dist: Any = None
    torch: Any = None
    if opts["gloo_port"]:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        import datetime

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{opts['gloo_port']}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))

    async def main() -> None:
        config = PeerConfig()
        transport = TcpTransport()
        pool = P2PPool(transport=transport, my_peer_id=rank, pool_size=opts["pool_size"], config=config,
                       socket_buffer_bytes=opts["socket_buffer"])
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
                                     send=send, out=out, op=ReduceOp.SUM, block_bytes=opts["block_bytes"])

            one, one_out = np.ones(1, np.float32), np.empty(1, np.float32)

            async def barrier() -> None:
                if dist is not None:
                    dist.barrier()
                else:
                    await op(one, one_out)

            for _ in range(3):  # every incoming connection up, caches warm
                await op(one, one_out)
            results: dict[int, dict[str, float]] = {}
            for nbytes in sizes:
                x = np.random.default_rng(rank).random(nbytes // 4, dtype=np.float32)
                out = np.empty_like(x)
                xt = torch.from_numpy(x.copy()) if dist is not None else None
                wall: dict[str, list[float]] = {"pccl": [], "gloo": []}
                cpu: dict[str, list[float]] = {"pccl": [], "gloo": []}
                for _ in range(iters + 3):
                    await barrier()
                    t, c = time.perf_counter(), time.process_time()
                    await op(x, out)
                    wall["pccl"].append(time.perf_counter() - t)
                    cpu["pccl"].append(time.process_time() - c)
                    if dist is not None:
                        await barrier()
                        t, c = time.perf_counter(), time.process_time()
                        dist.all_reduce(xt)
                        wall["gloo"].append(time.perf_counter() - t)
                        cpu["gloo"].append(time.process_time() - c)
                results[nbytes] = {
                    f"{k}_{what}": statistics.median(v[3:])
                    for what, d in (("s", wall), ("cpu_s", cpu))
                    for k, v in d.items()
                    if v
                }
            await op(one, one_out)
            if rank == 0:
                result_q.put(results)
            await pool.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    if dist is not None:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world: int, sizes: list[int], iters: int, *, pool_size: int = 1,
              block_bytes: int = DEFAULT_BLOCK_BYTES, socket_buffer: int | None = DEFAULT_SOCKET_BUFFER,
              gloo_inline: bool = False) -> dict[int, dict[str, float]]:
    """Run one world size in fresh processes; medians (seconds) per size."""
    ctx = mp.get_context("spawn")
    addr_q, result_q = ctx.Queue(), ctx.Queue()
    table_qs = [ctx.Queue() for _ in range(world)]
    opts = {"pool_size": pool_size, "block_bytes": block_bytes, "socket_buffer": socket_buffer,
            "gloo_port": _free_port() if gloo_inline else 0}
    procs = [
        ctx.Process(target=_worker, args=(r, world, sizes, iters, opts, addr_q, table_qs[r], result_q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    table: dict[int, tuple[str, int]] = {}
    for _ in range(world):
        rank, addr = addr_q.get(timeout=300)
        table[rank] = tuple(addr)  # type: ignore[assignment]
    for q in table_qs:
        q.put(table)
    res: dict[int, dict[str, float]] = result_q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return res


def run_gloo(path: str, world: int, sizes: list[int], iters: int) -> dict[int, float]:
    """Run the shared Gloo reference in fresh processes; median seconds per size."""
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
    p.add_argument("--gloo-inline", action="store_true",
                   help="also time Gloo in the same processes, alternating with ours (needs torch)")
    p.add_argument("--gloo", help="path of gloo_bench.py to run afterwards in fresh processes")
    p.add_argument("--json")
    a = p.parse_args(argv)
    plan = SUITE if a.suite else [(a.world, [int(s) for s in a.sizes.split(",")])]
    rows: list[dict[str, Any]] = []
    for world, sizes in plan:
        with HostSteal() as steal:
            ours = run_world(world, sizes, a.iters, pool_size=a.pool_size, block_bytes=a.block_bytes,
                             socket_buffer=a.socket_buffer or None, gloo_inline=a.gloo_inline)
        ref = run_gloo(a.gloo, world, sizes, a.iters) if a.gloo else {}
        for nbytes in sizes:
            rows.append({"world": world, "bytes": nbytes, **ours[nbytes], "gloo_bench_s": ref.get(nbytes),
                         "steal_pct": steal.percent})
    print(f"pool_size={a.pool_size} block_bytes={a.block_bytes} socket_buffer={a.socket_buffer or 'auto'} "
          f"iters={a.iters}")
    head = f"{'world':>5} {'bytes':>10} {'pccl ms':>9} {'GB/s':>6}"
    if a.gloo_inline:
        head += f" {'gloo ms':>9} {'gloo/pccl':>9} {'pccl cpu':>9} {'gloo cpu':>9}"
    if a.gloo:
        head += f" {'gloo_bench ms':>13} {'ratio':>6}"
    head += f" {'steal %':>7}"
    print(head)
    for r in rows:
        gbps = r["bytes"] / r["pccl_s"] / 1e9
        line = f"{r['world']:>5} {r['bytes']:>10} {r['pccl_s'] * 1e3:9.3f} {gbps:6.2f}"
        if a.gloo_inline:
            line += (f" {r['gloo_s'] * 1e3:9.3f} {r['gloo_s'] / r['pccl_s']:9.2f}"
                     f" {r['pccl_cpu_s'] * 1e3:9.3f} {r['gloo_cpu_s'] * 1e3:9.3f}")
        if a.gloo:
            g = r["gloo_bench_s"]
            line += f" {g * 1e3:13.3f} {g / r['pccl_s']:6.2f}"
        line += f" {r['steal_pct']:7.0f}"
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
