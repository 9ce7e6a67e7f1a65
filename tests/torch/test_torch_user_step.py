"""The user-owned step (``with run.step() as s:``), shared LR schedulers, checkpoints and resume."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from _torchrun_helpers import KillMidReduce, float_data, max_difference, mlp, state_bytes
from torch import nn

import pccl
from pccl.blocking import MasterNode
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import AsyncTrainingRun, SharedModel, TrainingRun, global_batch_indices

BATCH, STEPS, CLIP = 12, 10, 0.05


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = mlp(seed, torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def reference(steps: int) -> SharedModel:
    """Single-process torch: the same global batches, clipping and schedule."""
    x, y = float_data(dtype=torch.float64)
    model, opt, sched = make()
    shared = SharedModel(model, opt, scheduler=sched)
    for s in range(steps):
        idx = torch.from_numpy(global_batch_indices(s, BATCH, len(x)))
        opt.zero_grad(set_to_none=False)
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
    shared.before_sync()  # the scheduler's position into its shared tensors, as a driver's sync does
    return shared


async def test_user_step_with_clipping_and_a_scheduler_matches_single_process(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """3 peers, float64, the update owned by the loop (clipping of the averaged gradients, a StepLR),
    the last peer killed in step 4's all-reduce: the step is retried with the survivors on the cached
    batch, and both survivors end within 1e-12 of single-process training, scheduler included."""
    cluster = await pccl_cluster(3)
    x, y = float_data(dtype=torch.float64)
    hook = KillMidReduce(cluster, 2)
    assert cluster.network is not None
    cluster.network.add_hook(hook)
    out: dict[int, Any] = {}
    finished = {i: trio.Event() for i in (0, 1)}

    async def peer(i: int) -> None:
        model, opt, sched = make()
        shared = SharedModel(model, opt, scheduler=sched)
        run = AsyncTrainingRun(cluster.peer(i), shared, total_steps=STEPS, bucket_bytes=64)
        loads: list[int] = []
        attempts: list[tuple[int, int, int]] = []
        while True:
            async with run.step() as s:
                if s.done:
                    break

                def load(s: Any = s) -> Any:
                    loads.append(s.index)
                    return torch.from_numpy(global_batch_indices(s.index, BATCH, len(x)))

                whole = s.batch(load)  # the step's global batch, loaded once however often it is tried
                base, extra = divmod(BATCH, s.world_size)  # this peer's contiguous share of it
                start = s.rank * base + min(s.rank, extra)
                idx = whole[start:start + base + (1 if s.rank < extra else 0)]
                assert torch.equal(idx, torch.from_numpy(s.shard(BATCH, len(x))))
                attempts.append((s.index, s.world_size, s.attempt))
                if i == 2 and s.index == 4:
                    hook.armed = True
                nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                if await s.all_reduce_grads():
                    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                    opt.step()
                    sched.step()
        out[i] = (shared, loads, attempts, sched)
        if i in finished:
            finished[i].set()

    for i in cluster.alive:
        cluster.start_soon(i, peer, i)
    for event in finished.values():
        await event.wait()
    assert hook.fired and 2 not in out
    ref = reference(STEPS)
    for i in (0, 1):
        shared, loads, attempts, sched = out[i]
        assert loads == list(range(STEPS))  # step 4 was tried twice, its batch loaded once
        assert (4, 3, 0) in attempts and any(a[:2] == (4, 2) and a[2] >= 1 for a in attempts)
        assert max_difference(shared, ref) < 1e-12
        assert sched.last_epoch == STEPS and sched.get_last_lr() == ref.scheduler.get_last_lr()
    assert state_bytes(out[0][0]) == state_bytes(out[1][0])


def test_step_block_misuse_is_reported() -> None:
    with MasterNode("127.0.0.1:0") as master:
        master.run()
        model, opt, _ = make()
        with TrainingRun(master.address, SharedModel(model, opt), total_steps=2) as run:
            with pytest.raises(pccl.InvalidUsageError), run.step() as s:
                s.should_commit()
            with pytest.raises(pccl.InvalidUsageError), run.step():
                pass  # no all_reduce_grads()
            assert run.revision == 0


def test_scheduler_state_travels_and_bad_schedulers_are_refused() -> None:
    model, opt, sched = make()
    _, other_opt, _ = make(1)
    with pytest.raises(pccl.InvalidArgumentError):
        SharedModel(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(other_opt, 2))
    shared = SharedModel(model, opt, scheduler=sched)
    for _ in range(4):
        opt.step()
        sched.step()
    state = shared.state_dict()
    m2, o2, s2 = make(5)
    fresh = SharedModel(m2, o2, scheduler=s2)
    fresh.load_state_dict(state)
    assert s2.last_epoch == 4 and s2.get_last_lr() == sched.get_last_lr() == [o2.param_groups[0]["lr"]]
    assert state_bytes(fresh) == state_bytes(shared)
    with pytest.raises(pccl.InvalidArgumentError):
        SharedModel(*make()[:2]).load_state_dict(state)  # no scheduler: keys differ
    with pytest.raises(pccl.InvalidArgumentError):
        fresh.load_state_dict({"tensors": {}})


def _train_blocking(address: str, steps: int, ckpt: Path | None, save_at: int | None, seed: int = 0,
                    resume: Path | None = None, min_world_size: int = 1, wait_at: int | None = None,
                    reached: threading.Event | None = None) -> SharedModel:
    x, y = float_data(dtype=torch.float64)
    model, opt, sched = make(seed)
    shared = SharedModel(model, opt, scheduler=sched)
    with TrainingRun(address, shared, total_steps=steps, min_world_size=min_world_size) as run:
        if resume is not None:
            run.resume(resume)
        while True:
            with run.step() as s:
                if s.done:
                    break
                idx = torch.from_numpy(s.shard(BATCH, len(x)))
                nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                if s.all_reduce_grads():
                    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                    opt.step()
                    sched.step()
            if save_at is not None and ckpt is not None and run.revision == save_at:
                run.save(ckpt)
            if wait_at is not None and run.revision == wait_at:
                run.core.min_world_size = 2  # from here on, wait (in the driver) for a second peer
                if reached is not None:
                    reached.set()
    return shared


def test_a_run_restarted_from_a_checkpoint_continues(tmp_path: Path) -> None:
    """Train 4 steps and save; a new run (a fresh master, a fresh process state) resumes from the file
    and trains to 10: the result equals 10 uninterrupted steps (float64, within 1e-12)."""
    ckpt = tmp_path / "run.pt"
    with MasterNode("127.0.0.1:0") as master:
        master.run()
        _train_blocking(master.address, 4, ckpt, save_at=4)
    with MasterNode("127.0.0.1:0") as master:
        master.run()
        resumed = _train_blocking(master.address, STEPS, None, None, seed=9, resume=ckpt)
    assert resumed.revision == STEPS
    assert max_difference(resumed, reference(STEPS)) < 1e-12


def test_a_peer_restarted_from_a_newer_checkpoint_joins_the_running_group(tmp_path: Path) -> None:
    """A checkpoint at revision 50 (another run's) and a group at a lower revision: the restarted peer
    takes the group's state instead of being refused ("revision 50 skips ahead"), and both peers end
    identical and equal to single-process training."""
    ckpt = tmp_path / "late.pt"
    with MasterNode("127.0.0.1:0") as master:
        master.run()
        _train_blocking(master.address, 50, ckpt, save_at=50, seed=3)
    with MasterNode("127.0.0.1:0") as master:
        master.run()
        out: dict[int, SharedModel] = {}
        first_done, waiting = threading.Event(), threading.Event()

        def first() -> None:  # alone up to revision 5 (synced), then it waits for the second peer
            out[0] = _train_blocking(master.address, 40, None, None, min_world_size=1, wait_at=5,
                                     reached=waiting)
            first_done.set()

        t = threading.Thread(target=first)
        t.start()
        assert waiting.wait(60)
        out[1] = _train_blocking(master.address, 40, None, None, seed=4, resume=ckpt)
        t.join(60)
    assert first_done.is_set()
    assert state_bytes(out[0]) == state_bytes(out[1])
    assert out[1].revision == 40
    assert max_difference(out[1], reference(40)) < 1e-12


@pytest.mark.parametrize("kind", ["training-run", "diloco"])
async def test_min_world_size_timeout_gives_up(autojump_clock: trio.testing.MockClock,
                                               pccl_cluster: ClusterFactory, kind: str) -> None:
    """A peer alone, waiting for a second one that never comes: TooFewPeersError after the limit
    (virtual time), instead of waiting for ever."""
    from pccl.torch import AsyncDiLoCo

    cluster = await pccl_cluster(1)
    model, opt, _ = make()
    run: Any
    if kind == "training-run":
        run = AsyncTrainingRun(cluster.peer(0), SharedModel(model, opt), min_world_size=2,
                               min_world_size_timeout=1.5)
    else:
        run = AsyncDiLoCo(cluster.peer(0), model, opt, inner_steps=2, min_world_size=2,
                          min_world_size_timeout=1.5)
    start = trio.current_time()
    with pytest.raises(pccl.TooFewPeersError):
        await run.step(lambda step: None)
    assert 1.5 <= trio.current_time() - start < 2.5


def _poison(model: nn.Module) -> None:
    grad = next(model.parameters()).grad
    assert grad is not None
    grad.view(-1)[0] = float("inf")


def _scaled_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> None:
    """The update once the averaged (scaled) gradients are in ``.grad``."""
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    scaler.step(opt)  # skipped where the unscaled gradients are not finite
    scaler.update()


async def test_grad_scaler_with_the_user_owned_step_skips_and_rescales_on_every_peer(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """torch.amp.GradScaler("cpu") in the user-owned step, 3 peers, float64: the scaled gradients are
    averaged, unscaled, clipped; peer 1's gradient made infinite at step 5 poisons the average on every
    peer, so all of them skip that step and halve the scale; the scale grows every 3 clean steps alike.
    Every peer ends with the same scale history and parameters as single-process training that sees the
    same infinity, within 1e-12."""
    if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):
        pytest.skip("this torch has no torch.amp.GradScaler")
    cluster = await pccl_cluster(3)
    x, y = float_data(dtype=torch.float64)
    bad = 5

    def scaler() -> Any:
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)

    ref_model, ref_opt, _ = make()
    ref_scaler = scaler()
    ref_scales, ref_skipped = [], []
    for step in range(STEPS):
        idx = torch.from_numpy(global_batch_indices(step, BATCH, len(x)))
        ref_opt.zero_grad(set_to_none=False)
        ref_scaler.scale(nn.functional.mse_loss(ref_model(x[idx]), y[idx])).backward()
        if step == bad:
            _poison(ref_model)
        before = [p.detach().clone() for p in ref_model.parameters()]
        _scaled_step(ref_model, ref_opt, ref_scaler)
        after = list(ref_model.parameters())
        ref_skipped.append(all(torch.equal(a, p) for a, p in zip(before, after, strict=True)))
        ref_scales.append(ref_scaler.get_scale())
    assert ref_skipped == [s == bad for s in range(STEPS)]  # the reference does what the test claims
    assert ref_scales[bad] == ref_scales[bad - 1] / 2 and max(ref_scales) > 2.0**10
    ref = SharedModel(ref_model, ref_opt)

    out: dict[int, Any] = {}

    async def peer(i: int) -> None:
        model, opt, _ = make()
        shared = SharedModel(model, opt)
        grad_scaler = scaler()
        scales: list[float] = []
        run = AsyncTrainingRun(cluster.peer(i), shared, total_steps=STEPS)
        while True:
            async with run.step() as s:
                if s.done:
                    break
                idx = torch.from_numpy(s.shard(BATCH, len(x)))
                grad_scaler.scale(nn.functional.mse_loss(model(x[idx]), y[idx])).backward()
                if i == 1 and s.index == bad:
                    _poison(model)
                if await s.all_reduce_grads():
                    _scaled_step(model, opt, grad_scaler)
                    scales.append(grad_scaler.get_scale())
        out[i] = (shared, scales)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(peer, i)
    for i in range(3):
        shared, scales = out[i]
        assert scales == ref_scales
        assert max_difference(shared, ref) < 1e-12
    assert state_bytes(out[0][0]) == state_bytes(out[1][0]) == state_bytes(out[2][0])
