"""The rings members reported when they re-registered at a rebuilt master (who each one's group still
lists), for :class:`~pccl.master.state.MasterState`'s refusals of members their group dropped.

Members report their whole ring, and in a rebuild they nearly all report the same one: so each distinct
``(epoch, ring)`` is kept once, with the members that reported it. A return's two checks ("does some
member back no longer list this one?", "which members back does this one no longer list?") then cost
O(distinct rings) plus a set difference, not a walk over every member back: O(n) per return, not
O(n^2) over a rebuild of ``n``.
"""

from __future__ import annotations

from collections.abc import Iterable, Set

_Ring = tuple[int, frozenset[int]]  # (the epoch it was reported at, its members)


class ReportedRings:
    """peer -> the ``(epoch, ring)`` it reported, grouped by distinct ring (see the module docstring)."""

    def __init__(self) -> None:
        self._of: dict[int, _Ring] = {}
        self._by_ring: dict[_Ring, set[int]] = {}

    def __bool__(self) -> bool:
        return bool(self._of)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._of

    def __len__(self) -> int:
        return len(self._of)

    def epoch(self, peer_id: int) -> int:
        """The epoch ``peer_id`` reported its ring at."""
        return self._of[peer_id][0]

    def put(self, peer_id: int, epoch: int, ring: Iterable[int]) -> None:
        """``peer_id`` reports (or now has) ``ring`` at ``epoch``, replacing what it had."""
        self.pop(peer_id)
        key = (epoch, ring if isinstance(ring, frozenset) else frozenset(ring))
        holders = self._by_ring.setdefault(key, set())
        if holders:
            key = self._of[next(iter(holders))]  # share the one copy of an equal ring
        holders.add(peer_id)
        self._of[peer_id] = key

    def pop(self, peer_id: int) -> None:
        """Forget ``peer_id``'s ring (no error if it had none)."""
        key = self._of.pop(peer_id, None)
        if key is None:
            return
        holders = self._by_ring[key]
        holders.discard(peer_id)
        if not holders:
            del self._by_ring[key]

    def not_listing(self, peer_id: int, since_epoch: int) -> list[int]:
        """The members whose ring, reported at ``since_epoch`` or later, does not list ``peer_id``
        (ascending ids)."""
        out: list[int] = []
        for (epoch, ring), holders in self._by_ring.items():
            if epoch >= since_epoch and peer_id not in ring:
                out.extend(holders)
        return sorted(out)

    def not_in(self, listed: Set[int], until_epoch: int) -> list[int]:
        """The members not in ``listed`` whose ring was reported at ``until_epoch`` or earlier
        (ascending ids)."""
        return sorted(p for p in self._of.keys() - listed if self._of[p][0] <= until_epoch)


__all__ = ["ReportedRings"]
