"""Vote rounds of the master core: the unanimity rule, written once, and the round objects.

A vote completes when every accepted peer it concerns voted (docs/concepts.md): :func:`unanimous` is that
rule for every kind of vote (are_peers_pending, update/optimize topology, collectives, shared-state syncs).

:class:`PendingRound` is the are_peers_pending vote as an object with the round interface every vote is
of pccl/master/rounds/base.py (issue 32: one small object per open vote behind one interface): its
voters, whom it waits on, when it opened, check (is it complete, and who gets the answer), peer lost. The
other kinds are in pccl/master/rounds/.

Pure: no clock, no I/O (times are passed in).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from .describe import VoteWait


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
    vote_name = "are_peers_pending vote"  # as the vote timeout names it
    key = ("pending", None)
    group = None  # ring-wide
    voting = True  # it has no run after the vote

    def __init__(self) -> None:
        self.votes: set[int] = set()
        self.opened = 0.0  # when its first ballot came (the vote timeout counts from it)

    # -- the round interface (pccl/master/rounds/base.py)

    @property
    def ballots(self) -> Collection[int]:
        return self.votes

    def waits(self, members: set[int]) -> tuple[str, set[int], str] | None:
        return (self.what, members - self.votes, "") if self.votes else None

    def busy(self, ring: list[int]) -> set[int]:
        return set()

    def vote_waits(self) -> list[tuple[int, VoteWait]]:
        return [(p, VoteWait(self.kind)) for p in sorted(self.votes)]

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
