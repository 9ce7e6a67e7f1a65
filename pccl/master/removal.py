"""A peer leaves: lost (its link broke, it was evicted) or kicked, and the holds for members whose link broke.

Pure (no trio, sockets or clocks). :class:`Removal` takes a peer out of the master: its record, the
ring, the books of operations and rounds in doubt and lost, the link measurements; a member evicted or
kicked is announced to the others (``MemberRemoved``: its P2P credentials stop working at once), one
whose connection broke is held for ``rejoin_grace`` (pccl/master/away.py). What it leaves among the
votes is one call to the dispatcher (``_leave_votes``); then the quorum is re-counted, a lone
registered peer may be accepted, and the votes waiting on a decision in doubt are re-checked. It works
on the dispatcher through :class:`RemovalCore`.
"""

from __future__ import annotations

from typing import Protocol

from .._errors import Result
from ..wire import messages as m
from .admission import Admission
from .away import AwayBook
from .effects import Effect, Event, Kick, Send
from .lost import LostBook
from .membership import PeerRecord, Phase
from .ops_in_doubt import DoubtBook
from .penalties import RepeatOffenders, identities
from .quorum import Quorum
from .rounds_in_doubt import RoundBook
from .vote_records import VoteRecords


class RemovalCore(Protocol):
    """What :class:`Removal` uses of the master's dispatcher (:class:`~pccl.master.state.MasterState`)."""

    peers: dict[int, PeerRecord]
    ring: list[int]
    quorum: Quorum
    doubts: DoubtBook
    rounds: RoundBook
    lost: LostBook
    away: AwayBook
    offenders: RepeatOffenders
    admission: Admission
    records: VoteRecords
    bandwidth: dict[tuple[int, int], tuple[float, float]]
    latency: dict[tuple[int, int], float]
    rejoin_grace: float
    _now: float

    @property
    def resumed(self) -> bool: ...

    def _leave_votes(self, peer_id: int, group: int, was_accepted: bool) -> list[Effect]: ...

    def _note_quorum(self) -> list[Effect]: ...

    def _recheck_votes(self) -> list[Effect]: ...


class Removal:
    """Peers leaving ``core`` (see the module docstring)."""

    def __init__(self, core: RemovalCore) -> None:
        self.core = core

    def peer_lost(self, peer_id: int, reason: str, now: float | None = None, *,
                  broken: bool = False) -> list[Effect]:
        """The peer's connection broke, it was evicted, or it left. Unknown ids are ignored.

        Args:
            now: when (optional); it starts the hold clock if the loss costs the quorum.
            broken: the connection itself closed (not an eviction): an accepted member may be back
                in a moment (its link broke, the peer lives), so every vote waits up to
                ``rejoin_grace`` for its re-registration (pccl/master/away.py).
        """
        core = self.core
        rec = self._record(peer_id, now)
        if rec is None:
            return []
        effects: list[Effect] = [Event(f"peer {peer_id} ({rec.host}) {reason}")]
        if broken and rec.phase is Phase.ACCEPTED and core.away.left(peer_id, core._now, core.rejoin_grace):
            effects.append(Event(f"votes wait up to {core.rejoin_grace:g}s for peer {peer_id} to come back"))
        if not broken:
            effects += self._notices(rec, reason)
        effects += self.remove(peer_id)
        return effects

    def _record(self, peer_id: int, now: float | None) -> PeerRecord | None:
        """``peer_id``'s record (None: unknown), the core's clock set to ``now`` when given."""
        if now is not None:
            self.core._now = now
        return self.core.peers.get(peer_id)

    def rejoin_overdue(self, now: float) -> list[Effect]:
        """End the holds whose ``rejoin_grace`` ran out: those members are absent, and the votes go on
        without them (one that comes back later finds its group gone on: refused, join again)."""
        core = self.core
        core._now = now
        gone = core.away.overdue(now)
        if not gone:
            return []
        effects: list[Effect] = [Event(f"peer(s) {gone} did not re-register within {core.rejoin_grace:g}s: "
                                       "the votes go on without them")]
        if core.resumed:
            effects += core._recheck_votes()
            if not core.ring:
                effects += core.admission.accept_first_if_alone()
        return effects

    def evict_for_liveness(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE,
                           now: float | None = None) -> list[Effect]:
        """Kick ``peer_id`` for stalling the others, remembered against its source address and key: a
        rejoin is refused for a back-off, then held to a shorter grace (pccl/master/penalties.py)."""
        core = self.core
        rec = self._record(peer_id, now)
        if rec is None:
            return []
        strikes = core.offenders.strike(identities(rec.host, rec.public_key), core._now, reason[:120])
        return self.kick(peer_id, f"{reason} [strike {strikes}]", code)

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]:
        """Remove a peer on purpose."""
        core = self.core
        if peer_id not in core.peers:
            return []
        effects: list[Effect] = [Kick(peer_id, reason, int(code)), Event(f"peer {peer_id} kicked: {reason}")]
        # A member refused for good (KICKED) will not come back: its place is not held any more.
        unheld = code is Result.KICKED and core.away.back(peer_id)
        effects += self._notices(core.peers[peer_id], reason)
        effects += self.remove(peer_id)
        if unheld and core.resumed:
            effects += core._recheck_votes()
        return effects

    def _notices(self, rec: PeerRecord, reason: str) -> list[Effect]:
        """An evicted or kicked member's P2P credentials stop working at every other member at once
        (issue 33 item 5), not at the next epoch. Not for a broken connection: that member may
        re-register within ``rejoin_grace`` under its id and epoch."""
        core = self.core
        if rec.phase is not Phase.ACCEPTED:
            return []
        notice = m.MemberRemoved(peer_id=rec.peer_id, reason=reason[:200])
        return [Send(p, notice) for p in core.ring if p != rec.peer_id]

    def remove(self, peer_id: int) -> list[Effect]:
        core = self.core
        rec = core.peers.pop(peer_id)
        core.offenders.forget(peer_id)
        was_accepted = rec.phase is Phase.ACCEPTED
        undecided = core.doubts.undecided or core.rounds.undecided
        core.doubts.peer_lost(peer_id)
        core.rounds.peer_lost(peer_id)
        core.lost.peer_lost(peer_id)
        if was_accepted:
            core.doubts.dropped(peer_id, rec.group)
            core.away.dropped(peer_id, rec.group, core.records.rounds_of(rec.group))
        if peer_id in core.ring:
            core.ring = [p for p in core.ring if p != peer_id]
        core.bandwidth = {k: v for k, v in core.bandwidth.items() if peer_id not in k}
        core.latency = {k: v for k, v in core.latency.items() if peer_id not in k}
        effects = core._leave_votes(peer_id, rec.group, was_accepted)
        core.quorum.provisional.discard(peer_id)
        if was_accepted:
            effects += core._note_quorum()
        if was_accepted and not core.ring:
            effects += core.admission.accept_first_if_alone()
        if undecided and core.resumed:
            effects += core._recheck_votes()  # the last peer waiting on a decision left
        return effects
