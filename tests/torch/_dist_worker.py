"""One process of the torch.distributed backend tests (tests/torch/test_torch_distributed.py).

    python _dist_worker.py SCENARIO RANK WORLD MASTER STORE OUT [ARGS...]

``collectives`` and ``ddp`` run the same code on Gloo (file:// store) and then on pccl in this process and
save both results to OUT (torch.save) for the test to compare. ``manager`` trains with the pccl Manager on a
ProcessGroupPCCL made directly (``DistributedDataParallel(process_group=pg)``); the victim rank SIGKILLs
itself in its comm hook mid-step, and rank 0 writes ``STORE`` once the survivors have committed a step
after the loss (the test then starts a newcomer, RANK -1).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pccl.torch  # noqa: F401  (registers the backend)
from pccl.torch import SharedModel, global_batch_indices, shard_indices
from pccl.torch.distributed import Manager, PeerLostError, ProcessGroupPCCL, UnsupportedOperationError

GLOBAL_BATCH = 24  # divisible by 1, 2, 3, 4: every shard has the same size


def data(n: int = 96, d: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, 1, generator=g, dtype=torch.float64)
    return x, torch.sin(x @ w)


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def collectives(rank: int, n: int) -> dict[str, Any]:
    """The same calls on whatever backend the default group has; returns every result by name."""
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(100 + rank)
    ints = torch.randint(-50, 50, (37,), generator=g, dtype=torch.int64)
    exact = torch.randint(-1000, 1000, (37,), generator=g).double()  # float64 sums without rounding
    floats = torch.randn(37, generator=g, dtype=torch.float64)
    f32 = torch.randn(37, generator=g, dtype=torch.float32)
    for name, t in (("int64", ints), ("exact64", exact), ("float64", floats), ("float32", f32)):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            if op == "PRODUCT" and name != "int64":
                continue
            r = t.clone()
            dist.all_reduce(r, op=getattr(dist.ReduceOp, op))
            out[f"all_reduce/{name}/{op}"] = r
    b = ints.clone() if rank == 1 else torch.zeros_like(ints)
    dist.broadcast(b, src=1)
    out["broadcast/int64"] = b
    bf = f32.clone()
    dist.broadcast(bf, src=n - 1)
    out["broadcast/float32"] = bf
    gl = [torch.zeros(5, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(gl, floats[:5].clone())
    out["all_gather/float64"] = torch.stack(gl)
    gt = torch.zeros(n * 7, dtype=torch.int64)
    dist.all_gather_into_tensor(gt, ints[:7].clone())
    out["all_gather_into_tensor/int64"] = gt
    rs_in = torch.randint(-9, 9, (n * 4,), generator=g, dtype=torch.int64)
    rs = torch.zeros(4, dtype=torch.int64)
    dist.reduce_scatter_tensor(rs, rs_in.clone())
    out["reduce_scatter_tensor/int64/SUM"] = rs
    rs_list = torch.zeros(4, dtype=torch.int64)
    dist.reduce_scatter(rs_list, list(rs_in.clone().chunk(n)), op=dist.ReduceOp.MAX)
    out["reduce_scatter/int64/MAX"] = rs_list
    red = ints.clone()
    dist.reduce(red, dst=0)
    if rank == 0:
        out["reduce/int64/root"] = red
    for op in ("SUM", "MAX"):  # float64 with integer values (sums without rounding), root not rank 0
        red64 = exact.clone()
        dist.reduce(red64, dst=n - 1, op=getattr(dist.ReduceOp, op))
        if rank == n - 1:
            out[f"reduce/exact64/{op}/root"] = red64
    a2a = torch.zeros(n * 3, dtype=torch.int64)
    dist.all_to_all_single(a2a, torch.arange(n * 3, dtype=torch.int64) + 100 * rank)
    out["all_to_all_single/even"] = a2a
    # unequal splits: rank r sends r+1+j rows to rank j
    in_splits = [rank + 1 + j for j in range(n)]
    out_splits = [s + 1 + rank for s in range(n)]
    src = torch.arange(sum(in_splits) * 2, dtype=torch.float64).reshape(-1, 2) + 1000 * rank
    dst = torch.zeros(sum(out_splits), 2, dtype=torch.float64)
    dist.all_to_all_single(dst, src, out_splits, in_splits)
    out["all_to_all_single/uneven"] = dst
    lists_out = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
    dist.all_to_all(lists_out, [torch.full((2,), 10 * rank + j, dtype=torch.int64) for j in range(n)])
    out["all_to_all/list"] = torch.stack(lists_out)
    c1, c2 = exact.clone(), (exact[:11] * 3).clone()  # Gloo coalesces one dtype
    with dist._coalescing_manager(async_ops=True) as cm:  # type: ignore[attr-defined]
        dist.all_reduce(c1)
        dist.all_reduce(c2)
    cm.wait()
    out["coalesced/all_reduce"] = (c1, c2)
    w = dist.all_reduce(exact.clone(), async_op=True)
    assert w is not None
    w.wait()
    fut = dist.all_reduce(ints.clone(), async_op=True).get_future()  # type: ignore[union-attr]
    out["async/future"] = fut.wait()[0]
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(n)] if rank == 0 else None
    dist.gather(ints[:3].clone(), gathered, dst=0)
    if rank == 0:
        out["gather/int64/root"] = torch.stack(gathered)  # type: ignore[arg-type]
    sc = torch.zeros(4, dtype=torch.float64)
    dist.scatter(sc, [floats[4 * j:4 * j + 4].clone() for j in range(n)] if rank == 1 else None, src=1)
    out["scatter/float64"] = sc
    dist.barrier()
    return out


def pccl_only(rank: int, n: int) -> dict[str, Any]:
    """What Gloo cannot be compared on: AVG, unsupported calls."""
    out: dict[str, Any] = {}
    t = torch.arange(6, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["all_reduce/float64/AVG"] = t
    mine = torch.arange(5, dtype=torch.int64) + 10 * rank
    red = mine.clone()
    dist.reduce(red, dst=1)
    total = torch.arange(5, dtype=torch.int64) * n + 10 * sum(range(n))
    out["reduce/kept_off_root"] = torch.equal(red, total if rank == 1 else mine)
    for call, fn in (("send", lambda: dist.send(torch.zeros(1), dst=(rank + 1) % n)),
                     ("recv", lambda: dist.recv(torch.zeros(1), src=(rank + 1) % n)),
                     ("BAND", lambda: dist.all_reduce(torch.zeros(1, dtype=torch.int64),
                                                      op=dist.ReduceOp.BAND)),
                     ("new_group", lambda: dist.new_group(list(range(n)), backend="pccl"))):
        try:
            fn()
            out[f"unsupported/{call}"] = "no error"
        except (UnsupportedOperationError, RuntimeError) as exc:
            out[f"unsupported/{call}"] = f"{type(exc).__name__}: {exc}"
    return out


def train_ddp(rank: int, n: int, steps: int, make: Callable[[nn.Module], nn.Module],
              ) -> dict[str, torch.Tensor]:
    """DDP on the default group: SGD with momentum, each rank on its shard of the step's global batch."""
    x, y = data()
    model = mlp(seed=0)
    ddp = make(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        idx = torch.from_numpy(shard_indices(step, GLOBAL_BATCH, len(x), rank, n))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_fsdp(rank: int, n: int, steps: int) -> dict[str, torch.Tensor]:
    """FSDP2 (fully_shard per layer and on the root) on a 1-D CPU mesh of the default group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x, y = data()
    mesh = init_device_mesh("cpu", (n,))
    model = mlp(seed=0)
    for layer in list(model.modules()):
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        idx = torch.from_numpy(shard_indices(step, GLOBAL_BATCH, len(x), rank, n))
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]


def manager_run(rank: int, world: int, master: str, marker: str, total: int, kill_at: int,
                victim: int) -> dict[str, Any]:
    x, y = data()
    pg = ProcessGroupPCCL(master, rank=rank, world_size=world)
    model = mlp(seed=0 if rank >= 0 else 7)  # the newcomer starts from other weights: healing must fix them
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shared = SharedModel(model, opt)
    mgr = Manager(shared, process_group=pg)
    ddp = mgr.wrap(model)
    if rank == victim:
        def die(grad: torch.Tensor) -> torch.Tensor:
            if mgr.step == kill_at:  # mid-backward: its peers wait for it in the gradients' all-reduce
                os.kill(os.getpid(), signal.SIGKILL)
            return grad

        first = model[0]  # type: ignore[index]
        first.weight.register_hook(die)
    log: list[tuple[int, int, int, bool]] = []
    first_rx = -1
    while mgr.step < total:
        mgr.start_step()
        if first_rx < 0:
            first_rx = mgr.last_sync_rx_bytes
        step = mgr.step
        idx = torch.from_numpy(shard_indices(step, GLOBAL_BATCH, len(x), mgr.rank, mgr.world_size))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[idx]), y[idx]).backward()
        committed = mgr.should_commit()
        if committed:
            opt.step()
        log.append((step, mgr.rank, mgr.world_size, committed))
        print(f"step {step} rank {mgr.rank}/{mgr.world_size} committed {committed} "
              f"checksum {sum(float(p.double().sum()) for p in model.parameters())!r}", flush=True)
        if committed and step == kill_at + 2 and rank >= 0:
            mgr.min_world_size = 3  # the survivors wait for the newcomer before the next step
            if rank == 0:
                with open(marker, "w") as f:
                    f.write("go")
    result = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "log": log,
              "first_sync_rx": first_rx, "step": mgr.step}
    pg.close()
    return result


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process on the whole global batches: what every data-parallel run must compute."""
    x, y = data()
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        idx = torch.from_numpy(global_batch_indices(step, GLOBAL_BATCH, len(x)))
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(argv: list[str]) -> int:
    scenario, rank, n, master, store, out_path = argv[:6]
    r, world = int(rank), int(n)
    result: dict[str, Any] = {}
    if scenario in ("collectives", "ddp"):
        runs = [("gloo", f"file://{store}"), ("pccl", f"pccl://{master}")]
        for backend, init in runs:
            dist.init_process_group(backend, init_method=init, rank=r, world_size=world)
            assert dist.get_rank() == r and dist.get_world_size() == world
            if scenario == "collectives":
                result[backend] = collectives(r, world)
                if backend == "pccl":
                    result["pccl_only"] = pccl_only(r, world)
            else:
                steps = int(argv[6])
                result[backend] = train_ddp(r, world, steps, lambda m: nn.parallel.DistributedDataParallel(m))
                result[f"{backend}_fsdp"] = train_fsdp(r, world, steps)
                if backend == "pccl":
                    result["reference"] = reference(steps)
                    # DistributedDataParallel(process_group=pg), given the group object
                    pg = dist.group.WORLD
                    assert isinstance(pg, ProcessGroupPCCL)
                    result["pccl_pg"] = train_ddp(
                        r, world, steps, lambda m: nn.parallel.DistributedDataParallel(m, process_group=pg))
            dist.destroy_process_group()
    elif scenario == "manager":
        total, kill_at, victim = (int(a) for a in argv[6:9])
        result = manager_run(r, world, master, store, total, kill_at, victim)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    torch.save(result, out_path)
    return 0


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows its stacks in the test's log
    try:
        sys.exit(main(sys.argv[1:]))
    except PeerLostError as exc:
        print(f"peer lost: {exc}", file=sys.stderr)
        sys.exit(3)
