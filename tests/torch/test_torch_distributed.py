"""The "pccl" torch.distributed backend: each collective against Gloo on the same inputs, DDP against Gloo's
DDP, and the Manager through a peer killed mid-step and a newcomer (real OS processes, a real master).

Each multi-process test starts its processes once and checks everything they saved (torch is slow to
import on a shared machine): they are marked ``slow``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pccl.blocking import MasterNode
from pccl.torch._dist_plan import NEW_PEER_OFFSET, assign_ranks, chunk_bounds

WORKER = Path(__file__).with_name("_dist_worker.py")
ROOT = Path(__file__).resolve().parents[2]
WAIT = 240.0  # bound on a whole multi-process run (2 shared cores; normally 10-30 s)


# ---------------------------------------------------------------------------------------------------
# the pure parts


def test_first_configuration_gives_the_ranks_asked_for() -> None:
    asked = [2, 0, 1]  # by ring position
    assert assign_ranks([NEW_PEER_OFFSET + r for r in asked]) == asked


def test_survivors_keep_their_order_and_newcomers_follow() -> None:
    # ring: survivor rank 2, newcomer asking 0, survivor rank 0, newcomer asking nothing (-1)
    hints = [2, NEW_PEER_OFFSET + 0, 0, NEW_PEER_OFFSET - 1]
    assert assign_ranks(hints) == [1, 3, 0, 2]


def test_duplicate_requests_are_told_apart_by_ring_position() -> None:
    assert assign_ranks([NEW_PEER_OFFSET + 1, NEW_PEER_OFFSET + 1]) == [0, 1]


def test_chunk_bounds_tile_the_buffer() -> None:
    for count in (0, 1, 7, 12):
        for n in (1, 2, 3, 5):
            bounds = [chunk_bounds(count, n, i) for i in range(n)]
            assert bounds[0][0] == 0 and bounds[-1][1] == count
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_backend_is_registered_on_import() -> None:
    import torch.distributed as dist

    import pccl.torch  # noqa: F401

    assert "PCCL" in dist.Backend._plugins
    assert dist.Backend("pccl") == "pccl"


# ---------------------------------------------------------------------------------------------------
# multi-process


@pytest.fixture
def master() -> Iterator[str]:
    node = MasterNode("127.0.0.1:0")
    node.run()
    try:
        yield node.address
    finally:
        node.interrupt()


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with log.open("wb") as f:
        return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=f, stderr=subprocess.STDOUT,
                                env=env, stdin=subprocess.DEVNULL)


def _finish(procs: list[tuple[subprocess.Popen[bytes], Path]], deadline: float) -> list[int]:
    codes = []
    try:
        for p, _ in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def _run(scenario: str, world: int, master: str, tmp: Path, *extra: str) -> list[dict[str, Any]]:
    store = tmp / "gloo_store"
    procs = []
    for r in range(world):
        log = tmp / f"log{r}.txt"
        procs.append((_spawn([scenario, str(r), str(world), master, str(store), str(tmp / f"out{r}.pt"),
                              *extra], log), log))
    codes = _finish(procs, time.monotonic() + WAIT)
    for (_, log), code in zip(procs, codes, strict=True):
        assert code == 0, f"{log.name} exited {code}:\n{log.read_text()[-4000:]}"
    return [torch.load(tmp / f"out{r}.pt", weights_only=False) for r in range(world)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return all(_same(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_collectives_match_gloo(master: str, tmp_path: Path) -> None:
    results = _run("collectives", 3, master, tmp_path)
    for rank, res in enumerate(results):
        gloo, ours = res["gloo"], res["pccl"]
        assert gloo.keys() == ours.keys()
        for key in gloo:
            if key.startswith("all_reduce/float"):
                # float sums in another order than Gloo's ring: equal within rounding
                assert torch.allclose(ours[key], gloo[key], rtol=1e-6 if "32" in key else 1e-13, atol=0), key
            else:
                assert _same(ours[key], gloo[key]), (rank, key, ours[key], gloo[key])
        # every rank ends with the same bits where the results are the same for all (float sums included)
        for key in ours:
            if key.split("/")[0] in ("all_reduce", "broadcast", "all_gather", "coalesced", "async"):
                assert _same(ours[key], results[0]["pccl"][key]), key
        only = res["pccl_only"]
        expected_avg = torch.arange(6, dtype=torch.float64) * (1 + 2 + 3) / 3
        assert torch.equal(only["all_reduce/float64/AVG"], expected_avg)
        assert only["reduce/kept_off_root"] is True  # the root has the sum; the others keep their bits
        assert "send" in only["unsupported/send"] and "not supported" in only["unsupported/send"]
        assert "recv" in only["unsupported/recv"]
        assert "BAND" in only["unsupported/BAND"]
        assert "new_group: subgroups are not supported" in only["unsupported/new_group"]


@pytest.mark.slow
def test_ddp_and_fsdp2_float64_match_gloo(master: str, tmp_path: Path) -> None:
    results = _run("ddp", 3, master, tmp_path, "6")
    for res in results:
        for name, ref in res["gloo"].items():
            assert float((res["pccl"][name] - ref).abs().max()) <= 1e-12, name
            assert float((res["pccl"][name] - res["reference"][name]).abs().max()) <= 1e-12, name
            assert torch.equal(res["pccl"][name], results[0]["pccl"][name]), name
            assert torch.equal(res["pccl_pg"][name], res["pccl"][name]), name
        # FSDP2 (fully_shard) on the CPU mesh of the default group: Gloo's parameters within 1e-12
        for name, ref in res["gloo_fsdp"].items():
            assert float((res["pccl_fsdp"][name] - ref).abs().max()) <= 1e-12, name
            assert torch.equal(res["pccl_fsdp"][name], results[0]["pccl_fsdp"][name]), name


@pytest.mark.slow
def test_manager_survives_a_killed_peer_and_admits_a_newcomer(master: str, tmp_path: Path) -> None:
    total, kill_at, victim = 10, 3, 2
    marker = tmp_path / "marker"
    procs = []
    for r in range(3):
        log = tmp_path / f"log{r}.txt"
        procs.append((_spawn(["manager", str(r), "3", master, str(marker), str(tmp_path / f"out{r}.pt"),
                              str(total), str(kill_at), str(victim)], log), log))
    deadline = time.monotonic() + WAIT
    while not marker.exists():  # rank 0 writes it once the survivors committed steps after the loss
        assert time.monotonic() < deadline and procs[0][0].poll() is None, (tmp_path / "log0.txt").read_text()
        time.sleep(0.05)
    log3 = tmp_path / "log3.txt"
    procs.append((_spawn(["manager", "-1", "3", master, str(marker), str(tmp_path / "out3.pt"),
                          str(total), str(kill_at), str(victim)], log3), log3))
    codes = _finish(procs, deadline)
    assert codes[victim] == -9
    for i in (0, 1, 3):
        assert codes[i] == 0, procs[i][1].read_text()[-4000:]
    out = {i: torch.load(tmp_path / f"out{i}.pt", weights_only=False) for i in (0, 1, 3)}
    # everyone ends at the same step with bit-identical parameters, the newcomer included
    for i in (1, 3):
        assert out[i]["step"] == total
        for name, t in out[0]["params"].items():
            assert torch.equal(out[i]["params"][name], t), (i, name)
    # the kill step was discarded once on the survivors, then redone with 2 peers
    log0 = out[0]["log"]
    assert (kill_at, 0, 3, False) in log0 and (kill_at, 0, 2, True) in log0
    assert [s for s, *_, ok in log0 if ok] == list(range(total))
    # the newcomer received the whole state, joined at rank 2 of 3 and committed the remaining steps
    assert out[3]["first_sync_rx"] > 0
    assert out[3]["log"][0][1:3] == (2, 3)
    assert all(ok for *_, ok in out[3]["log"])
    # and the run computed what one process computes on the same global batches
    ref = _reference(total)
    for name, t in out[0]["params"].items():
        assert float((t - ref[name]).abs().max()) <= 1e-12, name


def _reference(steps: int) -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(WORKER.parent))
    try:
        import _dist_worker

        return _dist_worker.reference(steps)
    finally:
        sys.path.remove(str(WORKER.parent))


@pytest.mark.slow
def test_the_plain_ddp_example_runs_under_pccl_run() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    script = str(ROOT / "examples" / "torch_ddp.py")
    proc = subprocess.run([sys.executable, "-m", "pccl", "run", "-n", "2", script, "--short"],
                          capture_output=True, text=True, timeout=WAIT, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pccl: 2 ranks, 5 steps, parameters identical on every rank: True" in proc.stdout


def test_the_plain_ddp_example_started_without_the_launcher_says_how() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PCCL_MASTER"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_ddp.py"), "--short"],
                          capture_output=True, text=True, timeout=WAIT, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(
        "torch_ddp.py: error: no PCCL_MASTER: start it with 'pccl run -n 3 examples/torch_ddp.py'")


# ---------------------------------------------------------------------------------------------------
# several groups in this process (one background thread each): fast, and a peer can be closed on cue


def _groups(address: str, world: int) -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    from pccl.torch.distributed import ProcessGroupPCCL

    with ThreadPoolExecutor(world) as pool:  # each waits in formation until all are in
        futures = [pool.submit(ProcessGroupPCCL, address, rank=r, world_size=world) for r in range(world)]
        return [f.result(timeout=60) for f in futures]


def _each(groups: list[Any], fn: Any) -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(groups)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn, g) for g in groups]]


def test_a_lost_peer_fails_the_call_with_buffers_restored_until_reconfigured(master: str) -> None:
    import torch.distributed as dist

    from pccl.torch.distributed import PeerLostError

    groups = _groups(master, 3)
    try:
        assert sorted(g.rank() for g in groups) == [0, 1, 2] and all(g.size() == 3 for g in groups)
        survivors = [g for g in groups if g.rank() != 1]
        victim = next(g for g in groups if g.rank() == 1)
        buffers = [torch.arange(5, dtype=torch.float64) + g.rank() for g in survivors]
        before = [b.clone() for b in buffers]
        works = [g.allreduce([b]) for g, b in zip(survivors, buffers, strict=True)]
        victim.close()  # the survivors wait for it in this all-reduce
        for w, b, old in zip(works, buffers, before, strict=True):
            with pytest.raises(PeerLostError, match="all_reduce"):
                w.wait()
            assert torch.equal(b, old)
            assert isinstance(w.exception(), PeerLostError) and not w.is_success()
            with pytest.raises(PeerLostError):
                w.get_future().wait()
        # every later call of this configuration fails the same way (the group has 2 peers, not 3)
        later = [g.broadcast([torch.zeros(2)]) for g in survivors]
        for w in later:
            with pytest.raises(PeerLostError, match="broadcast"):
                w.wait()
        # reconfigured: ranks 0 and 2 become 0 and 1, and collectives work again
        configs = _each(survivors, lambda g: g.reconfigure())
        assert sorted(c.rank for c in configs) == [0, 1] and all(c.size == 2 for c in configs)
        old_rank0 = survivors[0]
        assert old_rank0.rank() == 0 and survivors[1].rank() == 1
        outs = [[torch.zeros(3, dtype=torch.int64) for _ in range(2)] for _ in survivors]
        works = [g.allgather([o], [torch.full((3,), 10 + g.rank(), dtype=torch.int64)])
                 for g, o in zip(survivors, outs, strict=True)]
        for w in works:
            w.wait()
        for o in outs:
            assert [t.tolist() for t in o] == [[10] * 3, [11] * 3]
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]
        avg = [torch.full((4,), float(g.rank()), dtype=torch.float64) for g in survivors]
        for w in [g.allreduce([t], opts) for g, t in zip(survivors, avg, strict=True)]:
            w.wait()
        assert all(torch.equal(t, torch.full((4,), 0.5, dtype=torch.float64)) for t in avg)
    finally:
        for g in groups:
            g.close()


def test_a_group_of_one_computes_locally(master: str) -> None:
    import torch.distributed as dist

    from pccl.torch.distributed import UnsupportedOperationError

    (g,) = _groups(master, 1)
    try:
        t = torch.arange(3, dtype=torch.float32)
        g.allreduce([t]).wait()
        assert t.tolist() == [0.0, 1.0, 2.0]
        out = torch.zeros(3)
        g._allgather_base(out, t).wait()
        assert torch.equal(out, t)
        fut = g.barrier().get_future()
        fut.wait()
        with pytest.raises(UnsupportedOperationError, match="send"):
            g.send([t], 0, 0)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.BXOR  # type: ignore[assignment]
        with pytest.raises(UnsupportedOperationError, match="BXOR"):
            g.allreduce([t], opts)
        with pytest.raises(UnsupportedOperationError, match="one tensor per call"):
            g.allreduce([t, t])
    finally:
        g.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_are_staged_like_pccls_own(master: str) -> None:
    import torch.distributed as dist

    groups = _groups(master, 2)
    try:
        def calls(g: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            r = g.rank()
            t = (torch.arange(1000, dtype=torch.float32, device="cuda") + r)
            g.allreduce([t]).wait()
            gathered = torch.zeros(2 * 3, dtype=torch.int64, device="cuda")
            g._allgather_base(gathered, torch.full((3,), r, dtype=torch.int64, device="cuda")).wait()
            opts = dist.BroadcastOptions()
            opts.rootRank = 1
            b = torch.full((4,), float(r), device="cuda")
            g.broadcast([b], opts).wait()
            return t.cpu(), gathered.cpu(), b.cpu()

        results = _each(groups, calls)
        expected = torch.arange(1000, dtype=torch.float32) * 2 + 1
        for t, gathered, b in results:
            assert torch.equal(t, expected)
            assert gathered.tolist() == [0, 0, 0, 1, 1, 1]
            assert torch.equal(b, torch.ones(4))
    finally:
        for g in groups:
            g.close()


def test_manager_in_one_process_loses_a_peer_and_admits_a_newcomer(master: str) -> None:
    """The Manager's protocol without DDP or extra processes: gradients of a linear model averaged with
    ``manager.allreduce``; rank 1 leaves in the middle of step 2 (after its peers launched the all-reduce);
    after step 4 a newcomer is admitted (the survivors wait for it with min_world_size)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pccl.torch import SharedModel
    from pccl.torch.distributed import Manager, ProcessGroupPCCL

    total, leave_at, join_after = 7, 2, 4
    x = torch.arange(48, dtype=torch.float64).reshape(24, 2) / 16
    y = x @ torch.tensor([[0.5], [-0.25]], dtype=torch.float64)
    joined = threading.Event()

    def train(pg: ProcessGroupPCCL, seed: int) -> tuple[list[tuple[int, int, bool]], torch.Tensor, Manager]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(2, 1, dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        mgr = Manager(SharedModel(model, opt), process_group=pg)
        log: list[tuple[int, int, bool]] = []
        while mgr.step < total:
            mgr.start_step()
            step, n = mgr.step, mgr.world_size
            idx = torch.arange(24).reshape(n, -1)[mgr.rank]  # 24 splits evenly among 1-4 peers
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            futures = [mgr.allreduce(p.grad) for p in model.parameters()]  # type: ignore[arg-type]
            if pg.rank() == 1 and step == leave_at and n == 3 and seed == 0:
                pg.close()  # leaves while its peers wait in these all-reduces
                return log, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), mgr
            for f in futures:
                f.wait()
            ok = mgr.should_commit()
            if ok:
                opt.step()
            log.append((step, n, ok))
            if ok and step == join_after and seed == 0:
                mgr.min_world_size = 3
                joined.set()
        return log, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), mgr

    groups = _groups(master, 3)
    try:
        with ThreadPoolExecutor(4) as pool:
            runs = [pool.submit(train, g, 0) for g in groups]
            assert joined.wait(60)
            newcomer = pool.submit(lambda: train(ProcessGroupPCCL(master, world_size=3), 1))
            results = [r.result(timeout=60) for r in runs] + [newcomer.result(timeout=60)]
    finally:
        for g in groups:
            g.close()
    left = next(i for i, g in enumerate(groups) if len(results[i][0]) == leave_at)
    survivors = [results[i] for i in range(3) if i != left]
    for log, _, mgr in survivors:
        assert (leave_at, 3, False) in log and (leave_at, 2, True) in log
        assert [s for s, _, ok in log if ok] == list(range(total))
        assert mgr.step == total
    new_log, new_params, new_mgr = results[3]
    assert new_mgr.last_sync_rx_bytes > 0 and new_log[0][:2] == (join_after + 1, 3)  # healed, then trained
    assert new_mgr.pg.joined_running_group
    for _, params, _ in survivors:
        assert torch.equal(params, new_params)
    new_mgr.pg.close()
