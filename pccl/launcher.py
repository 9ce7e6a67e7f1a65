"""``pccl run -n N SCRIPT [ARGS...]``: a local launcher for development, like torchrun.

Starts a master in this process and N peer processes ``python SCRIPT ARGS...``, each with
``PCCL_MASTER`` set to the master's address (plus ``PCCL_RANK`` = 0..N-1 and ``PCCL_WORLD_SIZE`` = N,
for scripts that want to tell themselves apart). Every line a process prints is prefixed with
``[peer I]`` (``[master]`` for the master's log). When a process fails, the others are stopped and
the launcher exits with the first failure's code; Ctrl-C (or SIGTERM) stops everything (exit 130).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

import trio

from . import _env
from ._cliutil import CliError, Parser, port_number
from ._config import MasterConfig
from .master.server import open_master

log = logging.getLogger("pccl.launcher")

#: Seconds a process gets to exit after SIGTERM before it is killed.
STOP_GRACE = 3.0


@dataclass
class _Child:
    rank: int
    proc: trio.Process
    prefix: str
    code: int | None = None
    done: trio.Event = field(default_factory=trio.Event)


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="pccl run", description="Start a master and N peer processes of SCRIPT (like torchrun).")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of peer processes")
    p.add_argument("--host", default="127.0.0.1", help="address the master binds (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=0, help="master port (default: any free port)")
    p.add_argument("--status-port", type=port_number, default=None,
                   help="serve the master's status page on this port")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix the processes' output")
    p.add_argument("script", help="the Python script every peer runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


async def _pump(stream: Any, prefix: str, out: TextIO) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed. When ``out`` breaks (a closed pipe)
    the rest is drained and dropped, so that the process never blocks on a full pipe."""
    buf = b""
    writable = True
    async for chunk in stream:
        if not writable:
            continue
        buf += chunk
        *lines, buf = buf.split(b"\n")
        try:
            for line in lines:
                out.write(prefix + line.decode(errors="replace") + "\n")
            out.flush()
        except (OSError, ValueError):  # BrokenPipeError, or a closed file
            writable = False
    if buf and writable:
        try:
            out.write(prefix + buf.decode(errors="replace") + "\n")
            out.flush()
        except (OSError, ValueError):
            pass


def _say(out: TextIO, text: str) -> None:
    try:
        out.write(text + "\n")
        out.flush()
    except (OSError, ValueError):
        pass


async def _stop(children: list[_Child]) -> None:
    """SIGTERM every running child, then SIGKILL those still running after :data:`STOP_GRACE`; returns
    once all have exited (shielded: it also runs while the launcher is being cancelled)."""
    with trio.CancelScope(shield=True):
        for c in children:
            if c.proc.returncode is None:
                c.proc.terminate()
        with trio.move_on_after(STOP_GRACE):
            for c in children:
                await c.proc.wait()
        for c in children:
            if c.proc.returncode is None:
                c.proc.kill()
        for c in children:
            await c.proc.wait()


async def launch(
    n: int,
    command: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    status_port: int | None = None,
    prefix: bool = True,
    out: TextIO | None = None,
) -> int:
    """Run a master and ``n`` copies of ``command`` until they all exit; returns the exit code.

    Args:
        n: peer processes.
        command: the argv of every peer process.
        host: address the master binds.
        port: master port (0: any).
        status_port: serve the status page on this port.
        prefix: prefix each output line with ``[peer I] ``.
        out: where the output goes (default ``sys.stdout``).

    Returns:
        0 when every process exited with 0; else the first failure's exit code (a process killed by a
        signal counts as 128 + the signal number); 130 after SIGINT/SIGTERM.
    """
    sink = out or sys.stdout
    cert, key, ca = _env.master_tls()
    config = MasterConfig(status_port=status_port, secret=_env.secret(None), tls_cert=cert, tls_key=key,
                          tls_ca=ca)
    async with open_master((host, port), config=config) as master:
        env = {**os.environ, _env.ENV_MASTER: master.connect_address, "PCCL_WORLD_SIZE": str(n)}
        if master.status_url:
            _say(sink, f"[launcher] status page: {master.status_url}")
        _say(sink, f"[launcher] master at {master.connect_address}; "
                   f"starting {n} peer(s): {' '.join(command)}")
        children: list[_Child] = []
        first_failure: list[int] = []
        interrupted = False
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def watch(child: _Child) -> None:
                    code = await child.proc.wait()
                    child.code = 128 - code if code < 0 else code
                    child.done.set()
                    if child.code != 0 and not first_failure and not interrupted:
                        first_failure.append(child.code)
                        _say(sink, f"[launcher] peer {child.rank} exited with code {child.code}; "
                                   "stopping the others")
                        nursery.start_soon(_stop, children)

                async def on_signal() -> None:
                    nonlocal interrupted
                    async for signum in signals:
                        interrupted = True
                        _say(sink, f"[launcher] {signal.Signals(signum).name}: stopping every process")
                        await _stop(children)
                        nursery.cancel_scope.cancel()
                        return

                signal_task = trio.CancelScope()

                async def guarded_signal() -> None:
                    with signal_task:
                        await on_signal()

                nursery.start_soon(guarded_signal)
                try:
                    for rank in range(n):
                        proc = await trio.lowlevel.open_process(
                            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**env, "PCCL_RANK": str(rank)}, start_new_session=True,
                        )
                        tag = f"[peer {rank}] " if prefix else ""
                        child = _Child(rank=rank, proc=proc, prefix=tag)
                        children.append(child)
                        assert proc.stdout is not None
                        nursery.start_soon(_pump, proc.stdout, tag, sink)
                        nursery.start_soon(watch, child)
                    for c in children:
                        await c.done.wait()
                finally:
                    if any(c.proc.returncode is None for c in children):
                        await _stop(children)
                signal_task.cancel()
        if interrupted:
            return 130
        return first_failure[0] if first_failure else 0


def main(argv: list[str]) -> int:
    """``pccl run``: parse ``argv`` and :func:`launch`.

    Raises:
        pccl.cli.CliError: a bad option or a script that does not exist.
    """
    args = _parser().parse_args(argv)
    if args.nproc < 1:
        raise CliError(f"-n must be at least 1, got {args.nproc}")
    if not os.path.isfile(args.script):
        raise CliError(f"no such script: {args.script}")
    _env.drop_env_handler()
    logging.basicConfig(level=getattr(logging, _env.log_level("WARNING")),
                        format="[master] %(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    command = [sys.executable, args.script, *args.args]
    return trio.run(lambda: launch(args.nproc, command, host=args.host, port=args.port,
                                   status_port=args.status_port, prefix=not args.no_prefix))


__all__ = ["STOP_GRACE", "launch", "main"]
