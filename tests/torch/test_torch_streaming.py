"""Streaming DiLoCo (fragments, overlap, mixing, compressed outer gradients) on a pccl.testing cluster,
and the codecs with error feedback."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio
import trio.testing
from _torchrun_helpers import KillMidReduce, state_bytes
from torch import nn

import pccl
from pccl.testing import TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import AsyncStreamingDiLoCo, ErrorFeedback, MinMaxCodec, StepResult, TopKCodec, choose_codec
from pccl.torch._codec import ChunkedCodec, average_payloads, codec_from_spec, wire_bytes
from pccl.torch._fragments import split_fragments

D, N, H, GLOBAL_BATCH = 8, 240, 6, 24


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g)
    y = torch.tanh(x @ torch.randn(D, 1, generator=g)) + 0.5
    return x, y


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 1))


def outer_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.5, nesterov=True)


def full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


async def train(cluster: TestCluster, i: int, nursery: trio.Nursery, *, cycles: int, codec: Any,
                out: dict[int, Any], seed: int = 0, fragments: int = 3, overlap: int = 1,
                on_step: Callable[[Any], None] | None = None) -> None:
    x, y = problem()
    model = make_model(seed)
    run = AsyncStreamingDiLoCo(cluster.peer(i), model, torch.optim.Adam(model.parameters(), lr=0.01),
                               nursery=nursery, outer_optimizer=outer_sgd, inner_steps=H, fragments=fragments,
                               overlap=overlap, mixing=0.5, codec=codec, total_outer_steps=cycles)
    start = full_loss(run.outer_model, x, y)

    def backward(step: Any) -> float:
        if on_step is not None:
            on_step(step)
        idx = torch.from_numpy(step.shard(GLOBAL_BATCH, N))
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        return float(loss.detach())

    results: list[StepResult] = []
    while (r := await run.step(backward)) is not None:
        results.append(r)
    out[i] = (run, start, full_loss(run.outer_model, x, y), results)


# -- codecs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [MinMaxCodec(8), MinMaxCodec(4), MinMaxCodec(4, block=64), TopKCodec(0.1),
                                   TopKCodec(0.2, bits=4), ChunkedCodec(MinMaxCodec(4, block=64), 3)],
                         ids=repr)
def test_codec_round_trip_and_size(codec: Any) -> None:
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 1000, 4097):
        x = torch.randn(n, generator=g)
        payload = codec.encode(x)
        assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(n)
        y = codec.decode(payload, n)
        assert y.shape == (n,) and torch.equal(codec.decode(payload.clone(), n), y)  # pure in its bytes
        if isinstance(codec, (MinMaxCodec, ChunkedCodec)):
            step = float(x.max() - x.min()) / (15 if isinstance(codec, ChunkedCodec) else codec.qmax)
            assert float((y - x).abs().max()) <= step / 2 * 1.001 + 1e-7


def test_min_max_4bit_packs_two_codes_per_byte() -> None:
    codec = MinMaxCodec(4, block=16)
    x = torch.arange(16, dtype=torch.float32)  # min 0, max 15: the codes are the values
    payload = codec.encode(x)
    assert payload.numel() == 8 + 8
    assert payload[8:].tolist() == [(2 * i) | ((2 * i + 1) << 4) for i in range(8)]
    assert torch.equal(codec.decode(payload, 16), x)
    const = codec.decode(codec.encode(torch.full((5,), 0.3)), 5)
    assert torch.equal(const, torch.full((5,), 0.3))  # a constant block is exact


@pytest.mark.parametrize("codec", [MinMaxCodec(4), MinMaxCodec(8), TopKCodec(0.05),
                                   ChunkedCodec(MinMaxCodec(4), 3)], ids=repr)
def test_error_feedback_keeps_the_sum_unbiased(codec: Any) -> None:
    """A known sequence with a constant drift far below the 4-bit step: without feedback the drift is
    rounded away every round; with it the decoded contributions sum to the inputs' sum minus the last
    residual, which stays bounded (within half a step for min-max), so the mean error tends to zero."""
    n, rounds = 512, 400
    g = torch.Generator().manual_seed(7)
    ef = ErrorFeedback(codec, n)
    sent = torch.zeros(n, dtype=torch.float64)
    decoded = torch.zeros(n, dtype=torch.float64)
    plain = torch.zeros(n, dtype=torch.float64)
    for _ in range(rounds):
        x = 0.01 * torch.randn(n, generator=g) + 1e-4
        _, dec = ef.encode(x)
        ef.commit()
        sent += x.double()
        decoded += dec.double()
        plain += codec.decode(codec.encode(x), n).double()
    # the invariant, exactly up to float32 rounding of each round
    assert float((sent - decoded - ef.residual.double()).abs().max()) < 1e-5
    bias_ef = float((decoded - sent).mean()) / rounds
    bias_plain = float((plain - sent).mean()) / rounds
    # what feedback leaves is the last residual spread over the rounds: bounded, so it shrinks as 1/rounds
    assert abs(bias_ef) <= float(ef.residual.abs().max()) / rounds + 1e-9
    assert float(ef.residual.abs().max()) < 0.2
    if not (isinstance(codec, MinMaxCodec) and codec.bits == 8):  # 8 bits resolve the drift by themselves
        assert abs(bias_ef) * 10 < abs(bias_plain), (bias_ef, bias_plain)


def test_error_feedback_discard_keeps_the_previous_residual() -> None:
    ef = ErrorFeedback(MinMaxCodec(4), 64)
    ef.encode(torch.linspace(0, 1, 64))
    ef.commit()
    kept = ef.residual.clone()
    ef.encode(torch.linspace(1, 3, 64))
    ef.discard()
    assert torch.equal(ef.residual, kept)


def test_average_is_rank_ordered_and_checked() -> None:
    codec = MinMaxCodec(4)
    parts = [codec.encode(torch.randn(100)) for _ in range(3)]
    avg = average_payloads(codec, torch.cat(parts), 3, 100)
    ref = (codec.decode(parts[0], 100) + codec.decode(parts[1], 100) + codec.decode(parts[2], 100)) / 3
    assert torch.equal(avg, ref)
    with pytest.raises(pccl.InvalidArgumentError):
        average_payloads(codec, torch.cat(parts)[:-1], 3, 100)
    with pytest.raises(pccl.InvalidArgumentError):
        TopKCodec(0.5).decode(torch.full((TopKCodec(0.5).payload_bytes(4),), 255, dtype=torch.uint8), 4)


def test_codec_specs_and_budget_choice() -> None:
    assert codec_from_spec("fp32") is None and codec_from_spec(None) is None
    assert isinstance(codec_from_spec("int4"), MinMaxCodec)
    assert isinstance(codec_from_spec("topk:0.1:int4"), TopKCodec)
    for bad in ("int3", "topk:x", "topk:0.1:fp8", "zip"):
        with pytest.raises(pccl.InvalidArgumentError):
            codec_from_spec(bad)
    n = 100_000
    fp32 = wire_bytes(None, n, 4, 3)
    assert choose_codec(n, 4, 3, fp32) is None
    assert getattr(choose_codec(n, 4, 3, fp32 // 2), "name", "") == "int8"  # two-stage: 1.3 B vs 5.3 B
    assert getattr(choose_codec(n, 4, 3, fp32 // 5), "name", "") == "int4"
    tight = choose_codec(n, 4, 3, fp32 // 40)
    assert isinstance(tight, TopKCodec) and wire_bytes(tight, n, 4, 3) <= fp32 // 40


def test_split_fragments() -> None:
    model = make_model(0)
    named = list(model.named_parameters())
    frags = split_fragments(named, 3)
    assert sorted(i for f in frags for i in f) == list(range(len(named)))
    assert all(f == sorted(f) for f in frags) and len(frags) == 3
    assert split_fragments(named, 10) == [[0], [1], [2], [3]]
    assert split_fragments(named, [["0.weight", "2.bias"], ["0.bias", "2.weight"]]) == [[0, 3], [1, 2]]
    with pytest.raises(pccl.InvalidArgumentError):
        split_fragments(named, [["0.weight"]])
    with pytest.raises(pccl.InvalidArgumentError):
        split_fragments(named, 0)


# -- on a cluster ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("codec", "overlap"), [(None, 1), ("int8", 1), ("int4", 1), ("int4", 2)],
                         ids=["fp32", "int8", "int4", "int4-overlap2"])
async def test_streaming_fragments_bit_identical_and_converging(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, codec: Any,
        overlap: int) -> None:
    cluster = await pccl_cluster(3)
    cycles = 12
    out: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(train, cluster, i, nursery, cycles=cycles, codec=codec,
                                                   out=out, seed=i, overlap=overlap))
    states = [state_bytes(out[i][0].shared) for i in range(3)]
    assert states[0] == states[1] == states[2]  # outer parameters and outer optimizer state
    run, start, final, results = out[0]
    assert run.cycles == cycles == run.revision and [r.index for r in results] == list(range(cycles * H))
    stats = run.statistics()["fragments"]
    assert len(stats) == 3 and [f["offset"] for f in stats] == [0, 2, 4]
    assert all(f["rounds"] == cycles and f["lost"] == 0 for f in stats)
    assert final < 0.2 * start, (start, final)
    # fragments are sent on their own steps: at most one fragment's bytes per step
    sending = [r.index % H for r in results if r.reduce_tx_bytes]
    # applied (and counted) overlap steps after the send, at the cycle's last step at the latest
    assert set(sending) == {min(o + overlap, H - 1) for o in (0, 2, 4)}
    spec = codec_from_spec(codec)
    if spec is not None:
        # 3 peers: each round sends exactly the two-stage exchange's 2 (n - 1) payloads of a third of the
        # fragment (uncompressed, the library picks the schedule: for these tiny tensors not the ring)
        expected = sum(wire_bytes(spec, f["numel"], 4, 3) for f in stats)
        assert sum(r.reduce_tx_bytes for r in results[:H]) == expected
    if codec == "int4":
        fp32_bytes = wire_bytes(None, sum(f["numel"] for f in stats), 4, 3)
        assert expected < fp32_bytes / 4  # these fragments are tiny: the per-block min/max weigh


async def test_streaming_peer_killed_in_a_fragment_exchange_loses_only_that_round(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(3)
    hook = KillMidReduce(cluster, 2)
    assert cluster.network is not None
    cluster.network.add_hook(hook)
    out: dict[int, Any] = {}
    finished = {i: trio.Event() for i in (0, 1)}

    def arm(step: Any) -> None:
        if step.index == 3 * H + 1:  # cycle 3, just before fragment 1 goes out (inner step 2)
            hook.armed = True

    async def peer(i: int) -> None:
        async with trio.open_nursery() as nursery:
            await train(cluster, i, nursery, cycles=10, codec="int4", out=out,
                        on_step=arm if i == 2 else None)
        if i in finished:
            finished[i].set()

    for i in cluster.alive:
        cluster.start_soon(i, peer, i)
    for event in finished.values():
        await event.wait()
    assert hook.fired and 2 not in out
    assert state_bytes(out[0][0].shared) == state_bytes(out[1][0].shared)
    run, start, final, results = out[0]
    stats = run.statistics()["fragments"]
    assert [f["lost"] for f in stats] == [0, 1, 0], stats  # only fragment 1's round of cycle 3
    assert run.cycles == 10 and len(results) == 10 * H
    assert {r.world_size for r in results[4 * H:]} == {2}
    assert final < 0.3 * start


async def test_streaming_admits_a_newcomer_mid_stream(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(2)
    out: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(train, cluster, i, nursery, cycles=10, codec="int4",
                                                   out=out))
            await trio.sleep(0.05)
            newcomer = await cluster.add_peer(admit=False)
            peers.start_soon(lambda: train(cluster, newcomer, nursery, cycles=10, codec="int4", out=out,
                                           seed=99))
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    new_results: list[StepResult] = out[newcomer][3]
    assert 0 < new_results[0].index and new_results[0].index % H == 0  # it came in at a cycle's start
    assert new_results[0].sync_rx_bytes > 0
    assert all(r.sync_rx_bytes == 0 for r in new_results[1:])
    assert new_results[-1].index == 10 * H - 1
    assert {r.world_size for r in out[0][3][-H:]} == {3}


async def test_min_world_size_timeout(autojump_clock: trio.testing.MockClock,
                                      pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(1)
    model = make_model(0)
    async with trio.open_nursery() as nursery:
        run = AsyncStreamingDiLoCo(cluster.peer(0), model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   nursery=nursery, inner_steps=4, min_world_size=2,
                                   min_world_size_timeout=2.0)
        start = trio.current_time()
        with pytest.raises(pccl.TooFewPeersError):
            await run.step(lambda step: None)
        assert 2.0 <= trio.current_time() - start < 3.0


def test_bad_arguments() -> None:
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from pccl.torch._streaming import StreamingCore

    base: dict[str, Any] = dict(outer_optimizer=outer_sgd, inner_steps=4, fragments=2, overlap=1, mixing=0.5,
                                codec=None, error_feedback=True, budget_bytes=None, total_outer_steps=None,
                                just_joined=False, min_world_size=1, poll_interval=0.05)
    for bad in ({"overlap": 4}, {"mixing": 1.0}, {"codec": "auto"}, {"codec": ["int4"]}, {"inner_steps": 0}):
        with pytest.raises(pccl.InvalidArgumentError):
            StreamingCore(model, opt, **{**base, **bad})


async def test_sync_every_spares_the_control_plane_and_the_end_syncs(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """Membership and sync at cycles 0 and 4 and at the run's end (6): three syncs, the revision
    counting them; the peers end identical, and each model holds the final outer parameters."""
    cluster = await pccl_cluster(2)
    out: dict[int, Any] = {}

    async def one(i: int, nursery: trio.Nursery) -> None:
        x, y = problem()
        model = make_model(i)
        run = AsyncStreamingDiLoCo(cluster.peer(i), model, torch.optim.Adam(model.parameters(), lr=0.01),
                                   nursery=nursery, outer_optimizer=outer_sgd, inner_steps=H, fragments=2,
                                   codec="int8", sync_every=4, total_outer_steps=6)

        def backward(step: Any) -> float:
            idx = torch.from_numpy(step.shard(GLOBAL_BATCH, N))
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            return float(loss.detach())

        while await run.step(backward) is not None:
            pass
        out[i] = (run, model)

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(one, i, nursery)
    (run0, model0), (run1, model1) = out[0], out[1]
    assert run0.cycles == 6 and run0.revision == 2 and run0.core.syncs == 3
    assert state_bytes(run0.shared) == state_bytes(run1.shared)
    for m, run in ((model0, run0), (model1, run1)):
        pairs = zip(m.parameters(), run.outer_model.parameters(), strict=True)
        assert all(torch.equal(p, o) for p, o in pairs)
