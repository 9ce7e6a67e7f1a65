"""Membership rounds in doubt across a master's loss: one outcome for every member (pure, no clock).

A topology round (``update_topology`` / ``optimize_topology``) ends with one ``TopologyResult`` per
member (and ``Accepted`` per newcomer); an ``are_peers_pending`` round with one ``PeersPendingResult``
per voter. A master lost between those answers leaves some members at the new epoch (or with the
answer) and the others waiting, and a loop that goes on from the answer would then deadlock (some
members in a collective at the new epoch, the others retrying the round). So a member reports in its
``Reregister`` where it stood (docs/concepts.md "Rounds in doubt"), and :class:`RoundBook` turns the
reports into one outcome per round:

**Topology round** of epoch ``X`` (the epoch of its ``EstablishP2P``), in doubt on every member that
confirmed its setup (``P2PConnectionsDone(success)``) without a ``TopologyResult``:

* **commit** (``TopologyResult(success)``: move to ``X`` and its ring) when any member reports that it
  committed ``X`` (``members_epoch >= X``: its ``TopologyResult`` or, a newcomer, its ``Accepted``
  arrived), or when every member of the round is back in doubt (every setup confirmed: the old master
  could only have committed it);
* **abort** (``TopologyResult(success=False)``, retryable, the table unchanged) when a member of the round
  reports that it had not confirmed the setup or got the round's failure (then the old master can have
  committed it nowhere: it commits only after every member confirmed), or when no decision came within
  the timeout the master passes to :meth:`RoundBook.overdue` (a member died with the master);
* a round of this master's own (a member's link broke, the master lived) is decided by what it did.

A member that reports as committed a round the book aborted is a step ahead: it is refused
(:meth:`RoundBook.conflict`) and must join again.

**Pending round**: members count the ``PeersPendingResult`` they got at their epoch, so a round is
``(epoch, n)``, the n-th of that epoch. A member whose vote waits reports ``(epoch, answers + 1)``:

* **the answer** another member got for that round, when one reports it;
* **re-run** (the waiting votes count at this master, whose own vote then answers everybody) when a
  member reports that it had not voted in that round (then it cannot have completed), when every member
  expected back waits in it, or at the timeout.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set
from dataclasses import dataclass, field

from ..wire import messages as m

#: How many settled topology outcomes the book remembers.
OUTCOMES_KEPT = 64

#: ``(epoch, n)``: the n-th are_peers_pending round (n >= 1) at ``epoch``.
PendingKey = tuple[int, int]


@dataclass
class TopologyDoubt:
    """A topology round of ``epoch`` that the peers in ``waiting`` confirmed without its result."""

    epoch: int
    members: tuple[int, ...]  # its ring, as the EstablishP2P named it
    kind: str  # "update" or "optimize"
    waiting: set[int] = field(default_factory=set)
    opened: float = 0.0


@dataclass(frozen=True)
class TopologyDecision:
    """Tell ``peers`` that the round of ``epoch`` (ring ``members``) is committed or aborted."""

    epoch: int
    commit: bool
    peers: tuple[int, ...]
    members: tuple[int, ...]
    kind: str
    reason: str


@dataclass
class PendingDoubt:
    """Pending round ``key`` that the peers in ``waiting`` voted in without an answer."""

    key: PendingKey
    waiting: set[int] = field(default_factory=set)
    opened: float = 0.0


@dataclass(frozen=True)
class PendingDecision:
    """Answer ``peers``' waiting vote with ``answer``, or (``answer`` None) count it at this master."""

    key: PendingKey
    answer: bool | None
    peers: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class _Where:
    """What one re-registration said about the rounds."""

    members_epoch: int
    in_doubt: int  # the topology round it confirmed without a result (-1: none)


def _topology_doubt(msg: m.Reregister) -> tuple[int, tuple[int, ...], str] | None:
    t = msg.topology_in_doubt
    if len(t) == 3 and isinstance(t[0], int) and isinstance(t[1], list) and isinstance(t[2], str) \
            and all(isinstance(p, int) for p in t[1]):
        return t[0], tuple(t[1]), "optimize" if t[2] == "optimize" else "update"
    return None


def reported_epoch(msg: m.Reregister) -> int:
    """The newest epoch ``msg``'s peer may be at: its table's, or that of the topology round it was in
    (in doubt or abandoned). A member waiting on round ``X`` is a member of ``X`` if ``X`` commits."""
    doubt = _topology_doubt(msg)
    return max(msg.epoch, msg.topology_abandoned, doubt[0] if doubt is not None else -1)


class RoundBook:
    """The outcomes of membership rounds across a master's loss, and the rounds still open."""

    def __init__(self, keep: int = OUTCOMES_KEPT) -> None:
        self._keep = keep
        self._outcomes: OrderedDict[int, bool] = OrderedDict()  # topology epoch -> committed
        self._where: dict[int, _Where] = {}  # peer -> its report
        self._topology: dict[int, TopologyDoubt] = {}  # epoch -> open doubt
        self._answers: OrderedDict[PendingKey, bool] = OrderedDict()  # the last rounds' answers
        self._not_voted: OrderedDict[PendingKey, None] = OrderedDict()  # rounds a member had not voted in
        self._pending: dict[PendingKey, PendingDoubt] = {}

    # -- queries --------------------------------------------------------------------------------

    @property
    def undecided(self) -> bool:
        """True while some peer waits for the outcome of a round."""
        return bool(self._topology) or bool(self._pending)

    def open_rounds(self) -> list[TopologyDoubt | PendingDoubt]:
        """The open doubts, oldest first (status and tests)."""
        return sorted([*self._topology.values(), *self._pending.values()], key=lambda d: d.opened)

    def outcome(self, epoch: int) -> bool | None:
        """Whether the topology round of ``epoch`` committed, if known."""
        return self._outcomes.get(epoch)

    def is_open(self, epoch: int) -> bool:
        """Whether the topology round of ``epoch`` is in doubt here (members wait for its outcome)."""
        return epoch in self._topology

    def round_above(self, epoch: int) -> bool:
        """Whether a topology round of a later epoch than ``epoch`` is in doubt or was aborted: a member
        whose topology call the loss failed before its EstablishP2P arrived (so it reports its older
        epoch) voted in that round, and is a member of the run's epoch."""
        return any(e > epoch for e in self._topology) or \
            any(e > epoch and not ok for e, ok in self._outcomes.items())

    def deadline(self, timeout: float) -> float | None:
        """When the oldest open doubt runs out of time (see :meth:`overdue`)."""
        return min((d.opened + timeout for d in self.open_rounds()), default=None)

    # -- what the master itself did -------------------------------------------------------------

    def settle(self, epoch: int, commit: bool) -> None:
        """The topology round of ``epoch`` committed (``commit``) or failed at this master (or by a
        decision)."""
        self._outcomes[epoch] = commit
        self._outcomes.move_to_end(epoch)
        while len(self._outcomes) > self._keep:
            self._outcomes.popitem(last=False)

    def answered(self, key: PendingKey, answer: bool) -> None:
        """Pending round ``key`` was answered ``answer`` (by this master, or as a member reports)."""
        self._answers[key] = answer
        self._answers.move_to_end(key)
        while len(self._answers) > self._keep:
            self._answers.popitem(last=False)

    def _not_voted_in(self, key: PendingKey) -> None:
        self._not_voted[key] = None
        self._not_voted.move_to_end(key)
        while len(self._not_voted) > self._keep:
            self._not_voted.popitem(last=False)

    # -- re-registrations -----------------------------------------------------------------------

    def conflict(self, msg: m.Reregister) -> str | None:
        """Why ``msg``'s peer cannot be taken back, if it committed a round the run aborted."""
        epoch = msg.members_epoch
        if epoch >= 0 and self._outcomes.get(epoch) is False:
            return (f"this peer moved to epoch {epoch} by a topology round that the run aborted while it "
                    "was away: it is a step ahead of the others, join again")
        return None

    def report(self, peer_id: int, msg: m.Reregister, now: float,
               expected: Set[int]) -> tuple[list[TopologyDecision], list[PendingDecision]]:
        """Member ``peer_id`` re-registered with ``msg`` at ``now`` (check :meth:`conflict` first).

        Args:
            expected: the members the master expects back (a pending round every one of them waits in
                cannot have completed).

        Returns:
            The decisions this report makes (to this peer and to the others waiting).
        """
        doubt = _topology_doubt(msg)
        self._where[peer_id] = _Where(msg.members_epoch, doubt[0] if doubt is not None else -1)
        if msg.members_epoch >= 0 and msg.members_epoch not in self._outcomes:
            self.settle(msg.members_epoch, True)  # the epoch its members came from was committed
        if msg.topology_abandoned > msg.epoch and msg.topology_abandoned not in self._outcomes:
            # It got that round's EstablishP2P and had not confirmed it: the round committed nowhere.
            self.settle(msg.topology_abandoned, False)
        if doubt is not None:
            epoch, members, kind = doubt
            d = self._topology.get(epoch)
            if d is None:
                d = self._topology[epoch] = TopologyDoubt(epoch, members, kind, opened=now)
            d.waiting.add(peer_id)
        self._report_pending(peer_id, msg, now)
        return self._decide_topology(), self._decide_pending(expected)

    def _report_pending(self, peer_id: int, msg: m.Reregister, now: float) -> None:
        p = msg.pending
        if len(p) != 4:
            return
        epoch, answers, waits, last = p
        if answers >= 1 and last in (0, 1):
            self.answered((epoch, answers), bool(last))
        if waits:
            key = (epoch, answers + 1)
            d = self._pending.get(key)
            if d is None:
                d = self._pending[key] = PendingDoubt(key, opened=now)
            d.waiting.add(peer_id)
        else:
            self._not_voted_in((epoch, answers + 1))
        at = reported_epoch(msg)
        if at > epoch:
            # In a topology round at the loss: it has voted in no pending round of the epoch it moves to.
            self._not_voted_in((at, 1))

    def _verdict(self, d: TopologyDoubt) -> tuple[bool, str] | None:
        out = self._outcomes.get(d.epoch)
        if out is not None:
            return out, "decided" if out else "the round did not complete"
        if any(e >= d.epoch and ok for e, ok in self._outcomes.items()):
            return True, "a member committed it before the master was lost"
        for p in d.members:
            w = self._where.get(p)
            if w is not None and w.in_doubt != d.epoch and w.members_epoch < d.epoch:
                return False, f"member {p} had not confirmed its P2P setup when the master was lost"
        if all(self._where.get(p, _Where(-1, -1)).in_doubt == d.epoch for p in d.members):
            return True, "every member confirmed its P2P setup before the master was lost"
        return None

    def _decide_topology(self) -> list[TopologyDecision]:
        decisions: list[TopologyDecision] = []
        for epoch, d in list(self._topology.items()):
            verdict = self._verdict(d)
            if verdict is not None:
                del self._topology[epoch]
                decisions.append(self._topology_decision(d, *verdict))
        return decisions

    def _topology_decision(self, d: TopologyDoubt, commit: bool, reason: str) -> TopologyDecision:
        self.settle(d.epoch, commit)
        return TopologyDecision(d.epoch, commit, tuple(sorted(d.waiting)), d.members, d.kind, reason)

    def _decide_pending(self, expected: Set[int]) -> list[PendingDecision]:
        decisions: list[PendingDecision] = []
        for key, d in list(self._pending.items()):
            if key in self._answers:
                answer: bool | None = self._answers[key]
                why = "another member got the answer before the master was lost"
            elif key in self._not_voted:
                answer, why = None, "a member had not voted: the round did not complete, it runs here"
            elif expected and expected <= d.waiting:
                answer, why = None, "no member got an answer: the round runs here"
            else:
                continue
            del self._pending[key]
            decisions.append(PendingDecision(key, answer, tuple(sorted(d.waiting)), why))
        return decisions

    def peer_lost(self, peer_id: int) -> None:
        """``peer_id`` left: it waits for nothing any more (a doubt nobody waits for is dropped)."""
        self._where.pop(peer_id, None)
        for epoch, d in list(self._topology.items()):
            d.waiting.discard(peer_id)
            if not d.waiting:
                del self._topology[epoch]
        for key, pd in list(self._pending.items()):
            pd.waiting.discard(peer_id)
            if not pd.waiting:
                del self._pending[key]

    def give_up(self) -> tuple[list[TopologyDecision], list[PendingDecision]]:
        """The roll call is over: whoever an open round still waits for is absent, so decide every open
        round now, as :meth:`overdue` does at the timeout."""
        return self.overdue(0.0, 0.0, everyone=True)

    def overdue(self, now: float, timeout: float,
                everyone: bool = False) -> tuple[list[TopologyDecision], list[PendingDecision]]:
        """Decide every round open for more than ``timeout`` seconds (``everyone``: every open round): a
        topology round aborts (a member never came back, nothing tells whether it committed), a pending
        round runs here."""
        topo: list[TopologyDecision] = []
        for epoch, d in list(self._topology.items()):
            if everyone or now > d.opened + timeout:
                del self._topology[epoch]
                topo.append(self._topology_decision(
                    d, False, "not every member came back after the master was lost: aborted for all, retry"))
        pending: list[PendingDecision] = []
        for key, pd in list(self._pending.items()):
            if everyone or now > pd.opened + timeout:
                del self._pending[key]
                pending.append(PendingDecision(key, None, tuple(sorted(pd.waiting)),
                                               "not every member came back: the round runs here"))
        return topo, pending


__all__ = [
    "OUTCOMES_KEPT",
    "PendingDecision",
    "PendingDoubt",
    "PendingKey",
    "RoundBook",
    "TopologyDecision",
    "TopologyDoubt",
    "reported_epoch",
]
