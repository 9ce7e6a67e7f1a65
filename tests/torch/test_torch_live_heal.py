"""DiLoCo runs with live heals (issue 35 item 4; on by default): where they help (a frozen part of the model:
it moves while the members step on) and where they cannot (every parameter changes at every outer step:
the newcomer's sync stays ordinary and it receives the state once)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
from typing import Any

import torch
import trio
import trio.testing
from _torchrun_helpers import finished_heals, mse_backward, run_steps, state_bytes
from test_torch_diloco import GLOBAL_BATCH, INNER, UINT8_MIN_MAX, D, full_loss, outer_sgd, problem, train
from torch import nn

import pccl
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, MASTER, TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import AsyncDiLoCo, StepResult

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


WIDE = 2048  # hidden units of the replay tests' model: 90 KiB of parameters, 180 KiB of shared state
SERVE_RATE = 48 * 1024.0  # bytes/s each donor serves a fetcher at most: the heal takes ~2 s


class Wide(nn.Module):
    """A model whose every parameter DiLoCo's outer step changes (a state that changes entirely)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(D, WIDE)
        self.out = nn.Linear(WIDE, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))  # type: ignore[no-any-return]


async def _train_replaying(cluster: TestCluster, i: int, nursery: trio.Nursery, out: dict[int, Any], *,
                           seed: int = 0, on_step: Any = None, quantization: Any = None) -> None:
    """As test_torch_diloco.train, with ``replay_heals`` (every peer of the run sets it alike)."""
    x, y = problem()
    torch.manual_seed(seed)
    model = Wide()
    diloco = AsyncDiLoCo(cluster.peer(i), model, torch.optim.SGD(model.parameters(), lr=0.005),
                         outer_optimizer=outer_sgd, inner_steps=INNER, total_outer_steps=OUTER,
                         nursery=nursery, replay_heals=True, quantization=quantization)
    start = full_loss(diloco.outer_model, x, y)

    hook = None if on_step is None else functools.partial(on_step, i)
    results: list[StepResult] = []
    try:
        await run_steps(diloco, mse_backward(model, x, y, GLOBAL_BATCH, on_step=hook), results)
    finally:
        out[i] = (diloco, start, full_loss(diloco.outer_model, x, y), results)


async def _replay_run(cluster: TestCluster, *, kill_at: float | None = None, quantization: Any = None,
                      far_master: bool = False, restart_master_at: float | None = None
                      ) -> tuple[dict[int, Any], int, dict[int, list[float]]]:
    """Two members train OUTER outer steps with ``replay_heals``; a newcomer is added at once, served at
    ``SERVE_RATE`` by each (its heal takes many rounds); ``kill_at``: the newcomer is killed that many
    seconds after it starts (mid-heal). Returns the drivers, the newcomer's index and each peer's step
    times (key -1: when the newcomer started)."""
    out: dict[int, Any] = {}
    times: dict[int, list[float]] = {}

    def on_step(i: int, step: Any) -> None:
        times.setdefault(i, []).append(trio.current_time())

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(_train_replaying, cluster, i, nursery, out,
                                                   on_step=on_step, quantization=quantization))
            net = cluster.network
            assert net is not None
            net.set_link(cluster.host(0), cluster.host(1), latency=0.05)  # a round takes ~0.2 s
            await trio.sleep(0.05)
            newcomer = await cluster.add_peer(admit=False)
            for d in (0, 1):
                net.set_link(cluster.host(d), cluster.host(newcomer), latency=0.005)
            if far_master:  # its join vote arrives after the members' sync at its revision
                net.set_link(cluster.host(newcomer), cluster.host(MASTER), latency=0.1)
            started = trio.current_time()
            times[-1] = [started]

            async def newcomer_trains() -> None:
                try:
                    await _train_replaying(cluster, newcomer, nursery, out, seed=99, on_step=on_step,
                                           quantization=quantization)
                except pccl.PCCLError as exc:  # killed (its own calls fail), or its heal failed
                    out[-1] = exc
                    if kill_at is None:
                        await cluster.leave(newcomer)  # as a program whose step raised: it leaves

            peers.start_soon(newcomer_trains)
            if kill_at is not None:
                await trio.sleep_until(started + kill_at)
                cluster.kill(newcomer)
            if restart_master_at is not None:
                await trio.sleep_until(started + restart_master_at)
                await cluster.restart_master()
        nursery.cancel_scope.cancel()  # (a killed newcomer's background fetch)
    return out, newcomer, times


def _round_times(times: list[float], start: float, end: float) -> list[float]:
    """The durations of the outer rounds (INNER steps each) whose first step was in [start, end)."""
    firsts = times[::INNER]
    return [b - a for a, b in itertools.pairwise(firsts) if start <= a < end]


REPLAYING = dataclasses.replace(DEFAULT_PEER_CONFIG, state_serve_rate=SERVE_RATE)


async def test_a_replaying_diloco_newcomer_heals_while_the_members_run_outer_rounds(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """Every outer step changes every key, yet with ``replay_heals`` the heal runs live: the members go on
    with their outer rounds while the newcomer fetches revision r (it takes part in their all-reduces,
    contributing nothing, and keeps each round's average), then it applies the outer steps it missed and
    joins the group's next sync, where nothing moves: bit-identical, and the state moved once."""
    cluster = await pccl_cluster(2, config=REPLAYING)
    out, newcomer, times = await _replay_run(cluster)
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    for i in (0, 1):  # the members ran every step, none twice
        assert [r.index for r in out[i][3]] == list(range(OUTER * INNER))
    core = out[newcomer][0].core
    assert core.rounds_replayed >= 2  # the members ran >= 2 outer all-reduces while it fetched
    assert core.rounds_observed == core.rounds_replayed
    new_results: list[StepResult] = out[newcomer][3]
    assert new_results[-1].index == OUTER * INNER - 1
    # it received the state once (the snapshot; the join moved nothing)
    assert new_results[0].sync_rx_bytes == sum(len(v) for v in states[0].values())
    assert all(r.sync_rx_bytes == 0 for r in new_results[1:])
    # the members were not held for the transfer: while it healed, their rounds took about as long as
    # after it joined (the same ring of three), and they ran at least the rounds it replayed
    started, joined = times[-1][0], times[newcomer][0]
    for i in (0, 1):
        during = _round_times(times[i], started, joined)
        after = _round_times(times[i], joined, math.inf)
        assert len(during) >= core.rounds_replayed, (during, core.rounds_replayed)
        assert max(during) < 1.5 * statistics.median(after), (during, after)
    assert joined - started > 3 * statistics.median(after)  # (the heal lasted several rounds)
    assert out[0][2] < 0.1 * out[0][1]  # (it trains: the outer model's loss fell)
    heals = finished_heals(cluster)
    assert heals["started"] == 1 and heals["kept_ordinary"] == 0 and heals["fetched"] == 1
    assert heals["joined_current"] + heals["joined_in_sync"] == 1 and heals["join_refused"] == 0


async def test_a_replaying_diloco_newcomer_killed_mid_heal_costs_the_members_no_call(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """The newcomer takes part in the members' all-reduces while it heals; killed then, the members'
    all-reduce in flight (if any) retries without it, their calls do not fail, and the run ends
    bit-identical."""
    cluster = await pccl_cluster(2, config=REPLAYING)
    out, newcomer, _ = await _replay_run(cluster, kill_at=1.0)
    assert not out[newcomer][3]  # killed before it trained a step
    assert out[newcomer][0].core.rounds_observed >= 3  # it was in the members' rounds until then
    # killed inside an all-reduce: at each member that round's all-reduce failed once and ran again, whole,
    # without it (no call failed)
    assert [out[i][0]._execute.whole_retries for i in (0, 1)] == [1, 1]
    assert state_bytes(out[0][0].shared) == state_bytes(out[1][0].shared)
    for i in (0, 1):
        assert [r.index for r in out[i][3]] == list(range(OUTER * INNER))
    heals = finished_heals(cluster)
    assert heals["started"] == 1 and heals["lost_fetchers"] == 1 and heals["fetched"] == 0


async def test_a_replaying_newcomer_is_bit_identical_with_quantized_pseudo_gradients(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """MIN_MAX uint8 on the wire: the newcomer's zeros go through the quantized ring too, the count does not
    (never quantized); every peer divides the same bits by the same count: bit-identical. Its link to the
    master is slow here: its join vote is answered at once (the members synced its revision already)."""
    cluster = await pccl_cluster(2, config=REPLAYING)
    out, newcomer, _ = await _replay_run(cluster, quantization=UINT8_MIN_MAX, far_master=True)
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    assert out[newcomer][0].core.rounds_replayed >= 2
    # (its control messages 0.1 s late: the members had synced at its revision when its join vote came,
    # which was answered current at once, after the master compared its hashes with that sync's)
    heals = cluster.master.state.statistics()["heals"]
    assert heals["joined_current"] == 1 and heals["joined_in_sync"] == 0
    assert out[0][2] < 0.1 * out[0][1]  # (it trains: the outer model's loss fell)


async def test_a_replaying_newcomers_heal_lost_with_the_master_costs_the_members_no_call(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """The master restarted mid-heal: the newcomer's heal fails, nothing applied, and its step raises at
    once (it does not wait for a round of the members, who at the new master wait for it as a member);
    it leaves, and the members go on: every step, bit-identical, no call failed."""
    config = dataclasses.replace(REPLAYING, reconnect_window=30.0)
    cluster = await pccl_cluster(2, config=config)
    out, newcomer, _ = await _replay_run(cluster, restart_master_at=1.0)
    error = out[-1]
    assert isinstance(error, pccl.SharedStateSyncError) and "the live heal" in str(error), error
    assert not out[newcomer][3] and out[newcomer][0].core.rounds_replayed == 0
    torch.manual_seed(99)  # its shared state is its own, as it started (nothing applied)
    assert torch.equal(out[newcomer][0].outer_model.hidden.weight, Wide().hidden.weight)
    assert state_bytes(out[0][0].shared) == state_bytes(out[1][0].shared)
    for i in (0, 1):
        assert [r.index for r in out[i][3]] == list(range(OUTER * INNER))
