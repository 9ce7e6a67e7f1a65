"""Each example runs in its short form, as a user would start it: one command, master included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Three limits, each inside the next: the example's own --timeout (it then prints where each of its
# processes is and ends them), the subprocess timeout, pytest-timeout's. On the shared 2-core machine at
# load 20-25, torch_charlm.py --short --mode ddp took 110-160 s (4 copies at once, every run passed):
# the global 120 s of pytest-timeout ended it first, before the example could say anything.
EXAMPLE_TIMEOUT = 180
pytestmark = [pytest.mark.slow, pytest.mark.timeout(EXAMPLE_TIMEOUT + 60)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# (script, arguments, a line the script prints only when all its own checks passed)
CASES = [
    ("hello_world.py", [], "hello world: OK"),
    ("digits_ddp.py", ["--short"], "digits data-parallel training: OK"),
    ("diloco.py", ["--short", "--mode", "both"], "[async] DiLoCo: OK"),
    ("streaming_diloco.py", ["--short"], "streaming DiLoCo: OK"),
    # the default runs both modes; one case each keeps a case within the timeout on a busy machine
    ("torch_charlm.py", ["--short", "--mode", "ddp"], "torch char-LM with kill and join: OK"),
    ("torch_charlm.py", ["--short", "--mode", "diloco"], "torch char-LM with kill and join: OK"),
]


@pytest.mark.parametrize(("script", "args", "ok_line"), CASES, ids=[" ".join([c[0], *c[1]]) for c in CASES])
def test_example_runs(script: str, args: list[str], ok_line: str) -> None:
    if script != "hello_world.py":
        pytest.importorskip("torch")
    if script in ("digits_ddp.py", "diloco.py", "streaming_diloco.py"):
        pytest.importorskip("sklearn", reason="the training examples use scikit-learn's digits data")
    # The timeout only turns a hang into a failure; the examples give up on their own before it.
    command = [sys.executable, str(EXAMPLES / script), *args, "--timeout", str(EXAMPLE_TIMEOUT)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT + 30,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} did not end within its own timeout\n{exc.stdout!r}\n{exc.stderr!r}")
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert ok_line in proc.stdout.splitlines(), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
