"""Who the master knows: every connected peer's record and the ring of accepted peers.

Pure (no trio, sockets or clocks). :class:`Membership` owns the peer table and the ring, and keeps the
two caches every vote relies on to stay O(1) per message: the accepted peers per group (recounted once
per ring change) and the ring's sort order (a rebuild's returns insert, they do not sort).
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

from ..wire import messages as m


class Phase(enum.Enum):
    """Lifecycle of a peer as the master sees it."""

    CONNECTED = "connected"  # hello done, not registered yet
    REGISTERED = "registered"  # waiting to be accepted
    ACCEPTED = "accepted"


@dataclass
class PeerRecord:
    """What the master knows about one peer."""

    peer_id: int
    host: str
    phase: Phase = Phase.CONNECTED
    p2p_port: int = 0
    group: int = 0
    public_key: bytes = b""  # its X25519 key for P2P credentials (b"": none)
    last_seen: float = 0.0
    # Recent gaps between consecutive messages (heartbeats included): how irregular this peer's
    # traffic is, so the straggler rule never evicts a peer for a silence it routinely shows.
    gaps: deque[float] = field(default_factory=partial(deque, maxlen=32))  # (no Python frame per peer)
    # The collective votes it has cast that may still be open, by (group, tag); pruned lazily against
    # the votes themselves (CollectiveMessages.over_vote_cap), so it may hold keys of votes closed since.
    open_votes: set[tuple[int, int]] = field(default_factory=set)
    # When an admission vote accepted it as a newcomer; None once it took part in a collective or a
    # shared-state sync (or for a member taken back or accepted alone): MasterState.admission_overdue.
    admitted: float | None = None

    def row(self) -> m.PeerRow:
        return m.PeerRow(self.peer_id, self.host, self.p2p_port, self.group)

    def straggler_limit(self, minimum: float, cap: float) -> float:
        """Silence tolerated while others wait on this peer: ``minimum``, or twice the longest
        recent gap between its messages if that is longer, never more than ``cap``."""
        longest = max(self.gaps, default=0.0)
        return min(cap, max(minimum, 2.0 * longest))


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (the run's peers must all be, or none)."""
    return host.startswith("127.") or host in ("::1", "localhost")


class Membership:
    """The peer table (``peers``: every connection past its hello, by id) and the ring (the accepted
    peers in ring order), with the id counter and the run's address kind (loopback or not)."""

    def __init__(self) -> None:
        self.peers: dict[int, PeerRecord] = {}
        self._ring: list[int] = []
        self._group_sizes: dict[int, int] | None = None  # accepted peers per group; None: recount
        # The list the ring was last sorted by (None: not known to be sorted), and that list's index.
        self._ring_sorted_by: list[int] | None = None
        self._ring_order: tuple[list[int] | None, dict[int, int]] = (None, {})
        self._next_peer_id = 1
        self._loopback: bool | None = None

    @property
    def ring(self) -> list[int]:
        """Accepted peers in ring order. Change it by assigning a new list, never in place: the
        per-group counts are recounted on assignment (and others cache by the list's identity)."""
        return self._ring

    @ring.setter
    def ring(self, value: list[int]) -> None:
        self._ring = value
        self._group_sizes = None
        self._ring_sorted_by = None

    def new_connection(self, host: str, now: float, claim: int = -1) -> int:
        """A connection finished its hello: its record, under ``claim`` when no connected peer holds
        that id (a member re-registering), else under a fresh id; returns the id."""
        if claim > 0 and claim not in self.peers:
            pid = claim
            self._next_peer_id = max(self._next_peer_id, claim + 1)
        else:
            pid = self._next_peer_id
            self._next_peer_id += 1
        self.peers[pid] = PeerRecord(peer_id=pid, host=host, last_seen=now)
        return pid

    def address_mismatch(self, host: str) -> str | None:
        """Why a peer registering from ``host`` cannot join the run (None: it can; the first one fixes
        the run's kind): loopback and non-loopback peers could not reach each other."""
        loop = host.startswith("127.") or host in ("::1", "localhost")  # (is_loopback, at every Register)
        if self._loopback is None:
            self._loopback = loop
            return None
        if loop == self._loopback:
            return None
        this, run = ("loopback", "non-loopback") if loop else ("non-loopback", "loopback")
        return (f"this peer connects via {this} ({host}) but the run's peers connect via {run}; "
                "their addresses would be unreachable for each other - connect to the master the same way")

    def note_address(self, host: str) -> None:
        """A member taken back fixes the run's address kind if nobody did yet (it is not checked)."""
        if self._loopback is None:
            self._loopback = is_loopback(host)

    def take_into_ring(self, peer_id: int, order_of: list[int]) -> None:
        """Add ``peer_id`` to the ring, kept in ``order_of``'s order (ids it does not name after those it
        does, ascending). While the ring stays sorted by the same list (every return of a rebuild,
        ordered by its expected ring), an insertion: O(log n) comparisons and a copy, not a sort."""
        if self._ring_order[0] is not order_of:
            self._ring_order = (order_of, {p: i for i, p in enumerate(order_of)})
        order = self._ring_order[1]
        last = len(order)

        def place(p: int) -> tuple[int, int]:
            return (order.get(p, last), p)

        if self._ring_sorted_by is order_of:
            ring = list(self._ring)
            bisect.insort(ring, peer_id, key=place)
        else:
            ring = sorted([*self._ring, peer_id], key=place)
        self.ring = ring
        self._ring_sorted_by = order_of

    def group_size(self, group: int) -> int:
        """How many accepted peers ``group`` has (counted once per ring change, not per vote: asked at every
        ballot)."""
        sizes = self._group_sizes
        return (sizes if sizes is not None else self.sizes_by_group()).get(group, 0)

    def sizes_by_group(self) -> dict[int, int]:
        """Accepted peers per group (cached until the ring changes)."""
        if self._group_sizes is None:
            sizes: dict[int, int] = {}
            for p in self._ring:
                g = self.peers[p].group
                sizes[g] = sizes.get(g, 0) + 1
            self._group_sizes = sizes
        return self._group_sizes

    def accepted(self, group: int | None = None) -> list[int]:
        """Accepted peers in ring order (optionally of one group)."""
        if group is None:
            return list(self._ring)
        return [p for p in self._ring if self.peers[p].group == group]

    def registered(self) -> list[int]:
        """Peers waiting to be accepted, in arrival order."""
        return [p.peer_id for p in self.peers.values() if p.phase is Phase.REGISTERED]

    def expired(self, now: float, timeout: float) -> list[int]:
        """Peers silent for longer than ``timeout`` at ``now``."""
        return [p.peer_id for p in self.peers.values() if now - p.last_seen > timeout]

    def straggler_deadlines(self, waited_on: Iterable[int], minimum: float, cap: float) -> dict[int, float]:
        """For every peer of ``waited_on`` (by id): when it becomes a straggler if it stays silent (its last
        message plus :meth:`PeerRecord.straggler_limit`)."""
        peers = self.peers
        return {p: peers[p].last_seen + peers[p].straggler_limit(minimum, cap) for p in sorted(waited_on)}

    def table(self, ids: list[int]) -> list[m.PeerRow]:
        """Peer-table rows for ``ids`` (in that order)."""
        return [self.peers[p].row() for p in ids]
