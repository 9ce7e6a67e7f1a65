"""``pccl run -n N SCRIPT [ARGS...]``: a launcher like torchrun, for one machine or several.

Starts a master in this process (or, with ``--master HOST:PORT``, attaches to one that runs elsewhere)
and N peer processes ``python SCRIPT ARGS...``, each with ``PCCL_MASTER`` set to the master's address,
``PCCL_RUN`` to the run's name (docs/concepts.md "Run names"), and ``PCCL_RANK`` (global),
``PCCL_LOCAL_RANK``, ``PCCL_NODE_RANK`` and ``PCCL_WORLD_SIZE`` (N times ``--nnodes``) for scripts that
want to tell themselves apart. Every line a process prints is prefixed with ``[peer RANK]`` (``[master]``
for the master's log). When a process fails, the others of this node are stopped and the launcher exits
with the first failure's code; Ctrl-C (or SIGTERM) stops everything (exit 130). docs/cli.md shows a run
on two machines.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

import trio

from . import _env
from ._address import EXPECTED_FORM, format_address, parse_address
from ._cliutil import CliError, Parser, port_number
from ._config import MasterConfig, check_run_name
from ._errors import PCCLError
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
    p = Parser(prog="pccl run",
               description="Start a master (or attach to one) and N peers running SCRIPT (like torchrun).")
    p.add_argument("-n", "--nproc", "--nproc-per-node", dest="nproc", type=int, required=True,
                   help="peer processes on this node")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes (machines) of the run, each running pccl run with the same -n (default 1); "
                        "sets PCCL_WORLD_SIZE and the global PCCL_RANK")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index, 0..nnodes-1 (default 0); node 0 starts the master unless "
                        "--master is given, the others need --master")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="attach to the master at this address instead of starting one (default: start "
                        "one; the peers get it as PCCL_MASTER)")
    p.add_argument("--run", default=None, metavar="NAME",
                   help="the run's name (default $PCCL_RUN; else, with a master of its own, SCRIPT's name "
                        "and a random suffix): the master refuses peers of other runs")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the master binds (default 127.0.0.1; 0.0.0.0 for other machines)")
    p.add_argument("--port", type=port_number, default=0,
                   help="master port (default: any free port; give one when other nodes attach)")
    p.add_argument("--status-port", type=port_number, default=None,
                   help="serve the master's status page on this port")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix the processes' output")
    p.add_argument("script", help="the Python script every peer runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def default_run_name(script: str) -> str:
    """A run name of its own for a launch of ``script``: its stem (cut to the allowed characters) and
    six random hex digits, e.g. ``hello_world-3fa2c1``."""
    stem = os.path.splitext(os.path.basename(script))[0]
    stem = "".join(c if c.isalnum() or c in "._-" else "-" for c in stem)[:40] or "run"
    return f"{stem}-{secrets.token_hex(3)}"


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
    master: str | None = None,
    run: str | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
) -> int:
    """Run a master (unless ``master`` is given) and ``n`` copies of ``command`` until they all exit;
    returns the exit code.

    Args:
        n: peer processes of this node.
        command: the argv of every peer process.
        host: address the master binds.
        port: master port (0: any).
        status_port: serve the status page on this port.
        prefix: prefix each output line with ``[peer RANK] ``.
        out: where the output goes (default ``sys.stdout``).
        master: ``HOST:PORT`` of a running master to attach to (None: start one here).
        run: the run name the peers get as ``PCCL_RUN`` (and the master started here serves); None or
            "": none.
        nnodes: nodes of the run (``PCCL_WORLD_SIZE`` is ``n * nnodes``).
        node_rank: this node's index (its peers' global ranks start at ``node_rank * n``).

    Returns:
        0 when every process exited with 0; else the first failure's exit code (a process killed by a
        signal counts as 128 + the signal number); 130 after SIGINT/SIGTERM.
    """
    sink = out or sys.stdout
    base = {**os.environ, "PCCL_WORLD_SIZE": str(n * nnodes), "PCCL_NODE_RANK": str(node_rank)}
    if run:
        base[_env.ENV_RUN] = run
    named = f" of run {run}" if run else ""
    if master is not None:
        _say(sink, f"[launcher] attaching to the master at {master}{named}; starting {n} peer(s) "
                   f"(node {node_rank} of {nnodes}, ranks {node_rank * n}..{node_rank * n + n - 1}): "
                   f"{' '.join(command)}")
        return await _run_peers(n, command, {**base, _env.ENV_MASTER: master}, node_rank, prefix, sink)
    cert, key, ca = _env.master_tls()
    config = MasterConfig(status_port=status_port, secret=_env.secret(None), tls_cert=cert, tls_key=key,
                          tls_ca=ca, run=run or None)
    async with open_master((host, port), config=config) as handle:
        if handle.status_url:
            _say(sink, f"[launcher] status page: {handle.status_url}")
        _say(sink, f"[launcher] master at {handle.connect_address}{named}; "
                   f"starting {n} peer(s): {' '.join(command)}")
        if nnodes > 1:
            _say(sink, f"[launcher] the other nodes attach with: pccl run --master HOST:{handle.address[1]} "
                       f"--nnodes {nnodes} --node-rank R -n {n}" + (f" --run {run}" if run else "")
                       + " SCRIPT (HOST: this machine's address they reach)")
        env = {**base, _env.ENV_MASTER: handle.connect_address}
        return await _run_peers(n, command, env, node_rank, prefix, sink)


async def _run_peers(n: int, command: list[str], env: dict[str, str], node_rank: int, prefix: bool,
                     sink: TextIO) -> int:
    """Start this node's ``n`` peer processes with ``env`` and watch them (see :func:`launch`)."""
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
                for local in range(n):
                    rank = node_rank * n + local
                    proc = await trio.lowlevel.open_process(
                        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        env={**env, "PCCL_RANK": str(rank), "PCCL_LOCAL_RANK": str(local)},
                        start_new_session=True,
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
    if args.nnodes < 1:
        raise CliError(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise CliError(f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), "
                       f"got {args.node_rank}")
    if not os.path.isfile(args.script):
        raise CliError(f"no such script: {args.script}")
    master = None
    if args.master is not None:
        try:
            master = format_address(*parse_address(args.master))
        except PCCLError as exc:
            raise CliError(f"--master: {exc.message}") from None
        if args.status_port is not None or args.port != 0:
            raise CliError("--port and --status-port configure a master of this launcher's own; with "
                           "--master it starts none (give them to the master you attach to)")
    elif args.node_rank > 0:
        raise CliError(f"node {args.node_rank} of {args.nnodes} needs --master HOST:PORT: the address of the "
                       f"master node 0 started (or of a pccl-master); {EXPECTED_FORM}")
    elif args.nnodes > 1 and args.port == 0:
        raise CliError("node 0 of several starts the master: give it a --port the other nodes can attach to "
                       "(and --host 0.0.0.0 or this machine's address)")
    run = args.run if args.run is not None else os.environ.get(_env.ENV_RUN, "").strip() or None
    if run is None and master is None:
        run = default_run_name(args.script)
    try:
        check_run_name(run, "--run" if args.run is not None else _env.ENV_RUN)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _env.drop_env_handler()
    logging.basicConfig(level=getattr(logging, _env.log_level("WARNING")),
                        format="[master] %(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    command = [sys.executable, args.script, *args.args]
    return trio.run(lambda: launch(args.nproc, command, host=args.host, port=args.port,
                                   status_port=args.status_port, prefix=not args.no_prefix, master=master,
                                   run=run, nnodes=args.nnodes, node_rank=args.node_rank))


__all__ = ["STOP_GRACE", "default_run_name", "launch", "main"]
