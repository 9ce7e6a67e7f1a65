"""Join latency: from the ``open_communicator(...)`` call to *accepted*, with N peers already in the run.

The N existing peers are separate OS processes running the membership step of the training-loop recipe in a
loop: ``if await comm.are_peers_pending(): await comm.update_topology()`` (``--step-ms`` adds a pause per
iteration, standing in for a training step; 0 means a tight loop). The master is a separate process too.

Two measurements per N:

* ``call -> accepted``: the joiner runs in-process (in this driver). The clock starts right before
  ``open_communicator(...)`` and stops when the block is entered (the peer is accepted and has the ring
  table). It then leaves again, so every join sees the same N. With ``--op-bytes`` the existing peers'
  loop also all-reduces that many bytes per iteration (a training step's collective), the joiner
  all-reduces once as soon as it is accepted, and ``call -> first all-reduce`` is timed too: what a
  joiner takes to be of use, including the connections its first operation needs.
* ``process start -> accepted``: a fresh joiner process per sample (interpreter start + imports + join),
  the figure comparable to the established library's 170-220 ms; ``python + import pccl`` is the part of
  it spent before ``open_communicator`` can even be called (a process that only imports the library,
  timed under the same load).

``--schedule`` sets ``PeerConfig.schedule`` of every peer: under ``auto`` (the default) a topology round
also opens the connections to every halving-doubling and tree partner of the new ring, under ``ring``
only the ring successor's (docs/history/benchmarks-join.md "Join latency").

usage: python benchmarks/join.py [--peers 1,4,8,16] [--joins 15] [--proc-joins 3] [--step-ms 0]
                                 [--schedule auto|ring|hd|tree] [--op-bytes 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from pccl import PCCLError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

# ----------------------------------------------------------------------------------------------
# children


async def _existing_peer(cfg: dict[str, Any]) -> None:
    from pccl.peer.communicator import open_communicator

    async with open_communicator(cfg["master"], config=c.peer_config(schedule=cfg["schedule"])) as comm:
        c.emit("accepted", peer=comm.peer_id, world=comm.world_size)
        last = comm.world_size
        x = np.ones(cfg["op_bytes"] // 4, np.float32)
        while True:
            await c.admit_pending(comm)
            if comm.world_size != last:
                last = comm.world_size
                c.emit("world", peer=comm.peer_id, world=last)
            if x.size and comm.world_size > 1:
                # the training step's all-reduce (a joiner that leaves during one fails it: next step)
                with contextlib.suppress(PCCLError):
                    await comm.all_reduce(x)
            if cfg["step_ms"] > 0:
                await trio.sleep(cfg["step_ms"] / 1000)


async def _joiner_process(cfg: dict[str, Any]) -> None:
    from pccl.peer.communicator import open_communicator

    t0 = time.monotonic()
    async with open_communicator(cfg["master"], config=c.peer_config(schedule=cfg["schedule"])) as comm:
        c.emit("accepted", peer=comm.peer_id, world=comm.world_size, t_call=t0)


def child_main(cfg: dict[str, Any]) -> int:
    c.child_setup()
    fn = {"existing": _existing_peer, "joiner": _joiner_process}[cfg["role"]]
    trio.run(fn, cfg)
    return 0


# ----------------------------------------------------------------------------------------------
# driver


async def _join_once(address: str, schedule: str, op_bytes: int) -> tuple[float, float, int]:
    """One join: seconds to accepted, seconds to the end of the first all-reduce (nan without
    ``op_bytes``), and the world size seen."""
    from pccl.peer.communicator import open_communicator

    t0 = time.perf_counter()
    first_op = float("nan")
    async with open_communicator(address, config=c.peer_config(schedule=schedule)) as comm:
        dt = time.perf_counter() - t0
        world = comm.world_size
        if op_bytes:
            x = np.ones(op_bytes // 4, np.float32)
            for attempt in range(3):
                try:
                    await comm.all_reduce(x)
                    break
                except PCCLError:
                    if attempt == 2:
                        raise
            first_op = time.perf_counter() - t0
    return dt, first_op, world


async def run(args: argparse.Namespace) -> list[list[Any]]:
    counts = sorted({int(x) for x in args.peers.split(",")})
    script = Path(__file__).resolve()
    rows: list[list[Any]] = []
    async with c.open_cluster(keep_logs=args.keep_logs) as cluster:
        master = await cluster.start_master()
        existing = 0
        for n in counts:
            while existing < n:
                await cluster.spawn(f"existing{existing}", c.script_argv(script, {
                    "role": "existing", "master": master.address, "step_ms": args.step_ms,
                    "schedule": args.schedule, "op_bytes": args.op_bytes}))
                existing += 1
                await cluster.wait_for(lambda ch, m: m.get("event") == "accepted", 60, "an existing peer")
            await trio.sleep(0.3)  # let the ring settle before timing
            times: list[float] = []
            op_times: list[float] = []
            for j in range(args.joins + 1):
                dt, first_op, world = await _join_once(master.address, args.schedule, args.op_bytes)
                if world != n + 1:
                    raise RuntimeError(f"joiner saw world size {world}, expected {n + 1}")
                if j > 0:  # the first join warms up this process's code paths
                    times.append(dt)
                    op_times.append(first_op)
                await trio.sleep(0.1)  # let the master process the leave before the next join
            proc_times: list[float] = []
            for j in range(args.proc_joins):
                t_spawn = time.monotonic()
                await cluster.spawn(f"joiner{n}_{j}", c.script_argv(script, {
                    "role": "joiner", "master": master.address, "schedule": args.schedule}))
                _, msg = await cluster.wait_for(
                    lambda ch, m, name=f"joiner{n}_{j}": ch.name == name and m.get("event") == "accepted",
                    60, "a joiner process")
                proc_times.append(msg["t"] - t_spawn)
                await trio.sleep(0.1)
            imports: list[float] = []
            for _ in range(args.proc_joins):
                # What a process spends before it can call open_communicator at all, under the same load.
                t = time.monotonic()
                await trio.run_process([sys.executable, "-c", "import pccl.peer.communicator"],
                                       env=c.child_env())
                imports.append(time.monotonic() - t)
            first = c.median_ms(op_times) if args.op_bytes else float("nan")
            rows.append([n, c.median_ms(times), min(times) * 1e3, max(times) * 1e3, first, len(times),
                         c.median_ms(proc_times) if proc_times else float("nan"),
                         c.median_ms(imports) if imports else float("nan")])
            print(f"  N={n}: call->accepted median {c.median_ms(times):.2f} ms "
                  f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}); "
                  f"call->first all-reduce median {first:.2f} ms; "
                  f"process start->accepted {c.median_ms(proc_times) if proc_times else float('nan'):.0f} ms",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--peers", default="1,4,8,16", help="existing peer counts (comma separated)")
    p.add_argument("--joins", type=int, default=15, help="in-process joins per count (median)")
    p.add_argument("--proc-joins", type=int, default=3, help="joiner processes per count (0 to skip)")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="pause per iteration of the existing peers' loop (0: tight loop)")
    p.add_argument("--schedule", choices=("auto", "ring", "hd", "tree"), default="auto",
                   help="PeerConfig.schedule of every peer (default auto)")
    p.add_argument("--op-bytes", type=c.parse_size, default=0,
                   help="the existing peers all-reduce this many bytes of float32 per loop iteration, and "
                        "each in-process joiner once right after it is accepted: the call->first all-reduce "
                        "column (K/M suffixes; 0, the default: no all-reduce)")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    print(f"join latency; {c.machine_line()}; existing peers: OS processes (loop step {args.step_ms:g} ms); "
          "joiner: in-process trio task", flush=True)
    rows = trio.run(run, args)
    print()
    print(c.format_table(["existing peers", "call->accepted median ms", "min ms", "max ms",
                          "call->first all-reduce median ms", "joins",
                          "process start->accepted median ms", "python + import pccl ms"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
