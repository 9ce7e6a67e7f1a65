"""Admission: a peer registers, the first one is accepted alone, a newcomer that holds the others up is
evicted (docs/protocol.md "Membership", issue 33 item 6).

Pure (no trio, sockets or clocks: times are passed in). :class:`Admission` checks a ``Register`` and
answers it, accepts the earliest registered peer at once while nobody is accepted (world size 1), and
evicts a newcomer that others have waited on in a vote for ``admission_grace`` seconds without it ever
taking part in a collective or a sync since its admission. Which newcomer holds up which vote is
:func:`newcomer_waits`, a function of the open votes (:class:`OpenVote`, listed by the dispatcher) and
the unproven newcomers alone. It works on the dispatcher through :class:`AdmissionCore`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from .._errors import Result
from ..wire import messages as m
from ..wire.credentials import check_public_key
from .effects import Effect, Event, Send
from .membership import Membership, PeerRecord, Phase
from .penalties import RepeatOffenders
from .quorum import Quorum
from .tokens import MemberTokens


@dataclass(frozen=True, slots=True)
class OpenVote:
    """A vote others joined that has not completed: its kind (``"are_peers_pending"``,
    ``"update_topology"``, ``"optimize_topology"``, ``"sync"`` or ``"collective"``), when its first ballot
    came, the group it concerns (None: ring-wide), the collective's tag, and who voted."""

    kind: str
    opened: float
    group: int | None
    voters: Collection[int]
    tag: int = -1

    @property
    def what(self) -> str:
        """The vote as an eviction's reason names it."""
        if self.kind == "sync":
            return f"shared-state sync vote (group {self.group})"
        if self.kind == "collective":
            return f"collective tag {self.tag} (group {self.group}) vote"
        return f"{self.kind} vote"


def newcomer_waits(newcomers: dict[int, tuple[int, float]],
                   votes: Sequence[OpenVote]) -> list[tuple[int, float, str, list[int]]]:
    """For every unproven newcomer (``newcomers``: peer -> its group and when it was admitted) that an open
    vote of its group, or a ring-wide one, misses: ``(peer, since when it holds them up, which vote, its
    voters)``, by peer; the oldest such vote (the first listed of equally old ones).

    The votes are walked oldest first (timsort: about linear, they are kept in about that order), and
    each newcomer stops at the first one it misses.
    """
    if not newcomers or not votes:
        return []
    by_age = sorted(votes, key=lambda v: v.opened)
    out: list[tuple[int, float, str, list[int]]] = []
    for p, (group, admitted) in sorted(newcomers.items()):
        for v in by_age:
            if (v.group is None or v.group == group) and p not in v.voters:
                out.append((p, max(v.opened, admitted), v.what, sorted(v.voters)))
                break
    return out


class AdmissionCore(Protocol):
    """What :class:`Admission` uses of the master's dispatcher (:class:`~pccl.master.state.MasterState`)."""

    peers: dict[int, PeerRecord]
    members: Membership
    ring: list[int]
    quorum: Quorum
    generation: int
    epoch: int
    tokens: MemberTokens
    offenders: RepeatOffenders
    _now: float

    @property
    def resumed(self) -> bool: ...

    @property
    def _topology(self) -> object: ...

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]: ...

    def evict_for_liveness(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE,
                           now: float | None = None) -> list[Effect]: ...

    def _open_votes_by_age(self) -> list[OpenVote]: ...


class Admission:
    """Registration, the lone first peer, and the newcomers' grace, on ``core``."""

    def __init__(self, core: AdmissionCore) -> None:
        self.core = core

    def on_register(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        """``Register``: checked (once, a valid port and key, the run's kind of address), answered with
        ``Registered`` and the peer's member token; accepted at once when nobody is."""
        assert isinstance(msg, m.Register)
        core = self.core
        if rec.phase is not Phase.CONNECTED:
            return core.kick(rec.peer_id, "duplicate Register")
        if not 0 < msg.p2p_port < 65536:
            return core.kick(rec.peer_id, f"invalid p2p port {msg.p2p_port}")
        bad_key = check_public_key(msg.public_key)
        if bad_key is not None:
            return core.kick(rec.peer_id, f"invalid Register: {bad_key}")
        mismatch = core.members.address_mismatch(rec.host)
        if mismatch is not None:
            return core.kick(rec.peer_id, mismatch)
        refused = core.offenders.refusal_of(rec.peer_id, rec.host, msg.public_key, core._now)
        if refused is not None:  # evicted for liveness lately (pccl/master/penalties.py)
            return core.kick(rec.peer_id, refused, Result.KICKED)
        rec.phase = Phase.REGISTERED
        rec.p2p_port = msg.p2p_port
        rec.group = msg.peer_group
        rec.public_key = msg.public_key
        effects: list[Effect] = [
            Send(rec.peer_id, m.Registered(peer_id=rec.peer_id, generation=core.generation,
                                           token=core.tokens.issue(core.generation, rec.peer_id))),
            Event(f"peer {rec.peer_id} joined from {rec.host}:{msg.p2p_port} (group {msg.peer_group})"),
        ]
        if not core.ring and core._topology is None:
            effects += self.accept_first_if_alone()
        return effects

    def accept_first_if_alone(self) -> list[Effect]:
        """With no accepted peer, the earliest registered one is accepted at once (world size 1);
        never while rebuilding (the run's members are coming back)."""
        core = self.core
        if core.ring or core._topology is not None or not core.resumed or core.quorum.yielding:
            return []
        waiting = core.members.registered()
        if not waiting:
            return []
        pid = waiting[0]
        core.peers[pid].phase = Phase.ACCEPTED
        core.ring = [pid]
        core.quorum.alone(pid)
        core.epoch += 1
        # No P2P credentials: alone, it connects to nobody and nobody connects to it; the next topology
        # round issues them.
        return [
            Send(pid, m.Accepted(peers=core.members.table(core.ring), epoch=core.epoch)),
            Event(f"peer {pid} accepted (world size 1)"),
        ]

    def waits(self) -> list[tuple[int, float, str, list[int]]]:
        """:func:`newcomer_waits` of the accepted newcomers not yet proven (:attr:`PeerRecord.admitted`);
        nothing while the master is held, and no vote listed without such a newcomer."""
        core = self.core
        if not core.resumed:
            return []
        newcomers: dict[int, tuple[int, float]] = {}
        for p in core.ring:
            rec = core.peers[p]
            if rec.admitted is not None:
                newcomers[p] = (rec.group, rec.admitted)
        if not newcomers:
            return []
        return newcomer_waits(newcomers, core._open_votes_by_age())

    def deadline(self, grace: float) -> float | None:
        """When the first unproven newcomer runs out of ``grace`` (see :meth:`overdue`)."""
        grace_of = self.core.offenders.grace  # shorter for a repeat offender
        return min((since + grace_of(p, grace) for p, since, _, _ in self.waits()), default=None)

    def overdue(self, now: float, grace: float) -> list[Effect]:
        """Evict every newcomer that others have waited on in a vote for ``grace`` seconds
        (MasterConfig.admission_grace) without it ever having taken part in a collective or a
        shared-state sync since its admission (issue 33 item 6).

        An admitted peer that never votes (one that only answered ``P2PConnectionsDone``, or calls
        nothing after ``connect``) used to hold every vote of its group until ``vote_timeout``. The
        grace counts from the later of its admission and the vote's first ballot: a newcomer is
        evicted at most ``grace`` seconds after it first holds the others up. A member taken back
        after a master's loss, or proven once, is under ``vote_timeout`` alone.
        """
        core = self.core
        effects: list[Effect] = []
        for p, since, what, voters in self.waits():
            own = core.offenders.grace(p, grace)  # shorter for a repeat offender
            if now >= since + own and p in core.peers:
                rec = core.peers[p]
                effects += core.evict_for_liveness(p, (
                    f"evicted: admitted {now - (rec.admitted or now):.1f}s ago and has taken part in no "
                    f"collective or shared-state sync since; {voters} waited {now - since:.1f}s on it in "
                    f"the {what} (admission_grace {own:g}s)"), now=now)
        return effects
