"""The core thread behind the blocking API: misuse from inside it, restart, and interpreter exit."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import numpy as np
import pytest
import torch

from pccl.blocking import (
    Attribute,
    Communicator,
    DataType,
    MasterNode,
    PCCLError,
    Result,
    _core,
    datatype_from_numpy,
    datatype_from_torch,
    datatype_to_numpy,
    datatype_to_torch,
)


def test_blocking_call_from_the_core_thread_raises_instead_of_deadlocking(master: MasterNode) -> None:
    comm = Communicator(master.address)
    comm.connect()
    with pytest.raises(PCCLError) as info:
        # what a progress callback or a finalizer running in the core would do
        _core.call_sync(lambda: comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE))
    assert info.value.result == Result.INVALID_USAGE
    assert "core thread" in str(info.value)
    assert comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
    comm.close()


def test_core_thread_restarts_after_stop() -> None:
    master = MasterNode("127.0.0.1:0")
    master.run()
    master.interrupt()
    _core.stop()
    assert not any(t.name == "pccl-core" for t in threading.enumerate())
    master.run()  # a fresh core thread starts on demand
    comm = Communicator(master.address)
    comm.connect()
    assert comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
    comm.close()
    master.interrupt()


_EXIT_SCRIPT = textwrap.dedent("""
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a foreground shell (a harness
    # started in the background of a script passes SIGINT ignored, and Python then installs no handler)
    import threading, numpy as np
    from pccl.blocking import Communicator, MasterNode, PCCLError, ReduceOp

    master = MasterNode("127.0.0.1:0")
    master.run()
    a = Communicator(master.address)
    a.connect()
    b = Communicator(master.address)
    t = threading.Thread(target=b.connect)
    t.start()
    while not a.are_peers_pending():
        pass
    a.update_topology()
    t.join()
    x = np.ones(1000, dtype=np.float32)
    handle = a.all_reduce_async(x, x, op=ReduceOp.SUM)  # b never joins: still running at exit
    waiting = Communicator(master.address)

    def connect_and_block():
        try:
            waiting.connect()  # blocks: nobody admits it; the exit hook closes it
        except PCCLError:
            pass

    threading.Thread(target=connect_and_block, daemon=True).start()
    print("ready", flush=True)
    # no close(), no interrupt(): the atexit hook closes the communicators without hanging, then (as the
    # established bindings) keeps the master serving until Ctrl-C
""")


def test_interpreter_exit_with_everything_still_open_does_not_hang() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == "ready"
        seen: list[str] = []
        for line in proc.stderr:  # the exit hook says the master keeps serving: the communicators are closed
            seen.append(line)
            if "keeps serving until interrupted" in line:
                break
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(signal.SIGINT)
        rest_out, rest_err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(seen) + rest_err
    assert proc.returncode == 0, stderr
    assert rest_out.strip() == ""
    assert "Traceback" not in stderr, stderr


def test_datatype_conversions() -> None:
    assert datatype_from_torch(torch.float32) == DataType.FLOAT32
    assert datatype_from_torch(torch.bfloat16) == DataType.BFLOAT16
    assert datatype_to_torch(DataType.INT64) == torch.int64
    assert datatype_from_numpy(np.float64) == DataType.FLOAT64
    assert datatype_from_numpy(np.dtype(np.uint8)) == DataType.UINT8
    assert datatype_to_numpy(DataType.FLOAT16) == np.dtype(np.float16)
    for dt in DataType:
        if dt != DataType.BFLOAT16:
            assert datatype_from_numpy(datatype_to_numpy(dt)) == dt
        assert datatype_from_torch(datatype_to_torch(dt)) == dt
    with pytest.raises(PCCLError) as info:
        datatype_from_numpy(np.complex64)
    assert info.value.result == Result.INVALID_ARGUMENT


def _forked_child(queue: Any) -> None:
    # The parent's core thread does not exist in a forked child: pccl must start a fresh one.
    master = MasterNode("127.0.0.1:0")
    master.run()
    comm = Communicator(master.address)
    comm.connect()
    queue.put(comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE))
    comm.close()
    master.interrupt()


def test_forked_child_gets_its_own_core_thread(master: MasterNode) -> None:
    parent_comm = Communicator(master.address)
    parent_comm.connect()  # the parent's core thread is busy serving
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_forked_child, args=(queue,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == 1
    assert parent_comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1  # the parent is unaffected
    parent_comm.close()
