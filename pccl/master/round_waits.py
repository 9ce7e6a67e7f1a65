"""Who holds up whom: the walks over the open rounds that the stall logs, the straggler check, the
deadlock watch and the status page read.

Pure (no trio, sockets or clocks). :class:`RoundWaits` lists every vote or round in progress with the peers
it waits for (the one place that knows who holds up what), the calls each peer voted for, the voters, the
groups in which every member could be voting (the deadlock watch's cheap bound, issue 33 item 3) and the
peers busy in a running round. It only reads; it works on the dispatcher through :class:`RoundWaitsCore`
(whose ``_open_rounds`` is the walk itself).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Protocol

from .describe import VoteWait
from .membership import Membership, PeerRecord
from .rounds.base import Round


class RoundWaitsCore(Protocol):
    """What :class:`RoundWaits` reads of the master's dispatcher
    (:class:`~pccl.master.state.MasterState`)."""

    members: Membership
    peers: dict[int, PeerRecord]
    ring: list[int]

    def _open_rounds(self, ordered: bool = True, with_ops: bool = True) -> list[Round]: ...


class RoundWaits:
    """The waits of ``core``'s open rounds (see the module docstring)."""

    def __init__(self, core: RoundWaitsCore) -> None:
        self.core = core

    def group_sets(self) -> dict[int | None, set[int]]:
        """Each group's accepted peers, and the ring's under None: once per walk, not once per vote (a
        timer walks every open vote, up to members x max_open_votes)."""
        core = self.core
        groups: dict[int | None, set[int]] = {None: set(core.ring)}
        for p in core.ring:
            groups.setdefault(core.peers[p].group, set()).add(p)
        return groups

    def waits(self) -> list[tuple[str, set[int], str]]:
        """Every vote or round in progress as ``(what, peers it waits for, detail)``: the one place
        that knows who holds up what (:meth:`waited_on` and :meth:`pending_summary` read it)."""
        core = self.core
        groups = self.group_sets()
        waits = [rnd.waits(groups.get(rnd.group, set())) for rnd in core._open_rounds()]
        return [w for w in waits if w is not None]

    def waited_on(self) -> set[int]:
        """Peers that others are waiting for right now.

        A peer is waited on when it has not yet voted in a vote that others of its group have
        joined (collective, shared-state sync, topology, pending-peers), or when it has not yet
        reported the end of a running collective, sync or topology round it takes part in.
        """
        core = self.core
        out: set[int] = set()
        for _, waiting, _ in self.waits():
            out |= waiting
        return out & set(core.peers)

    def pending_rounds(self) -> list[tuple[str, list[int], str]]:
        """Every vote or round in progress as ``(what, peers it waits for, detail)`` (for status pages)."""
        return [(what, sorted(waiting), detail) for what, waiting, detail in self.waits()]

    def vote_waits(self) -> dict[int, list[VoteWait]]:
        """For every peer: the calls it has voted for whose votes have not completed (in-flight rounds
        such as a running collective are not votes)."""
        core = self.core
        out: dict[int, list[VoteWait]] = {}
        for rnd in core._open_rounds():
            for p, wait in rnd.vote_waits():
                out.setdefault(p, []).append(wait)
        return out

    def vote_sets(self) -> Iterator[tuple[int | None, Collection[int]]]:
        """Every vote still open, as ``(group, voters)``: ``None`` for a ring-wide vote (topology,
        are_peers_pending), without the work :meth:`MasterState._open_votes` does for the vote timeout (who is
        missing, when it opened). The one walk :meth:`voting_peers` and :meth:`deadlock_candidates`
        share, so that the bound can never miss a kind of vote the voter set has."""
        core = self.core
        for rnd in core._open_rounds(ordered=False):
            if rnd.voting:
                yield rnd.group, rnd.ballots

    def voting_peers(self) -> set[int]:
        """The peers that :meth:`vote_waits` lists (``set(vote_waits())``), without building the waits:
        the test the deadlock check makes once :meth:`deadlock_candidates` names a group."""
        out: set[int] = set()
        for _, voters in self.vote_sets():
            out.update(voters)
        return out

    def deadlock_candidates(self) -> list[int]:
        """The groups of at least 2 accepted peers in which every member *could* have a vote in.

        An upper bound counted from the open votes' sizes alone: a peer voting in two calls counts
        twice, and a ring-wide vote (topology, are_peers_pending) counts for every group. It costs
        O(open votes + groups), where :meth:`voting_peers` costs O(voters): the deadlock check ran
        after every message, and with :meth:`voting_peers` alone a vote round of n peers cost the
        master O(n^2) (docs/benchmarks.md "Control plane at many peers"). It now runs on the timers'
        clock (:class:`~pccl.master.deadlock.DeadlockWatch`), at most every ``every`` seconds.
        """
        core = self.core
        counts: dict[int | None, int] = {}
        for group, voters in self.vote_sets():
            counts[group] = counts.get(group, 0) + len(voters)
        ring_wide = counts.get(None, 0)
        return [g for g, size in core.members.sizes_by_group().items()
                if size >= 2 and counts.get(g, 0) + ring_wide >= size]

    def busy_peers(self) -> set[int]:
        """Peers taking part in a running collective, sync or topology round (not just voting)."""
        core = self.core
        out: set[int] = set()
        for rnd in core._open_rounds(ordered=False):
            out |= rnd.busy(core.ring)
        return out

    def stragglers(self, now: float, minimum: float, cap: float) -> list[tuple[int, float]]:
        """Peers others are waiting for that have been silent past their straggler limit
        (:meth:`PeerRecord.straggler_limit`), with how long each has been silent."""
        peers = self.core.peers
        return [(p, now - peers[p].last_seen)
                for p, deadline in self._straggler_deadlines(minimum, cap).items() if now > deadline]

    def straggler_deadline(self, minimum: float, cap: float) -> float | None:
        """When the earliest waited-on peer would become a straggler if it stays silent."""
        return min(self._straggler_deadlines(minimum, cap).values(), default=None)

    def _straggler_deadlines(self, minimum: float, cap: float) -> dict[int, float]:
        """For every waited-on peer: when it becomes a straggler if it stays silent (its last message
        plus :meth:`PeerRecord.straggler_limit`)."""
        return self.core.members.straggler_deadlines(self.waited_on(), minimum, cap)

    def pending_summary(self) -> list[str]:
        """One line per vote or round in progress: what it is and whom it waits for (for stall logs)."""
        return [f"{what} waits for {sorted(waiting)}{detail}" for what, waiting, detail in self.waits()]
