"""The shared-state messages a member sends the master: its sync ballot (``SharedStateEntries`` frames,
then ``SharedStateSync``), its report (``SharedStateDone``) and its receiving progress
(``SharedStateProgress``).

Pure (no trio, sockets or clocks). :class:`SyncMessages` checks the sender (accepted, in phase for a new
ballot, within the ballot's bounds: pccl/wire/limits.py), gathers a ballot's rows over its frames, turns a
malformed one into a refused result, fails a sync the master's loss left lost for this member (once), hands
the ballot to the group's :class:`~pccl.master.rounds.sync.SyncRound` and asks the dispatcher to check
the vote; a report or progress goes to the round or, for a member healing live, to
:class:`~pccl.master.heals.HealBook`. A frame that breaks the rules kicks only its sender. It works on the
dispatcher through :class:`SyncMessagesCore`; the rows in progress (``_sync_rows``) stay there, dropped
with the peer.
"""

from __future__ import annotations

from typing import Any, Protocol

from .._errors import Result
from ..wire import limits as _limits
from ..wire import messages as m
from . import election as _election
from .away import AwayBook
from .context import MasterContext
from .effects import Effect, Send
from .heals import HealBook
from .lost import LostBook
from .membership import PeerRecord
from .rounds.base import Expel
from .rounds.sync import SyncVotes, lost_sync_result


class SyncMessagesCore(Protocol):
    """What :class:`SyncMessages` uses of the master's dispatcher (:class:`~pccl.master.state.MasterState`);
    the sync rounds reach the master through its :attr:`context`
    (:class:`~pccl.master.context.MasterContext`)."""

    context: MasterContext
    syncs: SyncVotes
    heals: HealBook
    lost: LostBook
    away: AwayBook
    _sync_rows: dict[int, tuple[list[list[Any]], int]]
    _now: float

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]: ...

    def _require_accepted(self, rec: PeerRecord, what: str) -> list[Effect] | None: ...



class SyncMessages:
    """The shared-state messages of ``core``'s members (see the module docstring)."""

    def __init__(self, core: SyncMessagesCore) -> None:
        self.core = core

    def in_phase(self, rec: PeerRecord, what: str) -> list[Effect] | None:
        """None when ``rec`` may send (the rows of) a new vote now; else the kick for a frame out of phase."""
        core = self.core
        bad = core._require_accepted(rec, what)
        if bad is not None:
            return bad
        rnd = core.syncs.get(rec.group)
        if rnd is not None and not rnd.takes_ballot_from(rec.peer_id) \
                and rec.peer_id not in core.heals.observers.joining:  # (a joiner's vote may wait: join)
            return core.kick(rec.peer_id, f"{what} while this peer's previous sync is still running")
        return None

    def add_rows(self, rec: PeerRecord, rows: list[list[Any]], what: str) -> list[Effect] | None:
        """Append one frame's rows to the peer's vote in progress; the kick when it goes over the bounds."""
        core = self.core
        held, frames = core._sync_rows.get(rec.peer_id, ([], 0))
        frames += 1
        total = len(held) + len(rows)
        if frames > _limits.SHARED_STATE_MAX_FRAMES or total > _limits.SHARED_STATE_MAX_ENTRIES:
            core._sync_rows.pop(rec.peer_id, None)
            most = _limits.SHARED_STATE_MAX_ENTRIES, _limits.SHARED_STATE_MAX_FRAMES
            return core.kick(
                rec.peer_id,
                f"{what}: shared-state vote over its bound (at least {total} entries in {frames} frames; "
                f"at most {most[0]} entries in {most[1]} frames)",
            )
        held.extend(rows)
        core._sync_rows[rec.peer_id] = (held, frames)
        return None

    def on_entries(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.SharedStateEntries)
        bad = self.in_phase(rec, "SharedStateEntries")
        if bad is None:
            bad = self.add_rows(rec, msg.entries, "SharedStateEntries")
        return bad or []

    def on_sync(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        core = self.core
        assert isinstance(msg, m.SharedStateSync)
        bad = self.in_phase(rec, "SharedStateSync")
        if bad is None:
            bad = self.add_rows(rec, msg.entries, "SharedStateSync")
        if bad is not None:
            return bad
        entries, _ = core._sync_rows.pop(rec.peer_id)
        vote = _election.vote_from_wire(revision=msg.revision, strategy=msg.strategy, entries=entries)
        if isinstance(vote, _election.Refusal):
            return [
                Send(
                    rec.peer_id,
                    m.SharedStateResult(
                        sync_seq=-1,
                        success=False,
                        revision=msg.revision,
                        reason=f"malformed shared state: {vote.reason}",
                        code=int(vote.code),
                    ),
                )
            ]
        if core.lost.owes(rec.peer_id, ("sync", rec.group, -1)):
            return [Send(rec.peer_id, lost_sync_result(msg.revision))]
        core.heals.observers.voted(rec.peer_id, msg.observe)
        if rec.peer_id in core.heals.observers.joining:
            return self.join(rec.peer_id, rec.group, vote)
        return self.count(rec.peer_id, rec.group, vote)

    def count(self, peer_id: int, group: int, vote: _election.SyncVote) -> list[Effect]:
        """Count ``vote`` in ``group``'s sync round and check the round."""
        core = self.core
        if core.syncs.vote(peer_id, group, vote, core._now):
            core.away.opened(("sync", group, -1))
        return core.context.check_sync(group)

    def join(self, peer_id: int, group: int, vote: _election.SyncVote) -> list[Effect]:
        """The vote of an observer that replayed the rounds it missed (pccl/master/observers.py): counted
        in the group's sync, kept while that sync runs, or answered at once."""
        core = self.core
        heals = core.heals
        rnd = core.syncs.get(group)
        answer = heals.observers.answer(peer_id, vote, running=rnd is not None and rnd.running,
                                        last_revision=core.context.revision_of(group),
                                        content=heals.contents.get(group))
        if answer.action == "wait":
            heals.observers.waiting[peer_id] = (group, vote)
            return []
        if answer.action == "vote":
            return self.count(peer_id, group, vote)
        heals.joined(peer_id)
        ok = answer.action == "current"
        return [Send(peer_id, m.SharedStateResult(sync_seq=-1, success=ok, revision=answer.revision,
                                                  reason=answer.reason, code=answer.code))]

    def join_waiting(self) -> list[Effect]:
        """The join votes kept while their group's sync ran, for the groups whose sync no longer runs."""
        core = self.core
        effects: list[Effect] = []
        for peer_id, (group, vote) in list(core.heals.observers.waiting.items()):
            rnd = core.syncs.get(group)
            if rnd is not None and rnd.running:
                continue
            del core.heals.observers.waiting[peer_id]
            effects += self.join(peer_id, group, vote)
        return effects

    def on_done(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        core = self.core
        assert isinstance(msg, m.SharedStateDone)
        if core.heals.is_healing(rec.peer_id):
            return core.heals.done(rec.peer_id, msg)
        got = core.syncs.report(rec.peer_id, rec.group, msg, core.context)
        return core.kick(rec.peer_id, got.reason) if isinstance(got, Expel) else got

    def on_progress(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        """A receiver's progress (for the status page; :meth:`SyncVotes.progress`): one breaking the rules
        kicks the sender."""
        core = self.core
        assert isinstance(msg, m.SharedStateProgress)
        if core.heals.is_healing(rec.peer_id):  # a live heal's fetcher (pccl/master/heals.py)
            why = core.heals.report(rec.peer_id, msg, core._now)
            return [] if why is None else core.kick(rec.peer_id, why)
        bad = core.syncs.progress(rec.peer_id, rec.group, msg, core._now)
        return [] if bad is None else core.kick(rec.peer_id, bad.reason)
