"""The collective messages a member sends the master: its ballot (``CollectiveInitiate``) and its report
(``CollectiveDone``).

Pure (no trio, sockets or clocks). :class:`CollectiveMessages` checks the sender (accepted, under the
member's cap of open votes, ``MasterConfig.max_open_votes``), opens the vote of ``(group, tag)`` on its
first ballot, refuses a stale ``op_seq``, aborts an operation the master's loss left lost for this member
(once), hands the ballot to the :class:`~pccl.master.rounds.collective.CollectiveRound` and asks the
dispatcher to check the vote; a report goes to the round, and one breaking the rules kicks only its
sender. It works on the dispatcher through :class:`CollectiveMessagesCore`.
"""

from __future__ import annotations

from typing import Protocol

from .._errors import Result
from ..wire import messages as m
from .away import AwayBook
from .context import MasterContext
from .effects import Effect, Event, Send
from .lost import LostBook
from .membership import PeerRecord, Phase
from .rounds.base import Expel
from .rounds.collective import CollectiveRound, CollectiveVotes, lost_abort


class CollectiveMessagesCore(Protocol):
    """What :class:`CollectiveMessages` uses of the master's dispatcher
    (:class:`~pccl.master.state.MasterState`); the collective rounds reach the master through its
    :attr:`context` (:class:`~pccl.master.context.MasterContext`)."""

    context: MasterContext
    collectives: CollectiveVotes
    lost: LostBook
    away: AwayBook
    max_open_votes: int | None
    _ops: dict[tuple[int, int], CollectiveRound]
    _now: float

    @property
    def resumed(self) -> bool: ...

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]: ...


class CollectiveMessages:
    """The collective messages of ``core``'s members (see the module docstring).

    Every member's ballot and report passes here (the control plane's hottest path: two messages per
    member per collective): the parts are looked up once, and the common case (an accepted member, no
    vote cap or one not reached, a new ballot, nothing lost) asks nothing it does not need.
    """

    def __init__(self, core: CollectiveMessagesCore) -> None:
        self.core = core
        self._ctx = core.context
        self._votes = core.collectives
        self._ops = core.collectives.ops
        self._lost = core.lost

    def on_initiate(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        core = self.core
        assert isinstance(msg, m.CollectiveInitiate)
        if rec.phase is not Phase.ACCEPTED:
            return core.kick(rec.peer_id, "CollectiveInitiate from a peer that is not accepted")
        key = (rec.group, msg.tag)
        cap = core.max_open_votes
        if cap is not None:
            over = self.over_vote_cap(rec, key, msg)
            if over is not None:
                return over
        pid = rec.peer_id
        op = self._ops.get(key)
        if op is None:
            op, _ = self._votes.open(rec.group, msg.tag, core._now)
            core.away.opened(("op", rec.group, msg.tag))
        elif op.running or pid in op.votes or pid in op.participant_set:
            refusal = op.refusal(pid, msg.op_seq)
            if refusal is not None:
                return [Send(pid, refusal)]
        if self._lost.owes(pid, ("op", rec.group, msg.tag)):
            self._votes.discard_empty(key)
            return [Send(pid, lost_abort(msg.tag, msg.op_seq))]
        op.vote(pid, msg.descriptor, msg.op_seq)
        if cap is not None:
            rec.open_votes.add(key)
        return self._votes.check(key, self._ctx) if core.resumed else []

    def over_vote_cap(self, rec: PeerRecord, key: tuple[int, int],
                       msg: m.CollectiveInitiate) -> list[Effect] | None:
        """Refuse a new collective vote of a member that holds ``max_open_votes`` open already (issue 33
        item 3: votes on tags nobody else uses cost the master work at every message). O(cap)."""
        core = self.core
        cap = core.max_open_votes
        if cap is None or key in rec.open_votes or len(rec.open_votes) < cap:
            return None
        pid = rec.peer_id
        rec.open_votes = {k for k in rec.open_votes
                          if (op := core._ops.get(k)) is not None and not op.running and pid in op.votes}
        if key in rec.open_votes or len(rec.open_votes) < cap:
            return None
        reason = (f"peer {pid} holds {len(rec.open_votes)} collective votes open (tags the rest of its group "
                  f"has not called yet; MasterConfig.max_open_votes = {cap}): finish or cancel some first")
        return [Send(pid, m.CollectiveAbort(tag=msg.tag, op_seq=msg.op_seq, code=int(Result.INVALID_USAGE),
                                            reason=reason)), Event(f"peer {pid}: {reason}")]

    def on_done(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.CollectiveDone)
        got = self._votes.report(rec.peer_id, (rec.group, msg.tag), msg, self._ctx)
        return self.core.kick(rec.peer_id, got.reason) if isinstance(got, Expel) else got
