"""Environment variables for the common settings (documented in docs/cli.md).

====================== ======================================================================
``PCCL_MASTER``        the master's ``HOST:PORT`` when a communicator is given no address
``PCCL_SECRET_FILE``   a file whose content (stripped) is the shared secret, for peers and master
``PCCL_SECRET``        the shared secret itself (``PCCL_SECRET_FILE`` wins when both are set)
``PCCL_TLS_CERT``      PEM certificate chain for TLS (peers, ``pccl-master``, ``pccl run``'s master)
``PCCL_TLS_KEY``       its private key (default: the ``PCCL_TLS_CERT`` file)
``PCCL_TLS_CA``        PEM CA certificates the other side's certificate must chain to
``PCCL_LOG_LEVEL``     DEBUG, INFO, WARNING or ERROR: level of the ``pccl`` loggers (stderr)
``PCCL_SPIN_SECONDS``  ``PeerConfig.spin_seconds`` of a communicator given no ``PeerConfig``
``PCCL_RUN``           the run name of a peer given no ``PeerConfig.run`` (docs/concepts.md "Run names")
``PCCL_CONGESTION_CONTROL`` ``PeerConfig.p2p_congestion_control`` of a communicator given no
                       ``PeerConfig`` (``default``: None, the kernel's own)
``PCCL_LOCAL_SOCKETS`` ``0`` turns off the same-host shortcut of ``TcpTransport`` (which reads it
                       with :func:`local_sockets_enabled`)
====================== ======================================================================

Explicit arguments always win over the environment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping

from ._address import EXPECTED_FORM, Addresses
from ._config import DEFAULT_MASTER_PORT, PeerConfig
from ._errors import InvalidArgumentError
from ._tls import check_pairing

ENV_MASTER = "PCCL_MASTER"
ENV_SECRET = "PCCL_SECRET"
ENV_SECRET_FILE = "PCCL_SECRET_FILE"
ENV_LOG_LEVEL = "PCCL_LOG_LEVEL"
ENV_SPIN_SECONDS = "PCCL_SPIN_SECONDS"
ENV_LOCAL_SOCKETS = "PCCL_LOCAL_SOCKETS"
ENV_RUN = "PCCL_RUN"
ENV_CONGESTION_CONTROL = "PCCL_CONGESTION_CONTROL"
ENV_TLS_CERT = "PCCL_TLS_CERT"
ENV_TLS_KEY = "PCCL_TLS_KEY"
ENV_TLS_CA = "PCCL_TLS_CA"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_HANDLER_NAME = "pccl-env-stderr"


def master_address(address: Addresses | None, environ: Mapping[str, str] | None = None) -> Addresses:
    """``address``, or ``$PCCL_MASTER`` when it is None (one ``HOST:PORT`` or several, comma-separated:
    the master, then its standbys).

    Raises:
        InvalidArgumentError: neither is given.
    """
    if address is not None:
        return address
    env = os.environ if environ is None else environ
    value = env.get(ENV_MASTER, "").strip()
    if not value:
        raise InvalidArgumentError(f"no master address: pass one ({EXPECTED_FORM}) or set {ENV_MASTER}")
    return value


def master_origin(address: Addresses | None, environ: Mapping[str, str] | None = None) -> str:
    """For error messages: " (from PCCL_MASTER=VALUE ...)" when :func:`master_address` took the address
    from the environment (with a note when it names no port, so the default one is used), else ""."""
    if address is not None:
        return ""
    env = os.environ if environ is None else environ
    value = env.get(ENV_MASTER, "").strip()
    if not value:
        return ""
    portless = [part.strip() for part in value.split(",") if ":" not in part.split("]")[-1]]
    note = f"; no port given, so the default {DEFAULT_MASTER_PORT}" if portless else ""
    return f" (from {ENV_MASTER}={value}{note})"


def local_sockets_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``$PCCL_LOCAL_SOCKETS`` lets :class:`~pccl.transport.TcpTransport` take the same-host
    shortcut (default: yes).

    Raises:
        InvalidArgumentError: the variable is set to something else than 1/0 (true/false, yes/no,
            on/off).
    """
    env = os.environ if environ is None else environ
    value = env.get(ENV_LOCAL_SOCKETS, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("", "1", "true", "yes", "on"):
        return True
    raise InvalidArgumentError(f"{ENV_LOCAL_SOCKETS} must be 1 or 0, not {value!r}")


def secret(explicit: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``explicit``, else the content of ``$PCCL_SECRET_FILE``, else ``$PCCL_SECRET``, else None.

    Raises:
        InvalidArgumentError: ``PCCL_SECRET_FILE`` names a file that cannot be read.
    """
    if explicit is not None:
        return explicit
    env = os.environ if environ is None else environ
    path = env.get(ENV_SECRET_FILE)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as exc:
            raise InvalidArgumentError(f"{ENV_SECRET_FILE}={path}: cannot read it ({exc.strerror})") from None
    return env.get(ENV_SECRET) or None


def tls_files(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None, str | None]:
    """``($PCCL_TLS_CERT, $PCCL_TLS_KEY, $PCCL_TLS_CA)``, each None when unset or empty; the key defaults
    to the certificate file (one PEM file may hold both)."""
    env = os.environ if environ is None else environ
    cert = env.get(ENV_TLS_CERT, "").strip() or None
    key = env.get(ENV_TLS_KEY, "").strip() or cert
    ca = env.get(ENV_TLS_CA, "").strip() or None
    return cert, key, ca


def master_tls(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None, str | None]:
    """The master's TLS files from the environment (:func:`tls_files`), checked as ``MasterConfig`` would.

    Raises:
        InvalidArgumentError: a CA without a certificate.
    """
    cert, key, ca = tls_files(environ)
    try:
        check_pairing(cert, key, ca, need_ca=False, who="the master")
    except ValueError as exc:
        raise InvalidArgumentError(f"{exc} (from ${ENV_TLS_CERT}, ${ENV_TLS_KEY}, ${ENV_TLS_CA})") from None
    return cert, key, ca


def peer_config(config: PeerConfig | None, environ: Mapping[str, str] | None = None) -> PeerConfig:
    """``config`` (default :class:`PeerConfig`) with its secret from the environment when it has none, and
    its TLS files from ``$PCCL_TLS_CERT`` / ``$PCCL_TLS_KEY`` / ``$PCCL_TLS_CA`` when it names none.

    Without ``config``, ``spin_seconds`` comes from ``$PCCL_SPIN_SECONDS`` and
    ``p2p_congestion_control`` from ``$PCCL_CONGESTION_CONTROL`` when they are set (the blocking API's
    communicators take no config).

    Raises:
        InvalidArgumentError: ``PCCL_SECRET_FILE`` cannot be read, the TLS variables are incomplete
            (a peer needs a certificate and a CA), ``PCCL_SPIN_SECONDS`` is not a number >= 0,
            ``PCCL_CONGESTION_CONTROL`` is no congestion control's name, or ``PCCL_RUN`` is no run name.
    """
    cfg = config or PeerConfig()
    env = os.environ if environ is None else environ
    spin = env.get(ENV_SPIN_SECONDS, "").strip()
    if config is None and spin:
        try:
            cfg = dataclasses.replace(cfg, spin_seconds=float(spin))
        except ValueError:
            raise InvalidArgumentError(
                f"${ENV_SPIN_SECONDS} must be a number of seconds >= 0, not {spin!r}"
            ) from None
    cc = env.get(ENV_CONGESTION_CONTROL)
    if config is None and cc is not None:
        choice: str | None = cc.strip()
        if choice in ("", "default"):
            choice = None
        try:
            cfg = dataclasses.replace(cfg, p2p_congestion_control=choice)
        except ValueError as exc:
            raise InvalidArgumentError(f"${ENV_CONGESTION_CONTROL}={cc!r}: {exc}") from None
    if cfg.run is None:
        name = env.get(ENV_RUN, "").strip()
        if name:
            try:
                cfg = dataclasses.replace(cfg, run=name)
            except ValueError as exc:
                raise InvalidArgumentError(f"{ENV_RUN}={name}: {exc}") from None
    if cfg.secret is None:
        found = secret(None, environ)
        if found is not None:
            cfg = dataclasses.replace(cfg, secret=found)
    if cfg.tls_cert is None and cfg.tls_key is None and cfg.tls_ca is None:
        cert, key, ca = tls_files(environ)
        if cert is not None or ca is not None:
            try:
                cfg = dataclasses.replace(cfg, tls_cert=cert, tls_key=key, tls_ca=ca)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"{exc} (from ${ENV_TLS_CERT}, ${ENV_TLS_KEY}, ${ENV_TLS_CA})"
                ) from None
    return cfg


def log_level(default: str = "WARNING", environ: Mapping[str, str] | None = None) -> str:
    """``$PCCL_LOG_LEVEL`` (upper-cased) when it is a known level, else ``default``."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_LOG_LEVEL, "").strip().upper()
    return value if value in LOG_LEVELS else default


def apply_log_level(environ: Mapping[str, str] | None = None) -> None:
    """When ``$PCCL_LOG_LEVEL`` is set: set the ``pccl`` logger to it and, if nothing else configured
    logging, log to stderr. Called once when :mod:`pccl` is imported."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_LOG_LEVEL, "").strip()
    if not value:
        return
    if value.upper() not in LOG_LEVELS:
        # Named, not silently ignored (a typo would otherwise look like "no logs at all").
        print(f"pccl: {ENV_LOG_LEVEL}={value} is not one of {', '.join(LOG_LEVELS)}: using WARNING",
              file=sys.stderr)
    logger = logging.getLogger("pccl")
    logger.setLevel(log_level("WARNING", env))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.set_name(_HANDLER_NAME)
        logger.addHandler(handler)


def drop_env_handler() -> None:
    """Remove the stderr handler :func:`apply_log_level` added (a tool that configures logging itself
    calls this, so that records are not printed twice)."""
    logger = logging.getLogger("pccl")
    for h in list(logger.handlers):
        if h.get_name() == _HANDLER_NAME:
            logger.removeHandler(h)


__all__ = [
    "ENV_LOG_LEVEL", "ENV_MASTER", "ENV_RUN", "ENV_SECRET", "ENV_SECRET_FILE", "ENV_TLS_CA", "ENV_TLS_CERT",
    "ENV_TLS_KEY", "LOG_LEVELS", "apply_log_level", "drop_env_handler", "log_level", "master_address",
    "master_origin", "master_tls", "peer_config", "secret", "tls_files",
]
