"""Vote rounds of the master core: the unanimity rule, written once, and the round objects.

A vote completes when every accepted peer it concerns voted (docs/concepts.md): :func:`unanimous` is that
rule for every kind of vote (are_peers_pending, update/optimize topology, collectives, shared-state syncs).

:class:`PendingRound` is the are_peers_pending vote as an object with the round interface every vote is
moving to (issue 32: one small object per open vote behind one interface): its voters, whom it waits on,
when it opened, check (is it complete, and who gets the answer), peer lost. The other kinds still live in
:class:`~pccl.master.state.MasterState` as records (docs/master.md "Where this is going").

Pure: no clock, no I/O (times are passed in).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable


def unanimous(votes: Collection[int], size: int, members: Callable[[], list[int]]) -> list[int] | None:
    """The members the vote concerns when every one of them (``size`` peers) voted, else None.

    The count first: every ballot but the last costs O(1) (votes come from accepted peers only, so
    ``len(votes) >= size`` is necessary); only then is the member list built (``members()``, once) and
    checked against the votes. An empty vote never completes (nothing was asked).
    """
    if not votes or len(votes) < size:
        return None
    listed = members()
    return listed if all(p in votes for p in listed) else None


class PendingRound:
    """The are_peers_pending vote of the accepted peers (ring-wide).

    Every accepted peer asks whether peers wait to be admitted; when all have asked, each voter gets
    the same answer. Voters lost meanwhile are simply dropped (nobody is waited on that is gone).
    """

    kind = "peers_pending"
    what = "peers-pending vote"  # as the stall logs and the status page name it

    def __init__(self) -> None:
        self.votes: set[int] = set()
        self.opened = 0.0  # when its first ballot came (the vote timeout counts from it)

    @property
    def open(self) -> bool:
        """True while some peer voted and the vote has not completed."""
        return bool(self.votes)

    def vote(self, peer_id: int, now: float) -> bool:
        """Count ``peer_id``'s ballot at ``now``; False: it had voted already (a duplicate)."""
        votes = self.votes
        if peer_id in votes:
            return False
        if not votes:
            self.opened = now
        votes.add(peer_id)
        return True

    def add(self, peer_ids: Collection[int], now: float) -> None:
        """Count ballots that arrive together (a round in doubt that runs here after a master's loss)."""
        if peer_ids and not self.votes:
            self.opened = now
        self.votes.update(peer_ids)

    def waiting(self, ring: Iterable[int]) -> set[int]:
        """The accepted peers (``ring``) that have not voted."""
        return set(ring) - self.votes

    def complete(self, ring: list[int]) -> bool:
        """True when every accepted peer (``ring``) voted."""
        return unanimous(self.votes, len(ring), lambda: ring) is not None

    def take(self, ring: list[int]) -> list[int]:
        """Close the completed vote: its voters in ring order (each gets the answer)."""
        voters = [p for p in ring if p in self.votes]
        self.votes.clear()
        return voters

    def peer_lost(self, peer_id: int) -> None:
        """``peer_id`` left: its ballot no longer counts (the others are re-checked by the caller)."""
        self.votes.discard(peer_id)


__all__ = ["PendingRound", "unanimous"]
