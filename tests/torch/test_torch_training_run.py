"""TrainingRun: data-parallel training on a pccl.testing cluster equals single-process training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
import trio.testing
from _torchrun_helpers import (
    KillMidReduce,
    float_data,
    integer_data,
    linear_model,
    max_difference,
    mlp,
    mse_backward,
    sgd,
    single_process,
    state_bytes,
)

import pccl
from pccl.testing import TestCluster
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import AsyncDiLoCo, AsyncTrainingRun, SharedModel, StepResult


async def train_peers(cluster: TestCluster, make: Any, steps: int, *, bucket_bytes: int = 64,
                      ) -> dict[int, tuple[SharedModel, list[StepResult]]]:
    """Every live peer trains ``steps`` steps with its own (model, optimizer, backward) from ``make(i)``."""
    out: dict[int, tuple[SharedModel, list[StepResult]]] = {}

    async def one(i: int) -> None:
        model, opt, backward = make(i)
        shared = SharedModel(model, opt)
        run = AsyncTrainingRun(cluster.peer(i), shared, total_steps=steps, bucket_bytes=bucket_bytes)
        results = []
        while (r := await run.step(backward)) is not None:
            results.append(r)
        out[i] = (shared, results)

    async with trio.open_nursery() as nursery:
        for i in cluster.alive:
            nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("bucket_bytes", [64, 8], ids=["one-bucket", "a-bucket-per-tensor"])
async def test_two_peers_equal_single_process_exactly_in_float64(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, bucket_bytes: int) -> None:
    """Power-of-two shards of integer data with dyadic weights: every rounding is the same, so the
    two peers' state is bit-identical to the single-process run's."""
    cluster = await pccl_cluster(2)
    x, y = integer_data()
    steps, batch = 6, 8

    def make(i: int) -> Any:
        model = linear_model()
        return model, sgd(model), mse_backward(model, x, y, batch)

    trained = await train_peers(cluster, make, steps, bucket_bytes=bucket_bytes)
    model = linear_model()
    reference = state_bytes(single_process(model, sgd(model), x, y, batch, steps))
    for shared, results in trained.values():
        assert [r.index for r in results] == list(range(steps))
        assert all(r.world_size == 2 and r.attempts == 1 for r in results)
        assert all(r.sync_rx_bytes == 0 for r in results)  # identical starts: nothing ever moves
        assert state_bytes(shared) == reference
        assert shared.revision == steps


async def test_three_peers_adam_float32_within_tolerance(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """float32, an MLP and Adam, 3 peers: the average of the three shard means differs from the global
    mean by rounding only; after 10 steps every tensor is within 1e-5 of the single-process run's and the
    peers are bit-identical to each other."""
    cluster = await pccl_cluster(3)
    x, y = float_data()
    steps, batch = 10, 12

    def make(i: int) -> Any:
        model = mlp()
        return model, torch.optim.Adam(model.parameters(), lr=1e-2), mse_backward(model, x, y, batch)

    trained = await train_peers(cluster, make, steps, bucket_bytes=256)
    model = mlp()
    reference = single_process(model, torch.optim.Adam(model.parameters(), lr=1e-2), x, y, batch, steps)
    states = [state_bytes(s) for s, _ in trained.values()]
    assert states[0] == states[1] == states[2]
    shared = trained[0][0]
    assert max_difference(shared, reference) < 1e-5
    untrained = mlp()
    assert max_difference(shared, SharedModel(untrained, torch.optim.Adam(untrained.parameters()))) > 1e-2
    # The optimizer state is shared too: Adam's step counters and moments.
    assert float(shared.tensors()["optim/0.weight/step"]) == steps


async def test_newcomer_catches_up_then_matches(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """One peer trains alone (the whole global batch), a second one joins with different weights and
    no optimizer state: its first sync gives it the model and the momentum, and from then on both
    peers are bit-identical to the single-process run (float64, exact)."""
    cluster = await pccl_cluster(1)
    x, y = integer_data()
    steps, batch = 8, 8
    out: dict[int, tuple[SharedModel, list[StepResult]]] = {}
    progress = trio.Condition()
    done_steps = [0]

    async def peer(i: int, scramble: int | None) -> None:
        model = linear_model(scramble=scramble)
        opt = sgd(model)
        shared = SharedModel(model, opt)
        run = AsyncTrainingRun(cluster.peer(i), shared, total_steps=steps)
        results = []
        while (r := await run.step(mse_backward(model, x, y, batch))) is not None:
            results.append(r)
            if i == 0:
                async with progress:
                    done_steps[0] = r.index + 1
                    progress.notify_all()
        out[i] = (shared, results)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer, 0, None)
        async with progress:
            while done_steps[0] < 3:
                await progress.wait()
        newcomer = await cluster.add_peer(admit=False)  # the training loop admits it
        nursery.start_soon(peer, newcomer, 7)

    model = linear_model()
    reference = state_bytes(single_process(model, sgd(model), x, y, batch, steps))
    (old, old_results), (new, new_results) = out[0], out[newcomer]
    assert state_bytes(old) == state_bytes(new) == reference
    first = new_results[0]
    assert first.index >= 3 and first.sync_rx_bytes > 0  # it caught up: received the state
    assert all(r.sync_rx_bytes == 0 for r in new_results[1:])  # and stayed identical
    assert [r.index for r in new_results] == list(range(first.index, steps))
    assert {r.world_size for r in old_results[:3]} == {1}
    assert {r.world_size for r in new_results} == {2}


@pytest.mark.parametrize("n", [3, 2], ids=["3-to-2-peers", "2-to-1-peer"])
async def test_peer_killed_mid_step_is_retried_and_states_stay_identical(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, n: int) -> None:
    """The last peer dies in the middle of step 4's gradient all-reduce. The survivors' step fails, is
    retried with the survivors (the same global batch, resharded; a lone survivor takes all of it), and
    training goes on. The survivors end bit-identical, and equal to the single-process run: within
    float64 rounding from 3 peers to 2 (a division by 3), exactly from 2 peers to 1."""
    cluster = await pccl_cluster(n)
    x, y = integer_data()
    steps, batch, victim, kill_step = 8, 4 * n, n - 1, 4
    survivors = list(range(n - 1))
    hook = KillMidReduce(cluster, victim)
    assert cluster.network is not None
    cluster.network.add_hook(hook)
    out: dict[int, tuple[SharedModel, list[StepResult], list[tuple[int, int, int]]]] = {}

    async def peer(i: int) -> None:
        model = linear_model()
        shared = SharedModel(model, sgd(model))
        run = AsyncTrainingRun(cluster.peer(i), shared, total_steps=steps, bucket_bytes=16)
        seen: list[tuple[int, int, int]] = []
        inner = mse_backward(model, x, y, batch, seen)

        def backward(step: Any) -> float:
            if i == victim and step.index == kill_step:
                hook.armed = True
            return inner(step)

        results = []
        while (r := await run.step(backward)) is not None:
            results.append(r)
        out[i] = (shared, results, seen)

    finished = {i: trio.Event() for i in survivors}

    async def survivor(i: int) -> None:
        await peer(i)
        finished[i].set()

    for i in cluster.alive:
        cluster.start_soon(i, survivor if i in survivors else peer, i)  # a killed peer's task is cancelled
    for event in finished.values():
        await event.wait()
    assert hook.fired and victim not in out
    shared0, results0, seen0 = out[0]
    for i in survivors:
        assert state_bytes(out[i][0]) == state_bytes(shared0)
        assert [r.world_size for r in out[i][1]] == [r.world_size for r in results0]
    retried = results0[kill_step]
    assert retried.index == kill_step and retried.attempts >= 2 and retried.world_size == n - 1
    assert (kill_step, n, 0) in seen0 and (kill_step, n - 1, retried.attempts - 1) in seen0
    assert [r.world_size for r in results0] == [n] * kill_step + [n - 1] * (steps - kill_step)
    assert all(r.attempts == 1 for r in results0 if r.index != kill_step)
    model = linear_model()
    reference = single_process(model, sgd(model), x, y, batch, steps)
    if n == 2:
        assert state_bytes(shared0) == state_bytes(reference)
    else:
        assert max_difference(shared0, reference) < 1e-12


async def test_bfloat16_and_float16_parameters(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """Half-precision parameters and gradients are reduced in their own dtype; the peers stay
    bit-identical and the loss goes down."""
    cluster = await pccl_cluster(2)
    x, y = float_data(dtype=torch.float32)

    def make(dtype: torch.dtype) -> Any:
        def f(i: int) -> Any:
            model = mlp(dtype=dtype)
            losses: list[float] = []
            base = mse_backward(model, x.to(dtype), y.to(dtype), 16)

            def backward(step: Any) -> float:
                losses.append(base(step))
                return losses[-1]

            return model, torch.optim.SGD(model.parameters(), lr=0.05), backward
        return f

    for dtype in (torch.bfloat16, torch.float16):
        trained = await train_peers(cluster, make(dtype), 20, bucket_bytes=128)
        (a, ra), (b, _) = trained[0], trained[1]
        assert state_bytes(a) == state_bytes(b)
        assert all(t.dtype == dtype for k, t in a.tensors().items() if k.startswith("param/"))
        assert sum(float(r.loss) for r in ra[-5:]) < sum(float(r.loss) for r in ra[:5])


async def test_shared_model_keys_and_optimizer_state_up_front() -> None:
    """Keys are stable names; Adam's state exists before the first step and the weights are untouched."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    shared = SharedModel(model, opt, extra={"cursor": torch.zeros(1, dtype=torch.int64)})
    keys = list(shared.tensors())
    assert keys[:2] == ["param/0.weight", "param/0.bias"]
    assert "buffer/1.running_mean" in keys and "buffer/1.num_batches_tracked" in keys
    assert "optim/0.weight/exp_avg" in keys and "optim/1.bias/step" in keys and keys[-1] == "extra/cursor"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # weight decay did not move anything
    assert all(float(v.abs().sum()) == 0 for k, v in shared.tensors().items() if k.startswith("optim/"))
    # The first real step is exactly the one a fresh optimizer takes.
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(before)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1, weight_decay=0.5)
    batch = torch.randn(4, 3)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(batch).sum().backward()
        o.step()
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    with pytest.raises(pccl.InvalidArgumentError):
        SharedModel(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


async def test_bad_arguments_raise_invalid_argument(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(2)
    model = linear_model()
    with pytest.raises(pccl.InvalidArgumentError, match="optimizer"):
        AsyncTrainingRun(cluster.peer(0), SharedModel(model))
    with pytest.raises(pccl.InvalidArgumentError):
        AsyncTrainingRun(cluster.peer(0), SharedModel(model, sgd(model)), max_in_flight=0)
    with pytest.raises(pccl.InvalidArgumentError):
        AsyncTrainingRun(cluster.peer(0), SharedModel(model, sgd(model)), bucket_bytes=0)
    with pytest.raises(pccl.InvalidArgumentError, match="nursery"):
        AsyncDiLoCo(cluster.peer(0), model, sgd(model), delayed=True)
    with pytest.raises(pccl.InvalidArgumentError):
        AsyncDiLoCo(cluster.peer(0), model, sgd(model), inner_steps=0)


async def test_comm_statistics_says_which_call_a_blocked_step_waits_in(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """A peer whose step waits for another (here: one that has not called yet) says so through
    ``comm_statistics``: the call it is in, its peer id and its group; it is back to no call after."""
    cluster = await pccl_cluster(2)
    x, y = integer_data()
    runs, backwards = [], []
    for i in range(2):
        model = linear_model()
        runs.append(AsyncTrainingRun(cluster.peer(i), SharedModel(model, sgd(model)), total_steps=1))
        backwards.append(mse_backward(model, x, y, 8))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runs[0].step, backwards[0])
        with trio.fail_after(60):
            while (stats := runs[0].comm_statistics())["membership_call"] is None:
                await trio.sleep(0.01)  # polls peer 0's state (mock time) until its step is in a call
        assert stats["membership_call"] == "sync_shared_state"
        assert stats["peer_id"] == cluster.peer(0).peer_id and stats["group_world_size"] == 2
        assert stats["master_ok"] and stats["ops_in_flight"] == 0
        await runs[1].step(backwards[1])  # the other peer comes: both steps end
    assert runs[0].comm_statistics()["membership_call"] is None
    assert runs[0].revision == runs[1].revision == 1
