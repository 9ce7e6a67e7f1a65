"""The snapshots a holder pins for live heals (pccl/peer/shared_state.py StateServer): served by sync_seq
beside the running sync, released by the master, at most PINS_KEPT at once."""

from __future__ import annotations

import numpy as np

from pccl.peer import shared_state as ss
from pccl.peer.shared_state import SharedState, StateServer, SyncContext, TensorInfo


def _ctx(seq: int, nbytes: int = 1000) -> SyncContext:
    state = SharedState([TensorInfo.from_numpy(np.zeros(nbytes, np.uint8), "w")])
    ctx = SyncContext(state=state, hashes={"w": 0}, seq=seq)
    ctx.plan_ready.set()
    return ctx


def test_pins_serve_by_seq_and_go_when_released() -> None:
    server = StateServer(plan_timeout=1.0)
    running = _ctx(9)
    server.ctx = running
    pinned = _ctx(4, 3000)
    server.pin(pinned)
    assert server.context_for(4) is pinned and server.context_for(9) is running
    assert server.pin_statistics() == {4: {"bytes": 3000, "tx_bytes": 0}} and server.pinned_bytes() == 3000
    server.release(4)
    assert server.context_for(4) is running  # (which then refuses: its seq is not 4)
    assert pinned.error is not None and server.pin_statistics() == {}
    server.release(4)  # twice, or unknown: nothing


def test_at_most_pins_kept_the_oldest_dropped() -> None:
    server = StateServer(plan_timeout=1.0)
    ctxs = [_ctx(s) for s in range(ss.PINS_KEPT + 2)]
    for c in ctxs:
        server.pin(c)
    assert sorted(server.pins) == list(range(2, ss.PINS_KEPT + 2))
    assert ctxs[0].error is not None and ctxs[1].error is not None and ctxs[2].error is None
