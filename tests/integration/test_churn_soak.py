"""The real-process churn soak in its 60-second CI mode (``benchmarks/churn_soak.py --duration 60``).

A master and up to 10 peer processes on loopback; every 0.5-2 s a peer is spawned, SIGKILLed or SIGSTOPped
while the others train (shared-state sync + all-reduce + admission). The soak itself checks that every
survivor ends with the same state hash, that no peer failed, and that no stretch without a completed
all-reduce exceeded ``--max-gap``; this test runs it and asserts on its exit code and summary. The
10-minute run reported in docs/history/benchmarks-churn-soak.md is the same script with ``--duration 600``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "churn_soak.py"


@pytest.mark.timeout(240)
def test_churn_soak_60s() -> None:
    # --max-gap 20: far above the ~2 s the soak shows on this machine, so a loaded CI box does not fail
    # it, yet a group stuck behind a peer (the kind of hang the soak has caught before) does.
    proc = subprocess.run(
        # and the master SIGKILLed and restarted every 25 s (issue 18); --max-master-gap 10 for a loaded
        # box (about 2 s on a quiet one: the 1 s restart delay plus the reconnection).
        [sys.executable, str(SOAK), "--duration", "60", "--seed", "7", "--max-gap", "20",
         "--status-every", "15", "--master-kill-every", "25", "--max-master-gap", "10"],
        capture_output=True, text=True, timeout=200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "soak PASSED" in out, out[-6000:]
    summary = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in out.splitlines()
        if line.startswith("|") and line.count("|") == 3
    }
    assert summary["identical state hash on all survivors"] == "yes", summary
    assert summary["peer errors / crashes"] == "0 / 0", summary
    churn = summary["peers spawned / SIGKILLed / SIGSTOPped"]
    spawned, killed, stopped = (int(v) for v in churn.split(" / "))
    assert spawned >= 10 and killed + stopped >= 5, summary  # it really churned
    assert int(summary["completed steps (all-reduces)"]) > 100, summary
    kills = summary["master SIGKILLs (restarted on the same port after s)"]
    assert int(kills.split()[0]) >= 2, summary
