"""Errors a person can act on and settings from the environment, on the blocking API."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from pccl import MasterConfig
from pccl.blocking import Communicator, MasterNode, PCCLError, ReduceOp, Result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_statistics_of_a_connected_peer(cluster_factory: Callable[..., list[Communicator]]) -> None:
    a, b = cluster_factory(2)
    with pytest.raises(PCCLError) as info:
        Communicator("127.0.0.1:1").statistics()
    assert info.value.result == Result.INVALID_USAGE
    xs = [np.ones(16, np.float32), np.ones(16, np.float32)]
    threads = [threading.Thread(target=c.all_reduce, args=(x, x), kwargs={"op": ReduceOp.SUM})
               for c, x in zip((a, b), xs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    s = a.statistics()
    assert s["world_size"] == 2 and s["group_world_size"] == 2 and s["master_ok"] is True
    assert s["ops_in_flight"] == 0 and set(s["last_op_phases"]) == {"vote", "ring", "confirm", "commit"}
    assert {a.statistics()["peer_id"], b.statistics()["peer_id"]} == {1, 2}


def test_tuple_address_and_pccl_master(master: MasterNode, monkeypatch: pytest.MonkeyPatch) -> None:
    with Communicator(("127.0.0.1", master.port)) as comm:
        comm.connect()
        assert comm.statistics()["world_size"] == 1
        assert repr(comm).startswith(f"<Communicator master=127.0.0.1:{master.port} ")
    monkeypatch.setenv("PCCL_MASTER", master.address)
    with Communicator() as comm:
        comm.connect()
        assert comm.address == master.address
    monkeypatch.delenv("PCCL_MASTER")
    with pytest.raises(PCCLError) as info:
        Communicator()
    assert info.value.result == Result.INVALID_ARGUMENT
    assert info.value.message.startswith('no master address: pass one ("HOST:PORT"')
    assert info.value.message.endswith("or set PCCL_MASTER")


def test_secret_from_pccl_secret_file(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "secret"
    path.write_text("s3cret\n")
    with MasterNode("127.0.0.1:0", config=MasterConfig(secret="s3cret")) as master:
        master.run()
        with pytest.raises(PCCLError) as info:
            Communicator(master.address).connect(n_attempts=1)
        assert "bad secret: missing or not the shared secret" in info.value.message
        monkeypatch.setenv("PCCL_SECRET_FILE", str(path))
        with Communicator(master.address) as comm:
            comm.connect()
        monkeypatch.setenv("PCCL_SECRET_FILE", str(path) + ".missing")
        with pytest.raises(PCCLError) as info:
            Communicator(master.address).connect()
        assert info.value.result == Result.INVALID_ARGUMENT
        assert info.value.message.startswith(f"PCCL_SECRET_FILE={path}.missing: cannot read it (")
        master.interrupt()


def test_no_master_is_one_line_without_a_chain() -> None:
    comm = Communicator(f"127.0.0.1:{_free_port()}")
    with pytest.raises(PCCLError) as info:
        comm.connect(n_attempts=1)
    assert info.value.result == Result.MASTER_CONNECTION_FAILED
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "\n" not in str(info.value)
    head = f"could not connect to the master at {comm.address} after 1 attempt(s)"
    assert info.value.message.startswith(head)
    assert info.value.message.endswith("Connection refused")  # the reason, not trio's "all attempts failed"
    comm.close()


def test_default_retries_wait_for_a_master_that_is_still_starting(caplog: pytest.LogCaptureFixture) -> None:
    """connect() with the default attempts outlasts a master that comes up after the first attempts failed
    (pccl-master takes 0.4-4 s to start on a busy machine); the master starts once two attempts failed."""
    port = _free_port()
    failed_twice = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "(attempt 2/5)" in record.getMessage():
                failed_twice.set()

    handler = Watch()
    logging.getLogger("pccl.blocking").addHandler(handler)
    caplog.set_level(logging.WARNING, logger="pccl.blocking")
    comm = Communicator(f"127.0.0.1:{port}")
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            comm.connect()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=connect)
    t.start()
    try:
        assert failed_twice.wait(30)
        with MasterNode(f"127.0.0.1:{port}") as master:
            master.run()
            t.join(30)
            assert not errors and comm.connected
            comm.close()
            master.interrupt()
    finally:
        logging.getLogger("pccl.blocking").removeHandler(handler)
        comm.close()
        t.join(30)


def test_master_node_port_in_use_is_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        master = MasterNode(f"127.0.0.1:{port}")
        with pytest.raises(PCCLError) as info:
            master.run()
        master.close()
    assert info.value.result == Result.SYSTEM_ERROR
    assert info.value.message == f"cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use"
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_bad_secret_fails_once_and_pccl_master_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pccl import HelloRefusedError

    caplog.set_level(logging.WARNING, logger="pccl")
    with MasterNode("127.0.0.1:0", config=MasterConfig(secret="s3cret")) as master:
        master.run()
        monkeypatch.setenv("PCCL_MASTER", master.address)
        with pytest.raises(HelloRefusedError) as info:
            Communicator().connect(n_attempts=5)
        # Not retried: no "attempt 1/5" warning, and the message names the variable it came from.
        assert "bad secret" in info.value.message
        assert f"(from PCCL_MASTER={master.address})" in info.value.message
        assert "attempt" not in caplog.text
        master.interrupt()


def test_pccl_master_without_a_port_says_so() -> None:
    from pccl._env import master_origin

    assert master_origin("h:1", {"PCCL_MASTER": "foo"}) == ""
    assert master_origin(None, {"PCCL_MASTER": "foo"}) == " (from PCCL_MASTER=foo; no port given, so the " \
        "default 48148)"
    assert master_origin(None, {"PCCL_MASTER": "[::1]:5,h:6"}) == " (from PCCL_MASTER=[::1]:5,h:6)"


def test_import_pccl_torch_without_torch_says_how_to_install_it() -> None:
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None; import pccl.torch"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "pccl.torch needs PyTorch" in out.stderr and "pip install torch" in out.stderr, out.stderr


def test_a_bad_pccl_log_level_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    from pccl._env import apply_log_level

    logger = logging.getLogger("pccl")
    before, handlers = logger.level, list(logger.handlers)
    try:
        apply_log_level({"PCCL_LOG_LEVEL": "verbose"})
        assert capsys.readouterr().err == (
            "pccl: PCCL_LOG_LEVEL=verbose is not one of DEBUG, INFO, WARNING, ERROR: using WARNING\n")
        apply_log_level({"PCCL_LOG_LEVEL": "info"})
        assert capsys.readouterr().err == ""
    finally:
        logger.setLevel(before)
        for h in list(logger.handlers):
            if h not in handlers:
                logger.removeHandler(h)
