#!/usr/bin/env python3
"""Wall time of ``optimize_topology()`` on loopback, real processes, for several world sizes.

usage: python benchmarks/topology.py [--worlds 2,3,4,8] [--probe 0.05]

Each world: a master process and n peer processes; the peers join, then all call
``optimize_topology()`` together (first call: every directed link is measured; second call: the
cached matrix is reused). Prints the slowest peer's wall time for both calls.
The established library spends about 10 s per link (23.7 s for 3 peers on this machine).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any


def _master(port_q: Any, stop: Any, probe: float) -> None:
    import trio

    from pccl.master.server import MasterServer

    async def main() -> None:
        server = MasterServer()
        server.state.bandwidth_probe_seconds = probe
        async with trio.open_nursery() as n:
            addr = await n.start(server.serve, "127.0.0.1", 0)
            port_q.put(addr[1])
            while not stop.is_set():
                await trio.sleep(0.05)
            n.cancel_scope.cancel()

    trio.run(main)


def _peer(port: int, n: int, out_q: Any) -> None:
    import numpy as np
    import trio

    import pccl
    from pccl import PeerConfig

    async def main() -> None:
        cfg = PeerConfig(p2p_listen_host="127.0.0.1")
        async with pccl.open_communicator(f"127.0.0.1:{port}", config=cfg) as comm:
            while comm.world_size < n:
                if await comm.are_peers_pending():
                    await comm.update_topology()
                else:
                    await trio.sleep(0.01)
            # the last joiner may not have voted yet: one more collective round aligns everyone
            await comm.update_topology()
            await comm.all_reduce(np.ones(1, np.float32))
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                await comm.optimize_topology()
                times.append(time.perf_counter() - t0)
                await comm.all_reduce(np.ones(1, np.float32))
            out_q.put(times)

    trio.run(main)


def run_world(n: int, probe: float) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    port_q, out_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    master = ctx.Process(target=_master, args=(port_q, stop, probe), daemon=True)
    master.start()
    port = port_q.get(timeout=60)
    peers = []
    for _ in range(n):
        p = ctx.Process(target=_peer, args=(port, n, out_q), daemon=True)
        p.start()
        peers.append(p)
        time.sleep(0.05)  # join one by one (spacing process start-up only; not a synchronization)
    results = [out_q.get(timeout=120) for _ in range(n)]
    for p in peers:
        p.join(timeout=30)
    stop.set()
    master.join(timeout=10)
    first = max(r[0] for r in results)
    second = max(r[1] for r in results)
    return first, second


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--worlds", default="2,3,4,8")
    ap.add_argument("--probe", type=float, default=0.05, help="seconds per link probe")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args(argv)
    print(f"{'peers':>5} {'links':>6} {'1st call (measure) s':>21} {'2nd call (cached) s':>20}")
    for n in [int(x) for x in a.worlds.split(",")]:
        runs = [run_world(n, a.probe) for _ in range(a.repeat)]
        f = statistics.median(r[0] for r in runs)
        s = statistics.median(r[1] for r in runs)
        print(f"{n:>5} {n * (n - 1):>6} {f:>21.3f} {s:>20.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
