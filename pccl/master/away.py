"""Members whose link to a live master broke: their places held for a grace (pure, no trio, no clock).

A member whose master connection breaks while the master lives (the link flapped, a middlebox reset
it) fails its call there and re-registers with the same master within its reconnect window. If the
others' votes completed without it meanwhile (the operation it failed, or the ``update_topology()`` a
loop runs after a failure), the group went on without it: it is refused (``KICKED``, join again), and a
loop that runs one call on some members and another on the rest cannot make progress.

So a master with ``MasterConfig.rejoin_grace`` > 0 holds every vote while a member whose connection
broke may still come back: until it re-registered or its grace ran out (docs/concepts.md "A member's
link breaks"). The master cannot tell a broken link from a crashed peer (both reset the connection),
so the grace is also what a crashed member costs the survivors' next vote: 0 (the default) holds
nothing. Kicks and evictions (a silent peer: the heartbeat timeout already ran) are never held.
:class:`AwayBook` keeps the members away and until when.
"""

from __future__ import annotations

from collections import OrderedDict

# Key: ``(kind, group, tag)`` as in ops_in_doubt.py, or ``("topology", -1, -1)``: the ring-wide
# topology round.
from .ops_in_doubt import Key

#: A vote round's state at one instant: no round, votes open (not started), or running.
NONE, OPEN, RUNNING = "none", "open", "running"

#: How many dropped members' snapshots the book keeps (the oldest go first).
SNAPSHOTS_KEPT = 1024


class AwayBook:
    """The members whose connection broke and who may still re-register, with their deadlines; and,
    for every member dropped here, where each vote round of its group stood at that instant, so that
    its report of a call it abandoned can be matched with the others' votes (:meth:`kept_votes`)."""

    def __init__(self) -> None:
        self._until: dict[int, float] = {}
        self._opened: dict[Key, int] = {}  # vote rounds opened per key, ever
        self._snaps: OrderedDict[int, tuple[int, dict[Key, tuple[int, str]]]] = OrderedDict()

    def opened(self, key: Key) -> None:
        """A vote round of ``key`` opened (its first vote arrived)."""
        self._opened[key] = self._opened.get(key, 0) + 1

    def dropped(self, peer_id: int, group: int, rounds: dict[Key, str]) -> None:
        """Member ``peer_id`` of ``group`` was dropped; ``rounds`` are its group's vote rounds then
        (:data:`OPEN` or :data:`RUNNING`), before the drop changed any of them."""
        counts = {k: (n, rounds.get(k, NONE)) for k, n in self._opened.items() if k[1] in (group, -1)}
        for k, what in rounds.items():
            counts.setdefault(k, (self._opened.get(k, 0), what))
        self._snaps[peer_id] = (group, counts)
        self._snaps.move_to_end(peer_id)
        while len(self._snaps) > SNAPSHOTS_KEPT:
            self._snaps.popitem(last=False)

    def kept_votes(self, peer_id: int, key: Key, now: str) -> bool | None:
        """Whether the others still vote, or will vote, for the call of ``key`` that ``peer_id``
        reports it abandoned when it was dropped here; ``now``: the key's round state now.

        Returns:
            None when ``peer_id`` was never dropped by this master (a rebuilt master's member);
            False when that call ended for everybody meanwhile: the round it was in was running (its
            abort failed every participant), or a round of ``key`` ended since (the others failed it,
            or went past it); True when the round open at the drop, or none then and the first one
            opened since, is still open: the others' calls of it must fail too.
        """
        snap = self._snaps.get(peer_id)
        if snap is None:
            return None
        n, then = snap[1].get(key, (0, NONE))
        count = self._opened.get(key, 0)
        if then == RUNNING:
            return False
        if then == OPEN:
            return count == n and now == OPEN
        return (count == n and now == NONE) or (count == n + 1 and now == OPEN)

    def forget(self, peer_id: int) -> bool:
        """``peer_id`` is back (its report was matched) or gone for good: True when it was dropped here."""
        return self._snaps.pop(peer_id, None) is not None

    def __bool__(self) -> bool:
        return bool(self._until)

    @property
    def members(self) -> set[int]:
        """The members away now (tests, status)."""
        return set(self._until)

    def left(self, peer_id: int, now: float, grace: float) -> bool:
        """Member ``peer_id``'s connection broke at ``now``: hold its place for ``grace`` seconds
        (nothing when ``grace`` <= 0). Returns True when a hold started."""
        if grace <= 0:
            return False
        self._until[peer_id] = now + grace
        return True

    def back(self, peer_id: int) -> bool:
        """``peer_id`` re-registered (or is gone for good): True when it was away."""
        return self._until.pop(peer_id, None) is not None

    def deadline(self) -> float | None:
        """When the earliest hold runs out (None: none)."""
        return min(self._until.values(), default=None)

    def overdue(self, now: float) -> list[int]:
        """End the holds whose grace ran out by ``now``; returns those members (absent from now on)."""
        gone = sorted(p for p, t in self._until.items() if now >= t)
        for p in gone:
            del self._until[p]
        return gone


__all__ = ["NONE", "OPEN", "RUNNING", "SNAPSHOTS_KEPT", "AwayBook", "Key"]
