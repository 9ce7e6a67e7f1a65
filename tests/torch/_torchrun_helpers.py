"""Models, data and reference (single-process) training for the pccl.torch tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pccl.testing import MASTER, HookAction, Reset, TestCluster, TrafficEvent, tensor_bytes
from pccl.torch import SharedModel, Step, StepResult, global_batch_indices


def integer_data(n: int = 48, d: int = 4, dtype: torch.dtype = torch.float64, seed: int = 0,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Small integers: with dyadic weights and a power-of-two batch every float64 op is exact."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, d), generator=g).to(dtype)
    y = torch.randint(-3, 4, (n, 1), generator=g).to(dtype)
    return x, y


def linear_model(dtype: torch.dtype = torch.float64, d: int = 4, *, scramble: int | None = None) -> nn.Module:
    """nn.Linear(d, 1) with dyadic weights (or random ones with ``scramble`` as the seed)."""
    m = nn.Linear(d, 1, dtype=dtype)
    with torch.no_grad():
        if scramble is None:
            m.weight.copy_(torch.arange(d, dtype=dtype).reshape(1, d) / 8 - 0.25)
            m.bias.fill_(0.5)
        else:
            g = torch.Generator().manual_seed(scramble)
            m.weight.copy_(torch.randn(1, d, generator=g, dtype=dtype))
            m.bias.copy_(torch.randn(1, generator=g, dtype=dtype))
    return m


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=2.0 ** -5, momentum=0.5)


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32, d: int = 6) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


def float_data(n: int = 96, d: int = 6, dtype: torch.dtype = torch.float32, seed: int = 0,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, 1, generator=g, dtype=torch.float64)
    y = torch.sin(x @ w)
    return x.to(dtype), y.to(dtype)


def mse_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, global_batch: int,
                 seen: list[tuple[int, int, int]] | None = None,
                 on_step: Callable[[Step], None] | None = None) -> Callable[[Step], float]:
    """The user's callback: MSE on this peer's shard of the step's global batch (``on_step`` is
    called with each step first)."""

    def backward(step: Step) -> float:
        if on_step is not None:
            on_step(step)
        idx = torch.from_numpy(step.shard(global_batch, len(x)))
        if seen is not None:
            seen.append((step.index, step.world_size, step.attempt))
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        return float(loss.detach())

    return backward


async def run_steps(run: Any, backward: Callable[[Step], float], results: list[StepResult]) -> None:
    """Step an async driver (``AsyncDiLoCo``, ``AsyncStreamingDiLoCo``) until it ends, appending
    each step's result to ``results`` (kept by the caller, so a failed run leaves what it did)."""
    while (r := await run.step(backward)) is not None:
        results.append(r)


def finished_heals(cluster: TestCluster) -> dict[str, int]:
    """The master's live-heal counters, once it is asserted that none is still under way (healing,
    joining or observing)."""
    heals: dict[str, int] = cluster.master.state.statistics()["heals"]
    assert heals["healing"] == heals["joining"] == heals["observing"] == 0, heals
    return heals


def single_process(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                   global_batch: int, steps: int) -> SharedModel:
    """The reference: plain torch on the same global batches."""
    shared = SharedModel(model, optimizer)  # creates the optimizer state the same way
    for s in range(steps):
        idx = torch.from_numpy(global_batch_indices(s, global_batch, len(x)))
        optimizer.zero_grad(set_to_none=False)
        # torch's Tensor.backward is unannotated
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        optimizer.step()
    return shared


def state_bytes(shared: SharedModel) -> dict[str, bytes]:
    return {k: tensor_bytes(t) for k, t in shared.tensors().items()}


def max_difference(a: SharedModel, b: SharedModel) -> float:
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    return max(float((ta[k].double() - tb[k].double()).abs().max()) for k in ta)


class KillMidReduce:
    """Traffic hook: once armed, the victim's host crashes as it sends its first ring data (40 bytes of
    it get out): it dies in the middle of an all-reduce."""

    def __init__(self, cluster: TestCluster, victim: int) -> None:
        self.cluster, self.victim = cluster, victim
        self.host, self.master = cluster.host(victim).name, cluster.host(MASTER).name
        self.armed = False
        self.fired = False

    def __call__(self, ev: TrafficEvent) -> HookAction | None:
        if not self.armed or self.fired or ev.src != self.host or ev.dst == self.master:
            return None
        self.fired = True
        self.cluster.kill(self.victim)
        return Reset(after=min(40, len(ev.data)))
