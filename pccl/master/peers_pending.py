"""The are_peers_pending round as the dispatcher runs it: the ballots, the answer, and the count of
answered rounds the members keep alike.

Pure (no trio, sockets or clocks). :class:`PeersPending` takes the ``PeersPendingVote`` ballots (accepted
members only, one each), answers the round once every member outside a live heal voted (pending: a
registered peer waits and no heal runs), and counts the rounds answered per epoch, as the members do
(docs/concepts.md "Rounds in doubt"): a member back after a broken link or a master's loss reports where
it is in that count, and :meth:`PeersPending.back` / :meth:`PeersPending.behind` read it (its vote counts
again at once, or it is refused when the run went on without it). The ballots themselves are
:class:`~pccl.master.votes.PendingRound` (``_pending`` on the dispatcher, walked with the other open
rounds); this works on the dispatcher through :class:`PeersPendingCore`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from .._errors import Result
from ..wire import messages as m
from .effects import Effect, Send
from .heals import HealBook
from .membership import PeerRecord, Phase
from .ops_in_doubt import DoubtBook
from .rounds.topology import TopologyRound
from .rounds_in_doubt import RoundBook
from .votes import PendingRound


class PeersPendingCore(Protocol):
    """What :class:`PeersPending` uses of the master's dispatcher
    (:class:`~pccl.master.state.MasterState`)."""

    ring: list[int]
    epoch: int
    heals: HealBook
    doubts: DoubtBook
    rounds: RoundBook
    _pending: PendingRound
    _topology: TopologyRound | None
    _now: float

    @property
    def resumed(self) -> bool: ...

    @property
    def rebuild(self) -> object | None:
        """The rebuild in progress (pccl/master/rejoin.py ``Rebuild``; only asked whether there is one)."""
        ...

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]: ...

    def registered(self) -> list[int]: ...


class PeersPending:
    """The are_peers_pending round of ``core`` (see the module docstring)."""

    def __init__(self, core: PeersPendingCore) -> None:
        self.core = core
        self._round = core._pending  # (every accepted peer's ballot passes here: looked up once)
        self._heals = core.heals
        # Rounds answered at an epoch (the members count them alike: docs/concepts.md "Rounds in doubt"),
        # and DoubtBook.total_progress when that count last changed (:meth:`behind`).
        self.count: tuple[int, int] = (0, 0)  # (epoch, rounds answered at it)
        self.mark = 0

    def on_vote(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        if rec.phase is not Phase.ACCEPTED:
            return self.core.kick(rec.peer_id, "PeersPendingVote from a peer that is not accepted")
        if not self._round.vote(rec.peer_id, self.core._now):
            return self.core.kick(rec.peer_id, "duplicate PeersPendingVote")
        return self.check()

    def check(self) -> list[Effect]:
        core = self.core
        healing = self._heals.groups  # out of this vote too; admissions wait for their heals to end
        ring = [p for p in core.ring if p not in healing] if healing else core.ring
        # (the count first: every ballot but the last, see votes.unanimous; then whether the master is held)
        if len(self._round.votes) < len(ring) or not core.resumed or not self._round.complete(ring):
            return []
        pending = bool(core.registered()) and not healing
        voters = core._pending.take(ring)
        self.count = (self.counting_epoch(), self.counted() + 1)
        self.mark = core.doubts.total_progress
        core.rounds.answered(self.count, pending)
        return [Send(p, m.PeersPendingResult(pending=pending)) for p in voters]

    def counted(self) -> int:
        """are_peers_pending rounds completed at the members' epoch (members count them alike)."""
        epoch, count = self.count
        return count if epoch == self.counting_epoch() else 0

    def counting_epoch(self) -> int:
        """The epoch the members count are_peers_pending answers at: the master's, except while a
        topology round sets up (the master moved to its epoch at the EstablishP2P, the members move at
        its TopologyResult, and an answer sent before that one reaches them at their old epoch)."""
        core = self.core
        rnd = core._topology
        return rnd.from_epoch if rnd is not None and rnd.establishing and rnd.from_epoch >= 0 else core.epoch

    def back(self, peer_id: int, msg: m.Reregister, was_dropped: bool,
             effects: list[Effect]) -> m.Reregister:
        """The are_peers_pending round member ``peer_id`` back reports (``effects`` gets what its vote
        completes); the report as the rounds in doubt should read it (``was_dropped``: this live master
        dropped it, its link broke)."""
        core = self.core
        rb = core.rebuild
        pend = msg.pending
        if len(pend) == 4 and pend[0] == self.counting_epoch():
            # are_peers_pending rounds are counted per epoch: this master's next one is the next of the
            # count the members back report (docs/concepts.md "Rounds in doubt").
            if rb is None and pend[2] and pend[1] == self.counted() and was_dropped:
                # At a live master: it waits in the round still open here (its link broke while it
                # voted): its vote counts again at once (docs/concepts.md "A member's link breaks").
                core._pending.add([peer_id], core._now)
                msg = replace(msg, pending=[])
                effects += self.check()
            else:
                counted = (self.counting_epoch(), max(self.counted(), pend[1]))
                if counted != self.count:
                    self.count, self.mark = counted, core.doubts.total_progress
        return msg

    def behind(self, msg: m.Reregister) -> str | None:
        """Why ``msg``'s peer cannot be taken back, if it waits in an are_peers_pending round that the
        run answered without it and went on past: a later round was answered at this epoch, or a
        collective or sync completed since the round's answer. (A member back after the roll call
        ended: given the round's answer, it would go on to the call after it while the others are
        further on, a deadlock until ``vote_timeout``.) While the run has not gone on, it gets the
        round's answer (RoundBook) and makes the next call with the others."""
        core = self.core
        p = msg.pending
        if len(p) != 4 or not p[2] or p[0] != self.counting_epoch():
            return None
        waits_in, count = p[1] + 1, self.counted()
        if count > waits_in or (count == waits_in and core.doubts.total_progress > self.mark):
            return (f"the run answered the are_peers_pending round this peer waits in ({p[0]}, {waits_in}) "
                    "without it and went on: join again")
        return None
