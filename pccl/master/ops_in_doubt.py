"""Operations in doubt across a master's loss: one decision for every peer (pure, no trio, no clock).

A collective commits on a peer only when the master's ``CollectiveComplete`` reaches it, and the master
sends one per participant. A master lost between those messages leaves some participants committed
and the others waiting, their part finished ("in doubt"). Likewise for a shared-state sync and its
``SharedStateResult``. A peer in doubt keeps the operation (buffers untouched) and reports it when it
re-registers (``Reregister.ops_in_doubt`` / ``sync_in_doubt``), together with the operations it failed
at the loss (``*_abandoned``) and those it committed (``*_committed``). :class:`DoubtBook` turns those
reports into one outcome per operation (docs/concepts.md "Operations in doubt"):

* **commit** when any peer reports it committed, or when every participant reports it in doubt
  (every part is finished, so the result is whole everywhere);
* **abort** when any participant reports it abandoned (then no peer can have committed it: the old
  master commits only after every participant finished), or when no decision came within the
  timeout the master passes to :meth:`DoubtBook.overdue` (a participant never came back), or, at a
  rebuilt master, when the roll call below ends first (every member is back or its grace ran out:
  a participant still silent is absent);
* an operation of this master's own generation (a peer lost its connection to a master that is still
  alive) is decided by what this master did: committed if it completed it, else aborted.

A peer that reports as committed an operation the book decided to abort is refused
(:meth:`DoubtBook.conflict`): it is a step ahead of the run and must join again.

The master holds every vote while a decision is open, so the run resumes only once every peer agrees
on what happened. A rebuilt master also holds the votes for a *roll call* (:meth:`DoubtBook.roll_call`):
until every member of the last epoch has re-registered, or a grace period has passed, or (a majority
back) nobody came back for a quiet period (:meth:`DoubtBook.quiet`). A member not back yet has not said
what it holds, and one that returns after the others resumed finds them in another call than the one it
retries (a deadlock); the roll call lets the members that reconnect a backoff step later return first,
and one back after it ended is refused once its group went on (:meth:`DoubtBook.moved_on`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..wire import messages as m

#: ``(kind, group, tag)``: kind "op" (a collective, by tag) or "sync" (tag -1: one sync per group).
Key = tuple[str, int, int]

#: How many settled outcomes the book remembers (the tags in use at once, per group).
OUTCOMES_KEPT = 1024


@dataclass
class Doubt:
    """One undecided operation: ``seq`` (op_seq or sync_seq) of ``key``."""

    key: Key
    seq: int
    participants: frozenset[int]
    revision: int = -1  # syncs: the plan's revision
    waiting: set[int] = field(default_factory=set)  # peers in doubt, waiting for the decision
    opened: float = 0.0


@dataclass(frozen=True)
class Decision:
    """Tell ``peers`` that ``seq`` of ``key`` is committed (``commit``) or aborted."""

    key: Key
    seq: int
    commit: bool
    peers: tuple[int, ...]
    revision: int = -1
    reason: str = ""


@dataclass
class _Report:
    """What one re-registration said about one group's operations."""

    in_doubt: list[tuple[Key, int, frozenset[int], int]]  # key, seq, participants, revision
    abandoned: list[tuple[Key, int]]
    committed: list[tuple[Key, int]]


def _report(group: int, msg: m.Reregister) -> _Report:
    in_doubt: list[tuple[Key, int, frozenset[int], int]] = []
    for row in msg.ops_in_doubt:
        if len(row) == 3 and isinstance(row[0], int) and isinstance(row[1], int) and isinstance(row[2], list):
            in_doubt.append((("op", group, row[0]), row[1], frozenset(int(p) for p in row[2]), -1))
    s = msg.sync_in_doubt
    if len(s) == 3 and isinstance(s[0], int) and isinstance(s[1], int) and isinstance(s[2], list):
        in_doubt.append((("sync", group, -1), s[0], frozenset(int(p) for p in s[2]), s[1]))
    abandoned = [(("op", group, r[0]), r[1]) for r in msg.ops_abandoned if len(r) == 2 and r[1] >= 0]
    if msg.sync_abandoned >= 0:
        abandoned.append((("sync", group, -1), msg.sync_abandoned))
    committed = [(("op", group, r[0]), r[1]) for r in msg.ops_committed if len(r) == 2]
    if msg.sync_committed >= 0:
        committed.append((("sync", group, -1), msg.sync_committed))
    return _Report(in_doubt, abandoned, committed)


class DoubtBook:
    """The outcomes of operations across a master's loss, and the doubts still open.

    Args:
        keep: how many settled outcomes to remember.
    """

    def __init__(self, keep: int = OUTCOMES_KEPT) -> None:
        self._keep = keep
        self._outcomes: OrderedDict[Key, tuple[int, bool]] = OrderedDict()
        # Every committed (key, seq) remembered, not only each key's last outcome: a member that
        # committed op k and lost op k + 1 with the master reports both, and a member still in doubt on
        # k must then learn that k committed (the last outcome of the key says "k + 1 aborted").
        self._commits: OrderedDict[tuple[Key, int], None] = OrderedDict()
        self._open: dict[tuple[Key, int], Doubt] = {}
        # Sequence numbers above these were handed out by this master (see own_from()).
        self._own_op_from = 0
        self._own_sync_from = 0
        # The roll call of a rebuilt master: the last epoch's members not back yet, and until when
        # the votes wait for them (None: no roll call).
        self._missing: set[int] = set()
        self._roll_until: float | None = None
        # Once a majority is back: the roll call also ends when nobody new came back for a quiet
        # period (see quiet()); None: no such end yet.
        self._quiet_until: float | None = None
        self.roll_call_end = ""  # why the last roll call ended early: "grace" or "quiet" (log lines)
        # The roll call's members and those back (its absentees, when it ends, are those not back).
        self._called: set[int] = set()
        self._back: set[int] = set()
        # Members absent when a roll call ended: every group's progress at that moment (moved_on()).
        self._absent_at: dict[int, dict[int, int]] = {}
        # Operations this master completed per group, and the count when each member was dropped:
        # a member that comes back after its group went on without it is behind (moved_on()).
        self._progress: dict[int, int] = {}
        self._dropped_at: dict[int, int] = {}

    # -- queries --------------------------------------------------------------------------------

    @property
    def undecided(self) -> bool:
        """True while some peer waits for a decision, or the roll call waits for a member."""
        return bool(self._open) or self._roll_until is not None

    @property
    def missing(self) -> set[int]:
        """Members the roll call still waits for (empty: none running)."""
        return set(self._missing) if self._roll_until is not None else set()

    def roll_call(self, members: list[int], returned: set[int], now: float, grace: float) -> None:
        """Hold the votes until every one of ``members`` re-registered (``returned`` are back) or
        ``grace`` seconds after ``now``, whichever comes first. ``grace`` <= 0 holds nothing. Each
        re-registration narrows ``members`` to those its ring lists (see :meth:`report`)."""
        self._missing = set(members) - returned
        self._roll_until = now + grace if self._missing and grace > 0 else None
        self._quiet_until = None
        self._called, self._back = set(members), set(returned)

    def quiet(self, now: float, seconds: float) -> None:
        """A member came back at ``now`` with a majority of the roll call's members back: the roll call
        ends ``seconds`` after the latest such return if nobody else returns meanwhile (and at its grace
        at the latest). Live members reconnect within one backoff step of each other, so a member not
        back a quiet period after the last one is absent. No roll call running: nothing."""
        if self._roll_until is not None:
            self._quiet_until = now + seconds

    def open_doubts(self) -> list[Doubt]:
        """The open doubts, oldest first (status and tests)."""
        return sorted(self._open.values(), key=lambda d: (d.opened, d.key, d.seq))

    def outcome(self, key: Key) -> tuple[int, bool] | None:
        """The last settled ``(seq, committed)`` of ``key``, if remembered."""
        return self._outcomes.get(key)

    def deadline(self, timeout: float) -> float | None:
        """When the oldest open doubt (or the roll call) runs out of time (see :meth:`overdue`)."""
        ends = [d.opened + timeout for d in self._open.values()]
        if self._roll_until is not None:
            ends.append(self._roll_until)
            if self._quiet_until is not None:
                ends.append(self._quiet_until)
        return min(ends, default=None)

    # -- what the master itself did ---------------------------------------------------------------

    def own_from(self, op_seq: int, sync_seq: int) -> None:
        """This master hands out sequence numbers above ``op_seq`` / ``sync_seq`` (a rebuilt
        master's start): lower ones belong to an older generation and are decided from the peers'
        reports."""
        self._own_op_from, self._own_sync_from = op_seq, sync_seq

    def settle(self, key: Key, seq: int, commit: bool) -> None:
        """The master completed (``commit``) or aborted ``seq`` of ``key`` itself."""
        self._outcomes[key] = (seq, commit)
        self._outcomes.move_to_end(key)
        while len(self._outcomes) > self._keep:
            self._outcomes.popitem(last=False)
        if commit:
            self._remember_commit(key, seq)

    def _remember_commit(self, key: Key, seq: int) -> None:
        self._commits[(key, seq)] = None
        self._commits.move_to_end((key, seq))
        while len(self._commits) > self._keep:
            self._commits.popitem(last=False)

    def committed(self, key: Key, seq: int) -> bool:
        """True when ``seq`` of ``key`` is known committed (reported or decided), if remembered."""
        return (key, seq) in self._commits

    def progressed(self, group: int) -> None:
        """The master completed a collective or sync of ``group``."""
        self._progress[group] = self._progress.get(group, 0) + 1

    @property
    def total_progress(self) -> int:
        """Collectives and syncs this master completed, every group together."""
        return sum(self._progress.values())

    def dropped(self, peer_id: int, group: int) -> None:
        """Member ``peer_id`` of ``group`` left this master (connection lost, evicted)."""
        self._dropped_at[peer_id] = self._progress.get(group, 0)

    def was_dropped(self, peer_id: int) -> bool:
        """True when this master had ``peer_id`` as a member and dropped it."""
        return peer_id in self._dropped_at

    def moved_on(self, peer_id: int, group: int, absent: bool = True) -> bool:
        """True when ``group`` completed an operation at this master since this master dropped
        ``peer_id``, or (``absent``) since a roll call ended without it: taken back, it would retry
        a call the others are past (a deadlock), so it must join again and sync instead. (The master
        passes ``absent=False`` where a second master may exist: then a member it never had, such as
        a minority failing over to a standby that went on, is taken back and syncs at its next step,
        docs/concepts.md "No split brain".)"""
        if peer_id in self._dropped_at and self._progress.get(group, 0) > self._dropped_at[peer_id]:
            return True
        at = self._absent_at.get(peer_id) if absent else None
        return at is not None and self._progress.get(group, 0) > at.get(group, 0)

    def _end_roll_call(self) -> None:
        """The roll call is over: the members it called that are not back are absent from here on,
        as if dropped now (:meth:`moved_on`)."""
        for p in self._called - self._back:
            self._absent_at[p] = dict(self._progress)
        self._missing, self._roll_until, self._quiet_until = set(), None, None
        self._called, self._back = set(), set()

    def _own(self, key: Key, seq: int) -> bool:
        return seq > (self._own_op_from if key[0] == "op" else self._own_sync_from)

    # -- re-registrations -----------------------------------------------------------------------

    def conflict(self, group: int, msg: m.Reregister) -> str | None:
        """Why ``msg``'s peer cannot be taken back, if it committed what the run aborted."""
        for key, seq in _report(group, msg).committed:
            out = self._outcomes.get(key)
            if out == (seq, False):
                what = f"collective tag {key[2]}" if key[0] == "op" else "shared-state sync"
                return (f"this peer committed {what} (sequence {seq}), which the run aborted while it was "
                        "away: it is a step ahead of the others, join again")
        return None

    def behind(self, group: int, msg: m.Reregister) -> str | None:
        """Why ``msg``'s peer cannot be taken back, if an operation it waits on in doubt was followed by
        a later one of the same tag that committed without it: its group went on past it (whatever
        its own op's outcome, taken back it would retry a call the others are past: a deadlock)."""
        for key, seq, _participants, _revision in _report(group, msg).in_doubt:
            out = self._outcomes.get(key)
            if out is not None and out[1] and out[0] > seq:
                what = f"collective tag {key[2]}" if key[0] == "op" else "shared-state sync"
                return (f"the group committed a later {what} (sequence {out[0]}) without this peer, whose "
                        f"sequence {seq} is still in doubt: it went on without it, join again")
        return None

    def report(self, peer_id: int, group: int, msg: m.Reregister, now: float) -> list[Decision]:
        """A member of ``group`` re-registered with ``msg`` at ``now`` (check :meth:`conflict` first).

        Returns:
            The decisions this report makes (to this peer and to the others waiting).
        """
        rep = _report(group, msg)
        # A member is waited for only while every member back lists it: a peer drops the dead of its
        # own group from its table but may still list the dead of other groups, so the rings differ,
        # and the roll call must not depend on whose came first.
        rolling = self._roll_until is not None
        self._absent_at.pop(peer_id, None)
        self._back.add(peer_id)
        self._missing &= set(msg.ring)
        self._missing.discard(peer_id)
        if rolling and not self._missing:
            self._end_roll_call()
        for key, seq in rep.committed:
            out = self._outcomes.get(key)
            if out is None or out[0] < seq:
                self.settle(key, seq, True)
            else:
                self._remember_commit(key, seq)  # the key's last outcome is a later one
        for key, seq in rep.abandoned:
            out = self._outcomes.get(key)
            if out is None or out[0] < seq:
                self.settle(key, seq, False)
        decisions: list[Decision] = []
        for key, seq, participants, revision in rep.in_doubt:
            if self.committed(key, seq):
                decisions.append(self._decision(key, seq, True, (peer_id,), revision, "reported"))
                continue
            out = self._outcomes.get(key)
            if out is not None and out[0] == seq:
                decisions.append(self._decision(key, seq, out[1], (peer_id,), revision, "reported"))
                continue
            if self._own(key, seq):
                # This master ran the op and forgot it (or never completed it): nobody committed it.
                decisions.append(self._decision(key, seq, False, (peer_id,), revision, "own"))
                continue
            d = self._open.get((key, seq))
            if d is None:
                d = self._open[(key, seq)] = Doubt(key, seq, participants, revision, opened=now)
            d.waiting.add(peer_id)
        decisions += self._decide_open()
        if rolling and self._roll_until is None:
            # Every member is back: a participant that has not said it finished never will.
            decisions += self._abort_open()
        return decisions

    def _abort_open(self) -> list[Decision]:
        """The roll call is over: abort every open doubt. The participants it still waits for are not
        back, so they are absent (nothing tells whether they committed), the same outcome as the
        timeout of :meth:`overdue`, without waiting for it."""
        decisions = [self._decision(d.key, d.seq, False, tuple(sorted(d.waiting)), d.revision, "timeout")
                     for d in self._open.values()]
        self._open.clear()
        return decisions

    def _decide_open(self) -> list[Decision]:
        decisions: list[Decision] = []
        for ks, d in list(self._open.items()):
            out = self._outcomes.get(d.key)
            if self.committed(d.key, d.seq):
                commit, why = True, "reported"
            elif out is not None and out[0] == d.seq:
                commit, why = out[1], "reported"
            elif d.participants and d.participants <= d.waiting:
                commit, why = True, "all done"
            else:
                continue
            del self._open[ks]
            decisions.append(self._decision(d.key, d.seq, commit, tuple(sorted(d.waiting)), d.revision, why))
        return decisions

    def _decision(self, key: Key, seq: int, commit: bool, peers: tuple[int, ...], revision: int,
                  why: str) -> Decision:
        self.settle(key, seq, commit)
        if commit:
            reason = ("committed by a peer before the master was lost" if why == "reported"
                      else "every participant finished its part before the master was lost")
        elif why == "own":
            reason = "the master did not complete this operation: retry"
        elif why == "timeout":
            reason = "not every participant came back after the master was lost: aborted for all, retry"
        else:
            reason = "a participant failed it when the master was lost: aborted for all, retry"
        return Decision(key, seq, commit, peers, revision, reason)

    def peer_lost(self, peer_id: int) -> None:
        """``peer_id`` left: it waits for nothing any more (a doubt nobody waits for is dropped)."""
        for ks, d in list(self._open.items()):
            d.waiting.discard(peer_id)
            if not d.waiting:
                del self._open[ks]

    def overdue(self, now: float, timeout: float) -> list[Decision]:
        """Abort every doubt open for more than ``timeout`` seconds: a participant never came back
        (it died with the master), so nothing tells whether it committed, and the survivors agree.
        The roll call's end (its grace or its quiet period ran out, or every member is back) aborts
        every open doubt at once: whoever it still waits for is absent."""
        decisions: list[Decision] = []
        quiet = self._quiet_until is not None and now >= self._quiet_until
        if self._roll_until is not None and (now >= self._roll_until or quiet):
            self.roll_call_end = "grace" if now >= self._roll_until else "quiet"
            self._end_roll_call()  # the latecomers are absent
            decisions += self._abort_open()  # and so are the participants the doubts wait for
        for ks, d in list(self._open.items()):
            if now > d.opened + timeout:
                del self._open[ks]
                decisions.append(self._decision(d.key, d.seq, False, tuple(sorted(d.waiting)), d.revision,
                                                "timeout"))
        return decisions


__all__ = ["OUTCOMES_KEPT", "Decision", "Doubt", "DoubtBook", "Key"]
