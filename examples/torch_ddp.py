"""A plain torch DistributedDataParallel training script that runs on pccl (or on Gloo, unchanged).

    pccl run -n 3 examples/torch_ddp.py                      # pccl: a master and 3 processes
    torchrun --nproc-per-node 3 examples/torch_ddp.py --backend gloo

The only pccl lines are the import that registers the backend and ``init_method="pccl://"`` (the master's
address, the rank and the world size come from the variables ``pccl run`` sets: PCCL_MASTER, PCCL_RANK,
PCCL_WORLD_SIZE). Everything else is ordinary DDP: ``init_process_group``, ``DistributedDataParallel``,
a per-rank shard of every batch, ``dist.all_reduce`` of the loss for the log, ``dist.barrier()``.

The script trains a small MLP regression in float64 and checks at the end, with ``dist.all_gather``, that
every rank holds the same parameters (exit 1 otherwise); rank 0 prints the loss every few steps.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="pccl", help="pccl (default) or gloo")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=48, help="global batch size (divisible by the world size)")
    p.add_argument("--short", action="store_true", help="a few steps (what the tests run)")
    args = p.parse_args(argv)
    steps = 5 if args.short else args.steps

    if args.backend == "pccl":
        import pccl.torch  # noqa: F401  (registers the "pccl" backend)

        if not os.environ.get("PCCL_MASTER"):  # started with plain python: say how to launch it
            p.error("no PCCL_MASTER: start it with 'pccl run -n 3 examples/torch_ddp.py' (or torchrun "
                    "--nproc-per-node 3 with --backend gloo)")

        dist.init_process_group("pccl", init_method="pccl://")
    else:
        dist.init_process_group(args.backend)  # torchrun's env://
    rank, world = dist.get_rank(), dist.get_world_size()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g, dtype=torch.float64)
    y = torch.sin(x @ torch.randn(16, 1, generator=g, dtype=torch.float64) * 0.25)
    torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    per_rank = args.batch // world
    for step in range(steps):
        batch = torch.randperm(len(x), generator=torch.Generator().manual_seed(step))[: args.batch]
        mine = batch[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[mine]), y[mine])
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.SUM)
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {float(logged) / world:.5f}  world {world}", flush=True)

    dist.barrier()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(everyone[0], other) for other in everyone)
    if rank == 0:
        print(f"{args.backend}: {world} ranks, {steps} steps, parameters identical on every rank: {same}")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
