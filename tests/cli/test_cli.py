"""Every command-line mistake through ``main([...])``: one line on stderr, a non-zero exit code; and
``pccl status`` against a running master."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio

from pccl import Communicator, MasterConfig, PeerConfig
from pccl.cli import VERSION, main, master_main
from pccl.master.server import MasterHandle, open_master


def _err_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@contextmanager
def master_in_thread(config: MasterConfig | None = None) -> Iterator[MasterHandle]:
    """A master with a status port, run by trio in a thread for the block."""
    box: dict[str, Any] = {}
    ready = threading.Event()

    async def run() -> None:
        with trio.CancelScope() as scope:
            box["scope"], box["token"] = scope, trio.lowlevel.current_trio_token()
            async with open_master(config=config, status_port=0) as master:
                box["master"] = master
                ready.set()
                await trio.sleep_forever()

    t = threading.Thread(target=trio.run, args=(run,), daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        yield box["master"]
    finally:
        trio.from_thread.run_sync(box["scope"].cancel, trio_token=box["token"])
        t.join(30)


def _busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


@pytest.mark.parametrize("entry", [["master"], []])
def test_port_in_use_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str], entry: list[str]) -> None:
    sock, port = _busy_port()
    with sock:
        argv = [*entry, "--host", "127.0.0.1", "--port", str(port)]
        code = main(argv) if entry else master_main(argv)
    prog = "pccl" if entry else "pccl-master"
    assert code == 1
    assert _err_lines(capsys) == [
        f"{prog}: error: cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use"
    ]


def test_a_bad_local_sockets_variable_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PCCL_LOCAL_SOCKETS", "maybe")
    code = master_main(["--host", "127.0.0.1", "--port", "0"])
    assert code == 1
    assert _err_lines(capsys) == [
        "pccl-master: error: INVALID_ARGUMENT: PCCL_LOCAL_SOCKETS must be 1 or 0, not 'maybe'"
    ]


def test_status_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    sock, port = _busy_port()
    with sock:
        code = master_main(["--host", "127.0.0.1", "--port", "0", "--status-port", str(port)])
    assert code == 1
    lines = _err_lines(capsys)
    assert lines[-1] == (
        f"pccl-master: error: cannot serve the status page on 127.0.0.1:{port}: Address already in use"
    )
    assert not any("Traceback" in line or "ExceptionGroup" in line for line in lines)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "argument --port: 99999 is not a port number (0-65535)"),
        (["--port", "http"], "argument --port: 'http' is not a port number (0-65535)"),
        (["--status-port", "-1"], "argument --status-port: -1 is not a port number (0-65535)"),
        (["--heartbeat-timeout", "soon"], "argument --heartbeat-timeout: 'soon' is not a number of seconds"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert master_main(argv) == 2
    assert _err_lines(capsys) == [f"pccl-master: error: {message} (see pccl-master --help)"]


def test_bad_host_and_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert master_main(["--host", "no-such-host.invalid", "--port", "0"]) == 1
    (line,) = _err_lines(capsys)
    assert line.startswith("pccl-master: error: cannot listen on no-such-host.invalid:0: ")
    assert master_main(["--host", "http://0.0.0.0", "--port", "0"]) == 2
    (line,) = _err_lines(capsys)
    assert "give the host and port only, not a URL" in line
    assert master_main(["--heartbeat-timeout", "0.1"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("pccl-master: error: need 0 < heartbeat_interval (0.5) < heartbeat_timeout (0.1)")


def test_an_unreadable_secret_file_names_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-such-secret"
    assert master_main(["--secret-file", str(missing)]) == 2
    assert _err_lines(capsys) == [
        f"pccl-master: error: --secret-file {missing}: cannot read it (No such file or directory)"
    ]
    monkeypatch.setenv("PCCL_SECRET_FILE", str(missing))  # the variable: named as such
    assert master_main(["--host", "127.0.0.1", "--port", "0"]) == 1
    assert _err_lines(capsys) == [
        f"pccl-master: error: INVALID_ARGUMENT: PCCL_SECRET_FILE={missing}: cannot read it "
        "(No such file or directory)"
    ]


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert master_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pccl-master {VERSION}"
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pccl {VERSION}"
    assert main(["--help"]) == 0
    assert "status   show a running master's status" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["frob"]) == 2
    assert _err_lines(capsys) == [
        "pccl: error: unknown command 'frob' (choose from master, status, run, demo; see pccl --help)"
    ]


@pytest.mark.parametrize(
    ("address", "fragment"),
    [
        ("http://127.0.0.1:8080", "give the host and port only, not a URL"),
        ("127.0.0.1", "has no port: give the master's HOST:STATUS_PORT"),
        ("127.0.0.1:99999", "port 99999 is out of range (0-65535)"),
        ("my host:1", "it contains spaces"),
    ],
)
def test_status_bad_addresses(capsys: pytest.CaptureFixture[str], address: str, fragment: str) -> None:
    assert main(["status", address]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("pccl: error: ") and fragment in line


def test_status_of_nothing_listening(capsys: pytest.CaptureFixture[str]) -> None:
    sock, port = _busy_port()
    sock.close()
    assert main(["status", f"127.0.0.1:{port}", "--timeout", "5"]) == 1
    (line,) = _err_lines(capsys)
    assert line.startswith(f"pccl: error: cannot reach http://127.0.0.1:{port}/status: ")
    assert line.endswith(f"(is the master running with --status-port {port}?)")


def test_status_of_a_running_master(capsys: pytest.CaptureFixture[str]) -> None:
    with master_in_thread() as master:
        assert master.status_address is not None
        addr = f"127.0.0.1:{master.status_address[1]}"
        with Communicator(master.connect_address) as comm:
            comm.connect()
            assert main(["status", addr]) == 0
            out = capsys.readouterr().out
            assert out.startswith(f"pccl master {master.address[0]}:{master.address[1]}")
            assert "1 accepted / 1 connected" in out and "group 0: 1" in out
            assert "peer 1 accepted (world size 1)" in out
            assert main(["status", addr, "--json"]) == 0
            snap = json.loads(capsys.readouterr().out)
            assert [p["id"] for p in snap["peers"]] == [1] and snap["ring"] == [1]
            assert main(["status", addr, "--watch", "--interval", "0", "--count", "3"]) == 0
            assert capsys.readouterr().out.count("pccl master ") == 3
        # Not a status port: the master's own port answers no HTTP.
        code = main(["status", f"127.0.0.1:{master.address[1]}", "--timeout", "2"])
    assert code == 1
    (line,) = _err_lines(capsys)
    assert line.startswith("pccl: error: ")


def test_quorum_options(capsys: pytest.CaptureFixture[str]) -> None:
    from pccl.cli import _master_config, _master_parser

    config = _master_config(_master_parser().parse_args(["--quorum", "off", "--quorum-hold-timeout", "5"]))
    assert config.quorum == "off" and config.quorum_hold_timeout == 5.0
    assert _master_config(_master_parser().parse_args([])).quorum == "auto"
    assert master_main(["--quorum", "maybe"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("pccl-master: error: argument --quorum: invalid choice")


def test_rejoin_grace_option(capsys: pytest.CaptureFixture[str]) -> None:
    from pccl.cli import _master_config, _master_parser

    assert _master_config(_master_parser().parse_args(["--rejoin-grace", "1.5"])).rejoin_grace == 1.5
    assert _master_config(_master_parser().parse_args([])).rejoin_grace == 0.0  # off by default
    assert master_main(["--rejoin-grace", "-1"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("pccl-master: error:") and "rejoin" in line


@pytest.mark.parametrize(("option", "field", "value"), [
    ("--speculative-go-delay", "speculative_go_delay", 0.0),
    ("--credentials-batch-delay", "credentials_batch_delay", 0.05),
])
def test_a_master_delay_option(option: str, field: str, value: float,
                               capsys: pytest.CaptureFixture[str]) -> None:
    from pccl import MasterConfig
    from pccl.cli import _master_config, _master_parser

    assert getattr(_master_config(_master_parser().parse_args([])), field) == 0.01
    config = _master_config(_master_parser().parse_args([option, f"{value:g}"]))
    assert getattr(config, field) == value
    assert master_main([option, "-1"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith(f"pccl-master: error: argument {option}: -1 must not be negative")
    negative: dict[str, Any] = {field: -0.5}
    with pytest.raises(ValueError, match=field):
        MasterConfig(**negative)


@pytest.mark.parametrize("option", ["--rebuild-grace", "--rebuild-quiet", "--rejoin-grace",
                                    "--speculative-go-delay", "--credentials-batch-delay",
                                    "--heartbeat-timeout"])
def test_a_seconds_option_refuses_nan(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    # NaN passes every range check (each comparison is False) and a NaN timeout never expires.
    assert master_main([option, "nan"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith(f"pccl-master: error: argument {option}: 'nan' is not a number of seconds")


@pytest.mark.parametrize("config", [MasterConfig, PeerConfig])
def test_configs_refuse_a_nan_field(config: type) -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout must be a number, not NaN"):
        config(heartbeat_timeout=float("nan"))
