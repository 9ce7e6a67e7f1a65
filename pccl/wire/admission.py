"""The cap on connections that have not finished their hello (total and per source host).

Pure: no trio, no sockets, no clock. A listener asks :meth:`HandshakeGate.enter` for every accepted
connection and calls :meth:`HandshakeGate.leave` once its hello is over (accepted, refused or timed
out). The hello timeout bounds how long each one holds its place, so a flood of idle connections holds at
most ``max_total`` descriptors of this process, and one host at most ``max_per_host``.

At the cap the gate makes room by closing the *oldest* connection in its hello (of that host when the
host's cap is reached, else of all), never by refusing the new one (issue 33 finding 8): a flood of idle
connections from one source, the same-host socket included, cannot lock an honest peer of that source
out. An honest hello needs a few round trips; a flood would have to open ``max_per_host`` connections
within that time, again and again, to push it out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_MAX_HANDSHAKES = 256
DEFAULT_MAX_HANDSHAKES_PER_HOST = 64


@dataclass
class HandshakeGate:
    """Counts connections in their hello, by source host, oldest first.

    Args:
        max_total: most connections in their hello at once.
        max_per_host: most of them from one source address.
    """

    max_total: int = DEFAULT_MAX_HANDSHAKES
    max_per_host: int = DEFAULT_MAX_HANDSHAKES_PER_HOST
    _all: OrderedDict[object, str] = field(default_factory=OrderedDict)
    _by_host: dict[str, OrderedDict[object, None]] = field(default_factory=dict)
    _flooding: bool = False
    evicted_total: int = 0

    def __post_init__(self) -> None:
        if self.max_total < 1 or self.max_per_host < 1:
            raise ValueError("handshake caps must be >= 1")

    @property
    def in_hello(self) -> int:
        """Connections admitted whose hello is not over."""
        return len(self._all)

    def enter(self, host: str, token: object) -> tuple[object | None, str | None, bool]:
        """Admit connection ``token`` from ``host`` (call :meth:`leave` with it later).

        Returns:
            ``(evicted, reason, first)``: ``evicted`` is the oldest connection in its hello that made room
            for this one (close it; it is no longer counted), or None; ``reason`` says why; ``first`` is True
            for the first eviction since the gate last admitted a connection without one (log that one; the
            others of the same flood are counted in :attr:`evicted_total`).
        """
        mine = self._by_host.get(host)
        evicted: object | None = None
        reason = None
        if mine is not None and len(mine) >= self.max_per_host:
            evicted = next(iter(mine))
            reason = (f"{len(mine)} connections from {host} are in their hello (the cap per host is "
                      f"{self.max_per_host}): the oldest is closed")
        elif len(self._all) >= self.max_total:
            evicted = next(iter(self._all))
            reason = (f"{len(self._all)} connections are in their hello (the cap is {self.max_total}): "
                      "the oldest is closed")
        first = False
        if evicted is not None:
            self.leave(evicted)
            self.evicted_total += 1
            first = not self._flooding
            self._flooding = True
        else:
            self._flooding = False
        self._all[token] = host
        self._by_host.setdefault(host, OrderedDict())[token] = None
        return evicted, reason, first

    def leave(self, token: object) -> None:
        """Connection ``token`` finished its hello (either way), or was evicted; idempotent."""
        host = self._all.pop(token, None)
        if host is None:
            return
        mine = self._by_host[host]
        del mine[token]
        if not mine:
            del self._by_host[host]


__all__ = ["DEFAULT_MAX_HANDSHAKES", "DEFAULT_MAX_HANDSHAKES_PER_HOST", "HandshakeGate"]
