"""examples/_support.py's give-up path: a parent that gives up on a run gets, from each process still
alive, its threads and its state, and the processes end (none is left waiting, like a late joiner whose
gate never opened)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import _support  # noqa: E402  (examples/_support.py: the examples import it as a sibling module)


def _stuck_peer(ready: Any, gate: Any) -> None:
    """A peer that says where it is when asked, then waits on a gate nobody opens."""
    sys.path.insert(0, str(EXAMPLES))
    import _support

    _support.dump_on_request("peer 7", lambda: "waiting in sync_shared_state")
    ready.set()
    gate.wait()


def test_give_up_dumps_each_live_peer_and_ends_it(capfd: pytest.CaptureFixture[str]) -> None:
    ctx = mp.get_context("spawn")
    ready, gate = ctx.Event(), ctx.Event()
    stuck = ctx.Process(target=_stuck_peer, args=(ready, gate), name="stuck-peer")
    done = ctx.Process(target=sys.exit, args=(0,), name="finished-peer")
    stuck.start()
    done.start()
    assert ready.wait(60)
    done.join(60)
    _support.give_up([stuck, done], grace=60)
    stuck.join(60)
    assert stuck.exitcode == _support.DUMPED  # it answered, and ended itself: not killed
    err = capfd.readouterr().err
    assert f"stuck-peer (pid {stuck.pid}): alive" in err
    assert f"finished-peer (pid {done.pid}): exit code 0" in err
    assert "--- peer 7 (pid" in err and "was asked where it is" in err
    assert "in _stuck_peer" in err  # its main thread's stack: waiting on the gate
    assert "--- peer 7: waiting in sync_shared_state" in err
