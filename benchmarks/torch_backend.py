"""DDP step time on the pccl torch.distributed backend against Gloo, side by side, on loopback or a WAN.

    python benchmarks/torch_backend.py                          # 2, 3, 4 processes; MLP 4 x 1024 (float32)
    python benchmarks/torch_backend.py --procs 2 --width 2048 --rounds 3
    sudo python benchmarks/torch_backend.py --wan 50 --procs 2 --steps 5   # emulated 50 ms RTT, 1000 Mbit/s

``--wan RTT_MS`` runs every round on a fresh :class:`pccl.testing.wan.WanEmulator` (root only; see
docs/testing.md): one host (network namespace) per rank, every pair joined by links of that round trip
and ``--rate-mbit``; our master runs on host 0 (``python -m pccl master``), Gloo's ranks use the
``wan0`` device (``GLOO_SOCKET_IFNAME``) and the same file:// store.

Every rank is its own process. In each round the same processes run the same DDP training twice, once
per backend (the order alternates between rounds: A/B interleaved): ``init_process_group`` (Gloo on a
file:// store, pccl on a fresh master), ``DistributedDataParallel(model)`` with DDP's defaults (25 MiB
buckets, the default all-reduce hook), ``--warmup`` untimed steps, then ``--steps`` timed steps of
forward, backward (which runs the bucketed all-reduces) and ``optimizer.step()``. Rank 0 reports the
median step time; the table shows, per process count, the median over the rounds and pccl / Gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import end_processes, format_table, machine_line, wait_listening  # noqa: E402


def worker(rank: int, world: int, master: str, store: str, order: list[str], width: int, depth: int,
           batch: int, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import pccl.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    result = {}
    for backend in order:
        init = f"file://{store}.{backend}" if backend == "gloo" else f"pccl://{master}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        x = torch.randn(batch, width)
        y = torch.randn(batch, 1)
        times = []
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            if step >= warmup:
                times.append(time.perf_counter() - t0)
        result[backend] = statistics.median(times) * 1e3
        params = sum(p.numel() for p in model.parameters())
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"step_ms": result, "params": params}), flush=True)


WAN_MASTER_PORT = 29_410

def _run_workers(world: int, order: list[str], args: argparse.Namespace, master: str, store: str,
                 spawn: Callable[[int, list[str]], subprocess.Popen[str]]) -> dict[str, object]:
    """Start rank r with ``spawn(r, argv)``; rank 0's result line."""
    shape = [str(args.width), str(args.depth), str(args.batch), str(args.steps), str(args.warmup)]
    procs = [spawn(r, [sys.executable, __file__, "--worker", str(r), str(world), master, store,
                       ",".join(order), *shape]) for r in range(world)]
    try:
        out, _ = procs[0].communicate(timeout=args.timeout)
        for p in procs[1:]:
            p.wait(timeout=args.timeout)
    finally:
        end_processes(procs)
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def run_round(world: int, order: list[str], args: argparse.Namespace) -> dict[str, object]:
    from pccl.blocking import MasterNode

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def spawn(rank: int, argv: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)

    with tempfile.TemporaryDirectory() as tmp, MasterNode("127.0.0.1:0") as master:
        master.run()
        return _run_workers(world, order, args, master.address, f"{tmp}/store", spawn)


def run_wan_round(world: int, order: list[str], args: argparse.Namespace) -> dict[str, object]:
    """One round on a fresh emulated WAN: rank r on host r, our master on host 0."""
    from pccl.testing.wan import WanEmulator

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               GLOO_SOCKET_IFNAME="wan0", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as tmp, WanEmulator(world) as wan:
        wan.set_all(rtt_ms=args.wan, rate_mbit=args.rate_mbit)
        log = Path(tmp) / "master.log"
        with log.open("w") as f:
            argv = [sys.executable, "-m", "pccl", "master", "--host", wan.addresses[0], "--port",
                    str(WAN_MASTER_PORT)]
            master = wan.popen(0, argv, stdout=subprocess.DEVNULL, stderr=f, env=env)
        try:
            if not wait_listening(master, log):
                raise SystemExit(f"our master did not start:\n{log.read_text()[-2000:]}")

            def spawn(rank: int, argv: list[str]) -> subprocess.Popen[str]:
                return wan.popen(rank, argv, stdout=subprocess.PIPE, text=True, env=env)

            res = _run_workers(world, order, args, f"{wan.addresses[0]}:{WAN_MASTER_PORT}",
                               f"{tmp}/store", spawn)
            links = wan.stats()["links"]  # what crossed the emulated links (both backends, all directions)
            res["wan_mib"] = sum(x["bytes"] for x in links) / 2**20
            res["wan_dropped"] = sum(x["queue_dropped_segments"] + x["lost_segments"] for x in links)
            return res
        finally:
            end_processes((), master)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(int(a[0]), int(a[1]), a[2], a[3], a[4].split(","), int(a[5]), int(a[6]), int(a[7]), int(a[8]),
               int(a[9]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--wan", type=float, metavar="RTT_MS",
                   help="run over the WAN emulator (root only) with this round trip between every two ranks")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="the emulated links' rate (with --wan)")
    args = p.parse_args()
    if args.wan is not None:
        from pccl.testing.wan import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            print(f"skipped: {reason}")
            return 0
    one_round = run_round if args.wan is None else run_wan_round
    rows = []
    params = 0
    wan_notes = []
    for world in args.procs:
        samples: dict[str, list[float]] = {"gloo": [], "pccl": []}
        for r in range(args.rounds):
            order = ["gloo", "pccl"] if r % 2 == 0 else ["pccl", "gloo"]
            res = one_round(world, order, args)
            params = int(res["params"])  # type: ignore[call-overload]
            for k, v in res["step_ms"].items():  # type: ignore[attr-defined]
                samples[k].append(float(v))
            if "wan_mib" in res:
                wan_notes.append(f"{world} procs round {r}: {res['wan_mib']:.0f} MiB over the links, "
                                 f"{res['wan_dropped']} segments dropped")
        g, q = statistics.median(samples["gloo"]), statistics.median(samples["pccl"])
        rounds = {k: " ".join(f"{v:.0f}" for v in vs) for k, vs in samples.items()}
        rows.append([world, f"{g:.1f}", f"{q:.1f}", f"{q / g:.2f}", rounds["gloo"], rounds["pccl"]])
    print(machine_line() if args.wan is None else
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; each rank in its own network "
          "namespace")
    print(f"DDP step (median ms), MLP {args.depth} x {args.width} float32 ({params * 4 / 2**20:.1f} MiB "
          f"of gradients), batch {args.batch} per rank, {args.steps} timed steps, {args.rounds} rounds, "
          + ("loopback" if args.wan is None else
             f"emulated WAN (every pair {args.wan:g} ms RTT, {args.rate_mbit:g} Mbit/s)"))
    print(format_table(["procs", "gloo ms", "pccl ms", "pccl/gloo", "gloo rounds", "pccl rounds"], rows))
    for note in wan_notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
