"""Shared pieces of the benchmarks: a master and peers as real OS processes on loopback.

Driver side (the benchmark script, inside ``trio.run``):

* :func:`open_cluster` yields a :class:`Cluster`; every process it starts is SIGKILLed when the block
  exits, on errors and on Ctrl-C too, so a benchmark never leaves processes behind.
* :meth:`Cluster.start_master` runs ``python -m pccl master --port 0`` and reads the bound port from its log;
  the master's membership log lines are kept with their arrival time (``MasterProcess.events``).
* :meth:`Cluster.spawn` runs a child; a child reports to the driver with one JSON object per stdout line
  (:func:`emit`) and may receive commands as JSON lines on stdin (:meth:`Child.send`).

Timestamps are ``time.monotonic()``: CLOCK_MONOTONIC is system-wide on Linux, so times taken in different
processes on the same machine can be subtracted.

Child side: :func:`child_setup` (die with the driver, ignore Ctrl-C, log warnings to stderr),
:func:`emit`, :func:`admit_pending` (the training-loop membership step).

Blocking driver side (children as ``subprocess.Popen``, e.g. the WAN emulator's ``wan.popen``):
:func:`wait_listening` (the master's log), :func:`follow_json_lines`, :func:`wait_for_results`,
:func:`end_processes`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_HOST = "127.0.0.1"

_LISTEN_RE = re.compile(r"master listening on ([0-9.]+):(\d+)")



# ----------------------------------------------------------------------------------------------
# child side


def child_setup(log_level: int = logging.WARNING) -> None:
    """Call first in every child process.

    The child leaves as soon as its stdin (a pipe from the driver) reaches end of file: that happens when
    the driver dies, so a crashed or killed benchmark leaves no orphans. (``PR_SET_PDEATHSIG`` does not
    fit: trio starts processes from worker threads, and the signal fires when that *thread* exits.)
    Ctrl-C in the terminal goes to the whole process group; the driver, not the children, decides how to
    stop, so children ignore SIGINT.
    """

    def watch_stdin() -> None:
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.buffer.read(65536):
                pass
        os._exit(3)

    threading.Thread(target=watch_stdin, name="watch-driver", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")


def emit(event: str, **fields: Any) -> None:
    """Report one event to the driver (one JSON line on stdout)."""
    fields["event"] = event
    fields.setdefault("t", time.monotonic())
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def admit_pending(comm: Any) -> bool:
    """The membership step of a training loop: admit waiting peers if there are any.

    ``are_peers_pending()`` is a collective query; only when it says yes do all peers run the
    ``update_topology()`` vote (retried while P2P setup fails somewhere).

    Returns:
        True if a topology update ran.
    """
    from pccl import UpdateTopologyFailedError

    if not await comm.are_peers_pending():
        return False
    while True:
        try:
            await comm.update_topology()
            return True
        except UpdateTopologyFailedError:
            await trio.sleep(0.01)


def peer_config(**overrides: Any) -> Any:
    """A PeerConfig whose P2P listener binds loopback only."""
    from pccl import PeerConfig

    return PeerConfig(p2p_listen_host=PEER_HOST, **overrides)


def child_env() -> dict[str, str]:
    """Environment for children: one BLAS thread each (the machine has few cores and many processes)."""
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ----------------------------------------------------------------------------------------------
# driver side


async def _read_lines(stream: Any, on_line: Callable[[str], None]) -> None:
    buf = b""
    while True:
        try:
            data = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            if buf.strip():
                on_line(buf.decode(errors="replace"))
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            on_line(line.decode(errors="replace"))


@dataclass(eq=False)
class Child:
    """A child process that reports JSON lines on stdout."""

    name: str
    proc: trio.Process
    log_path: Path
    started: float
    state: str = "running"  # running, stopped, killed, exited
    info: dict[str, Any] = field(default_factory=dict)  # last values reported (peer id, world...)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def send(self, obj: dict[str, Any]) -> None:
        """Write one JSON command line to the child's stdin (ignored if the child is gone)."""
        assert self.proc.stdin is not None
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.proc.stdin.send_all((json.dumps(obj) + "\n").encode())

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time just before the signal."""
        t = time.monotonic()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        if self.state != "exited":
            self.state = "killed"
        return t

    def stop(self) -> float:
        """SIGSTOP (the process hangs: no heartbeats, no data); returns the time just before the signal."""
        t = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGSTOP)
        self.state = "stopped"
        return t

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class MasterProcess:
    """``python -m pccl master`` running as a child; ``events`` holds (time, log line) pairs."""

    proc: trio.Process
    address: str
    events: list[tuple[float, str]]
    log_path: Path
    listening_at: float = 0.0  # monotonic time its "listening" line was read

    def membership_lines(self) -> list[str]:
        return [line for _, line in self.events if "pccl.master" in line]


class Cluster:
    """Processes of one benchmark run. Create with :func:`open_cluster`."""

    def __init__(self, nursery: trio.Nursery, logdir: Path) -> None:
        self._nursery = nursery
        self.logdir = logdir
        self.children: list[Child] = []
        self._masters: list[MasterProcess] = []
        self._send, self._recv = trio.open_memory_channel[tuple[Child, dict[str, Any]]](100_000)
        self._count = 0

    async def start_master(self, *, heartbeat_timeout: float | None = None, timeout: float = 20.0,
                           extra: Sequence[str] = (), port: int = 0) -> MasterProcess:
        """Start a master on 127.0.0.1 (``port`` 0: an OS-chosen port) and wait until it listens."""
        argv = [sys.executable, "-m", "pccl", "master", "--host", PEER_HOST, "--port", str(port), *extra]
        if heartbeat_timeout is not None:
            argv += ["--heartbeat-timeout", str(heartbeat_timeout)]
        self._count += 1
        log_path = self.logdir / f"master{self._count}.log"
        proc = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE,
                                                env=child_env(), cwd=str(REPO_ROOT))
        events: list[tuple[float, str]] = []
        listening = trio.Event()
        found: dict[str, str] = {}
        logf = log_path.open("w")

        def on_line(line: str) -> None:
            events.append((time.monotonic(), line))
            logf.write(line + "\n")
            logf.flush()
            mt = _LISTEN_RE.search(line)
            if mt and not listening.is_set():
                found["address"] = f"{mt.group(1)}:{mt.group(2)}"
                listening.set()

        self._nursery.start_soon(_read_lines, proc.stderr, on_line)
        master = MasterProcess(proc=proc, address="", events=events, log_path=log_path)
        self._masters.append(master)
        with trio.fail_after(timeout):
            await listening.wait()
        master.address = found["address"]
        master.listening_at = events[-1][0] if events else time.monotonic()
        for t, line in events:
            if _LISTEN_RE.search(line):
                master.listening_at = t
                break
        return master

    async def stop_master(self, master: MasterProcess, timeout: float = 5.0) -> int | None:
        """SIGTERM the master and wait for it; returns its exit code (None if it had to be killed)."""
        if master.proc.returncode is None:
            master.proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(timeout):
            return await master.proc.wait()
        master.proc.kill()
        return None

    async def spawn(self, name: str, argv: Sequence[str]) -> Child:
        """Start a child whose stdout lines are JSON events (see :meth:`next_event`)."""
        log_path = self.logdir / f"{name}.log"
        with log_path.open("w") as errf:
            proc = await trio.lowlevel.open_process(
                list(argv), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=errf,
                env=child_env(), cwd=str(REPO_ROOT))
        child = Child(name=name, proc=proc, log_path=log_path, started=time.monotonic())
        self.children.append(child)
        send = self._send.clone()

        def on_line(line: str) -> None:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                msg = {"event": "stdout", "line": line}
            if not isinstance(msg, dict):
                msg = {"event": "stdout", "line": line}
            send.send_nowait((child, msg))

        async def reader() -> None:
            await _read_lines(proc.stdout, on_line)
            code = await proc.wait()
            if child.state == "running":
                child.state = "exited"
            send.send_nowait((child, {"event": "exit", "code": code, "t": time.monotonic()}))
            send.close()

        self._nursery.start_soon(reader)
        return child

    async def next_event(self, timeout: float = math.inf) -> tuple[Child, dict[str, Any]]:
        """The next event from any child; raises trio.TooSlowError after ``timeout`` seconds."""
        with trio.fail_after(timeout):
            return await self._recv.receive()

    async def wait_for(
        self,
        pred: Callable[[Child, dict[str, Any]], bool],
        timeout: float,
        what: str = "an event",
        on_other: Callable[[Child, dict[str, Any]], None] | None = None,
    ) -> tuple[Child, dict[str, Any]]:
        """Consume events until ``pred`` holds; child errors and early exits raise RuntimeError."""
        deadline = trio.current_time() + timeout
        while True:
            try:
                with trio.fail_at(deadline):
                    child, msg = await self._recv.receive()
            except trio.TooSlowError:
                raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}") from None
            if pred(child, msg):
                return child, msg
            if msg.get("event") == "error":
                raise RuntimeError(f"{child.name} failed: {msg.get('message')}\n{child.log_tail()}")
            if on_other is not None:
                on_other(child, msg)

    def live(self) -> list[Child]:
        return [c for c in self.children if c.state == "running"]

    def kill_all(self) -> None:
        for c in self.children:
            if c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, signal.SIGKILL)
        for mproc in self._masters:
            if mproc.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(mproc.proc.pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def open_cluster(keep_logs: bool = False) -> AsyncIterator[Cluster]:
    """Yield a :class:`Cluster`; all its processes are killed (and reaped) when the block exits."""
    logdir = Path(tempfile.mkdtemp(prefix="pccl-bench-"))
    try:
        async with trio.open_nursery() as nursery:
            cluster = Cluster(nursery, logdir)
            try:
                yield cluster
            finally:
                cluster.kill_all()
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    for c in cluster.children:
                        await c.proc.wait()
                    for mp in cluster._masters:
                        await mp.proc.wait()
                nursery.cancel_scope.cancel()
    finally:
        if not keep_logs:
            for p in logdir.glob("*"):
                with contextlib.suppress(OSError):
                    p.unlink()
            with contextlib.suppress(OSError):
                logdir.rmdir()


def script_argv(script: str | Path, cfg: dict[str, Any]) -> list[str]:
    """argv that runs ``script`` as a child with a JSON configuration."""
    return [sys.executable, str(script), "--child", json.dumps(cfg)]


# ----------------------------------------------------------------------------------------------
# numbers and tables


def median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3 if seconds else float("nan")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table (right-aligned columns), also valid Markdown."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = ["| " + " | ".join(c.rjust(w) for c, w in zip(cells[0], widths, strict=True)) + " |",
           "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    for r in cells[1:]:
        out.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def parse_size(s: str) -> int:
    """``64``, ``64K``, ``1M``, ``2G`` (binary multiples) as a byte count.

    Raises:
        ValueError: not a size.
    """
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def machine_line() -> str:
    """One line describing where the numbers were taken."""
    import platform

    from pccl.transport import TcpTransport

    # Our connections between processes of this host: Unix sockets unless PCCL_LOCAL_SOCKETS=0
    # (docs/transport.md "Same-host connections"); Gloo's are loopback TCP either way.
    wire = "same-host Unix sockets" if TcpTransport().same_host else "loopback TCP (PCCL_LOCAL_SOCKETS=0)"
    return (f"{os.cpu_count()} CPU cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, {wire}")


class HostSteal:
    """Share of CPU time the hypervisor took from this VM while a block ran (Linux ``/proc/stat``).

    On a virtual machine whose host is busy, every figure (ours and the baseline's) can be several
    times slower than on a quiet host; printing the steal next to each side's numbers tells which runs
    are comparable. ``percent`` is NaN where ``/proc/stat`` has no steal column (not Linux). Use as
    ``with HostSteal() as s: ...`` and read ``s.percent`` afterwards.
    """

    def __init__(self) -> None:
        self.percent = float("nan")
        self._start: list[int] | None = None

    @staticmethod
    def _snapshot() -> list[int] | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu" or len(fields) < 9:
            return None
        return [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal

    def __enter__(self) -> HostSteal:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._snapshot()
        if self._start is None or end is None:
            return
        delta = [b - a for a, b in zip(self._start, end, strict=True)]
        total = sum(delta)
        if total > 0:
            self.percent = 100.0 * delta[7] / total


# ----------------------------------------------------------------------------------------------
# blocking driver side: children as ``subprocess.Popen`` (the WAN emulator's ``wan.popen``)


def wait_listening(master: subprocess.Popen[Any], log: Path, timeout: float = 30.0) -> bool:
    """Poll the master's log file until it has its "listening" line; False if the master exits first
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while "listening" not in log.read_text():
        if master.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling a child's log file for its first line
    return True


def follow_json_lines(proc: subprocess.Popen[str], into: list[dict[str, Any]]) -> None:
    """Start a daemon thread that appends every JSON object line of ``proc``'s stdout to ``into``."""

    def read() -> None:
        out = proc.stdout
        assert out is not None
        for line in out:
            if line.startswith("{"):
                into.append(json.loads(line))

    threading.Thread(target=read, daemon=True).start()


def wait_for_results(procs: Mapping[int, subprocess.Popen[str]], lines: Mapping[int, list[dict[str, Any]]],
                     expect: Iterable[int], deadline: float,
                     failure: Callable[[list[int]], str]) -> dict[int, dict[str, Any]]:
    """Wait until every child in ``expect`` has printed its ``result`` line (``lines``, filled by
    :func:`follow_json_lines`) and return each one's.

    Raises RuntimeError(``failure(dead)``) as soon as a child in ``expect`` exited without one
    (``dead``: those) or at ``deadline`` (``time.monotonic()``; ``dead`` then empty).
    """
    expect = list(expect)

    def has_result(h: int) -> bool:
        return any(x["event"] == "result" for x in lines[h])

    while not all(has_result(h) for h in expect):
        dead = [h for h in expect if procs[h].poll() is not None and not has_result(h)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(failure(dead))
        time.sleep(0.1)  # the readers fill ``lines``; the result lines end the wait
    return {h: next(x for x in lines[h] if x["event"] == "result") for h in expect}


def end_processes(children: Iterable[subprocess.Popen[Any]],
                  master: subprocess.Popen[Any] | None = None) -> None:
    """Stop a run's processes (call it in a ``finally``): SIGKILL each child still running and reap it,
    then the master: SIGTERM, 10 s to exit, else SIGKILL."""
    for p in children:
        if p.poll() is None:
            p.kill()
        p.wait()
    if master is not None:
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()
