"""scripts/upstream_compat.py's verdict on an upstream stress orchestrator's output: a peer failure
while the test runs fails it; the TOO_FEW_PEERS traceback of the last survivors while the
orchestrator's teardown kills the peers one by one (upstream raises the same) does not."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "upstream_compat.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("upstream_compat", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


RUNNING = """[INFO] Spawned peer PID=11; waiting for first line...
[PEER 11] (RANK=0) Reduce completed RX: 10, TX: 10; world_size: 2
[INFO] KILLING peer PID=12
[PEER 11] (RANK=0) Reduce completed RX: 10, TX: 10; world_size: 1
[INFO] Time limit reached; stopping stress test.
"""
TEARDOWN = """[INFO] Cleaning up peers...
[INFO] Killing peer PID=13
[PEER 11] Exception in thread ReduceThread:
[PEER 11] Traceback (most recent call last):
[INFO] Killing peer PID=11
[INFO] All peers terminated. Killing master process...
STRESS TEST COMPLETED SUCCESSFULLY!
"""
FAILURE = "[PEER 11] Traceback (most recent call last):\n"


def test_a_clean_run_passes_and_teardown_tracebacks_do_not_count() -> None:
    verdict = load().stress_verdict
    ok, detail = verdict(RUNNING + TEARDOWN, 0)
    assert ok, detail
    assert "2 'Reduce completed' lines" in detail and "1 peers killed" in detail
    assert "peer failures 0" in detail


def test_a_traceback_while_running_fails() -> None:
    verdict = load().stress_verdict
    ok, detail = verdict(RUNNING + FAILURE + TEARDOWN, 0)
    assert not ok
    assert "peer failures 1" in detail


def test_exit_code_success_line_and_progress_are_required() -> None:
    verdict = load().stress_verdict
    assert not verdict(RUNNING + TEARDOWN, 1)[0]
    assert not verdict(RUNNING + TEARDOWN, None)[0]  # timed out
    assert not verdict((RUNNING + TEARDOWN).replace("STRESS TEST COMPLETED SUCCESSFULLY!", ""), 0)[0]
    no_reduce = (RUNNING + TEARDOWN).replace("Reduce completed RX:", "Reduce")
    assert not verdict(no_reduce, 0)[0]
