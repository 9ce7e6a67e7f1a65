"""Streaming DiLoCo (fragments, overlap, mixing, compressed outer gradients) on a pccl.testing cluster,
and the codecs with error feedback."""

from __future__ import annotations

import functools
import math
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
from pccl.torch import (
    AsyncStreamingDiLoCo,
    DeflateCodec,
    ErrorFeedback,
    MinMaxCodec,
    StepResult,
    TopKCodec,
    choose_codec,
)
from pccl.torch._codec import ChunkedCodec, _raw_deflate, average_payloads, codec_from_spec, wire_bytes
from pccl.torch._fragments import split_fragments

D, N, H, GLOBAL_BATCH = 8, 240, 6, 24


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g)
    y = torch.tanh(x @ torch.randn(D, 1, generator=g)) + 0.5
    return x, y


def make_model(seed: int, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def outer_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.5, nesterov=True)


def full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


async def train(cluster: TestCluster, i: int, nursery: trio.Nursery, *, cycles: int, codec: Any,
                out: dict[int, Any], seed: int = 0, fragments: int = 3, overlap: Any = 1,
                on_step: Callable[[Any], None] | None = None, hidden: int = 16) -> None:
    x, y = problem()
    model = make_model(seed, hidden)
    run = AsyncStreamingDiLoCo(cluster.peer(i), model, torch.optim.Adam(model.parameters(), lr=0.01),
                               nursery=nursery, outer_optimizer=outer_sgd, inner_steps=H, fragments=fragments,
                               overlap=overlap, mixing=0.5, codec=codec, total_outer_steps=cycles)
    start = full_loss(run.outer_model, x, y)

    results: list[StepResult] = []
    await run_steps(run, mse_backward(model, x, y, GLOBAL_BATCH, on_step=on_step), results)
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


def test_deflate_codec_carries_the_plain_codes_losslessly() -> None:
    """int4's default: the codes deflated into 3.6 bits per element; where they fit (Gaussian-like
    values, what error-fed pseudo-gradients look like) the decoded values are the plain 4-bit codec's,
    bit for bit, in a fixed, smaller payload; small tensors keep the plain payload."""
    g = torch.Generator().manual_seed(5)
    plain = MinMaxCodec(4)
    codec = codec_from_spec("int4")
    assert isinstance(codec, DeflateCodec) and codec.bits == 3.6 and codec.name == "int4"
    for n in (1, 7, 600, 1001, 4097, 12970):
        x = 0.01 * torch.randn(n, generator=g)
        payload = codec.encode(x)
        assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(n)
        budget = 8 * plain.blocks_of(n) + min(plain.code_bytes(n), math.ceil(n * 3.6 / 8) + 32)
        assert codec.payload_bytes(n) == budget <= plain.payload_bytes(n)
        assert torch.equal(codec.decode(payload, n), plain.decode(plain.encode(x), n))
    assert codec.encodes == 3 and codec.widened == 0  # 1001, 4097, 12970 deflated; 1..600 plain
    # both stream layouts (packed codes; one code per byte, Huffman only) decode to the same values
    n = 4097
    x = 0.01 * torch.randn(n, generator=g)
    ref = plain.encode(x)
    head, packed = ref[:16], ref[16:]
    one = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n]
    for stream in (_raw_deflate(packed.numpy().tobytes(), 0),
                   _raw_deflate(one.numpy().tobytes(), 2)):  # Z_DEFAULT_STRATEGY, Z_HUFFMAN_ONLY
        body = torch.zeros(codec.body_bytes(n), dtype=torch.uint8)
        body[:len(stream)] = torch.tensor(list(stream), dtype=torch.uint8)
        assert torch.equal(codec.decode(torch.cat([head, body]), n), plain.decode(ref, n))


def test_deflate_codec_widens_what_does_not_fit_and_rejects_bad_payloads() -> None:
    g = torch.Generator().manual_seed(6)
    n = 4096
    x = torch.rand(n, generator=g)  # uniform: 4 bits of entropy per code, over the 3.6-bit budget
    codec = DeflateCodec(MinMaxCodec(4), bits=3.6)
    payload = codec.encode(x)
    assert payload.numel() == codec.payload_bytes(n) and codec.widened == 1
    y = codec.decode(payload, n)
    span = float(x.max() - x.min())
    assert float((y - x).abs().max()) <= 16 * span / 15 / 2 * 1.001  # at most 16x the plain step
    ef = ErrorFeedback(codec, n)
    _, decoded = ef.encode(x)
    ef.commit()
    assert torch.equal(ef.residual, x - codec.decode(ef.codec.encode(x), n))  # pure: residual exact
    assert torch.equal(decoded, codec.decode(codec.encode(x), n))
    tiny = DeflateCodec(MinMaxCodec(4), bits=0.05)  # nothing but a constant block fits
    y = tiny.decode(tiny.encode(x), n)
    assert tiny.widened == 1 and torch.equal(y, torch.full((n,), float(y[0])))
    bad = payload.clone()
    bad[8:] = 0xFF  # a reserved deflate block type
    with pytest.raises(pccl.InvalidArgumentError, match="deflate"):
        codec.decode(bad, n)
    stream = _raw_deflate(bytes([16]) * n, 2)  # one byte per code, but 16 is no 4-bit code
    bad[8:] = 0
    bad[8:8 + len(stream)] = torch.tensor(list(stream), dtype=torch.uint8)
    with pytest.raises(pccl.InvalidArgumentError, match="out of range"):
        codec.decode(bad, n)
    stream = _raw_deflate(bytes(n - 5), 2)  # neither n codes one per byte nor n / 2 packed bytes
    bad[8:] = 0
    bad[8:8 + len(stream)] = torch.tensor(list(stream), dtype=torch.uint8)
    with pytest.raises(pccl.InvalidArgumentError, match="does not hold"):
        codec.decode(bad, n)
    with pytest.raises(pccl.InvalidArgumentError):
        codec.decode(payload[:-1], n)
    with pytest.raises(pccl.InvalidArgumentError):
        DeflateCodec(MinMaxCodec(4), bits=4.5)


@pytest.mark.parametrize("codec", [MinMaxCodec(4), MinMaxCodec(8), TopKCodec(0.05),
                                   ChunkedCodec(MinMaxCodec(4), 3),
                                   DeflateCodec(MinMaxCodec(4, block=64), bits=3.0),
                                   ChunkedCodec(DeflateCodec(MinMaxCodec(4, block=64), bits=2.0), 3)],
                         ids=repr)
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
    assert isinstance(codec_from_spec("int4"), DeflateCodec)
    assert isinstance(codec_from_spec("int4-plain"), MinMaxCodec)
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


@pytest.mark.parametrize(("codec", "overlap", "hidden"),
                         [(None, 1, 16), ("int8", 1, 16), ("int4", 1, 16), ("int4", 2, 16),
                          (DeflateCodec(MinMaxCodec(4, block=64), bits=3.0), 4, 256), ("int4", "auto", 16)],
                         ids=["fp32", "int8", "int4", "int4-overlap2", "int4-deflated-overlap4", "int4-auto"])
async def test_streaming_fragments_bit_identical_and_converging(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, codec: Any,
        overlap: Any, hidden: int) -> None:
    cluster = await pccl_cluster(3)
    cycles = 12
    out: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(train, cluster, i, nursery, cycles=cycles, codec=codec,
                                                   out=out, seed=i, overlap=overlap, hidden=hidden))
    states = [state_bytes(out[i][0].shared) for i in range(3)]
    assert states[0] == states[1] == states[2]  # outer parameters and outer optimizer state
    # identical before the run's end too: no sync fetched anything after the first (with "auto" the end's
    # is the only one after it: the membership votes ran in the background and nobody waited)
    assert all(out[i][0].core.unreported_rx == 0 for i in range(3))
    assert all(r.sync_rx_bytes == 0 for i in range(3) for r in out[i][3][1:])
    run, start, final, results = out[0]
    assert run.revision == (1 if overlap == "auto" else cycles)
    assert run.cycles == cycles and [r.index for r in results] == list(range(cycles * H))
    stats = run.statistics()["fragments"]
    assert len(stats) == 3 and [f["offset"] for f in stats] == [0, 2, 4]
    assert all(f["rounds"] == cycles and f["lost"] == 0 for f in stats)
    assert final < 0.2 * start, (start, final)
    # fragments are sent on their own steps: at most one fragment's bytes per step
    sending = [r.index % H for r in results if r.reduce_tx_bytes]
    # applied (and counted) overlap steps after the send, at the cycle's last step at the latest;
    # "auto": at a step after the send, before the fragment's next send (a cycle later) at the latest
    if overlap == "auto":
        assert sending and all(0 <= s_ < H for s_ in sending)
        assert all(0 < f["mean_overlap"] <= H for f in stats)
    else:
        assert set(sending) == {min(o + overlap, H - 1) for o in (0, 2, 4)}
    spec = codec_from_spec(codec)
    if spec is not None:
        # 3 peers: each round sends exactly the two-stage exchange's 2 (n - 1) payloads of a third of the
        # fragment (uncompressed, the library picks the schedule: for these tiny tensors not the ring)
        expected = sum(wire_bytes(spec, f["numel"], 4, 3) for f in stats)
        assert sum(r.reduce_tx_bytes for r in results) == cycles * expected
        if overlap != "auto":  # all applied within their cycle
            assert sum(r.reduce_tx_bytes for r in results[:H]) == expected
    if codec == "int4":
        fp32_bytes = wire_bytes(None, sum(f["numel"] for f in stats), 4, 3)
        assert expected < fp32_bytes / 4  # these fragments are tiny: the per-block min/max weigh
    if isinstance(codec, DeflateCodec):  # chunks of ~680 elements: deflated (the codec is shared)
        assert codec.encodes > 0 and all(f["encodes"] == codec.encodes for f in stats)


@pytest.mark.parametrize("overlap", [1, "auto"])
async def test_streaming_peer_killed_in_a_fragment_exchange_loses_only_that_round(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, overlap: Any) -> None:
    """A peer killed in fragment 1's exchange of cycle 3: only that round is lost (with ``"auto"`` every
    fragment's rounds then in flight are lost: those the shrunk group refuses are not started again,
    since the order in which each peer finds them refused depends on timing, and those launched before
    the dead peer was removed are lost with it), the
    survivors go on as two and end identical; with ``"auto"`` the membership votes in the background
    (every cycle) are answered by the survivors alone."""
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
            await train(cluster, i, nursery, cycles=10, codec="int4", out=out, overlap=overlap,
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
    if overlap == "auto":
        # a fragment's round in flight at the kill (refused by the shrunk group, not started again), and
        # one launched before the dead peer was removed (lost with it); which ones depends on timing
        lost = [f["lost"] for f in stats]
        assert lost[1] >= 1 and max(lost) <= 2 and all(f["rounds"] == 10 for f in stats), stats
    else:
        assert [f["lost"] for f in stats] == [0, 1, 0], stats  # only fragment 1's round of cycle 3
    assert run.cycles == 10 and len(results) == 10 * H
    # (with "auto" the world size is read where a vote is answered: at cycle 5's start at the latest)
    assert {r.world_size for r in results[(4 if overlap == 1 else 5) * H:]} == {2}
    assert final < 0.3 * start


@pytest.mark.parametrize("overlap", [1, "auto"])
async def test_streaming_admits_a_newcomer_mid_stream(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, overlap: Any) -> None:
    """A newcomer is admitted at a cycle's start; with ``"auto"`` the membership votes run in the
    background (the one that finds it waiting admits it at the next cycle's start): every peer ends with
    the same state, which the run's end sync finds identical (nothing fetched)."""
    cluster = await pccl_cluster(2)
    out: dict[int, Any] = {}
    cycle_2 = trio.Event()

    def at(step: Any) -> None:
        if step.index == 2 * H:  # the newcomer comes while the run is under way
            cycle_2.set()

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(train, cluster, i, nursery, cycles=10, codec="int4",
                                                   out=out, overlap=overlap, on_step=at if i == 0 else None))
            await cycle_2.wait()
            newcomer = await cluster.add_peer(admit=False)
            peers.start_soon(lambda: train(cluster, newcomer, nursery, cycles=10, codec="int4", out=out,
                                           seed=99, overlap=overlap))
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    assert all(out[i][0].core.unreported_rx == 0 for i in (0, 1, newcomer))
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
    for bad in ({"overlap": 4}, {"overlap": "fast"}, {"overlap": 2.5}, {"overlap": True}, {"mixing": 1.0},
                {"codec": "auto"}, {"codec": ["int4"]}, {"inner_steps": 0}, {"check_every": 0},
                {"check_every": True}, {"check_every": 1.5}):
        with pytest.raises(pccl.InvalidArgumentError):
            StreamingCore(model, opt, **{**base, **bad})


@pytest.mark.parametrize("check_every", [None, 4])
async def test_sync_every_spares_the_control_plane_and_the_end_syncs(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory,
        check_every: int | None) -> None:
    """``overlap="auto"``, membership at cycle 4 of 6: its vote (and the last cycle's) runs in the background
    and, nobody waiting, nothing syncs but the run's start and end: two syncs, the revision counting
    them. With ``check_every=4`` cycle 4 syncs too (three), and cycle 3's last round is deferred past that
    sync: the peers still sync identical states. Either way nothing is fetched (the states were identical
    at every sync), the peers end identical, and each model holds the final outer parameters."""
    cluster = await pccl_cluster(2)
    out: dict[int, Any] = {}
    fetched: dict[int, int] = {}

    async def one(i: int, nursery: trio.Nursery) -> None:
        x, y = problem()
        model = make_model(i)
        run = AsyncStreamingDiLoCo(cluster.peer(i), model, torch.optim.Adam(model.parameters(), lr=0.01),
                                   nursery=nursery, outer_optimizer=outer_sgd, inner_steps=H, fragments=2,
                                   codec="int8", sync_every=4, check_every=check_every, total_outer_steps=6)

        def backward(step: Any) -> float:
            idx = torch.from_numpy(step.shard(GLOBAL_BATCH, N))
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            return float(loss.detach())

        while (r := await run.step(backward)) is not None:
            if r.index > 0:  # (the first sync: a peer may take the other's initial state)
                fetched[i] = fetched.get(i, 0) + r.sync_rx_bytes
        out[i] = (run, model)

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(one, i, nursery)
    (run0, model0), (run1, model1) = out[0], out[1]
    syncs = 2 if check_every is None else 3
    assert run0.cycles == 6 and run0.revision == syncs - 1 and run0.core.syncs == syncs
    assert fetched == {0: 0, 1: 0} and run0.core.unreported_rx == run1.core.unreported_rx == 0
    assert state_bytes(run0.shared) == state_bytes(run1.shared)
    for m, run in ((model0, run0), (model1, run1)):
        pairs = zip(m.parameters(), run.outer_model.parameters(), strict=True)
        assert all(torch.equal(p, o) for p, o in pairs)


def _drive(core: Any, model: nn.Module, execute: Callable[[Any], Any]) -> list[StepResult]:
    """Run ``core`` to the end through ``execute`` (a stand-in for the group), training ``model`` on the
    test problem; the step results."""
    from pccl.torch._ops import drive

    x, y = problem()

    def backward(step: Any) -> float:
        idx = torch.from_numpy(step.shard(GLOBAL_BATCH, N))
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        return float(loss.detach())

    results: list[StepResult] = []
    while (r := drive(core.step(backward), execute)) is not None:
        results.append(r)
    return results


def _three_like_peers(done: bool, log: list[tuple[int, str]], core: Any) -> Callable[[Any], Any]:
    """An executor standing in for a group of 3 peers that all hold this peer's state (rank 0): an
    all-to-all delivers this peer's block 0 from every rank, an all-gather this peer's payload from
    every rank. ``done``: whether a poll finds the background collective finished."""
    from pccl._types import ReduceInfo
    from pccl.torch import _ops

    def execute(op: Any) -> Any:
        if isinstance(op, _ops.Members):
            return 0, 3
        if isinstance(op, _ops.StartAllReduce):
            reduce = op.reduce
            assert isinstance(reduce, (_ops.AllToAll, _ops.AllGather))
            log.append((core.inner_step, type(reduce).__name__))
            block = reduce.send.numel() // 3 if isinstance(reduce, _ops.AllToAll) else reduce.send.numel()
            reduce.recv.copy_(reduce.send[:block].repeat(3))
            return ReduceInfo(local_world_size=3, tx_bytes=2 * block, rx_bytes=2 * block)
        if isinstance(op, _ops.PollAllReduce):
            return done
        if isinstance(op, _ops.WaitAllReduce):
            return op.handle
        if isinstance(op, (_ops.PeersPending, _ops.UpdateTopology, _ops.StartPeersPending)):
            return False  # (a background vote's handle: its wait returns it, the answer "nobody waits")
        if isinstance(op, _ops.Sync):
            from types import SimpleNamespace
            return SimpleNamespace(rx_bytes=0)
        raise AssertionError(op)

    return execute


@pytest.mark.parametrize("done", [True, False], ids=["all-to-all-done", "all-to-all-late"])
def test_second_stage_starts_as_soon_as_the_all_to_all_is_done(done: bool) -> None:
    """The all-gather of the two-stage exchange goes out at the first step that finds the all-to-all
    finished (one step after the launch here), and ``overlap // 2`` steps after the launch at the
    latest; when it goes out changes no result."""
    from pccl.torch._streaming import StreamingCore

    outs = {}
    for poll in (done, not done):
        model = make_model(0, hidden=256)
        core = StreamingCore(model, torch.optim.Adam(model.parameters(), lr=0.01), outer_optimizer=outer_sgd,
                             inner_steps=12, fragments=1, overlap=8, mixing=0.5,
                             codec=DeflateCodec(MinMaxCodec(4, block=64), bits=3.0), error_feedback=True,
                             budget_bytes=None, total_outer_steps=3, just_joined=False, min_world_size=1,
                             poll_interval=0.05)
        log: list[tuple[int, str]] = []
        execute = _three_like_peers(poll, log, core)
        _drive(core, model, execute)
        gathers = [s for s, kind in log if kind == "AllGather"]
        assert [s for s, kind in log if kind == "AllToAll"] == [0, 0, 0]
        assert gathers == ([1, 1, 1] if poll else [4, 4, 4])
        outs[poll] = [p.detach().clone() for p in core.outer_model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False], strict=True))


class _Vote:
    """A membership vote in the background (the fake executors' handle)."""


class _SlowExchanges:
    """An executor standing in for a group of ``world`` peers holding this peer's state, whose
    background exchanges are found finished by the ``polls``-th poll of each. It logs every launch,
    poll answer and wait, with the inner step it came at, and the control plane's requests with the cycle
    and step (``events``). ``pending``: the master's answer to every membership vote, or one answer per
    vote in turn (then False); ``failing``: the background votes whose answer is an error (counted from 0)."""

    def __init__(self, core: Any, world: int, polls: int, pending: bool | list[bool] = False,
                 failing: tuple[int, ...] = ()) -> None:
        self.core, self.world, self.polls, self.pending = core, world, polls, pending
        self.failing, self.votes = failing, 0
        self.log: list[tuple[int, str, Any]] = []
        self.events: list[tuple[int, int, str]] = []  # (cycle, inner step, request) of the control plane
        self.deferred_at_syncs: list[list[int]] = []  # per sync: the fragments whose round was in flight

    def _answer(self) -> bool:
        if isinstance(self.pending, bool):
            return self.pending
        return self.pending.pop(0) if self.pending else False

    def __call__(self, op: Any) -> Any:
        from types import SimpleNamespace

        from pccl._types import ReduceInfo
        from pccl.torch import _ops

        step = self.core.inner_step
        if isinstance(op, _ops.Members):
            return 0, self.world
        if isinstance(op, _ops.StartAllReduce):
            reduce = op.reduce
            if isinstance(reduce, _ops.AllReduce):
                for send, recv in reduce.pairs:
                    recv.copy_(send)  # every peer sent the same: the average is this peer's
                sent = sum(send.numel() * send.element_size() for send, _ in reduce.pairs)
            else:
                block = reduce.send.numel() // self.world if isinstance(reduce, _ops.AllToAll) \
                    else reduce.send.numel()
                reduce.recv.copy_(reduce.send[:block].repeat(self.world))
                sent = (self.world - 1) * block
            self.log.append((step, "start", type(reduce).__name__))
            return SimpleNamespace(polled=0, info=ReduceInfo(local_world_size=self.world, tx_bytes=sent,
                                                             rx_bytes=sent))
        if isinstance(op, _ops.PollAllReduce):
            op.handle.polled += 1
            done = op.handle.polled >= self.polls
            self.log.append((step, "poll", done))
            return done
        cycle = self.core.cycle
        if isinstance(op, _ops.StartPeersPending):
            self.events.append((cycle, step, "vote"))
            self.log.append((step, "vote", None))
            return _Vote()
        if isinstance(op, _ops.WaitAllReduce) and isinstance(op.handle, _Vote):
            self.events.append((cycle, step, "answer"))
            self.votes += 1
            if self.votes - 1 in self.failing:
                raise pccl.RankConnectionLostError("the vote was lost with the master")
            answer = self._answer()
            self.log.append((step, "answer", answer))
            return answer
        if isinstance(op, _ops.WaitAllReduce):
            self.log.append((step, "wait", op.handle.polled >= self.polls))
            return op.handle.info
        if isinstance(op, _ops.PeersPending):
            self.events.append((cycle, step, "pending"))
            answer = self._answer()
            self.log.append((step, "pending", answer))
            return answer
        if isinstance(op, _ops.UpdateTopology):  # nothing in flight when newcomers are admitted
            assert not any(f.in_flight for f in self.core.fragments)
            self.events.append((cycle, step, "update"))
            self.log.append((step, "update", None))
            return False
        if isinstance(op, _ops.Sync):
            # at a sync nothing in flight but deferred rounds, which no peer applies before it
            assert all(f.deferred for f in self.core.fragments if f.in_flight)
            assert self.core._vote is None  # no vote left in flight
            self.deferred_at_syncs.append([f.index for f in self.core.fragments if f.in_flight])
            self.events.append((cycle, step, "sync"))
            self.log.append((step, "sync", None))
            return SimpleNamespace(rx_bytes=0)
        raise AssertionError(op)


@pytest.mark.parametrize("world, codec", [(2, None), (3, "int4")], ids=["fp32-2-peers", "int4-3-peers"])
@pytest.mark.parametrize("polls", [1, 3, 100], ids=["at-once", "third-poll", "never"])
def test_auto_overlap_applies_at_the_first_step_that_finds_the_exchange_done(
        world: int, codec: Any, polls: int) -> None:
    """``overlap="auto"``: an exchange is polled at every step after its send and applied at the
    first step that finds it done (the two-stage exchange's all-gather goes out at the first step
    that finds the all-to-all done); it is waited for only before its fragment's next send or at the
    run's end, when it is not done by then. (Membership at the run's start and end only: its last
    cycle sends fragment 1 at 4 = 1 * H // 3 instead of 6.)"""
    from pccl.torch._streaming import StreamingCore

    h, cycles = 12, 2
    for overlap in ("auto", 5):
        model = make_model(0, hidden=64)
        core = StreamingCore(model, torch.optim.Adam(model.parameters(), lr=0.01), outer_optimizer=outer_sgd,
                             inner_steps=h, fragments=2, overlap=overlap, mixing=0.0, codec=codec,
                             error_feedback=True, budget_bytes=None, total_outer_steps=cycles,
                             just_joined=False, min_world_size=1, poll_interval=0.05, sync_every=cycles + 1)
        execute = _SlowExchanges(core, world, polls)
        _drive(core, model, execute)
        if overlap != "auto":  # a fixed overlap applies at its step, after waiting there
            fixed = [s for s, kind, _ in execute.log if kind == "wait"]
            assert {5, 11} <= set(fixed) <= {1, 2, 5, 7, 8, 11}
            continue
        log = execute.log
        stages = 2 if world == 3 else 1
        # an exchange's stage takes ``polls`` polls, one per step from the step after its send: each
        # stage done at the ``polls``-th step after it went out (the second stage is first polled at
        # the step it goes out), applied then; never done: waited for after the cycle's last step
        lag = min(polls * stages - (stages - 1), h) if polls < 100 else h
        applied = [f["mean_overlap"] for f in core.statistics()["fragments"]]
        # fragment 0 sent at 0 and 12: until its next send (12) and the run's end (24) at the latest;
        # fragment 1 sent at 6 and at 16 (step 4 of the last cycle): until 16 and 24 at the latest
        assert applied == [min(lag, h), (min(lag, 10) + min(lag, 8)) / 2], (applied, log)
        # nothing waits before it is done, but before its fragment's next send (steps 0 and 4 of the
        # last cycle) or at the run's last step's end (h)
        waits = [(s, done) for s, kind, done in log if kind == "wait"]
        assert len(waits) == 2 * cycles * stages  # each stage's result read once
        assert all(done or s in (0, 4, h) for s, done in waits), waits
        if world == 3 and polls == 3:
            gathers = [s for s, kind, name in log if kind == "start" and name == "AllGather"]
            assert gathers == [3, 9, 3, 7]  # the all-to-all found done at its third poll


def test_auto_overlap_carries_an_exchange_into_the_next_cycle() -> None:
    """``overlap="auto"`` with membership every second cycle: an exchange still on the wire at a cycle's
    end is carried into the next cycle and waited for at its fragment's next send, or before a newcomer
    is admitted (cycle 2's vote, taken in the background, says one waits: admitted at cycle 3's start,
    every exchange applied first, then the sync); the run's last cycle waits for its own at its end."""
    from pccl.torch._streaming import StreamingCore

    h = 12
    model = make_model(0, hidden=64)
    core = StreamingCore(model, torch.optim.Adam(model.parameters(), lr=0.01), outer_optimizer=outer_sgd,
                         inner_steps=h, fragments=2, overlap="auto", mixing=0.5, codec=None,
                         error_feedback=True, budget_bytes=None, total_outer_steps=4, just_joined=False,
                         min_world_size=1, poll_interval=0.05, sync_every=2)
    # never found done: every exchange is waited for; a newcomer pending at every membership vote
    execute = _SlowExchanges(core, 2, polls=10**6, pending=True)
    results = _drive(core, model, execute)
    stats = core.statistics()["fragments"]
    # fragment 0 sent at 0, 12, 24, 36, applied at 12, 24, 36 (its next sends; 36 is cycle 3's admission
    # too), 48 (the run's end); fragment 1 sent at 6, 18, 30, 40 (at 4 = 1 * H // 3 in the run's last
    # cycle), applied at 18, 30 (its next sends), 36 (drained for the newcomer), 48
    assert [f["mean_overlap"] for f in stats] == [12.0, (12 + 12 + 6 + 8) / 4]
    assert all(f["rounds"] == 4 and f["lost"] == 0 for f in stats)
    waits = [s for s, kind, _ in execute.log if kind == "wait"]
    assert waits == [0, 6, 0, 6, 0, 0, h, h]  # inner step of the cycle (h: after its last step)
    assert execute.deferred_at_syncs == [[], [], []]  # drained before each admission, so before each sync
    # the run's start: a blocking vote; cycle 2's in the background, answered at cycle 3's start (which
    # admits, syncs, and so sends no vote of its own); the run's end: a blocking vote
    assert [e for e in execute.events if e[2] != "update"] == [
        (0, 0, "pending"), (0, 0, "sync"), (2, 0, "vote"), (3, 0, "answer"), (3, 0, "sync"),
        (4, 0, "pending"), (4, 0, "sync")]
    kinds = [kind for _, kind, _ in execute.log if kind != "poll"]
    admitted = kinds.index("answer")
    assert kinds[admitted:admitted + 5] == ["answer", "wait", "wait", "update", "sync"]
    assert core.syncs == 3  # cycles 0, 3 and the run's end
    # every round's bytes in some step's result, the last ones in the last step's
    assert sum(r.reduce_tx_bytes for r in results) == sum(f["tx_bytes"] for f in stats) > 0


@pytest.mark.parametrize(
    "answers, failing", [([], ()), ([False, False, True], ()), ([False, False, False, True], ()), ([], (0,))],
    ids=["nobody-waits", "a-newcomer-at-cycle-4", "a-newcomer-at-the-end", "a-vote-lost"])
def test_auto_overlap_votes_in_the_background_and_syncs_only_to_admit(
        answers: list[bool], failing: tuple[int, ...]) -> None:
    """``overlap="auto"``, membership every second cycle of 6: the vote of cycles 2 and 4 goes out at the
    cycle's start and inner steps go on; its answer is read at the next cycle's start (every peer alike:
    the master's). Nobody waits: no sync there (the outer state is identical by construction), the run's
    first cycle syncs, and its final sync comes in its last cycle at the step where the last round lands
    (11: sent at 6 = 2 * H // 4, two stages of 3 polls), with the last cycle's vote (5) read before it
    and the cycle count synced as the run's end (6); the steps left then run without any request, and the
    run's end makes none. A newcomer waits (cycle 4's answer): admitted at cycle 5's start, every exchange
    applied before, then the sync; the final sync then votes itself. A newcomer waiting at the last
    cycle's vote is admitted before the final sync (which gives it the cycle count 6: it ends at once).
    A vote lost with the master (every member sees that): the next cycle's start votes again, blocking,
    and syncs. Exchanges taking 5 steps are never waited for."""
    from pccl.torch._streaming import StreamingCore

    h, cycles = 12, 6
    model = make_model(0, hidden=64)
    core = StreamingCore(model, torch.optim.Adam(model.parameters(), lr=0.01), outer_optimizer=outer_sgd,
                         inner_steps=h, fragments=3, overlap="auto", mixing=0.5, codec="int4",
                         error_feedback=True, budget_bytes=None, total_outer_steps=cycles, just_joined=False,
                         min_world_size=1, poll_interval=0.05, sync_every=2)
    execute = _SlowExchanges(core, 3, polls=3, pending=list(answers), failing=failing)
    results = _drive(core, model, execute)
    events = execute.events
    if answers == [False, False, False, True]:  # admitted at the final sync, which says the run is over
        assert events == [(0, 0, "pending"), (0, 0, "sync"), (2, 0, "vote"), (3, 0, "answer"),
                          (4, 0, "vote"), (5, 0, "answer"), (5, 0, "vote"), (5, 11, "answer"),
                          (5, 11, "update"), (6, 11, "sync")]
    elif answers:
        assert events == [(0, 0, "pending"), (0, 0, "sync"), (2, 0, "vote"), (3, 0, "answer"),
                          (4, 0, "vote"), (5, 0, "answer"), (5, 0, "update"), (5, 0, "sync"),
                          (5, 11, "pending"), (6, 11, "sync")]
        kinds = [kind for _, kind, _ in execute.log if kind not in ("poll", "start")]
        at = kinds.index("update")
        assert "wait" in kinds[kinds.index("answer", kinds.index("answer") + 1):at]  # drained first
    elif failing:
        assert events == [(0, 0, "pending"), (0, 0, "sync"), (2, 0, "vote"), (3, 0, "answer"),
                          (3, 0, "pending"), (3, 0, "sync"), (4, 0, "vote"), (5, 0, "answer"),
                          (5, 0, "vote"), (5, 11, "answer"), (6, 11, "sync")]
    else:
        assert events == [(0, 0, "pending"), (0, 0, "sync"), (2, 0, "vote"), (3, 0, "answer"),
                          (4, 0, "vote"), (5, 0, "answer"), (5, 0, "vote"), (5, 11, "answer"),
                          (6, 11, "sync")]
        # the vote is in flight while the cycle's inner steps train
        assert sum(1 for r in results if 2 * h <= r.index < 3 * h) == h
        assert [s for s, kind, done in execute.log if kind == "wait" and not done] == []
        assert core.syncs == 2 and core.shared.revision == 1
    assert execute.log[-1][1] == "sync"  # nothing after the final sync
    assert [r.index for r in results] == list(range(cycles * h)) and core.cycle == cycles
    pairs = zip(model.parameters(), core.outer_model.parameters(), strict=True)
    assert all(torch.equal(p, o) for p, o in pairs)
    stats = core.statistics()["fragments"]
    assert all(f["rounds"] == cycles and f["lost"] == 0 for f in stats)
    assert sum(r.reduce_tx_bytes for r in results) == sum(f["tx_bytes"] for f in stats) > 0


@pytest.mark.parametrize("early", [True, False], ids=["defer-and-send-early", "neither"])
def test_auto_overlap_defers_the_last_round_past_a_sync_and_sends_early_at_the_end(early: bool) -> None:
    """``overlap="auto"`` with a sync every second cycle (``check_every=2``): the last fragment's round of a
    cycle that ends at a sync point of the run is deferred: applied by no peer before that point's sync
    (nor polled), so the sync does not wait for it, then applied when found done; the run's last cycle
    sends fragment ``p`` of ``P`` at ``p * H // (P + 1)`` instead of ``p * H // P``, so the last exchange
    arrives before the run's end. An exchange that takes 5 steps is then never waited for. With neither
    (``early=False``, patched out) it is waited for at cycle 2's sync and at the run's end."""
    from pccl.torch._streaming import StreamingCore

    h = 12
    model = make_model(0, hidden=64)
    core = StreamingCore(model, torch.optim.Adam(model.parameters(), lr=0.01), outer_optimizer=outer_sgd,
                         inner_steps=h, fragments=3, overlap="auto", mixing=0.5, codec=None,
                         error_feedback=True, budget_bytes=None, total_outer_steps=4, just_joined=False,
                         min_world_size=1, poll_interval=0.05, sync_every=2, check_every=2)
    assert [(f.offset, f.early_offset) for f in core.fragments] == [(0, 0), (4, 3), (8, 6)]
    if not early:
        for f in core.fragments:
            f.early_offset = f.offset
        core._defers = lambda f: False  # type: ignore[method-assign]
    execute = _SlowExchanges(core, 2, polls=5)  # found done at the 5th poll after its send
    results = _drive(core, model, execute)
    sends = [s for s, kind, _ in execute.log if kind == "start"]
    assert sends == ([0, 4, 8] * 3 + [0, 3, 6] if early else [0, 4, 8] * 4)
    # a wait for an exchange not found done yet (the result of one found done is read at once)
    waits = [s for s, kind, done in execute.log if kind == "wait" and not done]
    stats = core.statistics()["fragments"]
    assert all(f["rounds"] == 4 and f["lost"] == 0 for f in stats)
    # cycles 0 and 2, and the final sync: at step 11 of the last cycle, where its last round lands (sent at
    # 6, found done at its 5th poll); without the early send that round is waited for at the run's end
    assert [s for s, kind, _ in execute.log if kind == "sync"] == ([0, 0, 11] if early else [0, 0, 0])
    if early:
        assert waits == []
        assert execute.deferred_at_syncs == [[], [2], []]  # cycle 1's last round still on the wire at 2's
        # the last fragment: cycle 0's round (sent at 8) carried and applied at 12 (its 5th poll, the cycle's
        # end check being the 4th: 4 steps); cycle 1's (20) deferred, first polled after cycle 2's sync
        # and applied at 28 (8); cycle 2's at 36 (4); the last cycle's (42) at 47 (5)
        assert stats[2]["mean_overlap"] == (4 + 8 + 4 + 5) / 4
        assert [f["mean_overlap"] for f in stats[:2]] == [5.0, 5.0]
    else:
        assert waits == [0, h]  # at cycle 2's sync, and at the run's end
        assert execute.deferred_at_syncs == [[], [], []]
    assert sum(r.reduce_tx_bytes for r in results) == sum(f["tx_bytes"] for f in stats) > 0
