"""The master's holds and what ends them: no quorum for too long, operations and rounds in doubt.

Pure (no trio, sockets or clocks: times are passed in). :class:`Holds` gives the run up when the master
was held without a quorum past ``MasterConfig.quorum_hold_timeout`` (docs/concepts.md "No split
brain"), and tells the waiting peers each decision about an operation (pccl/master/ops_in_doubt.py)
or a membership round (pccl/master/rounds_in_doubt.py) a master's loss left in doubt, by their
timeout, at the end of a rebuilt master's roll call, or when a member back reports (from
:class:`~pccl.master.rejoin.Rejoin`). Once nothing holds the votes any more, they are re-checked. It
works on the dispatcher through :class:`HoldsCore`.
"""

from __future__ import annotations

from typing import Protocol

from .._errors import Result
from ..wire import messages as m
from .effects import Effect, Event, Send
from .handout import CredentialHandout
from .membership import PeerRecord, Phase
from .ops_in_doubt import Decision, DoubtBook
from .quorum import Quorum
from .reported import ReportedRings
from .rounds_in_doubt import PendingDecision, RoundBook, TopologyDecision
from .votes import PendingRound


class RebuildState(Protocol):
    """What :class:`Holds` reads and moves of a rebuild in progress (pccl/master/rejoin.py ``Rebuild``)."""

    epoch: int
    expected: list[int]


class HoldsCore(Protocol):
    """What :class:`Holds` uses of the master's dispatcher (:class:`~pccl.master.state.MasterState`)."""

    peers: dict[int, PeerRecord]
    ring: list[int]
    base: list[int]
    quorum: Quorum
    generation: int
    epoch: int
    doubts: DoubtBook
    rounds: RoundBook
    credentials: CredentialHandout
    last_revision: dict[int, int]
    rebuild_grace: float
    _rings: ReportedRings
    _pending: PendingRound
    _now: float

    @property
    def rebuild(self) -> RebuildState | None: ...

    @rebuild.setter
    def rebuild(self, value: None) -> None: ...

    @property
    def resumed(self) -> bool: ...

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]: ...

    def _recheck_votes(self) -> list[Effect]: ...

    def _note_quorum(self) -> list[Effect]: ...

    def _quiet_period(self) -> float: ...


class Holds:
    """The holds of ``core`` and the decisions that end them (see the module docstring)."""

    def __init__(self, core: HoldsCore) -> None:
        self.core = core

    def on_standbys(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        """A peer can fail over to another master: in "auto" mode the live quorum rule applies now."""
        assert isinstance(msg, m.Standbys)
        core = self.core
        if msg.count <= 0 or core.quorum.failover:
            return []
        core.quorum.failover = True
        effects: list[Effect] = []
        if core.quorum.enforced:
            effects.append(Event(f"peer {rec.peer_id} can fail over to {msg.count} other master(s): votes "
                                 "now need a majority of the epoch's members"))
        return effects + core._note_quorum()

    def hold_deadline(self, timeout: float) -> float | None:
        """When the current hold (no quorum) runs out of time (None: not held)."""
        core = self.core
        return core.quorum.deadline(timeout)

    def hold_overdue(self, now: float, timeout: float) -> list[Effect]:
        """Give the run up when the master has been held (no quorum) for more than ``timeout``
        seconds (MasterConfig.quorum_hold_timeout).

        Every connection is closed with ``MASTER_CONNECTION_FAILED`` ("look for a newer master"):
        members fail over through their address lists. The master then holds no run, refuses
        re-registrations of this generation or older, and accepts newcomers as a fresh master does.

        Args:
            now: the current time (same clock as ``handle``).
            timeout: seconds a hold may last.

        Returns:
            The effects to execute (nothing before the deadline or when not held).
        """
        core = self.core
        core._now = now
        if not core.quorum.overdue(now, timeout):
            return []
        have = core.quorum.held_count(core.ring)
        reason = (f"no quorum: this master (generation {core.generation}) held only {have} of the epoch's "
                  f"{len(core.base)} member(s) for {timeout:g}s; look for a newer master")
        effects: list[Effect] = [Event(f"giving the run up: {reason}")]
        for pid in list(core.peers):
            effects += core.kick(pid, reason, Result.MASTER_CONNECTION_FAILED)
        core.rebuild = None
        core.quorum.give_up(core.generation)
        return effects

    def doubt_deadline(self, timeout: float) -> float | None:
        """When the oldest undecided operation in doubt runs out of time (see :meth:`doubts_overdue`)."""
        core = self.core
        ends = [d for d in (core.doubts.deadline(timeout), core.rounds.deadline(timeout)) if d is not None]
        return min(ends, default=None)

    def doubts_overdue(self, now: float, timeout: float) -> list[Effect]:
        """Abort, for every peer waiting on it, each operation in doubt left undecided for longer than
        ``timeout`` (a participant never came back after the master's loss), then resume the votes.

        Args:
            now: the current time (same clock as ``handle``).
            timeout: seconds a decision may wait for the participants' re-registrations (the server
                passes ``MasterConfig.heartbeat_timeout``: a peer silent that long is lost anyway).
        """
        core = self.core
        core._now = now
        was = core.doubts.undecided
        missing = core.doubts.missing
        effects = self.execute_decisions(core.doubts.overdue(now, timeout), was)
        # The roll call's grace ran out (or its quiet period): the members it waited for are absent, so a
        # topology or pending round still waiting for their reports is decided now (as at the timeout),
        # not ``timeout`` seconds after it opened: the decision cannot change any more (docs/concepts.md
        # "Rounds in doubt").
        if missing and not core.doubts.missing:
            why = (f"nobody came back for {core._quiet_period():g}s" if core.doubts.roll_call_end == "quiet"
                   else f"its grace of {core.rebuild_grace:g}s ran out")
            effects.insert(0, Event(f"roll call over ({why}): absent {sorted(missing)}"))
            return effects + self.execute_rounds(*core.rounds.give_up())
        return effects + self.execute_rounds(*core.rounds.overdue(now, timeout))

    def execute_decisions(self, decisions: list[Decision], was_undecided: bool) -> list[Effect]:
        """Tell the waiting peers each decision; resume the votes once none is left open (and the
        roll call is over)."""
        core = self.core
        effects: list[Effect] = []
        for d in decisions:
            kind, group, tag = d.key
            peers = [p for p in d.peers if p in core.peers]
            verdict = "committed" if d.commit else "aborted"
            if kind == "op":
                lost = int(Result.RANK_CONNECTION_LOST)
                msg: m.Message = (m.CollectiveComplete(tag=tag, op_seq=d.seq) if d.commit else
                                  m.CollectiveAbort(tag=tag, op_seq=d.seq, code=lost,
                                                    reason=f"in doubt after the master's loss: {d.reason}"))
                what = f"collective tag {tag} (group {group}, op {d.seq})"
            else:
                if d.commit and d.revision >= 0:
                    core.last_revision[group] = max(core.last_revision.get(group, -1), d.revision)
                msg = (m.SharedStateResult(sync_seq=d.seq, success=True, revision=d.revision) if d.commit else
                       m.SharedStateResult(sync_seq=d.seq, success=False, revision=d.revision,
                                           reason=f"in doubt after the master's loss: {d.reason}",
                                           code=int(Result.RANK_CONNECTION_LOST)))
                what = f"shared-state sync {d.seq} (group {group})"
            effects += [Send(p, msg) for p in peers]
            effects.append(Event(f"{what} in doubt: {verdict} for {peers} ({d.reason})"))
        if (decisions or was_undecided) and core.resumed:
            effects += core._recheck_votes()
        return effects

    def execute_rounds(self, topology: list[TopologyDecision],
                        pending: list[PendingDecision]) -> list[Effect]:
        """Tell the waiting peers each round's outcome (pccl/master/rounds_in_doubt.py); resume the votes
        once none is left open."""
        core = self.core
        effects: list[Effect] = []
        for d in topology:
            peers = [p for p in d.peers if p in core.peers]
            if d.commit:
                effects += self._adopt_round(d)
                msg: m.Message = m.TopologyResult(success=True, epoch=d.epoch, peers=[])
            else:
                if d.epoch > core.epoch:
                    # As after a failed round at the old master: every member moves to the round's epoch
                    # with its table (never reused by a later round here).
                    core.epoch = d.epoch
                    effects += self._reissue()
                code = (Result.UPDATE_TOPOLOGY_FAILED if d.kind == "update"
                        else Result.TOPOLOGY_OPTIMIZATION_FAILED)
                msg = m.TopologyResult(success=False, epoch=core.epoch, peers=[], code=int(code),
                                       reason=f"in doubt after the master's loss: {d.reason}")
            effects += [Send(p, msg) for p in peers]
            verdict = "committed" if d.commit else "aborted"
            effects.append(Event(f"{d.kind}_topology round of epoch {d.epoch} in doubt: {verdict} for "
                                 f"{peers} ({d.reason})"))
        for pd in pending:
            peers = [p for p in pd.peers if p in core.peers and core.peers[p].phase is Phase.ACCEPTED]
            if pd.answer is None:
                core._pending.add(peers, core._now)
            else:
                effects += [Send(p, m.PeersPendingResult(pending=pd.answer)) for p in peers]
            what = "runs here" if pd.answer is None else f"answered {pd.answer}"
            effects.append(Event(f"are_peers_pending round {pd.key} in doubt: {what} for {peers} "
                                 f"({pd.reason})"))
        if (topology or pending) and core.resumed:
            effects += core._recheck_votes()
        return effects

    def _adopt_round(self, d: TopologyDecision) -> list[Effect]:
        """A topology round in doubt committed: its epoch and ring become the run's (the members back so
        far get the epoch's P2P credentials of this master)."""
        core = self.core
        members = list(d.members)
        changed = d.epoch != core.epoch
        core.epoch = max(core.epoch, d.epoch)
        rb = core.rebuild
        if rb is not None and d.epoch >= rb.epoch:
            rb.epoch, rb.expected = d.epoch, list(members)
        core.base = list(members)
        order = {p: i for i, p in enumerate(members)}
        core.ring = sorted(core.ring, key=lambda p: (order.get(p, len(order)), p))
        ring = frozenset(members)
        for p in d.peers:
            if p in core._rings:
                core._rings.put(p, d.epoch, ring)
        return self._reissue() if changed else []

    def _reissue(self) -> list[Effect]:
        """The epoch changed outside a topology round: a new credential set of this (generation, epoch)
        for every accepted member (the members back later get it at their return)."""
        core = self.core
        return core.credentials.reissue(core.generation, core.epoch)
