"""DiLoCo and streaming DiLoCo restarted from their checkpoints continue exactly: every peer saves at a
round's end, a new master and new peers resume from those files, and the result equals an uninterrupted
run (float64, within 1e-12; stateful inner optimizers, compression with error feedback)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from _torchrun_helpers import max_difference, state_bytes
from torch import nn

from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import AsyncDiLoCo, AsyncStreamingDiLoCo

D, N, H, BATCH, PEERS = 6, 96, 4, 12, 3


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    return x, torch.tanh(x @ torch.randn(D, 1, generator=g, dtype=torch.float64))


def make_run(kind: str, comm: Any, nursery: trio.Nursery, rounds: int, seed: int) -> tuple[Any, nn.Module]:
    """The cluster's peers are accepted together: none is a newcomer to a running group (just_joined)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    inner = torch.optim.AdamW(model.parameters(), lr=0.02)  # its moments must survive the restart

    def outer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.7, momentum=0.5, nesterov=True)

    if kind == "diloco":
        return AsyncDiLoCo(comm, model, inner, inner_steps=H, outer_optimizer=outer, total_outer_steps=rounds,
                           min_world_size=PEERS, just_joined=False), model
    return AsyncStreamingDiLoCo(comm, model, inner, nursery=nursery, inner_steps=H, fragments=2, overlap=1,
                                mixing=0.5, codec="int4", outer_optimizer=outer, total_outer_steps=rounds,
                                min_world_size=PEERS, just_joined=False), model


async def train(kind: str, comm: Any, rounds: int, *, seed: int, save: Path | None = None,
                resume: Path | None = None) -> Any:
    x, y = problem()
    async with trio.open_nursery() as nursery:
        run, model = make_run(kind, comm, nursery, rounds, seed)
        if resume is not None:
            run.resume(resume)

        def backward(step: Any) -> float:
            idx = torch.from_numpy(step.shard(BATCH, N))
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            return float(loss.detach())

        while (r := await run.step(backward)) is not None:
            if save is not None and (r.index + 1) % H == 0 and (r.index + 1) // H == rounds:
                run.save(save)  # at the round's end, before the call that ends the run
    return run


async def run_cluster(pccl_cluster: ClusterFactory, work: Callable[[int, Any], Any]) -> dict[int, Any]:
    cluster = await pccl_cluster(PEERS)
    out: dict[int, Any] = {}

    async def one(i: int) -> None:
        out[i] = await work(i, cluster.peer(i))

    async with trio.open_nursery() as nursery:
        for i in range(PEERS):
            nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("kind", ["diloco", "streaming-int4"])
async def test_a_run_restarted_from_its_checkpoints_continues_exactly(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, kind: str,
        tmp_path: Path) -> None:
    total, saved_at = 6, 3
    whole = await run_cluster(pccl_cluster, lambda i, c: train(kind, c, total, seed=i))
    files = {i: tmp_path / f"peer{i}.pt" for i in range(PEERS)}
    first = await run_cluster(pccl_cluster, lambda i, c: train(kind, c, saved_at, seed=i, save=files[i]))
    assert all(f.exists() for f in files.values())
    assert "local" in torch.load(files[0], weights_only=True)
    # new master, new peers (other seeds: nothing of their own start survives), each resumes its own file
    resumed = await run_cluster(pccl_cluster,
                                lambda i, c: train(kind, c, total, seed=10 + i, resume=files[i]))
    assert state_bytes(resumed[0].shared) == state_bytes(resumed[1].shared) == state_bytes(resumed[2].shared)
    assert max_difference(resumed[0].shared, whole[0].shared) < 1e-12
    # and the restart matters: the first part alone is far from the whole run
    assert max_difference(first[0].shared, whole[0].shared) > 1e-3
