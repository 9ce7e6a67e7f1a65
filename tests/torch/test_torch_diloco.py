"""DiLoCo (synchronous, one-step-delayed, quantized) on a pccl.testing cluster."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio
import trio.testing
from _torchrun_helpers import KillMidReduce, mse_backward, run_steps, state_bytes
from torch import nn

import pccl
from pccl.testing import TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import AsyncDiLoCo, StepResult

D, N, INNER, GLOBAL_BATCH = 8, 240, 5, 24
UINT8_MIN_MAX = pccl.QuantizationOptions(quantized_datatype=pccl.DataType.UINT8,
                                         algorithm=pccl.QuantizationAlgorithm.MIN_MAX)


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g)
    y = x @ torch.randn(D, 1, generator=g) + 0.5
    return x, y


def outer_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Nesterov momentum 0.5: one-step-delayed updates diverge on this problem with the usual 0.9."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.5, nesterov=True)


def full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


async def train(cluster: TestCluster, i: int, nursery: trio.Nursery, *, delayed: bool, outer_steps: int,
                quantization: Any, out: dict[int, Any], seed: int = 0,
                on_step: Callable[[Any], None] | None = None,
                make_model: Callable[[], nn.Module] | None = None) -> None:
    x, y = problem()
    torch.manual_seed(seed)
    model = nn.Linear(D, 1) if make_model is None else make_model()
    diloco = AsyncDiLoCo(cluster.peer(i), model, torch.optim.SGD(model.parameters(), lr=0.05),
                         outer_optimizer=outer_sgd, inner_steps=INNER, delayed=delayed,
                         quantization=quantization, total_outer_steps=outer_steps, nursery=nursery)
    start = full_loss(diloco.outer_model, x, y)

    results: list[StepResult] = []
    await run_steps(diloco, mse_backward(model, x, y, GLOBAL_BATCH, on_step=on_step), results)
    out[i] = (diloco, start, full_loss(diloco.outer_model, x, y), results)


@pytest.mark.parametrize(("delayed", "quantization"), [(False, None), (True, None), (False, UINT8_MIN_MAX),
                                                       (True, UINT8_MIN_MAX)],
                         ids=["sync", "delayed", "sync-uint8", "delayed-uint8"])
async def test_diloco_converges_and_outer_states_stay_identical(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, delayed: bool,
        quantization: Any) -> None:
    cluster = await pccl_cluster(3)
    outer_steps = 12
    out: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(train, cluster, i, nursery, delayed=delayed,
                                                   outer_steps=outer_steps,
                                                   quantization=quantization, out=out))
    states = [state_bytes(out[i][0].shared) for i in range(3)]
    assert states[0] == states[1] == states[2]
    diloco, start, final, results = out[0]
    assert diloco.revision == outer_steps
    assert len(results) == outer_steps * INNER  # every inner step ran, none twice
    assert [r.index for r in results] == list(range(outer_steps * INNER))
    assert final < 0.02 * start, (start, final)
    assert float(diloco.shared.tensors()["optim/weight/momentum_buffer"].abs().sum()) > 0


async def test_delayed_diloco_admits_a_newcomer_with_the_pipeline_drained(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """A peer joins a delayed run: the running all-reduce is finished and applied before it is admitted,
    so its first sync gives it outer state that includes every round; all end identical."""
    cluster = await pccl_cluster(2)
    out: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(train, cluster, i, nursery, delayed=True, outer_steps=10,
                                                   quantization=None, out=out))
            await trio.sleep(0.05)
            newcomer = await cluster.add_peer(admit=False)
            peers.start_soon(lambda: train(cluster, newcomer, nursery, delayed=True, outer_steps=10,
                                           quantization=None, out=out, seed=99))
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    new_results: list[StepResult] = out[newcomer][3]
    assert 0 < new_results[0].index and new_results[0].index % INNER == 0
    assert new_results[0].sync_rx_bytes > 0
    assert all(r.sync_rx_bytes == 0 for r in new_results[1:])
    assert new_results[-1].index == 10 * INNER - 1 and out[newcomer][2] < 0.05 * out[0][1]


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "delayed"])
async def test_diloco_survives_a_peer_killed_mid_reduce(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, delayed: bool) -> None:
    """Peer 2 dies as its pseudo-gradients of round 3 go out: the survivors' all-reduce is retried with
    the two of them, and they go on to the end with identical outer states and a converged model."""
    cluster = await pccl_cluster(3)
    hook = KillMidReduce(cluster, 2)
    assert cluster.network is not None
    cluster.network.add_hook(hook)
    out: dict[int, Any] = {}
    finished = {i: trio.Event() for i in (0, 1)}

    def arm(step: Any) -> None:
        if step.index == 4 * INNER - 1:  # the last inner step of round 3: its reduce follows
            hook.armed = True

    async def peer(i: int) -> None:
        async with trio.open_nursery() as nursery:  # killing the peer cancels its background reduce too
            await train(cluster, i, nursery, delayed=delayed, outer_steps=10, quantization=None, out=out,
                        on_step=arm if i == 2 else None)
        if i in finished:
            finished[i].set()

    for i in cluster.alive:
        cluster.start_soon(i, peer, i)
    for event in finished.values():
        await event.wait()
    assert hook.fired and 2 not in out
    assert state_bytes(out[0][0].shared) == state_bytes(out[1][0].shared)
    diloco, start, final, results = out[0]
    assert diloco.revision == 10 and len(results) == 10 * INNER
    assert {r.world_size for r in results[:4 * INNER]} == {3}
    assert {r.world_size for r in results[5 * INNER:]} == {2}
    assert final < 0.05 * start
