"""The shared-state sync: one :class:`SyncRound` per group (its vote, then its run), and
:class:`SyncVotes`, the groups' open sync rounds (docs/protocol.md section 5).

A sync's vote completes when every accepted peer of the group voted (:func:`~pccl.master.votes.
unanimous`); the election (pccl/master/election.py) then refuses the voters it must (each gets its
failed result) and plans the fetches of the others (``SharedStatePlan``). The run completes when every
participant reported success; it fails for all when one fails or a participant is lost, except a donor
that fetches nothing while others fetch (its fetchers ask the other holders: issue 35).

Pure: no clock, no I/O. The master is reached through :class:`SyncContext` only; the caller checks that
the master is not held (``MasterState.resumed``) before asking a round to complete.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..._errors import Result
from ...wire import messages as m
from .. import election as _election
from ..describe import VoteWait
from ..effects import Effect, Event, Send
from ..lost import REASON as LOST_REASON
from ..transfers import SwarmCounts, SyncProgress
from ..votes import unanimous
from .base import Expel, RoundContext, VoteKey


class SyncContext(RoundContext, Protocol):
    """What a sync round asks of the master (``MasterState`` is one)."""

    def revision_of(self, group: int) -> int | None:
        """The revision ``group``'s last sync committed (None: none)."""
        ...

    def next_sync_seq(self) -> int:
        """A fresh sync_seq (never handed out before by this master's generation)."""
        ...

    def sync_settled(self, group: int, seq: int, committed: bool, revision: int) -> None:
        """A running sync ended (the run's revision, the books of operations in doubt and lost learn it)."""
        ...

    # live heals (issue 35 item 4, pccl/master/heals.py)

    def may_go_live(self, rows_of: dict[int, list[list[Any]]], group: int = 0,
                    content: dict[str, int] | None = None) -> bool:
        """Whether a sync of ``group`` whose participants fetch ``rows_of`` runs as a live heal (``content``:
        the elected ``{key: hash}``)."""
        ...

    def go_live(self, group: int, seq: int, revision: int, rows_of: dict[int, list[list[Any]]],
                table: list[m.PeerRow], note: str, progress: SyncProgress | None) -> list[Effect]:
        """Run the (closed) sync ``seq`` as a live heal: the plans and the holders' results."""
        ...

    def synced(self, peers: Collection[int]) -> None:
        """``peers`` ended an ordinary sync successfully."""
        ...


def lost_sync_result(revision: int) -> m.SharedStateResult:
    """The failed result of a sync call lost with the master (docs/concepts.md "A member's link breaks")."""
    return m.SharedStateResult(sync_seq=-1, success=False, revision=revision, reason=LOST_REASON,
                               code=int(Result.RANK_CONNECTION_LOST))


@dataclass
class SyncRound:
    """The vote, then the run, of ``group``'s shared-state sync."""

    group: int
    opened: float = 0.0  # ``now`` of the first vote (the vote deadline's start)
    votes: dict[int, _election.SyncVote] = field(default_factory=dict)
    running: bool = False
    seq: int = -1
    revision: int = 0
    participants: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    note: str = ""  # for the participants' result: which co-voters were refused and why (issue 37)
    fetchers: set[int] = field(default_factory=set)  # participants with something to fetch (issue 35)
    progress: SyncProgress | None = None  # the receivers' reports while it runs (issue 37 item 5)

    # -- the round interface (pccl/master/rounds/base.py)

    @property
    def key(self) -> VoteKey:
        return ("sync", self.group)

    @property
    def voting(self) -> bool:
        return not self.running

    @property
    def ballots(self) -> Collection[int]:
        return self.votes.keys()

    @property
    def vote_name(self) -> str:
        return f"shared-state sync vote (group {self.group})"

    def waits(self, members: set[int]) -> tuple[str, set[int], str] | None:
        if self.running:
            return f"shared-state sync (group {self.group})", self.participants - self.done, ""
        if self.votes:
            return self.vote_name, members - set(self.votes), f"; voted {sorted(self.votes)}"
        return None

    def busy(self, ring: list[int]) -> set[int]:
        return set(self.participants) if self.running else set()

    def vote_waits(self) -> list[tuple[int, VoteWait]]:
        return [] if self.running else [(p, VoteWait("sync")) for p in self.votes]

    def takes_ballot_from(self, peer_id: int) -> bool:
        """Whether ``peer_id`` may vote now (it has not, and the round does not run)."""
        return peer_id not in self.votes and not self.running

    def results(self, peers: list[int], success: bool, reason: str, code: Result = Result.SUCCESS,
                ) -> list[Effect]:
        """The run's SharedStateResult to each of ``peers``."""
        return [Send(p, m.SharedStateResult(sync_seq=self.seq, success=success, revision=self.revision,
                                            reason=reason, code=int(code))) for p in peers]


class SyncVotes:
    """The open sync rounds by group."""

    def __init__(self) -> None:
        self.rounds: dict[int, SyncRound] = {}

    def __iter__(self) -> Iterator[SyncRound]:
        return iter(self.rounds.values())

    def get(self, group: int) -> SyncRound | None:
        return self.rounds.get(group)

    def vote(self, peer_id: int, group: int, vote: _election.SyncVote, now: float) -> bool:
        """Count ``peer_id``'s ballot in ``group``'s round (opened at ``now`` if there is none); True:
        the round was opened now."""
        rnd = self.rounds.get(group)
        opened = rnd is None
        if rnd is None:
            rnd = self.rounds[group] = SyncRound(group=group, opened=now)
        rnd.votes[peer_id] = vote
        return opened

    # -- the vote completes

    def check(self, group: int, ctx: SyncContext) -> list[Effect]:
        """Complete ``group``'s vote when every accepted peer of it voted: the election's refusals, then
        the plans of the participants (none left: the round ends)."""
        rnd = self.rounds.get(group)
        if rnd is None or rnd.running:
            return []
        out = ctx.left_out(group, "sync")  # healing peers: not waited on
        members = unanimous(rnd.votes, ctx.group_size(group) - len(out),
                            lambda: [p for p in ctx.accepted(group) if p not in out])
        if members is None:
            return []
        votes = {p: rnd.votes[p] for p in members if p in rnd.votes}
        result = _election.elect(votes, last_revision=ctx.revision_of(group))
        effects: list[Effect] = []
        rnd.seq = ctx.next_sync_seq()
        rnd.revision = result.revision
        for p, refusal in sorted(result.refused.items()):
            effects.append(Send(p, m.SharedStateResult(sync_seq=rnd.seq, success=False,
                                                       revision=votes[p].revision, reason=refusal.reason,
                                                       code=int(refusal.code))))
            effects.append(Event(f"peer {p} refused by shared-state sync: {refusal.reason}"))
        rnd.participants = set(result.plans)
        if not rnd.participants:
            del self.rounds[group]
            return effects
        rnd.progress = SyncProgress({p: sum(i.nbytes for i in plan) for p, plan in result.plans.items()},
                                    ctx.now)
        rnd.note = "; ".join(f"peer {p} was refused: {r.reason}" for p, r in sorted(result.refused.items()))
        rnd.running = True
        # the group's table: the participants, and the observers (in its collectives, in no sync vote: a
        # streaming DiLoCo's fragment exchanges are sized by it)
        listed = members
        if out:  # (someone heals: the membership walked once more)
            out_ops = ctx.left_out(group, "op")
            listed = [p for p in ctx.accepted(group) if p in members or (p in out and p not in out_ops)]
        table = ctx.table(listed)
        rows_of = {p: _election.fetch_rows(result.plans[p]) for p in members if p in result.plans}
        elected = votes[result.elected_holders[0]].entries if result.elected_holders else ()
        if ctx.may_go_live(rows_of, group, {e.key: e.hash for e in elected}):  # the holders return now
            del self.rounds[group]
            return effects + ctx.go_live(group, rnd.seq, rnd.revision, rows_of, table, rnd.note, rnd.progress)
        for p in members:
            plan = result.plans.get(p)
            if plan is None:
                continue
            rows = _election.fetch_rows(plan)
            if rows:
                rnd.fetchers.add(p)
            effects.append(
                Send(p, m.SharedStatePlan(sync_seq=rnd.seq, revision=rnd.revision, fetch=rows, peers=table))
            )
        return effects

    # -- the run

    def report(self, peer_id: int, group: int, msg: m.SharedStateDone,
               ctx: SyncContext) -> list[Effect] | Expel:
        """``peer_id``'s SharedStateDone: its part done (the run may complete) or failed (it fails)."""
        rnd = self.rounds.get(group)
        if rnd is None or not rnd.running or msg.sync_seq != rnd.seq or peer_id not in rnd.participants:
            return []
        if peer_id in rnd.done:
            return Expel("duplicate SharedStateDone")
        if not msg.success:
            return self.fail(group, f"peer {peer_id}: {msg.reason}", Result.SHARED_STATE_SYNC_FAILED, ctx)
        rnd.done.add(peer_id)
        if rnd.progress is not None:
            rnd.progress.finished(peer_id, ctx.now)
        return self.check_done(group, ctx)

    def progress(self, peer_id: int, group: int, msg: m.SharedStateProgress, now: float) -> Expel | None:
        """A receiver's progress (for the status page): recorded only for a participant of the running
        sync, within its plan (:class:`SyncProgress`); one breaking the rules is an Expel. A report for
        another sync than the running one is dropped (it ended, or it was a former master's)."""
        rnd = self.rounds.get(group)
        if rnd is None or not rnd.running or msg.sync_seq != rnd.seq or rnd.progress is None:
            return None
        if peer_id not in rnd.participants:
            return Expel(f"SharedStateProgress for sync {msg.sync_seq}, which it takes no part in")
        if peer_id in rnd.done:
            return Expel("SharedStateProgress after its SharedStateDone")
        bad = rnd.progress.report(peer_id, msg.rx_bytes, msg.total_bytes, now, SwarmCounts.of(msg))
        return None if bad is None else Expel(bad)

    def transfer_progress(self, now: float) -> list[dict[str, Any]]:
        """Each running sync's receivers, for the status page, by group."""
        return [{"group": g, "sync_seq": rnd.seq, "receivers": rnd.progress.rows(now)}
                for g, rnd in sorted(self.rounds.items()) if rnd.running and rnd.progress is not None]

    def check_done(self, group: int, ctx: SyncContext) -> list[Effect]:
        """Complete ``group``'s run when every participant reported success."""
        rnd = self.rounds.get(group)
        if rnd is None or not rnd.running or len(rnd.done) < len(rnd.participants):
            return []
        if not rnd.participants <= rnd.done:
            return []
        del self.rounds[group]
        ctx.sync_settled(group, rnd.seq, True, rnd.revision)
        ctx.synced(rnd.participants)
        return rnd.results(sorted(rnd.participants), True, rnd.note)

    def fail(self, group: int, reason: str, code: Result, ctx: SyncContext) -> list[Effect]:
        """Fail ``group``'s run for its participants still connected."""
        rnd = self.rounds.pop(group)
        ctx.sync_settled(group, rnd.seq, False, rnd.revision)
        return rnd.results([p for p in sorted(rnd.participants) if ctx.known(p)], False, reason, code)

    def peer_lost(self, group: int, peer_id: int, ctx: SyncContext, resumed: bool) -> list[Effect]:
        """``peer_id`` left: a run it takes part in fails (a donor's fetchers go on without it); its
        ballot is withdrawn and the vote re-checked (when ``resumed``: the master is not held)."""
        rnd = self.rounds.get(group)
        if rnd is None:
            return []
        if rnd.running:
            if peer_id in rnd.participants and peer_id not in rnd.fetchers and rnd.fetchers:
                # A donor only (issue 35): its fetchers ask the other holders for what it had not sent,
                # and fail the sync themselves when none is left.
                rnd.participants.discard(peer_id)
                rnd.done.discard(peer_id)
                return [Event(f"donor peer {peer_id} was lost during shared-state sync {rnd.seq}; "
                              "its fetchers go on with the other holders"), *self.check_done(group, ctx)]
            if peer_id in rnd.participants:
                rnd.participants.discard(peer_id)
                why = f"peer {peer_id} was lost during the sync"
                return self.fail(group, why, Result.RANK_CONNECTION_LOST, ctx)
            return []
        rnd.votes.pop(peer_id, None)
        if not rnd.votes:
            del self.rounds[group]
            return []
        return self.check(group, ctx) if resumed else []

    # -- votes that fail without running

    def withdraw(self, group: int, peer_ids: Collection[int], reason: str, code: Result) -> list[Effect]:
        """Fail the ballots of ``peer_ids`` in ``group``'s open vote; drop it when none is left."""
        rnd = self.rounds.get(group)
        if rnd is None or rnd.running:
            return []
        effects: list[Effect] = []
        for p in sorted(set(peer_ids) & set(rnd.votes)):
            vote = rnd.votes.pop(p)
            effects.append(Send(p, m.SharedStateResult(sync_seq=-1, success=False, revision=vote.revision,
                                                       reason=reason, code=int(code))))
        if not rnd.votes:
            del self.rounds[group]
        return effects

    def fail_lost(self, group: int, owes: Callable[[int], bool]) -> list[Effect]:
        """The ballots of the voters ``owes`` names fail as lost with the master, once each."""
        rnd = self.rounds.get(group)
        if rnd is None or rnd.running:
            return []
        effects: list[Effect] = [Send(p, lost_sync_result(rnd.votes.pop(p).revision))
                                 for p in [p for p in rnd.votes if owes(p)]]
        if not rnd.votes:
            del self.rounds[group]
        return effects


__all__ = ["SyncContext", "SyncRound", "SyncVotes", "lost_sync_result"]
