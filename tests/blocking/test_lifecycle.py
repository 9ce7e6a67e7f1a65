"""Master node run/interrupt, communicators created and destroyed with and without connect, misuse errors."""

from __future__ import annotations

import gc
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from pccl.blocking import (
    Attribute,
    Communicator,
    MasterNode,
    PCCLError,
    ReduceOp,
    Result,
    SharedState,
    TensorInfo,
)

from ._helpers import JOIN_TIMEOUT, run_threads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _can_connect(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def test_master_run_reports_port_and_interrupt_releases_it() -> None:
    master = MasterNode("127.0.0.1:0")
    with pytest.raises(PCCLError) as no_port:
        _ = master.port
    assert no_port.value.result == Result.INVALID_USAGE
    master.run()
    assert master.running
    assert master.port > 0
    assert master.address == f"127.0.0.1:{master.port}"
    assert _can_connect(master.port)
    with pytest.raises(PCCLError) as twice:
        master.run()
    assert twice.value.result == Result.INVALID_USAGE
    master.interrupt()
    assert not master.running
    master.interrupt()  # a second interrupt does nothing
    assert not _can_connect(master.port)


def test_master_wildcard_address_is_reported_as_loopback() -> None:
    with MasterNode("0.0.0.0:0") as master:
        master.run()
        assert master.address == f"127.0.0.1:{master.port}"
    assert not master.running


def test_master_interrupt_before_run_is_invalid_usage() -> None:
    with pytest.raises(PCCLError) as info:
        MasterNode("127.0.0.1:0").interrupt()
    assert info.value.result == Result.INVALID_USAGE


def test_master_port_in_use_raises(master: MasterNode) -> None:
    second = MasterNode(f"127.0.0.1:{master.port}")
    with pytest.raises(PCCLError) as info:
        second.run()
    assert info.value.result == Result.SYSTEM_ERROR
    assert not second.running


def test_master_can_run_again_after_interrupt() -> None:
    port = _free_port()
    master = MasterNode(f"127.0.0.1:{port}")
    master.run()
    master.interrupt()
    master.run()
    assert master.port == port
    comm = Communicator(master.address)
    comm.connect()
    assert comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
    comm.close()
    master.interrupt()


@pytest.mark.parametrize("bad", ["", "127.0.0.1:notaport", "127.0.0.1:70000"])
def test_malformed_addresses_raise_invalid_argument(bad: str) -> None:
    with pytest.raises(PCCLError) as info:
        Communicator(bad)
    assert info.value.result == Result.INVALID_ARGUMENT
    with pytest.raises(PCCLError):
        MasterNode(bad)


def test_communicator_created_and_destroyed_without_connect(master: MasterNode) -> None:
    comm = Communicator(master.address, 0)
    del comm
    gc.collect()
    comm = Communicator(master.address, 0)
    comm.close()
    comm.close()  # idempotent
    with Communicator(master.address) as comm:
        assert not comm.connected
    assert master.statistics()["connections"] == 0


def test_calls_before_connect_raise_pccl_error(master: MasterNode) -> None:
    comm = Communicator(master.address)
    x = np.zeros(4, dtype=np.float32)
    calls: list[Callable[[], object]] = [
        comm.update_topology,
        comm.are_peers_pending,
        comm.optimize_topology,
        lambda: comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE),
        lambda: comm.all_reduce(x, x, op=ReduceOp.SUM),
        lambda: comm.all_reduce_async(x, x, op=ReduceOp.SUM),
        lambda: comm.sync_shared_state(SharedState([TensorInfo.from_numpy(x, "x")])),
    ]
    for call in calls:
        with pytest.raises(PCCLError) as info:
            call()
        assert info.value.result == Result.INVALID_USAGE
        assert "connect()" in str(info.value)
    comm.close()


def test_update_topology_before_connect_raises(master: MasterNode) -> None:
    comm = Communicator(master.address)
    with pytest.raises(PCCLError):
        comm.update_topology()


def test_connect_then_close_and_calls_after_close_raise(master: MasterNode) -> None:
    comm = Communicator(master.address)
    comm.connect()
    assert comm.connected
    assert comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
    assert master.statistics()["accepted"] == 1
    with pytest.raises(PCCLError) as twice:
        comm.connect()
    assert twice.value.result == Result.INVALID_USAGE
    comm.close()
    assert not comm.connected
    with pytest.raises(PCCLError) as after:
        comm.update_topology()
    assert after.value.result == Result.INVALID_USAGE
    with pytest.raises(PCCLError):
        comm.connect()


def test_garbage_collected_communicator_leaves_the_run(master: MasterNode) -> None:
    first = Communicator(master.address)
    first.connect()
    second = Communicator(master.address)
    t = threading.Thread(target=second.connect, daemon=True)
    t.start()
    while not first.are_peers_pending():
        pass
    first.update_topology()
    t.join(JOIN_TIMEOUT)
    assert first.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 2
    del second, t
    gc.collect()
    # The peer that is gone no longer blocks the group: the next collective fails fast, never hangs.
    x = np.ones(8, dtype=np.float32)
    with pytest.raises(PCCLError) as info:
        first.all_reduce(x, x, op=ReduceOp.SUM)
    assert info.value.result in (Result.TOO_FEW_PEERS, Result.RANK_CONNECTION_LOST)
    np.testing.assert_array_equal(x, np.ones(8, dtype=np.float32))
    first.close()


def test_connect_without_master_retries_then_raises() -> None:
    comm = Communicator(f"127.0.0.1:{_free_port()}")
    with pytest.raises(PCCLError) as info:
        comm.connect(n_attempts=2)
    assert info.value.result == Result.MASTER_CONNECTION_FAILED
    assert "2 attempt" in str(info.value)
    comm.close()


def test_connect_rejects_zero_attempts(master: MasterNode) -> None:
    with pytest.raises(PCCLError) as info:
        Communicator(master.address).connect(n_attempts=0)
    assert info.value.result == Result.INVALID_ARGUMENT


def test_close_from_another_thread_unblocks_a_pending_connect(master: MasterNode) -> None:
    first = Communicator(master.address)
    first.connect()
    waiting = Communicator(master.address)
    outcome: list[BaseException] = []

    def connect() -> None:
        try:
            waiting.connect()
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    while not first.are_peers_pending():  # the newcomer is registered and blocked in connect()
        pass
    waiting.close()
    t.join(JOIN_TIMEOUT)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], PCCLError)
    assert outcome[0].result == Result.INVALID_USAGE
    # The newcomer is gone: nobody is pending any more and the first peer carries on alone.
    assert not first.are_peers_pending()
    assert first.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
    first.close()


def test_many_communicators_share_one_core_thread(master: MasterNode) -> None:
    comms = [Communicator(master.address) for _ in range(3)]
    comms[0].connect()
    waiting = threading.Thread(target=comms[1].connect, daemon=True)  # waits until comms[0] admits it
    waiting.start()
    while not comms[0].are_peers_pending():
        pass
    comms[0].update_topology()
    waiting.join(JOIN_TIMEOUT)
    assert run_threads([lambda: comms[1].get_attribute(Attribute.GLOBAL_WORLD_SIZE)] * 4) == [2] * 4
    cores = [t for t in threading.enumerate() if t.name == "pccl-core"]
    assert len(cores) == 1  # the master, both peers and the unconnected communicator share it
    for c in comms:
        c.close()
