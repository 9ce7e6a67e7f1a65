"""A test that leaves a blocking MasterNode serving does not make pytest wait at exit.

Since a master keeps serving after ``run()`` until interrupted (the established bindings' lifetime), a test
session that forgot ``interrupt()`` would otherwise hang at interpreter exit; pccl's pytest plugin stops it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

LEAKY_TEST = '''
from pccl import MasterNode

def test_leaks_a_master():
    master = MasterNode("127.0.0.1:0")
    master.run()
    assert master is not None
'''


def test_pytest_exits_when_a_test_leaves_a_master_serving(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    # The timeout only turns a hang (the regression) into a failure.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed" in out, out
    assert "pccl: stopped 1 master(s) a test left serving: 127.0.0.1:" in out, out
