"""Lifetimes and errors as the established bindings (pypccl 1.0) have them, over a real master."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch

import pccl
import pccl.blocking
from pccl import Attribute, Communicator, MasterNode, PCCLError, ReduceInfo, ReduceOp, Result

from ._helpers import connect_pair


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_MASTER_SCRIPT = textwrap.dedent("""
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a foreground shell (a harness
    # started in the background of a script passes SIGINT ignored, and Python then installs no handler)
    import sys
    from pccl import *

    def main():
        master: MasterNode = MasterNode(listen_address=sys.argv[1])
        master.run()

    main()
    print("main returned", flush=True)
    # the script ends here: as in the established bindings, the master keeps serving until interrupted
""")


def test_master_script_that_ends_after_run_keeps_serving_until_interrupted() -> None:
    address = f"127.0.0.1:{_free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", _MASTER_SCRIPT, address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == "main returned"  # its MasterNode is already collected
        for line in proc.stderr:
            if "keeps serving until interrupted" in line:
                break
        assert proc.poll() is None
        comm = Communicator(address, 0)
        comm.connect(n_attempts=1)  # the script's master accepts us although the script has ended
        assert comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
        comm.close()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    with pytest.raises(PCCLError) as gone:
        Communicator(address).connect(n_attempts=1)  # and Ctrl-C stopped it
    assert gone.value.result is Result.MASTER_CONNECTION_FAILED


def test_dropped_master_keeps_serving_until_interrupted() -> None:
    port = _free_port()

    def start() -> None:
        MasterNode(listen_address=f"127.0.0.1:{port}").run()  # the object is dropped at once

    start()
    comm = Communicator(f"127.0.0.1:{port}")
    comm.connect(n_attempts=1)
    assert comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
    comm.close()
    # the only way to stop a dropped master in-process is what the exit hook does: stop its session
    sessions = [s for s in pccl.blocking._serving_masters if s.port == port]
    assert len(sessions) == 1
    pccl.blocking._core.call(sessions[0].stop, 5.0)
    assert sessions[0].stopped.is_set()


def test_upstream_unit_sequence(master: MasterNode) -> None:
    # the established unit tests: a communicator that is dropped connected or unconnected, misuse raises
    def connect_and_drop() -> None:
        Communicator(master.address, 0).connect()

    connect_and_drop()
    Communicator(master.address, 0)
    with pytest.raises(PCCLError) as info:
        Communicator(master.address, 0).update_topology()
    assert info.value.result is Result.INVALID_USAGE


def test_lone_all_reduce_async_raises_too_few_peers_at_launch(master: MasterNode) -> None:
    comm = Communicator(master.address, 0)
    comm.connect()
    try:
        for arr in (np.random.rand(27), torch.rand(27)):
            before = arr.copy() if isinstance(arr, np.ndarray) else arr.clone()
            with pytest.raises(pccl.PCCLError) as info:
                comm.all_reduce_async(arr, arr, op=pccl.ReduceOp.SUM)
            assert info.value.result is Result.TOO_FEW_PEERS
            # (elementwise: before is a copy of arr's kind, which the stubs cannot tell from the union;
            # for a tensor compared with an array they would pick object.__eq__'s bool)
            assert cast("np.ndarray[Any, Any] | torch.Tensor", arr == before).all()
    finally:
        comm.close()


def test_wait_returns_success_flag_raw_status_and_info(master: MasterNode) -> None:
    comms = connect_pair(master.address)
    try:
        xs = [np.full(16, float(r + 1), np.float32) for r in range(2)]
        handles = [c.all_reduce_async(x, x, op=ReduceOp.SUM) for c, x in zip(comms, xs, strict=True)]
        outcomes = [h.wait() for h in handles]
        for is_success, status, info in outcomes:
            assert is_success is True
            assert isinstance(status, int) and status == 0 == Result.SUCCESS.value
            assert f"{status}" == "0"  # formats as upstream's raw integer
            assert isinstance(info, ReduceInfo) and info.local_world_size == 2
        assert all((x == 3.0).all() for x in xs)
        assert handles[0].wait() == outcomes[0]  # waiting again gives the same outcome
    finally:
        for c in comms:
            c.close()


def test_bad_buffers_fail_like_upstream_asserts(master: MasterNode) -> None:
    comms = connect_pair(master.address)
    try:
        with pytest.raises(AssertionError):
            comms[0].all_reduce(torch.zeros(4), torch.zeros(4, dtype=torch.float64), op=ReduceOp.SUM)
        with pytest.raises(AssertionError):
            comms[0].all_reduce_async(np.zeros(4, np.float32), np.zeros(5, np.float32), op=ReduceOp.SUM)
        with pytest.raises(ValueError):  # upstream: ValueError for mixed types
            comms[0].all_reduce(np.zeros(4, np.float32), torch.zeros(4), op=ReduceOp.SUM)
    finally:
        for c in comms:
            c.close()


class _RecordingEvent:
    """Stands in for the communicator's closed-event: records each wait between connection attempts."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return False

    def set(self) -> None:
        pass


def test_connect_failure_retries_one_second_apart_then_raises_an_exception() -> None:
    comm = Communicator(f"127.0.0.1:{_free_port()}", 0)
    recorder = _RecordingEvent()
    comm._closed_event = recorder  # type: ignore[assignment]
    with pytest.raises(Exception) as info:  # what the established handlers catch
        comm.connect(n_attempts=3)
    assert isinstance(info.value, PCCLError) and info.value.result is Result.MASTER_CONNECTION_FAILED
    assert recorder.waits == [1.0, 1.0]  # between the 3 attempts
    comm.close()


_GC_SCRIPT = textwrap.dedent("""
    import gc, logging
    logging.basicConfig(level=logging.WARNING)
    from pccl import Communicator, MasterNode

    master = MasterNode("127.0.0.1:0")
    master.run()

    def connect_and_drop():
        c = Communicator(master.address, 0)
        c.connect()

    for _ in range(3):
        connect_and_drop()
        gc.collect()
    kept = Communicator(master.address, 0)  # still connected at exit: the exit hook closes it
    kept.connect()
    def in_a_function():
        m = MasterNode("127.0.0.1:0")
        m.run()
        c = Communicator(m.address, 0)
        c.connect()
        m.interrupt()
    in_a_function()
    gc.collect()
    master.interrupt()
    print("done", flush=True)
""")


def test_garbage_collected_objects_log_no_background_task_failure() -> None:
    proc = subprocess.run([sys.executable, "-c", _GC_SCRIPT], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert "background task failed" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_only_cancelled_groups_count_as_cancellation() -> None:
    import trio

    async def cancelled_group() -> BaseException:
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                await trio.sleep_forever()
            except trio.Cancelled as exc:
                return BaseExceptionGroup("g", [exc, BaseExceptionGroup("h", [exc])])
        raise AssertionError("unreachable")

    group = trio.run(cancelled_group)
    assert pccl.blocking._only_cancelled(group)
    assert not pccl.blocking._only_cancelled(BaseExceptionGroup("g", [ValueError()]))
    assert not pccl.blocking._only_cancelled(ValueError())


_FORK_SCRIPT = textwrap.dedent("""
    import os, sys
    from pccl import Communicator, MasterNode

    master = MasterNode("127.0.0.1:0")
    master.run()
    pid = os.fork()
    if pid == 0:
        # the child inherits the parent's record of its serving master, not the master itself: its exit must
        # not wait for it
        comm = Communicator(master.address, 0)
        comm.connect()
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
    master.interrupt()
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_does_not_wait_for_the_parents_master() -> None:
    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "child exit 0", proc.stderr
    assert "keeps serving" not in proc.stderr, proc.stderr


def test_a_background_task_cancelled_inside_a_nursery_is_not_logged_as_a_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    # What a communicator or master being torn down looks like to the core: its hosted task is cancelled
    # while it runs a nursery, so what escapes it is an exception group made only of Cancelled.
    import trio

    core = pccl.blocking._Core()

    async def body(started: Callable[[object], None]) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)
            started(None)
            await trio.sleep_forever()

    core.host(body)
    with caplog.at_level(logging.ERROR, logger="pccl.blocking"):
        core.stop()
    assert not core.running
    assert not [r for r in caplog.records if "background task failed" in r.getMessage()]
