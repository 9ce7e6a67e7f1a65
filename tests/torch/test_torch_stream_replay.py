"""Streaming DiLoCo with ``replay_heals`` (issue 35 item 4): exchanges averaged over contributors only, and
a newcomer that heals live while the members run their cycles, replays their rounds and ends bit-identical
(docs/concepts.md "Replaying the rounds missed", streaming)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import pytest
import torch
import trio
import trio.testing
from _torchrun_helpers import finished_heals, mse_backward, run_steps, state_bytes
from test_torch_streaming import GLOBAL_BATCH, D, full_loss, outer_sgd, problem
from torch import nn

import pccl
from pccl.testing import DEFAULT_PEER_CONFIG, TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import AsyncStreamingDiLoCo, MinMaxCodec, StepResult
from pccl.torch._codec import ChunkedCodec, average_payloads
from pccl.torch._stream_contrib import contributors_average, counted_average, flagged
from pccl.torch._stream_replay import join_point, syncs_between
from pccl.torch._streaming import StreamingCore

H, CYCLES, HIDDEN = 6, 16, 2048
SERVE_RATE = 24 * 1024.0  # bytes/s each donor serves the newcomer: its heal spans several cycles


# -- the averages over contributors ------------------------------------------------------------------


def test_flagged_payloads_average_over_the_contributors_only() -> None:
    codec = MinMaxCodec(8)
    g = [torch.randn(50, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    payloads = [codec.encode(t) for t in g]
    # peer 1 contributes nothing: its bytes (whatever they are) are ignored
    noise = torch.randint(0, 255, payloads[1].shape, dtype=torch.uint8)
    gathered = torch.cat([flagged(payloads[0], 1, True), flagged(noise, 1, False),
                          flagged(payloads[2], 1, True)])
    expected = average_payloads(codec, torch.cat([payloads[0], payloads[2]]), 2, 50)
    average = contributors_average(codec, gathered, 3, 50)
    assert average is not None and torch.equal(average, expected)
    assert contributors_average(codec, torch.cat([flagged(p, 1, False) for p in payloads]), 3, 50) is None
    bad = gathered.clone()
    bad[codec.payload_bytes(50)] = 2
    with pytest.raises(pccl.InvalidArgumentError, match="flags"):
        contributors_average(codec, bad, 3, 50)
    with pytest.raises(pccl.InvalidArgumentError, match="flagged payloads"):
        contributors_average(codec, gathered[:-1], 3, 50)


def test_flagged_chunks_of_the_all_to_all() -> None:
    """Each chunk's payload carries the flag: the all-to-all's rows go to the chunks' owners whole."""
    chunked = ChunkedCodec(MinMaxCodec(4), 3)
    payload = chunked.encode(torch.randn(31))
    rows = flagged(payload, 3, False).reshape(3, -1)
    assert rows.shape[1] == payload.numel() // 3 + 1 and rows[:, -1].tolist() == [0, 0, 0]
    assert torch.equal(rows[:, :-1].reshape(-1), payload)
    with pytest.raises(pccl.InvalidArgumentError):
        flagged(payload[:-1], 3, True)


def test_counted_average_divides_by_the_contributors() -> None:
    summed = torch.tensor([3.0, 6.0, -1.5, 2.0])
    average = counted_average(summed, 3)
    assert average is not None and torch.equal(average, torch.tensor([1.5, 3.0, -0.75]))
    assert counted_average(torch.tensor([0.0, 0.0]), 1) is None
    with pytest.raises(pccl.InvalidArgumentError, match="count"):
        counted_average(torch.tensor([1.0, 0.5]), 1)


def test_join_point_is_the_members_next_sync() -> None:
    core: Any = dataclasses.make_dataclass("C", ["sync_every", "total_outer_steps"])(3, 20)
    assert join_point(core, 6, 0) == 6 and join_point(core, 6, 1) == 9 and join_point(core, 6, 4) == 12
    assert join_point(core, 18, 1) == 20  # capped at the run's end, a sync too
    assert syncs_between(core, 6, 12) == 2 and syncs_between(core, 18, 20) == 1


def test_replay_heals_refuses_auto_overlap() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(pccl.InvalidArgumentError, match="integer overlap"):
        StreamingCore(model, torch.optim.SGD(model.parameters(), lr=0.1), outer_optimizer=outer_sgd,
                      inner_steps=4, fragments=1, overlap="auto", mixing=0.0, codec=None, error_feedback=True,
                      budget_bytes=None, total_outer_steps=None, just_joined=False, min_world_size=1,
                      poll_interval=0.1, replay_heals=True)


# -- a newcomer healing live on a cluster -------------------------------------------------------------


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


async def _train(cluster: TestCluster, i: int, nursery: trio.Nursery, out: dict[int, Any], *, codec: Any,
                 seed: int = 0, times: dict[int, list[float]] | None = None, sync_every: int = 1) -> None:
    x, y = problem()
    model = _model(seed)
    run = AsyncStreamingDiLoCo(cluster.peer(i), model, torch.optim.Adam(model.parameters(), lr=0.01),
                               nursery=nursery, outer_optimizer=outer_sgd, inner_steps=H, fragments=3,
                               overlap=1, mixing=0.5, codec=codec, total_outer_steps=CYCLES,
                               replay_heals=True, sync_every=sync_every)
    start = full_loss(run.outer_model, x, y)

    def record(_step: Any) -> None:
        if times is not None:
            times.setdefault(i, []).append(trio.current_time())

    results: list[StepResult] = []
    try:
        await run_steps(run, mse_backward(model, x, y, GLOBAL_BATCH, on_step=record), results)
    finally:
        out[i] = (run, start, full_loss(run.outer_model, x, y), results)


async def _run(cluster: TestCluster, codec: Any, kill_at: float | None = None, sync_every: int = 1
               ) -> tuple[dict[int, Any], int, dict[int, list[float]]]:
    """Two members train CYCLES cycles; a newcomer is added at once and served at SERVE_RATE by each."""
    out: dict[int, Any] = {}
    times: dict[int, list[float]] = {}
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(_train, cluster, i, nursery, out, codec=codec,
                                                   times=times, sync_every=sync_every))
            net = cluster.network
            assert net is not None
            net.set_link(cluster.host(0), cluster.host(1), latency=0.05)
            await trio.sleep(0.05)
            newcomer = await cluster.add_peer(admit=False)
            for d in (0, 1):
                net.set_link(cluster.host(d), cluster.host(newcomer), latency=0.005)
            times[-1] = [trio.current_time()]

            async def newcomer_trains() -> None:
                try:
                    await _train(cluster, newcomer, nursery, out, codec=codec, seed=99, times=times,
                                 sync_every=sync_every)
                except pccl.PCCLError as exc:  # killed: its own calls fail
                    out[-1] = exc

            peers.start_soon(newcomer_trains)
            if kill_at is not None:
                await trio.sleep(kill_at)
                cluster.kill(newcomer)
        nursery.cancel_scope.cancel()  # (a killed newcomer's background fetch and exchanges)
    return out, newcomer, times


def _cycle_times(times: list[float], start: float, end: float) -> list[float]:
    firsts = times[::H]
    return [b - a for a, b in itertools.pairwise(firsts) if start <= a < end]


REPLAYING = dataclasses.replace(DEFAULT_PEER_CONFIG, state_serve_rate=SERVE_RATE)


@pytest.mark.parametrize("codec", [None, "int8", "int4"])
async def test_a_streaming_newcomer_heals_while_the_members_run_cycles(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, codec: Any) -> None:
    """The outer state changes at every round, yet the heal runs live: the members go on with their cycles
    while the newcomer fetches (it takes part in every fragment's exchange contributing nothing: zeros
    flagged 0; with int4/int8 the two-stage exchange, where it owns a chunk), then it replays their rounds
    and joins their next sync, where nothing moves: bit-identical, the state moved once."""
    cluster = await pccl_cluster(2, config=REPLAYING)
    out, newcomer, times = await _run(cluster, codec)
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    for i in (0, 1):  # the members ran every step, none twice, and lost no round
        assert [r.index for r in out[i][3]] == list(range(CYCLES * H))
        assert all(f["lost"] == 0 for f in out[i][0].statistics()["fragments"])
    core = out[newcomer][0].core
    c0, point = core.replay_point
    assert point - c0 >= 2 and core.rounds_replayed == 3 * (point - c0)  # every round of >= 2 cycles
    new_results: list[StepResult] = out[newcomer][3]
    assert new_results[0].index == point * H and new_results[-1].index == CYCLES * H - 1
    # the snapshot's chunks it lacked, once (the join moved nothing)
    assert 0 < new_results[0].sync_rx_bytes <= sum(len(v) for v in states[0].values())
    assert all(r.sync_rx_bytes == 0 for r in new_results[1:])
    # the members were not held for the transfer: their cycles while it healed were about as long as
    # after it joined (the same group of three)
    started, joined = times[-1][0], times[newcomer][0]
    for i in (0, 1):
        during = _cycle_times(times[i], started, joined)
        after = _cycle_times(times[i], joined, math.inf)
        assert len(during) >= point - c0 - 1, (during, c0, point)
        assert max(during) < 1.1 * max(after), (during, after)
    assert out[0][2] < 0.5 * out[0][1]  # (it trains: the outer model's loss fell)
    heals = finished_heals(cluster)
    assert heals["started"] == 1 and heals["kept_ordinary"] == 0 and heals["fetched"] == 1
    assert heals["joined_current"] + heals["joined_in_sync"] == 1 and heals["join_refused"] == 0


async def test_a_streaming_newcomer_killed_mid_heal_costs_the_members_no_call(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """Killed while it takes part in the members' exchanges: at most the rounds in flight with it are lost
    (the same at both members), no member call fails, the members end bit-identical."""
    cluster = await pccl_cluster(2, config=REPLAYING)
    out, newcomer, _ = await _run(cluster, "int4", kill_at=1.5)
    assert not out[newcomer][3]  # killed before it trained a step
    assert out[newcomer][0].core.rounds_replayed == 0
    assert state_bytes(out[0][0].shared) == state_bytes(out[1][0].shared)
    for i in (0, 1):
        assert [r.index for r in out[i][3]] == list(range(CYCLES * H))
    lost = [[f["lost"] for f in out[i][0].statistics()["fragments"]] for i in (0, 1)]
    assert lost[0] == lost[1] and sum(lost[0]) <= 3
    heals = finished_heals(cluster)
    assert heals["started"] == 1 and heals["lost_fetchers"] == 1 and heals["fetched"] == 0


async def test_a_streaming_newcomer_joins_at_the_members_next_sync_point(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """With ``sync_every=3`` the members sync at every 3rd cycle's start only: the newcomer, admitted at
    one, observes until the first such point past its heal (replaying every round of the cycles before it)
    and joins at the members' revision there (the syncs they made meanwhile counted), bit-identical."""
    faster = dataclasses.replace(REPLAYING, state_serve_rate=3 * SERVE_RATE)  # a heal of ~3 cycles
    cluster = await pccl_cluster(2, config=faster)
    out, newcomer, _ = await _run(cluster, "int4", sync_every=3)
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    core = out[newcomer][0].core
    c0, point = core.replay_point
    assert c0 % 3 == 0 and point % 3 == 0 and c0 + 3 <= point < CYCLES, (c0, point)
    assert core.rounds_replayed == 3 * (point - c0)
    assert out[newcomer][3][0].index == point * H
    assert out[newcomer][0].revision == out[0][0].revision  # (syncs counted alike)
    heals = cluster.master.state.statistics()["heals"]
    assert heals["joined_current"] + heals["joined_in_sync"] == 1 and heals["join_refused"] == 0
