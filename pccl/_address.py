"""Address strings shared by the master and the peer side: ``"HOST:PORT"`` (IPv6 as ``[::1]:PORT``).

Neutral ground: neither side imports the other for a string helper.
"""

from __future__ import annotations

from ._config import DEFAULT_MASTER_PORT
from ._errors import InvalidArgumentError


def parse_address(address: str, *, default_port: int = DEFAULT_MASTER_PORT) -> tuple[str, int]:
    """Split ``"HOST:PORT"`` (IPv6 as ``[::1]:PORT``); a missing port means ``default_port``.

    Raises:
        InvalidArgumentError: malformed address or port out of range.
    """
    address = address.strip()
    if not address:
        raise InvalidArgumentError("empty address")
    host, port_s = address, ""
    if address.startswith("["):
        end = address.find("]")
        if end < 0:
            raise InvalidArgumentError(f"malformed address {address!r}")
        host = address[1:end]
        rest = address[end + 1 :]
        port_s = rest[1:] if rest.startswith(":") else ""
    elif address.count(":") == 1:
        host, port_s = address.split(":")
    try:
        port = int(port_s) if port_s else default_port
    except ValueError as exc:
        raise InvalidArgumentError(f"malformed port in {address!r}") from exc
    if not 0 <= port < 65536:
        raise InvalidArgumentError(f"port {port} out of range")
    return host or "0.0.0.0", port


__all__ = ["parse_address"]
