"""Command-line entry points: ``pccl-master`` and ``pccl`` (``python -m pccl``).

Every mistake on the command line ends in one line on stderr and a non-zero exit code (2 for a bad
option, 1 for an address that cannot be bound or reached); the cause's traceback goes to the DEBUG log.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import trio

from . import _env, _tls
from ._address import EXPECTED_FORM, parse_address
from ._cliutil import CliError, Parser, port_number, seconds
from ._config import DEFAULT_MASTER_PORT, MasterConfig
from ._errors import PCCLError
from ._exc import sole_exception
from .launcher import main as run_main

VERSION = "0.1.0"
log = logging.getLogger("pccl.cli")


def _add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")


def _master_parser(prog: str = "pccl-master") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description="Run a pccl master node.")
    defaults = MasterConfig()
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.add_argument("--port", type=port_number, default=DEFAULT_MASTER_PORT,
                   help=f"port (default {DEFAULT_MASTER_PORT})")
    p.add_argument("--status-port", type=port_number, default=None,
                   help="serve the status page, /status (JSON) and /metrics (Prometheus) over HTTP "
                        "on this port")
    p.add_argument("--status-host", default=None, help="address the status page binds (default: --host)")
    p.add_argument("--log-level", default=None, choices=list(_env.LOG_LEVELS),
                   help="default $PCCL_LOG_LEVEL, else INFO")
    p.add_argument("--heartbeat-timeout", type=seconds, default=defaults.heartbeat_timeout,
                   help="seconds of silence before a peer is evicted")
    p.add_argument("--straggler-timeout", type=seconds, default=None,
                   help="evict a peer the others wait on once it has been silent this long (default: off; "
                        "only the heartbeat timeout applies)")
    p.add_argument("--deadlock-grace", type=seconds, default=defaults.deadlock_grace,
                   help="fail the calls of a group whose peers wait in calls that cannot complete each other "
                        f"after this many seconds (default {defaults.deadlock_grace:g})")
    p.add_argument("--rebuild-grace", type=seconds, default=defaults.rebuild_grace,
                   help="a restarted master waits this long for every member of the run to come back "
                        f"before it resumes (default {defaults.rebuild_grace:g}; docs/concepts.md)")
    p.add_argument("--rebuild-quiet", type=seconds, default=defaults.rebuild_quiet,
                   help="once most of the run's members are back, a restarted master stops waiting for "
                        "the others when nobody came back for this long "
                        f"(default {defaults.rebuild_quiet or 0:g}; 0: wait the whole --rebuild-grace)")
    p.add_argument("--rejoin-grace", type=seconds, default=defaults.rejoin_grace,
                   help="hold the votes this long for a member whose connection broke to re-register "
                        "(a reset link), at the cost of that much per crashed member "
                        f"(default {defaults.rejoin_grace:g}: off; docs/concepts.md)")
    p.add_argument("--quorum", choices=("auto", "on", "off"), default=defaults.quorum,
                   help="complete votes only while a majority of the epoch's members is connected: 'auto' "
                        "once a peer says it can fail over to a standby master, 'on', 'off' "
                        f"(default {defaults.quorum})")
    p.add_argument("--quorum-hold-timeout", type=seconds, default=defaults.quorum_hold_timeout,
                   help="seconds a master without its quorum holds votes before it tells its peers to look "
                        f"for a newer master (default {defaults.quorum_hold_timeout:g})")
    p.add_argument("--speculative-go-delay", type=seconds, default=defaults.speculative_go_delay,
                   help="hold the 'everyone voted' message of a speculatively started collective back this "
                        "long; an operation that ends sooner gets only its completion (0: at once; "
                        f"default {defaults.speculative_go_delay:g}; docs/protocol.md section 4)")
    p.add_argument("--credentials-batch-delay", type=seconds, default=defaults.credentials_batch_delay,
                   help="send the P2P credentials of members that re-register to the other members in "
                        "batches this long apart: a restarted master's n members cost n messages per "
                        f"batch instead of n per return (0: at each return; default "
                        f"{defaults.credentials_batch_delay:g}; docs/security.md)")
    p.add_argument("--run", default=None, metavar="NAME",
                   help="the run's name: peers that name another run (PCCL_RUN, PeerConfig.run) are refused "
                        "(default $PCCL_RUN, else none: the master takes the first named peer's; "
                        "docs/concepts.md \"Run names\")")
    p.add_argument("--secret", default=None,
                   help="shared secret peers must know (optional; visible in the process list: "
                        "prefer --secret-file or $PCCL_SECRET)")
    p.add_argument("--secret-file", default=None,
                   help="read the shared secret from this file (default $PCCL_SECRET_FILE)")
    p.add_argument("--token-key-file", default=None, metavar="PATH",
                   help="without a secret: keep the member-token key in this file (made, mode 0600, if "
                        "missing), so that a restarted master refuses strangers' claims on places in its "
                        "rebuild (default: a per-user file under $PCCL_STATE_DIR, $XDG_STATE_HOME/pccl or "
                        "~/.local/state/pccl; '' for a key of this process only, whose "
                        "restart takes claims on trust; docs/security.md \"Re-registration\")")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve TLS with this certificate chain (default $PCCL_TLS_CERT; peers then need "
                        "TLS too)")
    p.add_argument("--tls-key", default=None, metavar="PEM",
                   help="the certificate's private key (default $PCCL_TLS_KEY, else the --tls-cert file)")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="require client certificates signed by these CAs: mutual TLS (default $PCCL_TLS_CA)")
    _add_version(p)
    return p


def _master_config(args: argparse.Namespace) -> MasterConfig:
    secret = args.secret
    if secret is None and args.secret_file is not None:
        try:
            with open(args.secret_file, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise CliError(f"--secret-file {args.secret_file}: cannot read it ({exc.strerror})") from None
    if secret is None:
        secret = _env.secret(None)
    try:
        cert, key, ca = _master_tls(args)
        parse_address((args.host, args.port))
        if args.status_host is not None:
            parse_address((args.status_host, 0))
        return MasterConfig(
            heartbeat_timeout=args.heartbeat_timeout,
            straggler_timeout=args.straggler_timeout,
            deadlock_grace=args.deadlock_grace,
            rebuild_grace=args.rebuild_grace,
            rebuild_quiet=args.rebuild_quiet or None,
            rejoin_grace=args.rejoin_grace,
            quorum=args.quorum,
            quorum_hold_timeout=args.quorum_hold_timeout,
            speculative_go_delay=args.speculative_go_delay,
            credentials_batch_delay=args.credentials_batch_delay,
            secret=secret,
            token_key_file=args.token_key_file,
            status_port=args.status_port,
            status_host=args.status_host,
            tls_cert=cert,
            tls_key=key,
            tls_ca=ca,
            run=_run_name(args.run),
        )
    except ValueError as exc:  # InvalidArgumentError is a ValueError too
        raise CliError(exc.message if isinstance(exc, PCCLError) else str(exc)) from None


def _run_name(option: str | None) -> str | None:
    """``--run``, else ``$PCCL_RUN``, else None (checked by ``MasterConfig``; the variable named)."""
    if option is not None:
        return option
    value = os.environ.get(_env.ENV_RUN, "").strip() or None
    if value is not None:
        try:
            MasterConfig(run=value)
        except ValueError as exc:
            raise ValueError(f"{_env.ENV_RUN}={value}: {exc}") from None
    return value


def _master_tls(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """The TLS files: the options, else the environment; loaded once here, so that a bad file is one
    line and exit code 2 before anything listens.

    Raises:
        ValueError: a certificate without a key file or a CA without a certificate (InvalidArgumentError:
            a file that cannot be read or is not valid).
    """
    env_cert, env_key, env_ca = _env.tls_files()
    cert = args.tls_cert or env_cert
    key = args.tls_key or (args.tls_cert if args.tls_cert else env_key)
    ca = args.tls_ca or env_ca
    if _tls.check_pairing(cert, key, ca, need_ca=False, who="TLS options"):
        assert cert is not None and key is not None
        _tls.server_context(_tls.TlsFiles(cert, key, ca))
    return cert, key, ca


async def _run_master(args: argparse.Namespace, config: MasterConfig) -> None:
    from .master.server import serve_master

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


def setup_logging(level: str | None) -> None:
    """Log to stderr at ``level`` (default ``$PCCL_LOG_LEVEL``, else INFO)."""
    name = level or _env.log_level("INFO")
    _env.drop_env_handler()
    logging.basicConfig(level=getattr(logging, name), format=_env.LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("pccl").setLevel(getattr(logging, name))


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def _run_guarded(prog: str, body: Any, argv: list[str]) -> int:
    """Run ``body(argv)``; turn CLI mistakes and bind failures into one line and an exit code."""
    from .transport import ConnectFailed

    try:
        return int(body(argv))
    except SystemExit as exc:  # --help / --version
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    except CliError as exc:
        return _fail(prog, exc.message, exc.code)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        sole = sole_exception(exc)
        if isinstance(sole, (ConnectFailed, PCCLError)):
            log.debug("%s failed", prog, exc_info=exc)
            return _fail(prog, str(sole), 1)
        raise


def _master(argv: list[str], prog: str = "pccl-master") -> int:
    args = _master_parser(prog).parse_args(argv)
    config = _master_config(args)
    setup_logging(args.log_level)
    trio.run(_run_master, args, config)
    return 0


def master_main(argv: list[str] | None = None) -> int:
    """``pccl-master``: run a master until SIGINT/SIGTERM. Returns the exit code (0; 1 when the address
    cannot be bound; 2 for a bad option)."""
    return _run_guarded("pccl-master", _master, list(sys.argv[1:] if argv is None else argv))


# ------------------------------------------------------------------------------------------------
# pccl status


def _status_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pccl status", description="Show a running master's status (its --status-port).")
    p.add_argument("address", help="the master's HOST:STATUS_PORT")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval", type=seconds, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after this many refreshes")
    p.add_argument("--json", action="store_true", help="print the raw /status JSON")
    p.add_argument("--timeout", type=seconds, default=5.0, help="HTTP timeout in seconds (default 5)")
    return p


def fetch_status(address: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET ``http://ADDRESS/status``.

    Raises:
        CliError: malformed address, or the status page cannot be reached or read.
    """
    try:
        host, port = parse_address(address, default_port=-1)
    except PCCLError as exc:
        raise CliError(exc.message) from None
    if port < 0:
        raise CliError(f"{address!r} has no port: give the master's HOST:STATUS_PORT (its --status-port)")
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            data: dict[str, Any] = json.load(resp)
            return data
    except urllib.error.HTTPError as exc:
        raise CliError(f"{url} answered {exc.code} {exc.reason}: is this a pccl master's status port?", 1) \
            from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        log.debug("fetching %s failed", url, exc_info=True)
        raise CliError(f"cannot reach {url}: {reason} (is the master running with --status-port {port}?)",
                       1) from None
    except ValueError as exc:
        msg = f"{url} did not answer JSON ({exc}): is this a pccl master's status port?"
        raise CliError(msg, 1) from None


def _status(argv: list[str]) -> int:
    from .master.status import render_text

    args = _status_parser().parse_args(argv)
    shown = 0
    while True:
        snap = fetch_status(args.address, args.timeout)
        text = json.dumps(snap, indent=1) + "\n" if args.json else render_text(snap)
        if args.watch and sys.stdout.isatty():
            sys.stdout.write("\x1b[H\x1b[2J")
        sys.stdout.write(text)
        sys.stdout.flush()
        shown += 1
        if not args.watch or (args.count is not None and shown >= args.count):
            return 0
        time.sleep(args.interval)


# ------------------------------------------------------------------------------------------------
# pccl


USAGE = f"""usage: pccl {{master,status,run,demo}} [options]   (pccl --version)

  master   run a master node (same as pccl-master)
  status   show a running master's status: pccl status HOST:STATUS_PORT [--watch]
  run      start a master (or attach to one: --master HOST:PORT) and N peer processes of a script:
           pccl run -n N [--nnodes K --node-rank R] SCRIPT [ARGS...]
  demo     local demo: a master and peers training together, one killed, one joining

Peers find the master through the address they are given, or $PCCL_MASTER (port {DEFAULT_MASTER_PORT} when
omitted; addresses are {EXPECTED_FORM})."""


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"pccl {VERSION}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "master":
        return _master(rest, "pccl master")
    if cmd == "status":
        return _status(rest)
    if cmd == "run":
        return run_main(rest)
    if cmd == "demo":
        from .demo import main as demo_main

        return int(demo_main(rest))
    raise CliError(f"unknown command {cmd!r} (choose from master, status, run, demo; see pccl --help)")


def main(argv: list[str] | None = None) -> int:
    """``pccl``/``python -m pccl``: subcommands ``master``, ``status``, ``run`` and ``demo``."""
    return _run_guarded("pccl", _main, list(sys.argv[1:] if argv is None else argv))


__all__ = ["VERSION", "CliError", "fetch_status", "main", "master_main", "port_number", "setup_logging"]
