"""What every vote round shares: its key, the round interface the master's walks use, and
:class:`Expel` (a message that breaks the protocol: the master kicks its sender).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from ...wire import messages as m
from ..describe import VoteWait

#: Which open vote: ``("pending", None)``, ``("topology", None)``, ``("op", (group, tag))``,
#: ``("sync", group)``.
VoteKey = tuple[str, tuple[int, int] | int | None]


class RoundContext(Protocol):
    """What every vote round asks of the master (``MasterState`` is one); each kind of round adds its
    own needs (``CollectiveContext``, ``SyncContext``)."""

    @property
    def now(self) -> float: ...

    def group_size(self, group: int) -> int:
        """How many accepted peers ``group`` has."""
        ...

    def accepted(self, group: int | None = None) -> list[int]:
        """The accepted peers of ``group``, ring order."""
        ...

    def table(self, ids: list[int]) -> list[m.PeerRow]:
        """The peer-table rows of ``ids``."""
        ...

    def known(self, peer_id: int) -> bool:
        """Whether ``peer_id`` is still connected."""
        ...
    def left_out(self, group: int, kind: str) -> frozenset[int]:
        """Peers of ``group`` that no vote of ``kind`` ("op" or "sync") waits on (healing, or for
        collectives behind after a heal: pccl/master/heals.py)."""
        ...


@dataclass(frozen=True)
class Expel:
    """The sender's message breaks the protocol (a duplicate report, one out of phase): the master
    kicks it with ``reason`` (a round never removes a peer itself)."""

    reason: str


class Round(Protocol):
    """One open vote, as the master's cross-cutting walks see it (docs/master.md "Vote rounds").

    ``group`` is None for a ring-wide vote (topology, are_peers_pending). While :attr:`voting`, the
    round collects ballots (:attr:`ballots`, since :attr:`opened`); after, it runs (a collective, a
    sync, a topology round's measurement or P2P setup) and waits on its participants
    (:meth:`waits`, :meth:`busy`).
    """

    @property
    def key(self) -> VoteKey: ...

    @property
    def group(self) -> int | None: ...

    @property
    def opened(self) -> float: ...

    @property
    def voting(self) -> bool: ...

    @property
    def ballots(self) -> Collection[int]: ...

    @property
    def vote_name(self) -> str:
        """The vote, as the vote timeout's messages name it (e.g. ``collective tag 3 (group 0) vote``).."""
        ...

    def waits(self, members: set[int]) -> tuple[str, set[int], str] | None:
        """``(what, peers it waits for, detail)`` given the accepted peers it concerns (its group's, or
        the ring's); None: it waits on nobody (a vote with no ballot)."""
        ...

    def busy(self, ring: list[int]) -> set[int]:
        """The peers taking part in it while it runs (empty while it votes)."""
        ...

    def vote_waits(self) -> list[tuple[int, VoteWait]]:
        """For each voter, the call it waits in (empty once the round runs)."""
        ...


__all__ = ["Expel", "Round", "VoteKey"]
