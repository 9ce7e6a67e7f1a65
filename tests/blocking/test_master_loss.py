"""Issue 18 item 6: after the master is lost, every blocking call fails promptly; none hangs.

Reported: three peers loop 1 MB all-reduces through the blocking API, the master is SIGKILLed, the
all-reduces fail with MASTER_CONNECTION_FAILED and the next ``are_peers_pending()`` hangs in every
peer. These tests land the master's loss *inside* each call that waits on the master (two of three
peers are in the call, so the master is still waiting for the third when it goes) and then make
every blocking call on every peer, each in a thread bounded by ``JOIN_TIMEOUT``: a hang fails the
test instead of blocking the suite. ``MasterNode.interrupt()`` closes every connection the master
holds, which is what the peers see of a SIGKILL (a closed connection).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pccl import PeerConfig
from pccl.blocking import (
    Communicator,
    MasterNode,
    PCCLError,
    ReduceOp,
    Result,
    SharedState,
    TensorInfo,
)

from ._helpers import JOIN_TIMEOUT, Thunk, make_cluster, run_threads, wait_until

_SIZE = 1 << 18  # float32 elements: 1 MB


def _state() -> SharedState:
    return SharedState([TensorInfo.from_numpy(np.ones(1000, np.float32), "w")])


def _async_wait(c: Communicator) -> Any:
    x = np.ones(_SIZE, np.float32)
    ok, status, _ = c.all_reduce_async(x, x, op=ReduceOp.SUM, tag=7).wait()
    assert not ok
    raise PCCLError("async all-reduce failed", status)


#: The call the master's loss lands in, and what of that call's progress shows it is waiting on the
#: master (a key of the async communicator's statistics, true while it waits).
_IN_FLIGHT: dict[str, tuple[Callable[[Communicator], Any], Callable[[dict[str, Any]], bool]]] = {
    "are_peers_pending": (lambda c: c.are_peers_pending(), lambda s: s["pending_queries_waiting"] > 0),
    "update_topology": (lambda c: c.update_topology(), lambda s: s["topology_call_waiting"]),
    "all_reduce": (lambda c: c.all_reduce(np.ones(_SIZE, np.float32), np.empty(_SIZE, np.float32),
                                          op=ReduceOp.SUM, tag=7),
                   lambda s: 7 in s["op_tags"]),
    "all_reduce_async.wait": (_async_wait, lambda s: 7 in s["op_tags"]),
    "sync_shared_state": (lambda c: c.sync_shared_state(_state()), lambda s: s["sync_call_waiting"]),
}

#: Every blocking call that needs the master, made after its loss.
_AFTER: dict[str, Callable[[Communicator], Any]] = {
    "are_peers_pending": lambda c: c.are_peers_pending(),
    "update_topology": lambda c: c.update_topology(),
    "optimize_topology": lambda c: c.optimize_topology(),
    "all_reduce": lambda c: c.all_reduce(np.ones(_SIZE, np.float32), None, op=ReduceOp.SUM, tag=1),
    "all_reduce_async.wait": lambda c: _async_wait(c),
    "sync_shared_state": lambda c: c.sync_shared_state(_state()),
}


def _raises_master_lost(fn: Thunk[object]) -> Callable[[], PCCLError]:
    def call() -> PCCLError:
        with pytest.raises(PCCLError) as info:
            fn()
        return info.value

    return call


@pytest.mark.parametrize("during", sorted(_IN_FLIGHT))
def test_master_lost_inside_a_call_then_every_call_fails_promptly(during: str) -> None:
    master = MasterNode("127.0.0.1:0")
    master.run()
    # No reconnection: the master's loss ends the run for these peers (the reconnecting default is
    # tested by the restart and standby tests below).
    comms = make_cluster(master.address, 3, config=PeerConfig(reconnect_window=0))
    try:
        call, waiting = _IN_FLIGHT[during]
        inside = comms[:2]  # the third never calls: the master is waiting for it when it goes
        errors: list[PCCLError | None] = [None, None]

        def body(i: int) -> None:
            errors[i] = _raises_master_lost(lambda: call(inside[i]))()

        threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: all(waiting(c.statistics()) for c in inside))
        master.interrupt()
        for t in threads:
            t.join(JOIN_TIMEOUT)
        assert not any(t.is_alive() for t in threads), f"{during} hung after the master was lost"
        # The call in flight fails: with the master's loss, or, when the stopping master dropped another
        # peer's connection first and still told this one, with the call's own "a participant was lost".
        lost_first = {Result.UPDATE_TOPOLOGY_FAILED, Result.TOPOLOGY_OPTIMIZATION_FAILED,
                      Result.RANK_CONNECTION_LOST}
        for err in errors:
            assert err is not None and (err.result == Result.MASTER_CONNECTION_FAILED
                                        or (err.result in lost_first and "lost" in err.message)), err
        # Every later call, on every peer (also the one that was not in the call), fails at once.
        for name, fn in _AFTER.items():
            got = run_threads([_raises_master_lost(lambda c=c: fn(c)) for c in comms])
            for err in got:
                assert err.result == Result.MASTER_CONNECTION_FAILED, (name, err)
        assert all(not c.statistics()["master_ok"] for c in comms)
    finally:
        for c in comms:
            c.close()
        master.close()


def _retrying_all_reduce(c: Communicator) -> float:
    x = np.ones(1000, np.float32)
    while True:
        try:
            c.all_reduce(x, x, op=ReduceOp.SUM)
            return float(x[0])
        except PCCLError as exc:
            if exc.result != Result.RANK_CONNECTION_LOST:
                raise


def test_blocking_peers_survive_a_master_restarted_on_the_same_port() -> None:
    """Opt-in reconnection through the blocking API: the master stops, a fresh one listens on the same
    port, the peers re-register and their next all-reduce succeeds with the whole world."""
    config = PeerConfig(reconnect_window=JOIN_TIMEOUT, p2p_listen_host="127.0.0.1")
    master = MasterNode("127.0.0.1:0")
    master.run()
    port = master.port
    second: MasterNode | None = None
    comms: list[Communicator] = []
    try:
        comms = make_cluster(master.address, 2, config=config)
        a, b = comms
        assert b.connected
        assert run_threads([lambda: _retrying_all_reduce(a), lambda: _retrying_all_reduce(b)]) == [2.0, 2.0]
        master.interrupt()
        second = MasterNode(f"127.0.0.1:{port}")
        second.run()
        assert run_threads([lambda: _retrying_all_reduce(a), lambda: _retrying_all_reduce(b)]) == [2.0, 2.0]
        stats = second.statistics()
        assert stats["generation"] == 2 and stats["accepted"] == 2
    finally:
        for c in comms:
            c.close()
        master.close()
        if second is not None:
            second.close()


def test_blocking_peers_fail_over_to_a_running_standby() -> None:
    """A standby master given as the second address takes the run over when the first one stops."""
    config = PeerConfig(reconnect_window=JOIN_TIMEOUT, p2p_listen_host="127.0.0.1")
    first = MasterNode("127.0.0.1:0")
    standby = MasterNode("127.0.0.1:0")
    first.run()
    standby.run()
    addresses = f"{first.address},{standby.address}"
    comms: list[Communicator] = []
    try:
        comms = make_cluster(addresses, 2, config=config)
        a, b = comms
        assert b.connected and standby.statistics()["connected"] == 0  # the first address is the master
        assert run_threads([lambda: _retrying_all_reduce(a), lambda: _retrying_all_reduce(b)]) == [2.0, 2.0]
        first.interrupt()
        assert run_threads([lambda: _retrying_all_reduce(a), lambda: _retrying_all_reduce(b)]) == [2.0, 2.0]
        stats = standby.statistics()
        assert stats["generation"] == 2 and stats["accepted"] == 2
    finally:
        for c in comms:
            c.close()
        first.close()
        standby.close()
