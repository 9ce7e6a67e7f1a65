#!/usr/bin/env python3
"""64 MB float32 all-reduce with and without uint8 quantization: on a 1 Gbit/s virtual link and on loopback.

usage: python benchmarks/quantization.py [--mb 64] [--iters 5] [--gbit 1.0]

* virtual: two peers in one process on pccl.testing.VirtualNetwork with every link limited to
  ``--gbit`` Gbit/s, real clock (so quantization's CPU cost counts too);
* loopback: a master and two peer processes over real TCP on 127.0.0.1.

The established library: 72 ms quantized vs 64 ms plain for 16 MB on loopback here; on a slow link
quantization must win by close to 4x.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np

from pccl import DataType, QuantizationAlgorithm, QuantizationOptions

Q8 = QuantizationOptions(quantized_datatype=DataType.UINT8, algorithm=QuantizationAlgorithm.MIN_MAX)


def virtual(mb: int, iters: int, gbit: float) -> dict[str, float]:
    import trio

    from pccl.testing import VirtualNetwork, open_test_cluster

    res: dict[str, float] = {}

    async def main() -> None:
        net = VirtualNetwork(latency=0.0005, bandwidth=gbit * 1e9 / 8)
        async with open_test_cluster(2, network=net) as cl:
            count = mb * 1024 * 1024 // 4
            xs = [np.random.default_rng(i).random(count, dtype=np.float32) for i in range(2)]
            for name, q in (("plain", None), ("uint8", Q8)):
                times = []
                for _ in range(iters + 1):
                    t0 = time.perf_counter()
                    async with trio.open_nursery() as n:
                        for c, x in zip(cl.peers, xs, strict=True):
                            n.start_soon(lambda c=c, x=x: c.all_reduce(x, quantization=q))
                    times.append(time.perf_counter() - t0)
                res[name] = statistics.median(times[1:])

    trio.run(main)
    return res


def _master(q: Any, stop: Any) -> None:
    import trio

    from pccl.master.server import MasterServer

    async def main() -> None:
        async with trio.open_nursery() as n:
            addr = await n.start(MasterServer().serve, "127.0.0.1", 0)
            q.put(addr[1])
            while not stop.is_set():
                await trio.sleep(0.05)
            n.cancel_scope.cancel()

    trio.run(main)


def _peer(port: int, mb: int, iters: int, out: Any) -> None:
    import trio

    import pccl

    async def main() -> None:
        cfg = pccl.PeerConfig(p2p_listen_host="127.0.0.1")
        async with pccl.open_communicator(f"127.0.0.1:{port}", config=cfg) as comm:
            while comm.world_size < 2:
                if await comm.are_peers_pending():
                    await comm.update_topology()
                else:
                    await trio.sleep(0.01)
            await comm.update_topology()
            x = np.random.default_rng(comm.peer_id).random(mb * 1024 * 1024 // 4, dtype=np.float32)
            res = {}
            for name, q in (("plain", None), ("uint8", Q8)):
                times = []
                for _ in range(iters + 1):
                    await comm.all_reduce(np.ones(1, np.float32))  # align the peers
                    t0 = time.perf_counter()
                    await comm.all_reduce(x, quantization=q)
                    times.append(time.perf_counter() - t0)
                res[name] = statistics.median(times[1:])
            out.put(res)

    trio.run(main)


def loopback(mb: int, iters: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    pq, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    m = ctx.Process(target=_master, args=(pq, stop), daemon=True)
    m.start()
    port = pq.get(timeout=60)
    ps = [ctx.Process(target=_peer, args=(port, mb, iters, out), daemon=True) for _ in range(2)]
    for p in ps:
        p.start()
    results = [out.get(timeout=300) for _ in ps]
    for p in ps:
        p.join(timeout=30)
    stop.set()
    m.join(timeout=10)
    return {k: max(r[k] for r in results) for k in results[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gbit", type=float, default=1.0)
    a = ap.parse_args(argv)
    rows = [
        (f"virtual {a.gbit:g} Gbit/s", virtual(a.mb, a.iters, a.gbit)),
        ("loopback TCP", loopback(a.mb, a.iters)),
    ]
    print(f"{a.mb} MB float32 all-reduce, 2 peers, medians")
    print(f"{'link':>22} {'plain ms':>10} {'uint8 ms':>10} {'speed-up':>9}")
    for name, r in rows:
        plain, q8 = r["plain"], r["uint8"]
        print(f"{name:>22} {plain * 1e3:>10.1f} {q8 * 1e3:>10.1f} {plain / q8:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
