"""The main job's demo (``python -m pccl demo --quick``) runs end to end and its invariants hold."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_quick_passes() -> None:
    # A subprocess, exactly like scripts/demo.sh runs it: master in the demo process, peer processes,
    # a SIGKILL mid-run and a newcomer catching up through shared state. The demo itself bounds its run
    # (--quick: 30 s); the outer timeout only guards against a hang in process teardown.
    proc = subprocess.run([sys.executable, "-m", "pccl", "demo", "--quick"], capture_output=True, text=True,
                          timeout=40)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "demo PASSED" in out, out
    assert "[FAIL]" not in out, out
    assert "SIGKILL peer" in out, out
    assert "received the whole state once" in out, out


def test_demo_rejects_bad_arguments() -> None:
    from pccl._cliutil import CliError
    from pccl.demo import main

    with pytest.raises(CliError) as exc:
        main(["--peers", "1"])
    assert exc.value.code == 2
    with pytest.raises(CliError):
        main(["--steps", "10", "--kill-at", "9"])


@pytest.mark.parametrize("argv", [["--peers", "0"], ["--peers", "x"], ["--frob"]])
def test_demo_errors_are_one_line_like_pccl_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``pccl demo --peers 0`` used to print argparse's whole usage before its error line (issue 37)."""
    from pccl.cli import main as pccl_main

    assert pccl_main(["demo", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("pccl: error: "), err
    assert err[0].endswith("(see pccl demo --help)") and "usage:" not in err[0]
    assert pccl_main(["run", "-n", "0", "x.py"]) == 2  # the same shape as pccl run's
    assert capsys.readouterr().err.splitlines() == ["pccl: error: -n must be at least 1, got 0"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "-1"], "--steps must be at least 8"),
    (["--step-delay", "-1"], "--step-delay must be 0 or more"),
    (["--timeout", "0"], "--timeout must be more than 0"),
    (["--hidden", "0"], "--hidden must be at least 1"),
])
def test_demo_names_the_bad_option(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pccl.cli import main

    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0], err
