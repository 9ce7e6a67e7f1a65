"""Command-line entry points: ``pccl-master`` and ``pccl`` (``python -m pccl``)."""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys

import trio

from ._config import DEFAULT_MASTER_PORT, MasterConfig


def _master_parser(prog: str = "pccl-master") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run a pccl master node.")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_MASTER_PORT, help=f"port (default {DEFAULT_MASTER_PORT})"
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=MasterConfig().heartbeat_timeout,
        help="seconds of silence before a peer is evicted",
    )
    p.add_argument(
        "--straggler-timeout",
        type=float,
        default=None,
        help="evict a peer the others wait on once it has been silent this long (default: off; "
        "only the heartbeat timeout applies)",
    )
    p.add_argument("--secret", default=None, help="shared secret peers must present (optional)")
    return p


async def _run_master(args: argparse.Namespace) -> None:
    from .master.server import serve_master

    config = MasterConfig(
        heartbeat_timeout=args.heartbeat_timeout, straggler_timeout=args.straggler_timeout, secret=args.secret
    )
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(serve_master, config=config), args.host, args.port)

            async def stop_on_signal() -> None:
                async for signum in signals:
                    logging.getLogger("pccl.master").info(
                        "received %s, shutting down", signal.Signals(signum).name
                    )
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def master_main(argv: list[str] | None = None) -> int:
    """``pccl-master``: run a master until SIGINT/SIGTERM. Returns the exit code."""
    args = _master_parser().parse_args(argv)
    _setup_logging(args.log_level)
    from .transport import ConnectFailed

    try:
        trio.run(_run_master, args)
    except ConnectFailed as exc:
        logging.getLogger("pccl.master").error("%s", exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``pccl``/``python -m pccl``: subcommands ``master`` and ``demo``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: pccl {master,demo} [options]\n\n"
            "  master   run a master node (same as pccl-master)\n"
            "  demo     local demo: a master and peers training together, one killed, one joining"
        )
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "master":
        return master_main(rest)
    if cmd == "demo":
        from .demo import main as demo_main

        return int(demo_main(rest))
    print(f"pccl: unknown command {cmd!r}", file=sys.stderr)
    return 2
