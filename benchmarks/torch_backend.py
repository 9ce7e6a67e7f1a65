"""DDP step time on the pccl torch.distributed backend against Gloo, side by side, on loopback.

    python benchmarks/torch_backend.py                          # 2, 3, 4 processes; MLP 4 x 1024 (float32)
    python benchmarks/torch_backend.py --procs 2 --width 2048 --rounds 3

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import format_table, machine_line  # noqa: E402


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


def run_round(world: int, order: list[str], args: argparse.Namespace) -> dict[str, object]:
    from pccl.blocking import MasterNode

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp, MasterNode("127.0.0.1:0") as master:
        master.run()
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), str(world), master.address, f"{tmp}/store",
             ",".join(order), str(args.width), str(args.depth), str(args.batch), str(args.steps),
             str(args.warmup)], stdout=subprocess.PIPE, text=True, env=env) for r in range(world)]
        try:
            out, _ = procs[0].communicate(timeout=args.timeout)
            for p in procs[1:]:
                p.wait(timeout=args.timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs):
            raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
        return dict(json.loads(out.strip().splitlines()[-1]))


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
    args = p.parse_args()
    rows = []
    params = 0
    for world in args.procs:
        samples: dict[str, list[float]] = {"gloo": [], "pccl": []}
        for r in range(args.rounds):
            order = ["gloo", "pccl"] if r % 2 == 0 else ["pccl", "gloo"]
            res = run_round(world, order, args)
            params = int(res["params"])  # type: ignore[call-overload]
            for k, v in res["step_ms"].items():  # type: ignore[attr-defined]
                samples[k].append(float(v))
        g, q = statistics.median(samples["gloo"]), statistics.median(samples["pccl"])
        rounds = {k: " ".join(f"{v:.0f}" for v in vs) for k, vs in samples.items()}
        rows.append([world, f"{g:.1f}", f"{q:.1f}", f"{q / g:.2f}", rounds["gloo"], rounds["pccl"]])
    print(machine_line())
    print(f"DDP step (median ms), MLP {args.depth} x {args.width} float32 ({params * 4 / 2**20:.1f} MiB "
          f"of gradients), batch {args.batch} per rank, {args.steps} timed steps, {args.rounds} rounds, "
          "loopback")
    print(format_table(["procs", "gloo ms", "pccl ms", "pccl/gloo", "gloo rounds", "pccl rounds"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
