"""The short mode of scripts/fuzz_listeners.py (random and mutated frames at a master and P2P listeners
while peers all-reduce, exact-checked), with and without a secret. The long run is in the issue's note."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz_listeners.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_listeners", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("secret", [None, "fuzz-secret"])
def test_short_fuzz_run_keeps_every_all_reduce_exact(
    secret: str | None, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    argv = ["--rounds", "4", "--attacks-per-round", "12", "--seed", "7"]
    if secret:
        argv += ["--secret", secret]
    assert load().main(argv) == 0
    assert "48 attacks, every all-reduce exact" in capsys.readouterr().out
    assert "refused" in caplog.text or "dropped during hello" in caplog.text


def test_short_insider_run_keeps_results_exact_and_bounds_held(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 33: a member attacks the others' P2P listeners with its own credentials while it takes part
    in every all-reduce; results stay exact and every stash and per-peer connection count in bounds."""
    caplog.set_level(logging.WARNING, logger="pccl")
    assert load().main(["--rounds", "4", "--attacks-per-round", "12", "--seed", "7", "--member"]) == 0
    out = capsys.readouterr().out
    assert "48 insider attacks" in out and "within their bounds" in out
    assert "the cap per peer is 2" in caplog.text  # its flood of bench connections was refused


def test_a_seed_fixes_the_insiders_mix_of_attacks(capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of one seed print the same mix of insider attacks (the outsider and the insider each
    draw from their own generator: a shared one was drawn from in trio's shuffled task order)."""
    argv = ["--rounds", "3", "--attacks-per-round", "10", "--seed", "61", "--member"]
    mixes = []
    for _ in range(2):
        assert load().main(argv) == 0
        mixes.append([line for line in capsys.readouterr().out.splitlines() if "insider attacks" in line])
    assert mixes[0] and mixes[0] == mixes[1]
