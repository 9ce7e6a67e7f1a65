"""Addresses shared by the master and the peer side: ``"HOST:PORT"`` (IPv6 as ``[::1]:PORT``) or a
``(host, port)`` tuple. A missing port means :data:`~pccl._config.DEFAULT_MASTER_PORT` (48148).

Neutral ground: neither side imports the other for a string helper.
"""

from __future__ import annotations

import re
from typing import Any

from ._config import DEFAULT_MASTER_PORT
from ._errors import InvalidArgumentError

#: The forms every address parameter accepts (quoted in errors).
EXPECTED_FORM = '"HOST:PORT" (e.g. "127.0.0.1:48148", "[::1]:48148") or a (host, port) tuple'

# Host names (RFC 1123 labels, underscores tolerated), IPv4, or an IPv6 literal (checked apart).
_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")
_IPV6 = re.compile(r"^[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?$")

Address = str | tuple[str, int]


def _bad(address: Any, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"invalid address {address!r}: {why}; expected {EXPECTED_FORM}")


def _check_port(address: Any, port: Any) -> int:
    if isinstance(port, bool) or not isinstance(port, int):
        raise _bad(address, f"the port must be an integer, got {port!r}")
    if not 0 <= port < 65536:
        raise _bad(address, f"port {port} is out of range (0-65535)")
    return port


def _check_host(address: Any, host: str) -> str:
    if not host:
        return "0.0.0.0"
    if "/" in host:
        raise _bad(address, "give the host and port only, not a URL")
    if ":" in host:
        if host.count(":") < 2 or not _IPV6.match(host):
            raise _bad(address, f"{host!r} is not a host name or IP address")
        return host
    if not _HOSTNAME.match(host):
        raise _bad(address, f"{host!r} is not a host name or IP address")
    return host


def parse_address(address: Address, *, default_port: int = DEFAULT_MASTER_PORT) -> tuple[str, int]:
    """Split ``"HOST:PORT"`` (IPv6 as ``[::1]:PORT``) or check a ``(host, port)`` tuple.

    A missing port means ``default_port`` (48148, the master's); an empty host means ``0.0.0.0``.

    Args:
        address: ``"HOST:PORT"``, ``"HOST"``, ``"[IPv6]:PORT"`` or ``(host, port)``.
        default_port: the port when the string has none.

    Returns:
        ``(host, port)``.

    Raises:
        InvalidArgumentError: anything else (a URL, spaces or other junk, a port out of range), with
            a message naming the expected form.
    """
    if isinstance(address, tuple):
        if len(address) < 2 or not isinstance(address[0], str):
            raise _bad(address, "a tuple must be (host: str, port: int)")
        return _check_host(address, address[0].strip()), _check_port(address, address[1])
    if not isinstance(address, str):
        raise _bad(address, f"got a {type(address).__name__}")
    text = address.strip()
    if not text:
        raise _bad(address, "it is empty")
    if "://" in text or "/" in text:
        raise _bad(address, "give the host and port only, not a URL")
    if any(c.isspace() for c in text):
        raise _bad(address, "it contains spaces")
    host, port_s = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _bad(address, "an IPv6 address needs its closing ']'")
        host = text[1:end]
        rest = text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise _bad(address, f"unexpected {rest!r} after ']'")
        port_s = rest[1:]
        if not host or ":" not in host:
            raise _bad(address, f"{host!r} in brackets is not an IPv6 address")
    elif text.count(":") == 1:
        host, port_s = text.split(":")
        if not port_s:
            raise _bad(address, "the port after ':' is missing")
    if port_s:
        if not port_s.isdigit():
            raise _bad(address, f"the port {port_s!r} is not a number")
        port = _check_port(address, int(port_s))
    else:
        port = default_port
    return _check_host(address, host), port


#: One master address, or several: a list of them, or one string of comma-separated addresses (the
#: first is tried first; the next ones are standbys, see docs/concepts.md "Surviving the master").
Addresses = Address | list[Address]


def parse_addresses(address: Addresses, *, default_port: int = DEFAULT_MASTER_PORT) -> list[tuple[str, int]]:
    """Parse one master address or several (``["h1:p", "h2:p"]`` or ``"h1:p,h2:p"``), in order.

    Args:
        address: an :data:`Address`, a list of them, or a comma-separated string.
        default_port: the port when an address has none.

    Returns:
        ``[(host, port), ...]``, at least one, no duplicates (the first occurrence kept).

    Raises:
        InvalidArgumentError: an empty list, or any malformed address (see :func:`parse_address`).
    """
    if isinstance(address, list):
        items: list[Address] = list(address)
        if not items:
            raise _bad(address, "the list of addresses is empty")
    elif isinstance(address, str) and "," in address:
        items = [part for part in address.split(",")]
    else:
        items = [address]
    out: list[tuple[str, int]] = []
    for item in items:
        parsed = parse_address(item, default_port=default_port)
        if parsed not in out:
            out.append(parsed)
    return out


def format_address(host: str, port: int) -> str:
    """``"HOST:PORT"`` (IPv6 hosts in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["EXPECTED_FORM", "Address", "Addresses", "format_address", "parse_address", "parse_addresses"]
