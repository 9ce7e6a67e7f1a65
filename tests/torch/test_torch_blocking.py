"""The blocking drivers (TrainingRun, DiLoCo) over loopback TCP with a MasterNode, one thread per peer;
the data-sharding helpers; CUDA tensors (skipped without a GPU)."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from _torchrun_helpers import integer_data, linear_model, mse_backward, sgd, single_process, state_bytes
from torch import nn

import pccl
from pccl.blocking import MasterNode
from pccl.torch import DiLoCo, SharedModel, StreamingDiLoCo, TrainingRun, global_batch_indices, shard_indices

T = TypeVar("T")


def run_threads(target: Callable[[int], T], n: int) -> dict[int, T]:
    out: dict[int, T] = {}
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            out[i] = target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_training_run_blocking_two_peers_equal_single_process() -> None:
    x, y = integer_data()
    steps, batch = 5, 8
    with MasterNode("127.0.0.1:0") as master:
        master.run()

        def peer(i: int) -> dict[str, bytes]:
            model = linear_model()
            shared = SharedModel(model, sgd(model))
            with TrainingRun(master.address, shared, total_steps=steps, min_world_size=2) as run:
                while (r := run.step(mse_backward(model, x, y, batch))) is not None:
                    assert r.world_size == 2 and run.world_size == 2 and run.rank in (0, 1)
                assert run.revision == steps
            return state_bytes(shared)

        states = run_threads(peer, 2)
    model = linear_model()
    assert states[0] == states[1] == state_bytes(single_process(model, sgd(model), x, y, batch, steps))


def test_diloco_blocking_delayed_two_peers() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.randn(4, 1, generator=g)
    # The initial model is made here, once: two threads seeding and drawing from torch's one global
    # generator at the same time would interleave their draws (and differ from the reference below).
    torch.manual_seed(0)
    init = nn.Linear(4, 1)
    with MasterNode("127.0.0.1:0") as master:
        master.run()

        def peer(i: int) -> tuple[dict[str, bytes], float]:
            model = copy.deepcopy(init)
            with DiLoCo(master.address, model, torch.optim.SGD(model.parameters(), lr=0.1), inner_steps=4,
                        delayed=True, total_outer_steps=6, min_world_size=2,
                        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.5)) as d:
                while d.step(mse_backward(model, x, y, 16)) is not None:
                    pass
                with torch.no_grad():
                    loss = float(nn.functional.mse_loss(d.outer_model(x), y))
                return state_bytes(d.shared), loss

        out = run_threads(peer, 2)
    assert out[0][0] == out[1][0]
    with torch.no_grad():
        start = float(nn.functional.mse_loss(init(x), y))
    assert out[0][1] < 0.2 * start


def test_training_run_reports_an_unreachable_master() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(pccl.MasterConnectionError):
        TrainingRun("127.0.0.1:1", SharedModel(model, sgd(model)), connect_attempts=1)


def test_sharding_is_deterministic_and_covers_the_global_batch() -> None:
    for step in (0, 1, 7, 25):
        batch = global_batch_indices(step, 12, 100, seed=3)
        assert len(set(batch.tolist())) == 12
        for world in (1, 2, 3, 5):
            shards = [shard_indices(step, 12, 100, r, world, seed=3) for r in range(world)]
            assert np.array_equal(np.concatenate(shards), batch)  # resharding keeps the global batch
            assert max(map(len, shards)) - min(map(len, shards)) <= 1
    # Epochs: each visits every sample at most once; a new epoch is a new permutation.
    epoch = np.concatenate([global_batch_indices(s, 12, 100) for s in range(8)])
    assert len(set(epoch.tolist())) == 96
    assert not np.array_equal(global_batch_indices(8, 12, 100), global_batch_indices(0, 12, 100))
    with pytest.raises(pccl.InvalidArgumentError):
        shard_indices(0, 12, 100, 3, 3)
    with pytest.raises(pccl.InvalidArgumentError):
        global_batch_indices(0, 101, 100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")
def test_training_run_cuda_parameters() -> None:
    """CUDA parameters, gradients and optimizer state: same result as on the CPU."""
    x, y = integer_data()
    steps, batch = 5, 8
    with MasterNode("127.0.0.1:0") as master:
        master.run()

        def peer(i: int) -> dict[str, bytes]:
            model = linear_model().cuda()
            shared = SharedModel(model, sgd(model))
            xc, yc = x.cuda(), y.cuda()
            with TrainingRun(master.address, shared, total_steps=steps, min_world_size=2) as run:
                while run.step(mse_backward(model, xc, yc, batch)) is not None:
                    pass
            return state_bytes(shared)

        states = run_threads(peer, 2)
    model = linear_model()
    assert states[0] == states[1] == state_bytes(single_process(model, sgd(model), x, y, batch, steps))


def test_pccl_itself_never_imports_torch() -> None:
    code = ("import sys, pccl, pccl.blocking, pccl.testing, pccl.testing.pytest_plugin; "
            "assert 'torch' not in sys.modules, 'pccl imported torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("overlap", [4, "auto"])
def test_streaming_blocking_three_peers_bit_identical_launching_without_a_hop(overlap: Any) -> None:
    """StreamingDiLoCo from three threads, deflated int4 (chunks of ~1,400 elements) and the two-stage
    exchange: identical outer states; the launches and the polls of background exchanges never wait
    on the driver's trio thread (only membership, syncs and unfinished exchanges do); with ``"auto"``
    (membership every second cycle) neither does a membership vote sent into the background, and the
    run's end sync fetches nothing."""
    from pccl.torch import StreamingDiLoCo

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = torch.tanh(x @ torch.randn(4, 1, generator=g))
    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(4, 1024), nn.Tanh(), nn.Linear(1024, 1))
    with MasterNode("127.0.0.1:0") as master:
        master.run()

        def peer(i: int) -> tuple[dict[str, bytes], dict[str, float], list[dict[str, int]]]:
            model = copy.deepcopy(init)
            with StreamingDiLoCo(master.address, model, torch.optim.Adam(model.parameters(), lr=0.01),
                                 inner_steps=6, fragments=2, overlap=overlap, codec="int4",
                                 total_outer_steps=4, min_world_size=3, sync_every=2) as run:
                while run.step(mse_backward(model, x, y, 24)) is not None:
                    pass
                assert run.core.unreported_rx == 0 and run.core.syncs == (2 if overlap == "auto" else 3)
                return state_bytes(run.shared), dict(run._blocking.wait_by_op), run.statistics()["fragments"]

        out = run_threads(peer, 3)
    assert out[0][0] == out[1][0] == out[2][0]
    for _, waits, stats in out.values():
        assert not {"StartAllReduce", "StartPeersPending", "PollAllReduce", "Members"} & set(waits), waits
        assert [(f["rounds"], f["lost"]) for f in stats] == [(4, 0), (4, 0)]
        assert stats[0]["encodes"] == 4 * (3 + 1)  # per round: the 3 chunks, then the owned chunk's average


def test_training_run_comm_statistics_from_another_thread() -> None:
    """The blocking driver reads its communicator's statistics in its background thread, so any thread
    may ask (a supervisor, a signal handler in the main thread)."""
    x, y = integer_data()
    with MasterNode("127.0.0.1:0") as master:
        master.run()
        model = linear_model()
        with TrainingRun(master.address, SharedModel(model, sgd(model)), total_steps=2) as run:
            while run.step(mse_backward(model, x, y, 8)) is not None:
                pass
            stats = run_threads(lambda i: run.comm_statistics(), 1)[0]
        assert stats["world_size"] == 1 and stats["master_ok"] and stats["membership_call"] is None
        assert stats["ops_in_flight"] == 0 and stats["peer_id"] >= 0
        with pytest.raises(pccl.PCCLError):
            run.comm_statistics()  # closed: a domain error, not a raw trio one


def _diloco_replaying(address: str, model: nn.Module, config: pccl.PeerConfig, min_world_size: int) -> Any:
    return DiLoCo(address, model, torch.optim.SGD(model.parameters(), lr=0.01), inner_steps=2,
                  total_outer_steps=150, min_world_size=min_world_size, config=config, replay_heals=True)


def _streaming_replaying(address: str, model: nn.Module, config: pccl.PeerConfig, min_world_size: int) -> Any:
    return StreamingDiLoCo(address, model, torch.optim.SGD(model.parameters(), lr=0.01), inner_steps=2,
                           fragments=2, overlap=1, codec="int8", total_outer_steps=150,
                           min_world_size=min_world_size, config=config, replay_heals=True)


@pytest.mark.parametrize("make_driver", [_diloco_replaying, _streaming_replaying],
                         ids=["diloco", "streaming"])
def test_blocking_replay_heals_a_newcomer_while_the_members_go_on(make_driver: Any) -> None:
    """The blocking DiLoCo and StreamingDiLoCo (int8, two fragments) with ``replay_heals`` (the fetch runs
    in the driver's background thread): a newcomer joins two members mid-run; its heal, slowed by the
    members' serving cap, runs live while the members go on with their rounds (it takes part in their
    exchanges, contributing nothing); it replays them, joins their next sync and ends bit-identical."""
    init = nn.Sequential(nn.Linear(4, 2048), nn.Linear(2048, 1))  # ~160 KiB of shared state
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.randn(4, 1, generator=g)
    capped = pccl.PeerConfig(state_serve_rate=64 * 1024.0)  # the heal takes over a second
    started = threading.Event()
    with MasterNode("127.0.0.1:0") as master:
        master.run()

        def peer(i: int) -> tuple[dict[str, bytes], int]:
            model = copy.deepcopy(init)
            if i == 2:
                started.wait(30)
            with make_driver(master.address, model, capped, 1 if i == 2 else 2) as run:
                while (r := run.step(mse_backward(model, x, y, 16))) is not None:
                    if i == 0 and r.index == 10:
                        started.set()  # the members run: the newcomer may come
                return state_bytes(run.shared), run.core.rounds_replayed

        out = run_threads(peer, 3)
    assert out[0][0] == out[1][0] == out[2][0]
    assert out[2][1] >= 2  # it took part in (and replayed) the members' rounds while it fetched


@pytest.mark.parametrize("driver, kwargs, says", [
    (StreamingDiLoCo, {"replay_heals": True}, "replay_heals needs an integer overlap"),
    (StreamingDiLoCo, {"check_every": 0}, "check_every must be None or an int >= 1"),
    (StreamingDiLoCo, {"inner_steps": 0, "overlap": 3}, "inner_steps, min_world_size and sync_every"),
    (DiLoCo, {"delayed": True, "replay_heals": True}, "replay_heals is built for delayed=False"),
], ids=["stream-replay-auto", "stream-check-every", "stream-inner-steps", "diloco-replay-delayed"])
def test_blocking_drivers_refuse_bad_schedules_before_connecting(driver: Any, kwargs: dict[str, Any],
                                                                 says: str) -> None:
    """A bad schedule argument is refused as such before the driver connects: with no master at the
    address (nothing listens there) the user gets the argument's error, not a connection failure."""
    model = nn.Linear(2, 2)
    with pytest.raises(pccl.InvalidArgumentError, match=says):
        driver("127.0.0.1:9", model, torch.optim.SGD(model.parameters(), lr=0.1), connect_attempts=1,
               **kwargs)
