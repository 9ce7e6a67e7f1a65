"""The P2P credential set a master issued last, and the rows it still owes the members holding it.

A pure part of :class:`~pccl.master.state.MasterState` (docs/security.md "P2P bound to membership"):
which set of ``(generation, epoch)`` went out, with every member's row. A member taken back into that
set (it re-registered) gets the whole table at once, in the message after its ``Reregistered``; the
members that hold the set lack only the returning member's row.

Those rows are **batched**. A restarted master's members all re-register within moments of each
other, and a message to every holder at every return costs the master ``n (n - 1) / 2`` messages in
a rebuild of ``n`` members: 32,640 at 256 members, every one a send of its own. With a ``delay``, the
rows of the members back within it go out together, one message to each holder: the master sends
``n`` per batch instead of ``n`` per return. Nothing waits on them but a P2P listener whose set does
not list a peer that dials it yet, and that waits for the row (``PeerConfig.connect_timeout / 2``;
pccl/peer/credentials.py), so the delay only shifts when such a connection is accepted, by at most
the delay. (Delay 0: the holders are told at each return, as before batching.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ..wire.credentials import CredentialIssuer
from ..wire.messages import P2PCredentials, PublicKeyRow


class IssuedSet:
    """The set issued last and the rows owed its holders (see the module docstring).

    Args:
        issuer: the master's credential issuer (its root key and binding).
        delay: seconds the rows of returning members wait for others before going to the holders.
    """

    def __init__(self, issuer: CredentialIssuer, *, delay: float = 0.0) -> None:
        if not delay >= 0:
            raise ValueError(f"the credential batch delay must be >= 0 seconds, not {delay}")
        self.issuer = issuer
        self.delay = delay
        self.serial: tuple[int, int] | None = None
        """``(generation, epoch)`` of the set issued last (None: none yet)."""
        self._rows: dict[int, PublicKeyRow] = {}  # every member's row, in the order they joined the set
        self._owed: dict[int, PublicKeyRow] = {}  # the rows of members back since the holders were told
        self._last: int | None = None  # the member back last: its table holds every owed row
        self._owed_since: float | None = None
        self.batches = 0
        """Messages of owed rows sent to the holders so far, one per batch (statistics)."""

    def issue(self, generation: int, epoch: int, rows: Iterable[tuple[int, bytes]]) -> P2PCredentials:
        """A new set of ``(generation, epoch)`` for the members ``rows`` names (peer id, public key):
        one message for all of them (encoded once). Rows owed under the previous set are void."""
        self.serial = (generation, epoch)
        self._rows = {p: PublicKeyRow(p, k) for p, k in rows}
        self._void()
        return self._message(self._rows.values())

    def take_back(self, peer_id: int, key: bytes, now: float) -> tuple[P2PCredentials, bool]:
        """Member ``peer_id`` (public key ``key``) is back in the current set at ``now``.

        Returns:
            Its table (every member's row, its own included), and whether the holders now lack its
            row (it is owed them: :meth:`pay` once :meth:`due`; with delay 0, at once).
        """
        row = self._rows.get(peer_id)
        new = row is None or row.public_key != key
        if new:
            row = self._rows[peer_id] = PublicKeyRow(peer_id, key)
            self._owed[peer_id] = row
            if self._owed_since is None:
                self._owed_since = now
        if self._owed:
            # Its table holds every row owed so far: the batch need not go to it (nor to one back
            # before it: they lack its row).
            self._last = peer_id
        return self._message(self._rows.values()), new

    def members(self) -> Iterator[int]:
        """The peers the current set lists (the holders are those of them still accepted)."""
        return iter(self._rows)

    def deadline(self) -> float | None:
        """When the rows owed now must go out (None: none is owed)."""
        return None if self._owed_since is None else self._owed_since + self.delay

    def due(self, now: float) -> bool:
        """True when rows are owed and their delay ran out by ``now``."""
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def pay(self) -> tuple[P2PCredentials, int | None] | None:
        """Take the owed rows: one message with all of them for every holder, and the one member that
        needs it not (the one back last, whose table has them all). None when nothing is owed."""
        if not self._owed:
            return None
        msg, last = self._message(self._owed.values()), self._last
        self._void()
        self.batches += 1
        return msg, last

    @property
    def owed(self) -> int:
        """How many rows the holders are owed now."""
        return len(self._owed)

    def _void(self) -> None:
        self._owed = {}
        self._last = None
        self._owed_since = None

    def _message(self, rows: Iterable[PublicKeyRow]) -> P2PCredentials:
        assert self.serial is not None
        generation, epoch = self.serial
        return self.issuer.message(list(rows), generation=generation, epoch=epoch)


__all__ = ["IssuedSet"]
