"""DiLoCo runs with live heals (issue 35 item 4; on by default): where they help (a frozen part of the model:
it moves while the members step on) and where they cannot (every parameter changes at every outer step:
the newcomer's sync stays ordinary and it receives the state once)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import trio
import trio.testing
from _torchrun_helpers import state_bytes
from test_torch_diloco import INNER, D, train
from torch import nn

from pccl.testing import DEFAULT_MASTER_CONFIG, TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import StepResult

OUTER = 30
TABLE = 4096  # floats of the frozen part


class FrozenTable(nn.Module):
    """A linear model next to a frozen table (as a fine-tuned model's frozen backbone: no gradient, so
    DiLoCo's outer step leaves it, and its momentum, bit-identical)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, 1)
        self.table = nn.Parameter(torch.randn(TABLE), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # type: ignore[no-any-return]


async def _run(cluster: TestCluster, rate: float, make_model: Any = None) -> tuple[dict[int, Any], int]:
    """Two members train OUTER outer steps; a newcomer is added at once over ``rate`` bytes/s links."""
    out: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(train, cluster, i, nursery, delayed=False,
                                                   outer_steps=OUTER, quantization=None, out=out,
                                                   make_model=make_model))
            net = cluster.network
            assert net is not None
            net.set_link(cluster.host(0), cluster.host(1), latency=0.05)  # a round takes ~0.2 s
            await trio.sleep(0.05)
            newcomer = await cluster.add_peer(admit=False)
            for d in (0, 1):  # slow links to the newcomer: its heal takes a few rounds
                net.set_link(cluster.host(d), cluster.host(newcomer), bandwidth=rate, latency=0.005)
            peers.start_soon(functools.partial(train, cluster, newcomer, nursery, delayed=False,
                                               outer_steps=OUTER, quantization=None, out=out, seed=99,
                                               make_model=make_model))
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    for i in (0, 1):  # the members ran every step, none twice
        assert [r.index for r in out[i][3]] == list(range(OUTER * INNER))
    new_results: list[StepResult] = out[newcomer][3]
    assert new_results[0].index % INNER == 0 and new_results[-1].index == OUTER * INNER - 1
    assert new_results[0].sync_rx_bytes > 0 and all(r.sync_rx_bytes == 0 for r in new_results[1:])
    return out, newcomer


async def test_diloco_members_step_on_while_a_newcomer_heals_the_frozen_part(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """The frozen table, most of the state, moves in a live round while the members' DiLoCo rounds go on;
    what changed meanwhile (the linear layer and its momentum: every key the newcomer still lacks, changed
    at every outer step, so another live round could not catch up) moves in an ordinary sync."""
    cluster = await pccl_cluster(2, master_config=dataclasses.replace(DEFAULT_MASTER_CONFIG,
                                                                      live_heal_rounds=2))
    out, newcomer = await _run(cluster, rate=16000.0, make_model=FrozenTable)
    new_results: list[StepResult] = out[newcomer][3]
    # it joined rounds after it started healing: the members went on meanwhile
    assert new_results[0].index >= 5 * INNER
    sizes = {k: len(v) for k, v in state_bytes(out[0][0].shared).items()}
    frozen = {k for k in sizes if "table" in k}
    assert frozen == {"param/table", "optim/table/momentum_buffer"}, sizes
    # live: the table and the linear part (its zero momentum it held already); ordinary: the linear part
    # again, changed since. The table moved once.
    changed = sum(n for k, n in sizes.items() if k not in frozen)
    assert new_results[0].sync_rx_bytes == sizes["param/table"] + 2 * changed
    heals = cluster.master.state.statistics()["heals"]
    assert heals["started"] == 1 and heals["kept_ordinary"] == 1 and heals["rejoined"] == 1
    assert heals["behind"] == heals["healing"] == 0


async def test_a_diloco_newcomer_receives_the_state_once_when_every_parameter_changes(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """Every outer step changes every key of the shared state: a live round could not catch up (the
    newcomer would fetch it all again at its join while the members wait), so with live heals on (the
    default) its sync stays ordinary and it receives the state once."""
    cluster = await pccl_cluster(2)
    out, newcomer = await _run(cluster, rate=1000.0)
    new_results: list[StepResult] = out[newcomer][3]
    assert new_results[0].sync_rx_bytes == sum(len(v) for v in state_bytes(out[0][0].shared).values())
    heals = cluster.master.state.statistics()["heals"]
    assert heals["started"] == 0 and heals["kept_ordinary"] >= 1
