"""The collective vote and run: one :class:`CollectiveRound` per (group, tag), the reservations of the
speculative start (:class:`Reservations`), and :class:`CollectiveVotes`, the run's open collective rounds
with the held-back tableless commences (docs/protocol.md section 4).

A collective's vote completes when every accepted peer of its group voted (:func:`~pccl.master.votes.
unanimous`); then it fails for all (descriptors differ, too few peers, a speculative attempt failed or
its start does not hold) or runs under a fresh op_seq (``CollectiveCommence`` with the table), or, when
every voter started speculatively under the number reserved at the group's last completion on the same
ring, under that number (``FastStart``: the master's answer is the confirmation). A run completes when
every participant reported success (``CollectiveComplete``, with the number reserved for the next op of
the tag) and fails for all when one fails or is lost.

Pure: no clock, no I/O. The master is reached through :class:`CollectiveContext` only (what the round
must know of membership, and where op_seq numbers come from); the caller checks that the master is not
held (``MasterState.resumed``) before asking a round to complete.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ..._errors import Result
from ...wire import messages as m
from ..describe import VoteWait, describe_mismatch, too_few_peers_reason
from ..effects import Effect, FastStart, Send
from ..lost import REASON as LOST_REASON
from ..votes import unanimous
from .base import Expel, RoundContext, VoteKey

#: Reservations kept per group (the oldest go first; peers keep the same number in the same order).
RESERVATIONS_PER_GROUP = 1024


class CollectiveContext(RoundContext, Protocol):
    """What a collective round asks of the master (``MasterState`` is one)."""

    def collective_started(self, group: int, voters: list[int]) -> None:
        """A collective of ``group`` starts with ``voters`` (live heals ask who trains: heals.py)."""
        ...

    @property
    def epoch(self) -> int: ...

    def registered_in(self, group: int) -> list[int]:
        """The peers of ``group`` waiting to be accepted."""
        ...

    def next_op_seq(self) -> int:
        """A fresh op_seq (never handed out before by this master's generation)."""
        ...

    def op_settled(self, group: int, tag: int, seq: int, committed: bool) -> None:
        """A running op ended (the books of operations in doubt and lost learn it)."""
        ...


@dataclass
class Reservation:
    """The op_seq reserved for a group's next operation with one tag (sent in CollectiveComplete):
    valid while the epoch is ``epoch`` and the group's ring is still ``members``."""

    seq: int
    epoch: int
    members: list[int]


class Reservations:
    """The reserved op_seqs, group -> tag -> :class:`Reservation`, oldest first."""

    def __init__(self) -> None:
        self._by_group: dict[int, dict[int, Reservation]] = {}

    def reserve(self, group: int, tag: int, seq: int, epoch: int, members: list[int]) -> None:
        """Reserve ``seq`` for ``group``'s next op with ``tag`` (the oldest of the group go past
        :data:`RESERVATIONS_PER_GROUP`)."""
        held = self._by_group.setdefault(group, {})
        held.pop(tag, None)
        held[tag] = Reservation(seq=seq, epoch=epoch, members=list(members))
        while len(held) > RESERVATIONS_PER_GROUP:
            del held[next(iter(held))]

    def take(self, key: tuple[int, int]) -> Reservation | None:
        """The reservation of (group, tag), removed: a number is never run twice."""
        held = self._by_group.get(key[0])
        return None if held is None else held.pop(key[1], None)

    def revoke(self, group: int) -> bool:
        """Drop every reservation of ``group`` (it lost a member); True when it held any."""
        return bool(self._by_group.pop(group, {}))

    def __len__(self) -> int:
        return sum(len(r) for r in self._by_group.values())


def lost_abort(tag: int, op_seq: int, forget: list[int] | None = None) -> m.CollectiveAbort:
    """The abort of a call lost with the master (docs/concepts.md "A member's link breaks")."""
    return m.CollectiveAbort(tag=tag, op_seq=op_seq, code=int(Result.RANK_CONNECTION_LOST),
                             reason=LOST_REASON, forget=forget or [])


@dataclass
class CollectiveRound:
    """The vote, then the run, of one collective of ``group`` under ``tag``."""

    group: int
    tag: int
    opened: float = 0.0  # ``now`` of the first vote (the vote deadline's start)
    votes: dict[int, m.CollectiveDescriptor] = field(default_factory=dict)
    running: bool = False
    op_seq: int = -1
    participants: list[int] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    # the schedule each ``done`` peer says "auto" ran (the plan rule's majority: pccl/master/op_plans.py)
    schedules: dict[int, str] = field(default_factory=dict)
    # since when every participant but one reported its part done (pccl/master/held_ops.py)
    alone_since: float | None = None
    # the same peers as ``participants``, for O(1) membership tests (kept in step with it)
    participant_set: set[int] = field(default_factory=set)
    # the speculative start: each voter's proposed op_seq (-1: none), and voters whose speculative
    # attempt already reported success while the vote was still open
    proposals: dict[int, int] = field(default_factory=dict)
    early_done: set[int] = field(default_factory=set)
    early_failed: dict[int, str] = field(default_factory=dict)  # ... or failure, with its reason
    retired: set[int] = field(default_factory=set)  # proposals of voters that withdrew or were lost
    fast: bool = False  # running under the reserved op_seq (no CollectiveCommence was sent)
    # the speculating voters still owed the tableless commence (held back by ``go_delay``)
    go_to: list[int] = field(default_factory=list)

    # -- the round interface (pccl/master/rounds/base.py)

    @property
    def key(self) -> VoteKey:
        return ("op", (self.group, self.tag))

    @property
    def voting(self) -> bool:
        return not self.running

    @property
    def ballots(self) -> Collection[int]:
        return self.votes.keys()

    @property
    def vote_name(self) -> str:
        return f"collective tag {self.tag} (group {self.group}) vote"

    def waits(self, members: set[int]) -> tuple[str, set[int], str] | None:
        if self.running:
            return (f"collective tag {self.tag} (group {self.group}, op {self.op_seq})",
                    set(self.participants) - self.done, " to finish")
        if self.votes:
            return self.vote_name, members - set(self.votes), f"; voted {sorted(self.votes)}"
        return None

    def busy(self, ring: list[int]) -> set[int]:
        return set(self.participants) if self.running else set()

    def vote_waits(self) -> list[tuple[int, VoteWait]]:
        if self.running:
            return []
        return [(p, VoteWait("collective", self.tag, tuple(d))) for p, d in self.votes.items()]

    # -- ballots

    def refusal(self, peer_id: int, op_seq: int) -> m.CollectiveAbort | None:
        """The refusal of ``peer_id``'s ballot when it votes again or the op runs without it."""
        if peer_id in self.votes or peer_id in self.participant_set:
            where = "in this group"  # the running op is unaffected; only this call is refused
        elif self.running:
            where = "without this peer"
        else:
            return None
        return m.CollectiveAbort(tag=self.tag, op_seq=op_seq, code=int(Result.INVALID_USAGE),
                                 reason=f"tag {self.tag} is already running {where}")

    def vote(self, peer_id: int, descriptor: m.CollectiveDescriptor, op_seq: int) -> None:
        """Count ``peer_id``'s ballot (``op_seq`` >= 0: it started speculatively under that number)."""
        self.votes[peer_id] = descriptor
        if op_seq >= 0:
            self.proposals[peer_id] = op_seq

    def proposal(self, peer_id: int) -> int:
        """The op_seq ``peer_id`` runs this op under as far as it knows (its proposal, or -1)."""
        return self.op_seq if self.running else self.proposals.get(peer_id, -1)

    def speculative_seqs(self) -> list[int]:
        """The speculative op_seqs the voters proposed (their frames must be dropped everywhere)."""
        return sorted({s for s in self.proposals.values() if s >= 0} | self.retired)

    def drop_voter(self, peer_id: int) -> int:
        """Take ``peer_id``'s vote back; returns its proposal (kept among the numbers to forget)."""
        self.votes.pop(peer_id, None)
        self.early_done.discard(peer_id)
        self.early_failed.pop(peer_id, None)
        seq = self.proposals.pop(peer_id, -1)
        if seq >= 0:
            self.retired.add(seq)
        return seq

    def abort_to(self, targets: list[int], code: Result, reason: str, forget: list[int]) -> list[Effect]:
        """CollectiveAbort to each of ``targets``, each under the op_seq it knows the op by."""
        return [
            Send(p, m.CollectiveAbort(tag=self.tag, op_seq=self.proposal(p), code=int(code), reason=reason,
                                      forget=forget))
            for p in targets
        ]

    def why_not_fast(self, res: Reservation | None, voters: list[int], epoch: int) -> str:
        """Why the voters' speculative start does not hold (for the abort's reason)."""
        if res is None:
            return "no op_seq is reserved for this tag: the group changed or the last op did not complete"
        if res.epoch != epoch:
            return f"reserved in epoch {res.epoch}, the run is at epoch {epoch}"
        if res.members != voters:
            return f"reserved for the ring {res.members}, the group is {voters} now"
        odd = sorted(p for p in voters if self.proposals.get(p, res.seq) != res.seq)
        if odd:
            return f"peer(s) {odd} started under another op_seq than the reserved {res.seq}"
        return f"a voter withdrew after starting under the reserved op_seq {res.seq}"

    def holds_fast(self, res: Reservation | None, voters: list[int], epoch: int) -> bool:
        """The speculative start holds when the reservation does (same epoch, the ring it was reserved
        for, nobody lost since: a loss drops it) and no voter started under another number. Voters
        without the number (they reconnected or cancelled and missed the last confirmation) join it
        through a CollectiveCommence naming it; a number a withdrawn voter already ran under is never
        run again (its frames may be out there): then everyone is aborted."""
        return (
            res is not None
            and bool(self.proposals)
            and not self.retired
            and res.epoch == epoch
            and res.members == voters
            and all(self.proposals.get(p, res.seq) == res.seq for p in voters)
        )


class CollectiveVotes:
    """The open collective rounds of the run by (group, tag), the reservations, and the tableless
    commences held back by ``go_delay`` (MasterConfig.speculative_go_delay)."""

    def __init__(self, go_delay: float = 0.0) -> None:
        self.ops: dict[tuple[int, int], CollectiveRound] = {}
        self.reserved = Reservations()
        self.go_delay = go_delay
        # (group, tag) -> (when, op_seq): the tableless commence held back for that running op
        self.go_due: dict[tuple[int, int], tuple[float, int]] = {}
        self.fast_starts = 0  # collectives that ran on the speculative start (statistics)
        self.go_held = 0  # held-back commences the op's end made unnecessary (statistics)

    def __iter__(self) -> Iterator[CollectiveRound]:
        return iter(self.ops.values())

    def get(self, key: tuple[int, int]) -> CollectiveRound | None:
        return self.ops.get(key)

    def open(self, group: int, tag: int, now: float) -> tuple[CollectiveRound, bool]:
        """The round of (group, tag), opened at ``now`` if there is none; True: it was opened now."""
        op = self.ops.get((group, tag))
        if op is not None:
            return op, False
        op = self.ops[(group, tag)] = CollectiveRound(group=group, tag=tag, opened=now)
        return op, True

    def discard_empty(self, key: tuple[int, int]) -> None:
        """Drop the round of ``key`` if it holds no ballot (a call refused before it voted)."""
        op = self.ops.get(key)
        if op is not None and not op.running and not op.votes:
            del self.ops[key]

    def running(self) -> int:
        return sum(1 for o in self.ops.values() if o.running)

    # -- the vote completes

    def check(self, key: tuple[int, int], ctx: CollectiveContext) -> list[Effect]:
        """Complete the vote of ``key`` when every accepted peer of its group voted (the caller checked
        the master is not held): abort it for all, or start it (fast or slow)."""
        op = self.ops.get(key)
        if op is None or op.running:
            return []
        out = ctx.left_out(op.group, "op")  # healing or behind after a heal: not waited on
        size = ctx.group_size(op.group) - len(out)
        if len(op.votes) < size:
            return []  # (every ballot but the last: the count alone says no, see :func:`unanimous`)
        members = unanimous(op.votes, size, lambda: [p for p in ctx.accepted(op.group) if p not in out])
        if members is None:
            return []
        voters = [p for p in members if p in op.votes]
        first = op.votes[voters[0]]
        del self.ops[key]
        # The reservation is used (or void) either way: a number is never run twice.
        res = self.reserved.take(key)
        forget = op.speculative_seqs()
        if any(op.votes[p] != first for p in voters):
            reason = describe_mismatch(op.tag, {p: op.votes[p] for p in voters})
            return op.abort_to(voters, Result.INVALID_ARGUMENT, reason, forget)
        if len(voters) < 2:
            reason = too_few_peers_reason(op.group, ctx.registered_in(op.group))
            return op.abort_to(voters, Result.TOO_FEW_PEERS, reason, forget)
        fast = op.holds_fast(res, voters, ctx.epoch)
        if op.early_failed:
            # A speculative attempt failed before the vote completed (and the descriptors agree):
            # the op cannot complete; everyone is aborted, buffers intact.
            p0 = min(op.early_failed)
            reason = f"peer {p0} failed: {op.early_failed[p0]}"
            return op.abort_to(voters, Result.RANK_CONNECTION_LOST, reason, forget)
        if op.proposals and not fast:
            # Some voters started speculatively but the start does not hold: their data planes ran on a
            # number (or a ring) the others do not share. All-or-nothing: everyone is aborted with
            # their buffers intact and forgets the speculative numbers; the retry has no reservation
            # and takes the slow path.
            why = op.why_not_fast(res, voters, ctx.epoch)
            reason = f"tag {op.tag}: the speculative start was not confirmed ({why}): retry"
            return op.abort_to(voters, Result.RANK_CONNECTION_LOST, reason, forget)
        op.running = True
        op.participants = voters
        op.participant_set = set(voters)
        ctx.collective_started(op.group, voters)
        self.ops[key] = op
        if fast:
            assert res is not None
            return self._start_fast(key, op, res, voters, ctx)
        op.op_seq = ctx.next_op_seq()
        op.done = set()
        # one object for every voter: the server's streams encode its n-row table once (SHARED)
        commence = m.CollectiveCommence(tag=op.tag, op_seq=op.op_seq, peers=ctx.table(voters), forget=forget)
        return [Send(p, commence) for p in voters]

    def _start_fast(self, key: tuple[int, int], op: CollectiveRound, res: Reservation, voters: list[int],
                    ctx: CollectiveContext) -> list[Effect]:
        """The speculative start holds: every participant already runs under the reserved number on the
        ring it names; the master's one answer is the confirmation (or an abort)."""
        op.fast = True
        op.op_seq = res.seq
        op.done = op.early_done & op.participant_set
        if len(op.done) + 1 == len(op.participant_set):
            op.alone_since = ctx.now
        self.fast_starts += 1
        # Off the critical path, the speculating voters hear that everyone voted (a commence without a
        # table: their data planes already run; it starts their stall clocks); voters that did not have
        # the number get the table and run under it. With ``go_delay`` the tableless commence waits: an
        # op that ends sooner (every small one) needs none, its Complete or Abort follows; a longer one
        # gets it from go_overdue().
        go = m.CollectiveCommence(tag=op.tag, op_seq=op.op_seq, peers=[])
        late = [p for p in voters if p not in op.proposals]
        table = (m.CollectiveCommence(tag=op.tag, op_seq=op.op_seq, peers=ctx.table(voters)) if late
                 else go)  # the late voters' commence, with the table (one object for all of them)
        held = self.go_delay > 0
        if held:
            op.go_to = [p for p in voters if p in op.proposals]
            self.go_due[key] = (ctx.now + self.go_delay, op.op_seq)
        return [
            FastStart(op.group, op.tag, op.op_seq),
            *(Send(p, go if p in op.proposals else table) for p in voters
              if not (held and p in op.proposals)),
            *self.check_done(key, ctx),
        ]

    # -- the run

    def report(self, peer_id: int, key: tuple[int, int], msg: m.CollectiveDone,
               ctx: CollectiveContext) -> list[Effect] | Expel:
        """``peer_id``'s CollectiveDone for ``key``: a speculative attempt's report while the vote is
        open, a withdrawal, or its part of the run done or failed."""
        op = self.ops.get(key)
        if op is not None and not op.running and peer_id in op.votes:
            if not msg.success and msg.op_seq >= 0 and msg.op_seq == op.proposals.get(peer_id, -1):
                # Its speculative attempt failed before the vote completed: the op fails, but the
                # verdict waits for the vote (a descriptor mismatch, the likely cause, is then named).
                op.early_failed.setdefault(peer_id, msg.reason)
                return []
            if not msg.success:
                # The peer withdrew its vote (its call was cancelled): the op cannot run as voted.
                return self.abort(key, f"peer {peer_id} withdrew: {msg.reason}", Result.RANK_CONNECTION_LOST,
                                  ctx)
            if msg.op_seq >= 0 and msg.op_seq == op.proposals.get(peer_id, -1):
                # A speculative attempt finished before the vote did (a broadcast's upstream peers
                # need nothing from the late ones): it counts if the vote confirms the number.
                op.early_done.add(peer_id)
            return []
        if op is None or not op.running or peer_id not in op.participant_set:
            # Late report for an op already aborted (the abort raced with it): harmless.
            return []
        if msg.op_seq >= 0 and msg.op_seq != op.op_seq:
            # The report of a speculative attempt this op's CollectiveCommence replaced (sent before
            # the peer read it): the peer runs again under op.op_seq and reports that.
            return []
        if peer_id in op.done:
            return Expel(f"duplicate CollectiveDone for tag {msg.tag}")
        if not msg.success:
            return self.abort(key, f"peer {peer_id} failed: {msg.reason}", Result.RANK_CONNECTION_LOST, ctx)
        op.done.add(peer_id)
        if msg.schedule:
            op.schedules[peer_id] = msg.schedule
        if len(op.done) + 1 == len(op.participant_set):
            op.alone_since = ctx.now  # one left: what the others wait on (pccl/master/held_ops.py)
        return self.check_done(key, ctx)

    def check_done(self, key: tuple[int, int], ctx: CollectiveContext) -> list[Effect]:
        """Complete the run of ``key`` when every participant reported success (and reserve the number
        of the tag's next op on the same ring)."""
        op = self.ops[key]
        if len(op.done) >= len(op.participant_set) and op.participant_set <= op.done:
            del self.ops[key]
            if op.go_to and self.go_due.pop(key, None) is not None:
                self.go_held += 1
            ctx.op_settled(op.group, op.tag, op.op_seq, True)
            # Reserved on the ring this op ran on, also while a member heals (left out: the ring is the
            # members'; their tables dropped it at the commence that named them, and a table that
            # changes again drops its reservations, pccl/peer/state.py reconcile_group): a master
            # round trip per collective would cost the training loop more than the heal's serving
            seq = ctx.next_op_seq()
            self.reserved.reserve(op.group, op.tag, seq, ctx.epoch, op.participants)
            complete = m.CollectiveComplete(tag=op.tag, op_seq=op.op_seq, next_op_seq=seq)
            return [Send(p, complete) for p in op.participants]  # one object: encoded once (SHARED)
        return []

    def abort(self, key: tuple[int, int], reason: str, code: Result, ctx: CollectiveContext) -> list[Effect]:
        """Fail the round of ``key`` for all: its participants when it runs, else its voters."""
        op = self.ops.pop(key)
        if op.running:
            ctx.op_settled(op.group, op.tag, op.op_seq, False)
        self.reserved.take(key)
        targets = [p for p in (op.participants if op.running else op.votes) if ctx.known(p)]
        return op.abort_to(targets, code, reason, [] if op.running else op.speculative_seqs())

    def peer_lost(self, key: tuple[int, int], peer_id: int, ctx: CollectiveContext,
                  resumed: bool) -> list[Effect]:
        """``peer_id`` left: a run it takes part in fails for all; its ballot is withdrawn and the vote
        re-checked (when ``resumed``: the master is not held)."""
        op = self.ops.get(key)
        if op is None:
            return []
        if op.running:
            if peer_id in op.participant_set:
                op.participants.remove(peer_id)
                op.participant_set.discard(peer_id)
                return self.abort(key, f"peer {peer_id} was lost during the operation",
                                  Result.RANK_CONNECTION_LOST, ctx)
            return []
        op.drop_voter(peer_id)  # its number stays among those to forget: the others may hold its frames
        if not op.votes:
            del self.ops[key]
            return []
        return self.check(key, ctx) if resumed else []

    # -- votes that fail without running

    def withdraw(self, key: tuple[int, int], peer_ids: Collection[int], reason: str, code: Result,
                 ) -> list[Effect]:
        """Fail the ballots of ``peer_ids`` in the open vote of ``key``; drop it when none is left."""
        op = self.ops.get(key)
        if op is None or op.running:
            return []
        effects: list[Effect] = []
        for p in sorted(set(peer_ids) & set(op.votes)):
            seq = op.drop_voter(p)
            if seq >= 0:
                self.reserved.take(key)  # frames may be out under it: it never runs again
            abort = m.CollectiveAbort(tag=op.tag, op_seq=seq, code=int(code), reason=reason,
                                      forget=op.speculative_seqs())
            effects.append(Send(p, abort))
        if not op.votes:
            del self.ops[key]
        return effects

    def fail_lost(self, key: tuple[int, int], owes: Callable[[int], bool]) -> list[Effect]:
        """The ballots of the voters that ``owes`` names fail as lost with the master, once each (a
        member reported the call abandoned at the master's loss)."""
        op = self.ops.get(key)
        if op is None or op.running:
            return []
        effects: list[Effect] = []
        for p in [p for p in op.votes if owes(p)]:
            seq = op.drop_voter(p)
            if seq >= 0:
                self.reserved.take(key)  # (as withdraw: it never runs again)
            effects.append(Send(p, lost_abort(op.tag, seq, op.speculative_seqs())))
        if not op.votes:
            del self.ops[key]
        return effects

    # -- the held-back tableless commence

    @property
    def go_waiting(self) -> bool:
        """True while a held-back tableless commence may still be due (:meth:`go_deadline`)."""
        return bool(self.go_due)

    def go_deadline(self) -> float | None:
        """When the earliest held-back tableless commence is due (None: none is held)."""
        return min((due for due, _ in self.go_due.values()), default=None)

    def go_overdue(self, now: float) -> list[Effect]:
        """The tableless commences held back until ``now`` for ops still running, to their speculating
        participants whose data plane has not reported yet. Ops that ended or were replaced meanwhile
        get nothing."""
        effects: list[Effect] = []
        for key, (due, seq) in list(self.go_due.items()):
            if due > now:
                continue
            del self.go_due[key]
            op = self.ops.get(key)
            if op is None or not op.running or not op.fast or op.op_seq != seq:
                self.go_held += 1  # it ended (aborted) meanwhile
                continue
            go = m.CollectiveCommence(tag=op.tag, op_seq=seq, peers=[])
            effects += [Send(p, go) for p in op.go_to if p in op.participant_set and p not in op.done]
            op.go_to = []
        return effects


__all__ = ["RESERVATIONS_PER_GROUP", "CollectiveContext", "CollectiveRound", "CollectiveVotes", "Reservation",
           "Reservations", "lost_abort"]
