"""The cap on connections that have not finished their hello (total and per source host).

Pure: no trio, no sockets, no clock. A listener asks :meth:`HandshakeGate.enter` for every accepted
connection and calls :meth:`HandshakeGate.leave` once its hello is over (accepted, refused or timed
out); a connection over the cap is closed at once, unread. The hello timeout bounds how long each
admitted one holds its place, so a flood of idle connections can hold at most ``max_total``
descriptors of this process for one hello timeout, and one host at most ``max_per_host``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_HANDSHAKES = 256
DEFAULT_MAX_HANDSHAKES_PER_HOST = 64


@dataclass
class HandshakeGate:
    """Counts connections in their hello, by source host.

    Args:
        max_total: most connections in their hello at once.
        max_per_host: most of them from one source address.
    """

    max_total: int = DEFAULT_MAX_HANDSHAKES
    max_per_host: int = DEFAULT_MAX_HANDSHAKES_PER_HOST
    _by_host: dict[str, int] = field(default_factory=dict)
    _total: int = 0
    _refusing: bool = False
    refused_total: int = 0

    def __post_init__(self) -> None:
        if self.max_total < 1 or self.max_per_host < 1:
            raise ValueError("handshake caps must be >= 1")

    @property
    def in_hello(self) -> int:
        """Connections admitted whose hello is not over."""
        return self._total

    def enter(self, host: str) -> tuple[str | None, bool]:
        """Admit a new connection from ``host``, or say why not.

        Returns:
            ``(None, False)`` when admitted (call :meth:`leave` later); else ``(reason, first)``, where
            ``first`` is True for the first refusal since the gate last admitted a connection (log
            that one; the others of the same flood are counted in :attr:`refused_total`).
        """
        n = self._by_host.get(host, 0)
        reason = None
        if self._total >= self.max_total:
            reason = f"{self._total} connections are in their hello (the cap is {self.max_total})"
        elif n >= self.max_per_host:
            reason = (
                f"{n} connections from {host} are in their hello (the cap per host is {self.max_per_host})"
            )
        if reason is not None:
            first = not self._refusing
            self._refusing = True
            self.refused_total += 1
            return reason, first
        self._by_host[host] = n + 1
        self._total += 1
        self._refusing = False
        return None, False

    def leave(self, host: str) -> None:
        """A connection admitted by :meth:`enter` finished its hello (either way)."""
        n = self._by_host.get(host, 0)
        if n <= 0:
            raise ValueError(f"leave({host!r}) without enter")
        if n == 1:
            del self._by_host[host]
        else:
            self._by_host[host] = n - 1
        self._total -= 1


__all__ = ["DEFAULT_MAX_HANDSHAKES", "DEFAULT_MAX_HANDSHAKES_PER_HOST", "HandshakeGate"]
