"""``pccl run -n N SCRIPT``: a master and N peer processes, prefixed output, first failure's exit code,
Ctrl-C stops everything."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from pccl.cli import main
from pccl.launcher import launch

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

ALL_REDUCE = textwrap.dedent("""
    import os, numpy as np
    from pccl import Attribute, Communicator, ReduceOp
    n = int(os.environ["PCCL_WORLD_SIZE"])
    rank = int(os.environ["PCCL_RANK"])
    print("master", os.environ["PCCL_MASTER"], flush=True)
    with Communicator() as comm:          # the address comes from PCCL_MASTER
        comm.connect()
        while comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) < n:
            if comm.are_peers_pending():
                comm.update_topology()
        x = np.full(4, rank + 1, np.float32)
        comm.all_reduce(x, x, op=ReduceOp.SUM)
        print("result", x[0], flush=True)
""")


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_two_peers_all_reduce_with_prefixed_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "ar.py", ALL_REDUCE)
    assert main(["run", "-n", "2", script]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[launcher] master at 127.0.0.1:")
    address = out[0].split()[3].rstrip(";")
    for rank in (0, 1):
        assert f"[peer {rank}] master {address}" in out
        assert f"[peer {rank}] result 3.0" in out


def test_first_failure_sets_the_exit_code_and_stops_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = tmp_path / "rank0.ready"
    # Rank 1 fails only once rank 0 is running and has said its pid (else the launcher may stop rank 0
    # before it prints, and the test cannot check that it was stopped).
    script = _script(tmp_path, "fail.py", textwrap.dedent(f"""
        import os, sys, time
        ready = {str(ready)!r}
        if os.environ["PCCL_RANK"] == "1":
            deadline = time.monotonic() + 60
            while not os.path.exists(ready) and time.monotonic() < deadline:
                time.sleep(0.01)
            print("giving up", flush=True)
            sys.exit(3)
        print("pid", os.getpid(), flush=True)
        open(ready, "w").close()
        time.sleep(120)
    """))
    assert main(["run", "-n", "2", "--no-prefix", script, "--some-arg"]) == 3
    out = capsys.readouterr().out
    assert "[launcher] peer 1 exited with code 3; stopping the others" in out
    assert "\ngiving up\n" in out  # --no-prefix
    pid = int(next(line for line in out.splitlines() if line.startswith("pid ")).split()[1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    script = _script(tmp_path, "sleep.py", textwrap.dedent("""
        import os, time
        print("ready", os.getpid(), flush=True)
        time.sleep(120)
    """))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pccl", "run", "-n", "2", script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    pids = []
    for line in proc.stdout:
        if "] ready " in line:
            pids.append(int(line.split()[-1]))
            if len(pids) == 2:
                break
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()
    assert proc.wait(30) == 130
    assert "[launcher] SIGINT: stopping every process" in rest
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "-n", "0", "x.py"], "pccl: error: -n must be at least 1, got 0"),
        (["run", "-n", "2", "no/such/script.py"], "pccl: error: no such script: no/such/script.py"),
        (["run", "x.py"],
         "pccl: error: the following arguments are required: -n/--nproc/--nproc-per-node "
         "(see pccl run --help)"),
        (["run", "-n", "two", "x.py"],
         "pccl: error: argument -n/--nproc/--nproc-per-node: invalid int value: 'two' (see pccl run --help)"),
        (["run", "-n", "1", "--nnodes", "2", "--node-rank", "2", __file__],
         "pccl: error: --node-rank must be in 0..1 (--nnodes 2), got 2"),
        (["run", "-n", "1", "--nnodes", "2", "--node-rank", "1", __file__],
         "pccl: error: node 1 of 2 needs --master HOST:PORT: the address of the master node 0 started (or of "
         'a pccl-master); "HOST:PORT" (e.g. "127.0.0.1:48148", "[::1]:48148") or a (host, port) tuple'),
        (["run", "-n", "1", "--nnodes", "2", __file__],
         "pccl: error: node 0 of several starts the master: give it a --port the other nodes can attach to "
         "(and --host 0.0.0.0 or this machine's address)"),
        (["run", "-n", "1", "--master", "http://x:1", __file__],
         "pccl: error: --master: invalid address 'http://x:1': give the host and port only, not a URL; "
         'expected "HOST:PORT" (e.g. "127.0.0.1:48148", "[::1]:48148") or a (host, port) tuple'),
        (["run", "-n", "1", "--master", "h:1", "--status-port", "9", __file__],
         "pccl: error: --port and --status-port configure a master of this launcher's own; with --master it "
         "starts none (give them to the master you attach to)"),
        (["run", "-n", "1", "--run", "a b", __file__],
         "pccl: error: --run must be at most 64 letters, digits, '.', '_' or '-', not 'a b'"),
    ],
)
def test_launcher_mistakes(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == message


class _ClosedPipe(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


async def test_a_closed_output_pipe_does_not_hang_the_launcher(tmp_path: Path) -> None:
    """`pccl run ... | head` used to hang once head exited: the output task died, and stopping the peers
    waited for events that task would have set."""
    script = _script(tmp_path, "chatty.py", "for i in range(20000):\n    print('line', i)\n")
    with trio.fail_after(60):
        code = await launch(2, [sys.executable, script], out=_ClosedPipe())
    assert code == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("first", ["pccl run", "pccl-master"])
def test_two_nodes_attach_to_one_master(tmp_path: Path, first: str) -> None:
    """Two `pccl run` invocations on this machine form one run of 2 x 2 peers: node 0 starts the master
    (or a pccl-master runs it), node 1 attaches with --master; the example runs under it as 4 peers."""
    port = _free_port()
    hello = str(EXAMPLES / "hello_world.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PCCL_RUN": "two-nodes"}
    common = ["-n", "2", "--nnodes", "2", "--host", "127.0.0.1"]
    procs = []
    if first == "pccl-master":
        procs.append(subprocess.Popen([sys.executable, "-m", "pccl", "master", "--host", "127.0.0.1",
                                       "--port", str(port)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env=env))
        node0 = ["--master", f"127.0.0.1:{port}"]
    else:
        node0 = ["--port", str(port)]
    try:
        argvs = [[sys.executable, "-m", "pccl", "run", *common, "--node-rank", str(r), *extra, hello]
                 for r, extra in ((0, node0), (1, ["--master", f"127.0.0.1:{port}"]))]
        nodes = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for a in argvs]
        outs = [n.communicate(timeout=150)[0] for n in nodes]
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
            p.wait(30)
    for node, out in zip(nodes, outs, strict=True):
        assert node.returncode == 0, out
    assert "of run two-nodes" in outs[0]
    assert f"[launcher] attaching to the master at 127.0.0.1:{port} of run two-nodes" in outs[1]
    for rank in range(4):
        out = outs[rank // 2]
        assert f"[peer {rank}] peer {rank} of 4: using the master at PCCL_MASTER=127.0.0.1:{port}" in out
        assert f"[peer {rank}] peer {rank}: all-reduce -> 10 everywhere" in out  # 1 + 2 + 3 + 4
        assert f"[peer {rank}] hello world: OK" in out


def test_a_peer_of_another_run_is_refused_by_a_named_master(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    master = subprocess.Popen([sys.executable, "-m", "pccl", "master", "--host", "127.0.0.1", "--port",
                               str(port), "--run", "mine"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env=env)
    try:
        script = _script(tmp_path, "join.py", ALL_REDUCE)
        argv = [sys.executable, "-m", "pccl", "run", "-n", "1", "--master", f"127.0.0.1:{port}", "--run",
                "theirs", script]
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    finally:
        master.send_signal(signal.SIGINT)
        log = master.communicate(timeout=30)[1]
    assert out.returncode == 1, out.stdout
    assert "HelloRefusedError" in out.stdout or "refused" in out.stdout
    assert "other run: this peer belongs to run 'theirs' and the master serves run 'mine'" in out.stdout
    assert "attempt" not in out.stdout  # refused once, not retried
    assert "other run: this peer belongs to run 'theirs' and the master serves run 'mine'" in log


@pytest.mark.parametrize("example", ["hello_world.py", "digits_ddp.py"])
def test_an_example_launched_alone_says_it_needs_two_peers(example: str) -> None:
    """`pccl run -n 1 examples/digits_ddp.py` waited forever for a second peer, silently; hello_world
    failed in its all-reduce with a traceback. Both now stop at once with one line (no master needed:
    they stop before they connect)."""
    env = {**os.environ, "PCCL_MASTER": "127.0.0.1:9", "PCCL_RANK": "0", "PCCL_WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLES / example), "--short"] if example != "hello_world.py"
                         else [sys.executable, str(EXAMPLES / example)],
                         capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.splitlines()[-1] == (
        "error: this example needs at least 2 peers; PCCL_WORLD_SIZE=1 (pccl run -n 2 or more)")
