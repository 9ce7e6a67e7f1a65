#!/usr/bin/env python
"""Run the established PCCL library's own Python tests and examples (pypccl 1.0) against this pccl.

Not part of CI (the upstream sources are not in this repository). Usage::

    python scripts/upstream_compat.py UPSTREAM [--only NAME ...] [--stress-seconds 90] [--keep]

``UPSTREAM`` is a checkout of github.com/PrimeIntellect-ai/pccl (the directory that holds ``python/``) or a
bare git directory of it (then ``--rev``, default ``release/v1.0.0``, is exported; files whose objects are
missing, such as the MNIST archives, are skipped). Everything runs on a temporary copy; the upstream scripts
keep their code, only these environment adaptations are applied (each one is printed):

* the upstream package ``python/framework/pccl`` is replaced by a shim that re-exports this pccl (some
  upstream scripts import ``python.framework.pccl._pccl``), and the copy's root is put on ``PYTHONPATH``;
* masters listen on ``127.0.0.1`` instead of ``0.0.0.0``;
* offline stand-ins: ``torchvision`` (``datasets.MNIST``: a small synthetic 28x28, 10-class data set, the same
  in every process; ``transforms.ToTensor``), ``imageio`` and ``PIL`` (only imported by the nanoGPT profiler's
  video export, which a short run never reaches), and synthetic ``data/openwebtext/{train,val}.bin`` token
  files in the format the nanoGPT scripts read;
* CPU instead of CUDA: small nanoGPT configs (``device: cpu``, ``float32``, a tiny model, a few iterations)
  written in the upstream JSON format, and ``torch.cuda.synchronize`` made a no-op when torch has no CUDA
  (``train_pccl.py`` calls it unconditionally). The DiLoCo scripts build their outer parameters with
  ``local_p.detach().cpu()``, a copy on CUDA but the model's own tensor on CPU (so the outer step is a no-op
  and the peers drift apart, which their ``rx_bytes == 0`` assertion catches); they run unchanged (expected
  to fail on CPU, with pypccl as well) and as ``cpu_*.py`` copies with ``.cpu().clone()``;
* fewer steps: ``STEPS`` of the basic reduce peer, ``MAX_STEPS`` of the MNIST DDP peer (an environment
  variable it reads), the stress orchestrator's duration and peer count; the stress orchestrator's macOS
  TextEdit pop-up is a print;
* the basic stress test's current peer never prints the ``Reduce completed RX:`` line its orchestrator
  waits for (so no peer is ever marked alive or killed, with pypccl too): it is judged by the
  orchestrator's verdict, the peers' progress and the absence of peer failures, and it runs a second time
  with the orchestrator spawning the ``stress_test_peer_old.py`` next to it, which prints that line;
* the numpy-only test runs with torch hidden from imports (as in a venv without torch);
* the pytorch-only test runs twice: unchanged (it asserts numpy is absent: numpy is a dependency of this
  pccl, so that assertion fails by design) and with that one assertion removed;
* the MNIST DiLoCo peer loop has no exit condition upstream: it runs for a fixed time and its log is checked
  (outer steps made, no traceback).

Prints a table ``test or example | verdict | time`` and exits 1 when something not expected to fail failed.
The upstream scripts' masters all listen on 127.0.0.1:48148: a test that finds another process there is a
FAIL saying so (another job's master would take its peers); on a shared machine run the script in a network
namespace of its own: ``unshare -rn sh -c 'ip link set lo up && python scripts/upstream_compat.py UPSTREAM'``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OURS = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------------------
# stand-in modules (written into <tmp>/_standins, first on PYTHONPATH)

_SITECUSTOMIZE = '''
"""Environment adaptations for running upstream scripts (see scripts/upstream_compat.py)."""
import importlib.abc
import os
import sys

_HIDDEN = [n for n in os.environ.get("PCCL_COMPAT_HIDE", "").split(",") if n]


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in _HIDDEN):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by upstream_compat)", name=name)
        return None


if _HIDDEN:
    sys.meta_path.insert(0, _Hide())

if os.environ.get("PCCL_COMPAT_CPU_CUDA_SYNC") == "1":
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
'''

_TORCHVISION_INIT = '''
"""Offline stand-in for torchvision (upstream_compat): only what the MNIST scripts use."""
from . import datasets, transforms  # noqa: F401
'''

_TORCHVISION_TRANSFORMS = '''
import numpy as np
import torch


class ToTensor:
    """HxW uint8 image -> 1xHxW float tensor in [0, 1]."""

    def __call__(self, image):
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).unsqueeze(0)
'''

_TORCHVISION_DATASETS = '''
import numpy as np


class MNIST:
    """Synthetic stand-in for MNIST: 28x28 uint8 images of 10 noisy class prototypes, the same everywhere."""

    def __init__(self, root, train=True, transform=None, download=False):
        rng = np.random.default_rng(0)
        prototypes = rng.integers(0, 256, size=(10, 28, 28)).astype(np.float32)
        n = 4096 if train else 1024
        rng = np.random.default_rng(1 if train else 2)
        self.targets = rng.integers(0, 10, size=n)
        noise = rng.normal(0.0, 40.0, size=(n, 28, 28))
        self.data = np.clip(prototypes[self.targets] + noise, 0, 255).astype(np.uint8)
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        image = self.data[i]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[i])
'''

_IMAGEIO = '''
"""Stand-in for imageio (upstream_compat): the nanoGPT profiler imports it for a video export."""


def get_writer(*args, **kwargs):
    raise RuntimeError("imageio stand-in: video export is not available")
'''

_PIL_INIT = '''
"""Stand-in for PIL (upstream_compat): the nanoGPT profiler imports it for a video export."""
from . import Image, ImageDraw, ImageFont  # noqa: F401
'''

_PIL_SUB = '''
def __getattr__(name):
    raise RuntimeError("PIL stand-in: drawing is not available")
'''

_SHIM_INIT = '''
"""Shim (upstream_compat): the upstream package replaced by this pccl."""
from pccl import *  # noqa: F401,F403
from pccl import cuda  # noqa: F401
'''

_SHIM_PCCL = '''
from pccl._pccl import *  # noqa: F401,F403
'''


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())


def _standins(root: Path) -> Path:
    d = root / "_standins"
    _write(d / "sitecustomize.py", _SITECUSTOMIZE)
    _write(d / "torchvision" / "__init__.py", _TORCHVISION_INIT)
    _write(d / "torchvision" / "transforms.py", _TORCHVISION_TRANSFORMS)
    _write(d / "torchvision" / "datasets.py", _TORCHVISION_DATASETS)
    _write(d / "imageio.py", _IMAGEIO)
    _write(d / "PIL" / "__init__.py", _PIL_INIT)
    for sub in ("Image", "ImageDraw", "ImageFont"):
        _write(d / "PIL" / f"{sub}.py", _PIL_SUB)
    return d


# ---------------------------------------------------------------------------------------------------------
# the copy and its adaptations

ADAPTATIONS: list[str] = []


def _export(upstream: Path, rev: str, dest: Path) -> None:
    if (upstream / "python").is_dir():
        shutil.copytree(upstream / "python", dest / "python", ignore=shutil.ignore_patterns("MNIST", "*.pth"))
        return
    git = ["git", f"--git-dir={upstream}"]
    names = subprocess.run([*git, "ls-tree", "-r", "--name-only", rev, "python/"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run([*git, "show", f"{rev}:{name}"], capture_output=True)
        if blob.returncode != 0:
            continue  # an object the mirror does not hold (the MNIST archives)
        out = dest / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(blob.stdout)


def _sub(path: Path, pattern: str, replacement: str, why: str, count: int = 0) -> None:
    text = path.read_text()
    new, n = re.subn(pattern, replacement, text, count=count)
    if n == 0:
        raise SystemExit(f"adaptation not applicable to {path}: {pattern!r}")
    path.write_text(new)
    rel = path.relative_to(path.parents[len(path.parents) - 1])
    for parent in path.parents:
        if parent.name == "python":
            rel = path.relative_to(parent.parent)
            break
    ADAPTATIONS.append(f"{rel}: {why}")


def _adapt(py: Path) -> None:
    shutil.rmtree(py / "framework" / "pccl")
    _write(py / "framework" / "pccl" / "__init__.py", _SHIM_INIT)
    _write(py / "framework" / "pccl" / "_pccl.py", _SHIM_PCCL)
    ADAPTATIONS.append("python/framework/pccl: replaced by a shim re-exporting this pccl")
    for master in py.rglob("*.py"):
        if "0.0.0.0:" in master.read_text():
            _sub(master, r"0\.0\.0\.0:", "127.0.0.1:", "master listens on loopback instead of 0.0.0.0")
    _sub(py / "tests/end_to_end/basic_reduce_test/peer.py", r"STEPS: int = 1000", "STEPS: int = 20",
         "STEPS 1000 -> 20")
    for kind in ("basic_stress_test", "cross_step_async_reduces_test"):
        orch = py / "tests/stress_tests" / kind / "stresstest_orchestrator.py"
        _sub(orch, r'subprocess\.run\(\["open", "-a", "TextEdit", rtf_path\]\)', "print(message, flush=True)",
             "macOS TextEdit pop-up -> print")
        _sub(orch, r"run_stress_test\(duration_hours=8\.0, max_peers=10\)",
             "run_stress_test(duration_hours=float(os.environ['STRESS_SECONDS']) / 3600, max_peers=4)",
             "8 hours / 10 peers -> STRESS_SECONDS / 4 peers")
    basic = py / "tests/stress_tests/basic_stress_test"
    shutil.copy(basic / "stresstest_orchestrator.py", basic / "old_peer_orchestrator.py")
    _sub(basic / "old_peer_orchestrator.py", r"max_peers=4\)",
         'max_peers=4, spawn_script_name="stress_test_peer_old.py")',
         "(a copy of the orchestrator) spawns stress_test_peer_old.py, which prints the line it waits for")
    ex = py / "examples"
    for name, body in _nanogpt_configs().items():
        (ex / name).write_text(json.dumps(body, indent=2))
        ADAPTATIONS.append(f"python/examples/{name}: small CPU config in the upstream format")
    for d in (ex / "nanogptddp", ex / "nanogpt_diloco"):
        _token_files(d / "data" / "openwebtext")
    for script in ("sync_diloco.py", "async_diloco.py"):
        src = ex / "nanogpt_diloco" / script
        dst = src.with_name(f"cpu_{script}")
        shutil.copy(src, dst)
        _sub(dst, r"torch\.nn\.Parameter\(local_p\.detach\(\)\.cpu\(\)\)",
             "torch.nn.Parameter(local_p.detach().cpu().clone())",
             f"(a copy of {script}) CPU: .cpu() of a CPU tensor returns the tensor itself (on CUDA a copy), "
             "so the outer parameters would alias the model's; .clone() keeps the CUDA meaning")
    ADAPTATIONS.append("python/examples/*/data/openwebtext/{train,val}.bin: synthetic uint16 tokens")


def _nanogpt_configs() -> dict[str, dict[str, object]]:
    common: dict[str, object] = {
        "out_dir": "out", "eval_interval": 2000, "log_interval": 1, "eval_iters": 2, "eval_only": False,
        "always_save_checkpoint": False, "init_from": "scratch", "wandb_log": False, "wandb_project": "x",
        "wandb_run_name": "x", "dataset": "openwebtext", "gradient_accumulation_steps": 1, "batch_size": 2,
        "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0, "bias": False,
        "learning_rate": 0.0006, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
        "decay_lr": True, "min_lr": 0.00006, "backend": "gloo", "device": "cpu", "dtype": "float32",
        "compile": False,
    }
    ddp = {**common, "max_iters": 6, "warmup_iters": 2, "lr_decay_iters": 6, "ccoip_host": "127.0.0.1:48148"}
    diloco = {**common, "max_iters": 8, "inner_steps": 2, "warmup_iters": 2, "lr_decay_iters": 8,
              "val_batch_size": 2, "outer_learning_rate": 0.7, "ccoip_host": "127.0.0.1:48147"}
    async_diloco = {**diloco, "ccoip_host": "127.0.0.1:48148"}
    return {
        "nanogptddp/compat_config_0.json": {**ddp, "is_master_process": True},
        "nanogptddp/compat_config_1.json": {**ddp, "is_master_process": False},
        "nanogpt_diloco/compat_config_0.json": {**diloco, "is_master_process": True},
        "nanogpt_diloco/compat_config_1.json": {**diloco, "is_master_process": False},
        "nanogpt_diloco/compat_async_config_0.json": {**async_diloco, "is_master_process": True},
        "nanogpt_diloco/compat_async_config_1.json": {**async_diloco, "is_master_process": False},
    }


def _token_files(d: Path) -> None:
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 4000)):
        rng.integers(0, 50257, size=n, dtype=np.uint16).tofile(d / f"{split}.bin")


# ---------------------------------------------------------------------------------------------------------
# running


@dataclass
class Outcome:
    name: str
    verdict: str
    seconds: float
    expected_failure: bool = False
    detail: str = ""


class Runner:
    def __init__(self, root: Path, standins: Path, logs: Path) -> None:
        self.root = root
        self.logs = logs
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([str(standins), str(OURS), str(root)])
        self.env["PYTHONUNBUFFERED"] = "1"

    def _env(self, **extra: str) -> dict[str, str]:
        return {**self.env, **extra}

    def popen(self, script: Path, args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
        out = open(log, "wb")
        return subprocess.Popen([sys.executable, str(script), *args], cwd=script.parent, env=self._env(**env),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def pytest(self, target: Path, name: str, timeout: float, **env: str) -> tuple[bool, str]:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            try:
                proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                       "-o", "addopts=", str(target)], cwd=target.parent if target.is_file()
                                      else target, env=self._env(**env), stdout=out, stderr=subprocess.STDOUT,
                                      timeout=timeout)
            except subprocess.TimeoutExpired:
                return False, f"timed out after {timeout:.0f}s (log {log})"
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return proc.returncode == 0, f"{tail[0]} (log {log})"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
    """Wait until every process exited, one failed (the others could wait for it forever) or time is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.5)
    return [p.poll() for p in procs]


def _master_and_peers(r: Runner, name: str, master: Path, peer: Path, peer_args: list[list[str]],
                      timeout: float, peer_env: list[dict[str, str]] | None = None) -> tuple[bool, str]:
    m = r.popen(master, [], r.logs / f"{name}.master.log")
    peers = [r.popen(peer, args, r.logs / f"{name}.peer{i}.log", **((peer_env or [{}] * len(peer_args))[i]))
             for i, args in enumerate(peer_args)]
    try:
        codes = _wait_all(peers, timeout)
        master_alive = m.poll() is None  # the master script ended with run(): it must still serve
    finally:
        for p in [*peers, m]:
            _stop(p)
    ok = all(c == 0 for c in codes) and master_alive
    return ok, f"peer exit codes {codes}, master serving to the end: {master_alive} (logs {r.logs}/{name}.*)"


def run_unit(r: Runner, py: Path) -> tuple[bool, str]:
    return r.pytest(py / "tests/unit_tests/pccl_test.py", "unit_tests", 300)


def run_numpy_only(r: Runner, py: Path) -> tuple[bool, str]:
    return r.pytest(py / "tests/numpy_only_tests/numpy_only_test.py", "numpy_only", 300,
                    PCCL_COMPAT_HIDE="torch")


def run_pytorch_only(r: Runner, py: Path) -> tuple[bool, str]:
    return r.pytest(py / "tests/pytorch_only_tests/pytorch_only_test.py", "pytorch_only", 300)


def run_pytorch_only_without_numpy_assert(r: Runner, py: Path) -> tuple[bool, str]:
    src = py / "tests/pytorch_only_tests/pytorch_only_test.py"
    dst = src.with_name("pytorch_only_no_numpy_assert_test.py")
    text = src.read_text()
    line = ('assert get_module_by_name("numpy") is None, '
            '"numpy module should not be available for pytorch_only tests"\n')
    if line not in text:
        return False, "the numpy assertion line was not found"
    dst.write_text(text.replace(line, ""))
    return r.pytest(dst, "pytorch_only_no_numpy_assert", 300)


def run_basic_reduce(r: Runner, py: Path) -> tuple[bool, str]:
    return r.pytest(py / "tests/end_to_end/basic_reduce_test/basic_reduce_e2e_test.py", "basic_reduce", 600)


def run_mnist_ddp(r: Runner, py: Path) -> tuple[bool, str]:
    return r.pytest(py / "tests/end_to_end/mnist_ddp/mnist_ddp_e2e_test.py", "mnist_ddp", 1200,
                    MAX_STEPS="48", IS_CI="1")


def run_mnist_diloco(r: Runner, py: Path, seconds: float = 90.0) -> tuple[bool, str]:
    d = py / "tests/end_to_end/mnist_diloco"
    name = "mnist_diloco"
    m = r.popen(d / "mnist_diloco_master.py", [], r.logs / f"{name}.master.log")
    peers = [r.popen(d / "mnist_diloco_peer.py", [], r.logs / f"{name}.peer{i}.log", RANK=str(i), IS_CI="1")
             for i in range(2)]
    try:
        codes = _wait_all(peers, seconds)  # no exit condition upstream: they should still be training
        master_alive = m.poll() is None
    finally:
        for p in [*peers, m]:
            _stop(p)
    logs = [(r.logs / f"{name}.peer{i}.log").read_text(errors="replace") for i in range(2)]
    outer = [log.count("Performing outer step") for log in logs]
    clean = all("Traceback" not in log and "exception" not in log.lower() for log in logs)
    ok = all(c is None for c in codes) and master_alive and min(outer) >= 2 and clean
    return ok, (f"ran {seconds:.0f}s: still running {[c is None for c in codes]}, "
                f"outer steps per peer {outer}, "
                f"no traceback: {clean} (logs {r.logs}/{name}.*)")


_TEARDOWN = "[INFO] Cleaning up peers..."
"""What the stress orchestrators print when their time is up, before they kill every peer."""


def _run_stress(r: Runner, py: Path, kind: str, seconds: float,
                orchestrator: str = "stresstest_orchestrator.py", need_reduce_lines: bool = True
                ) -> tuple[bool, str]:
    d = py / "tests/stress_tests" / kind
    name = f"stress_{kind}_{orchestrator.removesuffix('.py')}"
    log = r.logs / f"{name}.log"
    with open(log, "wb") as out:
        try:
            proc = subprocess.run([sys.executable, str(d / orchestrator)], cwd=d,
                                  env=r._env(STRESS_SECONDS=str(seconds)), stdout=out,
                                  stderr=subprocess.STDOUT, timeout=seconds + 300, start_new_session=True)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    ok, detail = stress_verdict(log.read_text(errors="replace"), code, need_reduce_lines)
    return ok, f"{seconds:.0f}s: {detail} (log {log})"


def stress_verdict(text: str, code: int | None, need_reduce_lines: bool = True) -> tuple[bool, str]:
    """Judge a stress orchestrator's output (``text``) and exit code: passed, and what it did."""
    reduces = text.count("Reduce completed RX:")
    steps = len(re.findall(r"\(RANK=\d+, it=\d+\) update_topology\(\)", text))
    syncs = text.count("tx_bytes=")
    resyncs = text.count("running the sync again without the lost peer")
    kills = text.count("KILLING peer")
    # The orchestrator's teardown kills the peers one after another; a survivor's reduce thread then
    # raises TOO_FEW_PEERS (upstream's all_reduce_multiple_with_retry does the same once its group is down
    # to one), printing a traceback the verdict must not count: only what happened before it counts.
    running, _sep, _teardown = text.partition(_TEARDOWN)
    failed = [ln for ln in running.splitlines() if "failed with:" in ln or "Traceback" in ln]
    progressed = reduces > 0 if need_reduce_lines else steps > 0 and syncs > 0
    ok = code == 0 and "STRESS TEST COMPLETED SUCCESSFULLY!" in text and progressed and not failed
    return ok, (f"{reduces} 'Reduce completed' lines, {steps} steps, {syncs} syncs "
                f"({resyncs} re-run after a lost peer), {kills} peers killed, peer failures {len(failed)}"
                f"{': ' + failed[0][:160] if failed else ''}")


def run_stress_basic(r: Runner, py: Path, seconds: float) -> tuple[bool, str]:
    # Its current peer never prints the "Reduce completed RX:" line the orchestrator waits for (the old peer
    # did), so the orchestrator never marks a peer alive and never kills one, with pypccl too: judge it by the
    # orchestrator's verdict, the peers' progress and the absence of peer failures.
    return _run_stress(r, py, "basic_stress_test", seconds, need_reduce_lines=False)


def run_stress_basic_old_peer(r: Runner, py: Path, seconds: float) -> tuple[bool, str]:
    return _run_stress(r, py, "basic_stress_test", seconds, orchestrator="old_peer_orchestrator.py")


def run_stress_cross_step(r: Runner, py: Path, seconds: float) -> tuple[bool, str]:
    return _run_stress(r, py, "cross_step_async_reduces_test", seconds)


def run_nanogptddp(r: Runner, py: Path) -> tuple[bool, str]:
    d = py / "examples/nanogptddp"
    return _master_and_peers(
        r, "nanogptddp", d / "master.py", d / "train_pccl.py",
        [["--config_path=compat_config_0.json"], ["--config_path=compat_config_1.json"]], 900,
        [{"PCCL_COMPAT_CPU_CUDA_SYNC": "1"}] * 2)


def run_nanogpt_diloco(r: Runner, py: Path, script: str, master: str, configs: str) -> tuple[bool, str]:
    d = py / "examples/nanogpt_diloco"
    return _master_and_peers(
        r, f"nanogpt_diloco_{script.removesuffix('.py')}", d / master, d / script,
        [[f"--config_path={configs}_0.json"], [f"--config_path={configs}_1.json"]], 900)


#: The master port the upstream scripts hard-code (127.0.0.1:48148 after the adaptation above).
UPSTREAM_PORT = 48148


def port_held_by_another(port: int = UPSTREAM_PORT, wait: float = 10.0) -> bool:
    """Whether something still listens on 127.0.0.1:``port`` after up to ``wait`` seconds (the previous
    test's master may take a moment to close). Another job's master there (the upstream scripts all use
    this port) would receive this test's peers and fail them with a misleading error."""
    deadline = time.monotonic() + wait
    while True:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.2)


BUSY_PORT = (f"127.0.0.1:{UPSTREAM_PORT} is held by another process (the upstream scripts hard-code "
             "that port), so this test did not run; run the script in a network namespace of its own: "
             "unshare -rn sh -c 'ip link set lo up && python scripts/upstream_compat.py UPSTREAM'")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("upstream", type=Path, help="upstream checkout (holding python/) or bare git dir")
    ap.add_argument("--rev", default="release/v1.0.0", help="revision to export from a bare git dir")
    ap.add_argument("--only", nargs="*", help="run only these (names as in the table)")
    ap.add_argument("--stress-seconds", type=float, default=90.0)
    ap.add_argument("--diloco-seconds", type=float, default=90.0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy and logs")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pccl_upstream_"))
    _export(args.upstream.resolve(), args.rev, root)
    py = root / "python"
    _adapt(py)
    standins = _standins(root)
    logs = root / "logs"
    logs.mkdir()
    print(f"upstream copy: {root}")
    for a in ADAPTATIONS:
        print(f"  adaptation: {a}")
    r = Runner(root, standins, logs)
    suite: list[tuple[str, Callable[[], tuple[bool, str]], bool]] = [
        ("unit_tests/pccl_test.py", lambda: run_unit(r, py), False),
        ("numpy_only_tests", lambda: run_numpy_only(r, py), False),
        ("pytorch_only_tests (unchanged)", lambda: run_pytorch_only(r, py), True),
        ("pytorch_only_tests (numpy assertion removed)", lambda: run_pytorch_only_without_numpy_assert(r, py),
         False),
        ("end_to_end/basic_reduce_test", lambda: run_basic_reduce(r, py), False),
        ("end_to_end/mnist_ddp", lambda: run_mnist_ddp(r, py), False),
        ("end_to_end/mnist_diloco", lambda: run_mnist_diloco(r, py, args.diloco_seconds), False),
        ("stress_tests/basic_stress_test", lambda: run_stress_basic(r, py, args.stress_seconds), False),
        ("stress_tests/basic_stress_test (stress_test_peer_old.py)",
         lambda: run_stress_basic_old_peer(r, py, args.stress_seconds), False),
        ("stress_tests/cross_step_async_reduces_test",
         lambda: run_stress_cross_step(r, py, args.stress_seconds), False),
        ("examples/nanogptddp", lambda: run_nanogptddp(r, py), False),
        ("examples/nanogpt_diloco sync_diloco.py (unchanged, on CPU)",
         lambda: run_nanogpt_diloco(r, py, "sync_diloco.py", "sync_master.py", "compat_config"), True),
        ("examples/nanogpt_diloco sync_diloco.py (.cpu() copy)",
         lambda: run_nanogpt_diloco(r, py, "cpu_sync_diloco.py", "sync_master.py", "compat_config"), False),
        ("examples/nanogpt_diloco async_diloco.py (.cpu() copy)",
         lambda: run_nanogpt_diloco(r, py, "cpu_async_diloco.py", "async_master.py", "compat_async_config"),
         False),
    ]
    outcomes: list[Outcome] = []
    for name, fn, expected_failure in suite:
        if args.only and not any(o in name for o in args.only):
            continue
        print(f"running {name} ...", flush=True)
        t0 = time.monotonic()
        ok, detail = (False, BUSY_PORT) if port_held_by_another() else fn()
        verdict = "pass" if ok else ("fail (expected)" if expected_failure else "FAIL")
        outcomes.append(Outcome(name, verdict, time.monotonic() - t0, expected_failure, detail))
        print(f"  {verdict}: {detail}", flush=True)

    print()
    print("| test or example | verdict | time |")
    print("|---|---|---|")
    for o in outcomes:
        print(f"| {o.name} | {o.verdict} | {o.seconds:.0f} s |")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept {root}")
    return 0 if all(o.verdict != "FAIL" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
