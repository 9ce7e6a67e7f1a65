"""The master's pure state machine: membership, votes, collectives, shared state, topology.

No trio, no sockets, no clocks: the trio server feeds it events and executes the returned
effects. ``handle(peer_id, message, now)`` and ``peer_lost(peer_id, reason)`` are the only ways
in; both return a list of effects (:class:`Send`, :class:`Kick`, :class:`Event`).

Each open vote is an object of pccl/master/rounds/ (and :class:`~pccl.master.votes.PendingRound`): this
class keeps the data and routes each message to the part that handles it (:attr:`MasterState._HANDLERS`);
the walks over the open rounds are :class:`~pccl.master.open_rounds.OpenRounds`, and the rounds see the
master through :class:`~pccl.master.context.MasterContext` (docs/master.md "Vote rounds", "The map").

Vote rules (docs/protocol.md sections 2-6):

* A vote completes when every *accepted* peer it concerns has voted. Registered (not yet
  accepted) peers never block a vote. When a peer is lost (broken connection, eviction by
  heartbeat, kick) it is removed from every pending vote and every vote is re-checked, so the
  survivors proceed.
* An illegal message (wrong phase, duplicate vote, message from an unregistered peer) gets only
  the sender kicked, with a reason; nothing else changes.
* A collective or shared-state round that has started fails for every participant when any
  participant fails or is lost: all-or-nothing, so survivors retry together.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from types import MethodType
from typing import Any, cast

from .._errors import Result
from ..wire import messages as m
from ..wire.credentials import CredentialIssuer
from .admission import Admission, OpenVote
from .away import AwayBook
from .collective_messages import CollectiveMessages
from .context import MasterContext
from .describe import VoteWait

# The effects: re-exported here, where the state's callers have always taken them.
from .effects import Effect as Effect
from .effects import Event as Event
from .effects import FastStart as FastStart
from .effects import Kick as Kick
from .effects import Send as Send
from .handout import CredentialHandout
from .heals import HealBook
from .holds import Holds
from .issued import IssuedSet
from .lost import LostBook
from .membership import Membership
from .membership import PeerRecord as PeerRecord
from .membership import Phase as Phase
from .open_rounds import OpenRounds
from .ops_in_doubt import DoubtBook
from .peers_pending import PeersPending
from .penalties import RepeatOffenders
from .quorum import Quorum
from .rejoin import Rebuild, Rejoin
from .removal import Removal
from .reported import ReportedRings
from .ring_setup import RingSetup
from .round_waits import RoundWaits
from .rounds.base import Round
from .rounds.base import VoteKey as VoteKey
from .rounds.collective import RESERVATIONS_PER_GROUP as RESERVATIONS_PER_GROUP
from .rounds.collective import CollectiveVotes
from .rounds.sync import SyncVotes
from .rounds.topology import (
    TopologyRound,
)
from .rounds_in_doubt import RoundBook
from .summary import statistics as _statistics
from .sync_messages import SyncMessages
from .tokens import MemberTokens
from .vote_records import VoteRecords
from .vote_timeouts import VoteTimeouts
from .votes import PendingRound

#: op_seq and sync_seq values of master generation g start at ``g << _SEQ_SHIFT``: a restarted master
#: never hands out a sequence number a peer saw from an older generation (stale stashed frames); data
#: frames carry op_seq as a u32, so this leaves 2**24 operations per generation, 255 generations.
_SEQ_SHIFT = 24


def _frozen_clock() -> float:
    """The default solver clock: never advances (see MasterState's ``clock``)."""
    return 0.0




#: A message handler bound to one state: ``handler(sender's record, message) -> effects``.
Handler = Callable[[PeerRecord, m.Message], list[Effect]]


class _Part:
    """An entry of :attr:`MasterState._HANDLERS` that names a method of one of the dispatcher's parts (by
    attribute names), bound to that part when a state is built."""

    __slots__ = ("method", "part")

    def __init__(self, part: str, method: str) -> None:
        self.part, self.method = part, method

    def __call__(self, state: MasterState, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        return self.bound(state)(rec, msg)

    def bound(self, state: MasterState) -> Handler:
        """The part's method of ``state``."""
        return cast(Handler, getattr(getattr(state, self.part), self.method))


class MasterState:
    """Pure master state machine.

    Args:
        bandwidth_probe_seconds: duration of each link's bandwidth probe during optimize_topology.
        bandwidth_stale_after: measurements older than this (seconds of ``now``) are re-measured.
        solver: ``solve(bw_matrix) -> ring order (indices)``; defaults to the ATSP solver.
        clock: the time source the default solver's budget is measured with (the server passes
            ``time.perf_counter``). Without one the budget never binds: the solve stops at its own
            step and stall limits, deterministically.
        rebuild_grace: a rebuilt master's roll call (pccl/master/ops_in_doubt.py): votes wait up to this
            many seconds after the rebuild started for the last epoch's members not back yet, even
            once a majority returned (the server passes ``MasterConfig.rebuild_grace``; 0: none).
        rebuild_quiet: the roll call also ends once a majority is back and no member came back for
            this many seconds (``MasterConfig.rebuild_quiet``; None: only the grace ends it).
        failover_quiet: the least quiet period in a run whose peers can fail over (:attr:`enforced`):
            members that give a hung master up do so at their own heartbeat silence, up to one
            heartbeat interval of that master apart (the server passes its ``heartbeat_interval`` plus
            the reconnect backoff cap).
        credential_root: the random key every P2P credential of this master is derived from
            (:mod:`pccl.wire.credentials`); default: 32 fresh random bytes. Tests pass a fixed one.
        tokens: the member tokens a re-registering member proves itself with (pccl/master/tokens.py;
            the server derives them from ``MasterConfig.secret``); default: a random key of its own.
        quorum: ``"auto"``, ``"on"`` or ``"off"``: when the live quorum rule applies
            (MasterConfig.quorum; docs/concepts.md "No split brain").
        go_delay: seconds the tableless ``CollectiveCommence`` of a speculative start is held back
            (MasterConfig.speculative_go_delay; 0, the default here: sent with the vote's last
            ballot). An op that completes or aborts sooner never gets it (its Complete or Abort says
            more); the others get it from :meth:`go_overdue`.
    """

    def __init__(
        self,
        *,
        bandwidth_probe_seconds: float = 0.05,
        bandwidth_stale_after: float = 3600.0,
        solver: Callable[[list[list[float | None]]], list[int]] | None = None,
        clock: Callable[[], float] | None = None,
        rebuild_grace: float = 0.0,
        rebuild_quiet: float | None = None,
        failover_quiet: float = 0.0,
        credential_root: bytes | None = None,
        quorum: str = "auto",
        rejoin_grace: float = 0.0,
        go_delay: float = 0.0,
        credentials_delay: float = 0.0,
        tokens: MemberTokens | None = None,
        max_open_votes: int | None = None,
        live_heal_rounds: int = 0,
    ) -> None:
        self.members = Membership()  # the peer table and the ring (pccl/master/membership.py)
        self.peers = self.members.peers
        self.epoch = 0
        self._topology: TopologyRound | None = None  # pccl/master/rounds/topology.py
        self._pending = PendingRound()  # the are_peers_pending vote (pccl/master/votes.py)
        # The collective votes and runs, the speculative start's reservations and held-back commences
        # (pccl/master/rounds/collective.py); ``_ops`` is its rounds by (group, tag).
        self.collectives = CollectiveVotes(go_delay)
        self._ops = self.collectives.ops
        self._op_seq = 0
        # The shared-state syncs by group (pccl/master/rounds/sync.py); ``_syncs`` is its rounds.
        self.syncs = SyncVotes()
        self.heals = HealBook(live_heal_rounds)  # live heals (issue 35 item 4, pccl/master/heals.py)
        self._syncs = self.syncs.rounds
        # Per peer: the rows of its next SharedStateSync received so far in SharedStateEntries frames
        # (the rows, then how many frames brought them); dropped with the peer or consumed by its vote.
        self._sync_rows: dict[int, tuple[list[list[Any]], int]] = {}
        self._sync_seq = 0
        self.last_revision: dict[int, int] = {}
        self.bandwidth: dict[tuple[int, int], tuple[float, float]] = {}  # (a, b) -> (bytes/s, when)
        # (a, b) -> one-way seconds, measured with the bandwidth of the same pair (reachable pairs only)
        self.latency: dict[tuple[int, int], float] = {}
        self.bandwidth_probe_seconds = bandwidth_probe_seconds
        self.bandwidth_stale_after = bandwidth_stale_after
        self._solver = solver
        self._clock: Callable[[], float] = clock if clock is not None else _frozen_clock
        self.solver_time_budget = 0.2
        self.exact_limit = 12
        # Background ring improvement (large worlds): a job for the server to run off the event loop,
        # and its result, adopted at the next topology change if the membership still matches.
        self._improvement_job: tuple[list[int], list[list[float | None]]] | None = None
        self.improved_ring: list[int] | None = None
        self._now = 0.0
        # Surviving the master (docs/concepts.md): the generation (fencing number), a rebuild from
        # re-registrations, and what a master's loss or a broken link leaves open (every vote waits while
        # any is): operations in doubt (ops_in_doubt.py) and lost (lost.py), members away for at most
        # ``rejoin_grace`` (away.py), membership rounds in doubt (rounds_in_doubt.py), the rings members
        # reported at their return (reported.py); the rebuilt master's roll call waits ``rebuild_grace``.
        self.generation = 1
        self.rebuild: Rebuild | None = None
        self.doubts, self.lost, self.away, self.rounds = DoubtBook(), LostBook(), AwayBook(), RoundBook()
        self._rings = ReportedRings()
        self.rejoin_grace, self.rebuild_grace = rejoin_grace, rebuild_grace
        self.rebuild_quiet, self.failover_quiet = rebuild_quiet, failover_quiet
        self._topology_owed: set[int] = set()  # members whose next topology vote fails once (see above)
        # P2P bound to membership (docs/security.md): the set issued last, its rows owed batched over
        # ``credentials_delay`` (issued.py), and who gets which message (handout.py).
        self._issued = IssuedSet(CredentialIssuer(credential_root or secrets.token_bytes(32)),
                                 delay=credentials_delay)
        self.credentials = CredentialHandout(self._issued, self.members)
        # Re-registration only with proof of membership (docs/security.md "Re-registration").
        self.tokens = tokens if tokens is not None else MemberTokens.for_secret(None)
        self.max_open_votes = max_open_votes  # collective votes one member may hold open (None: no cap)
        self.quorum = Quorum(quorum)  # no split brain: the live quorum rule and its hold (quorum.py)
        self.offenders = RepeatOffenders()  # peers evicted for liveness, by address and key (penalties.py)
        self._attach_parts()

    def _attach_parts(self) -> None:
        """The dispatcher's parts, each working on this core through its Protocol (docs/master.md)."""
        self.context = MasterContext(self)  # what the vote rounds ask of the master (context.py)
        self.rejoin = Rejoin(self)  # re-registration and the rebuild
        self.removal = Removal(self)  # peers leaving
        self.admission = Admission(self)  # registration and the newcomers' grace
        self.holds = Holds(self)  # the holds and the decisions in doubt that end them
        self.ring_setup = RingSetup(self)  # the topology round: vote, measurements, solve, P2P setup
        self.sync_messages = SyncMessages(self)  # the shared-state ballots, reports and progress
        self.collective_messages = CollectiveMessages(self)  # the collective ballots and reports
        self.vote_timeouts = VoteTimeouts(self)  # the vote timeout, and votes failed for a deadlock
        self.peers_pending = PeersPending(self)  # the are_peers_pending round and its count
        self.records = VoteRecords(self)  # what the parts read of the open rounds
        self.open_rounds = OpenRounds(self)  # the walks over every open round
        self.round_waits = RoundWaits(self)  # who holds up whom
        self._handlers: dict[type[m.Message], Handler] = {
            kind: h.bound(self) if isinstance(h, _Part) else cast(Handler, MethodType(h, self))
            for kind, h in self._HANDLERS.items()}

    # ---------------------------------------------------------------------------------------
    # queries

    @property
    def ring(self) -> list[int]:
        """Accepted peers in ring order (:attr:`Membership.ring`). Change it by assigning a new list,
        never in place: the per-group counts that keep every vote O(1) per message are recounted on
        assignment."""
        return self.members._ring  # (the attribute itself: read on every vote, a property less)

    @ring.setter
    def ring(self, value: list[int]) -> None:
        self.members.ring = value

    def accepted(self, group: int | None = None) -> list[int]:
        """Accepted peers in ring order (optionally of one group)."""
        return self.members.accepted(group)

    def registered(self) -> list[int]:
        """Peers waiting to be accepted, in arrival order."""
        return self.members.registered()

    def table(self, ids: list[int]) -> list[m.PeerRow]:
        """Peer-table rows for ``ids`` (in that order)."""
        return self.members.table(ids)

    def statistics(self) -> dict[str, Any]:
        """A summary of the master state (tests assert on it; :func:`pccl.master.summary.statistics`)."""
        return _statistics(self)

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<MasterState accepted={s['accepted']} registered={s['registered']} "
            f"epoch={s['epoch']} running_ops={s['collectives_running']}>"
        )

    # ---------------------------------------------------------------------------------------
    # connection lifecycle

    def new_connection(self, host: str, now: float, claim: int = -1) -> int:
        """A connection finished its hello; returns the peer id assigned to it.

        Args:
            host: the peer's address as the master sees it.
            now: the time.
            claim: the id the hello claimed (a member re-registering after losing its master), or -1.
                Granted when no connected peer holds it; otherwise a fresh id is assigned (and the
                ``Reregister`` that follows is refused).
        """
        return self.members.new_connection(host, now, claim)

    @property
    def enforced(self) -> bool:
        """Whether the live quorum rule applies: ``quorum="on"``, or ``"auto"`` once a peer said it can
        fail over to another master (:class:`~pccl.wire.messages.Standbys`)."""
        return self.quorum.enforced

    @property
    def quorate(self) -> bool:
        """Whether the accepted peers this master holds are more than half of the epoch's members."""
        return self.quorum.quorate(self.ring)

    @property
    def base(self) -> list[int]:
        """The current epoch's members (ring order), whom the quorum rule counts. Assign a new list."""
        return self.quorum.base

    @base.setter
    def base(self, value: list[int]) -> None:
        self.quorum.base = value

    @property
    def resumed(self) -> bool:
        """False while the master is *held* (no vote completes): rebuilding without a majority of the
        last epoch's members, or, when the live rule applies (:attr:`enforced`), holding fewer than
        a majority of its epoch's members (docs/concepts.md "No split brain"); or while an operation
        in doubt is undecided or a rebuilt master's roll call runs (pccl/master/ops_in_doubt.py); or while a
        member whose connection broke may still re-register (pccl/master/away.py). Asked at every ballot:
        :attr:`_quorum_ok` is written out here."""
        quorum = self.quorum
        return (self.rebuild is None and (not quorum.enforced or quorum.quorate(self.members._ring))
                and not self.doubts.undecided and not self.rounds.undecided and not self.away)

    @property
    def _quorum_ok(self) -> bool:
        """The quorum part of :attr:`resumed` (what the hold clock of :meth:`_note_quorum` follows)."""
        return self.rebuild is None and (not self.quorum.enforced or self.quorum.quorate(self.members.ring))

    def _note_quorum(self) -> list[Effect]:
        """Start or end the hold after a membership change: a master that became held starts its
        hold clock; one that is no longer held re-checks every pending vote."""
        change = self.quorum.note(not self._quorum_ok, self._now)
        if change == "held" and self.rebuild is None:
            have = self.quorum.held_count(self.ring)
            return [Event(f"no quorum: {have} of the epoch's {len(self.base)} member(s) held; "
                          "votes wait for members to come back")]
        return self._recheck_votes() if change == "resumed" else []

    def hold_deadline(self, timeout: float) -> float | None:
        """When the current hold (no quorum) runs out of time (None: not held)."""
        return self.holds.hold_deadline(timeout)

    def hold_overdue(self, now: float, timeout: float) -> list[Effect]:
        """Give the run up when the master has been held (no quorum) for more than ``timeout`` seconds
        (:meth:`Holds.hold_overdue`)."""
        return self.holds.hold_overdue(now, timeout)

    def doubt_deadline(self, timeout: float) -> float | None:
        """When the oldest undecided operation in doubt runs out of time (see :meth:`doubts_overdue`)."""
        return self.holds.doubt_deadline(timeout)

    def doubts_overdue(self, now: float, timeout: float) -> list[Effect]:
        """Abort each operation in doubt left undecided for longer than ``timeout``, then resume the votes
        (:meth:`Holds.doubts_overdue`)."""
        return self.holds.doubts_overdue(now, timeout)

    def expired(self, now: float, timeout: float) -> list[int]:
        """Peers silent for longer than ``timeout``."""
        return self.members.expired(now, timeout)

    def _open_rounds(self, ordered: bool = True, with_ops: bool = True) -> list[Round]:
        """Every open vote round (:meth:`OpenRounds.rounds`)."""
        return self.open_rounds.rounds(ordered, with_ops)

    # Who holds up whom (pccl/master/round_waits.py): what the stall logs, the deadlock watch and the
    # status page read.

    def waited_on(self) -> set[int]:
        """Peers that others are waiting for right now (:meth:`RoundWaits.waited_on`)."""
        return self.round_waits.waited_on()

    def pending_rounds(self) -> list[tuple[str, list[int], str]]:
        """Every vote or round in progress as ``(what, peers it waits for, detail)`` (for status pages)."""
        return self.round_waits.pending_rounds()

    def vote_waits(self) -> dict[int, list[VoteWait]]:
        """For every peer: the calls it has voted for whose votes have not completed."""
        return self.round_waits.vote_waits()

    def voting_peers(self) -> set[int]:
        """The peers that :meth:`vote_waits` lists, without building the waits."""
        return self.round_waits.voting_peers()

    def deadlock_candidates(self) -> list[int]:
        """The groups where every member *could* be voting (:meth:`RoundWaits.deadlock_candidates`)."""
        return self.round_waits.deadlock_candidates()

    def busy_peers(self) -> set[int]:
        """Peers taking part in a running collective, sync or topology round (not just voting)."""
        return self.round_waits.busy_peers()

    def pending_summary(self) -> list[str]:
        """One line per vote or round in progress: what it is and whom it waits for (for stall logs)."""
        return self.round_waits.pending_summary()

    def stragglers(self, now: float, minimum: float, cap: float) -> list[tuple[int, float]]:
        """Waited-on peers silent past their straggler limit, and how long (RoundWaits.stragglers)."""
        return self.round_waits.stragglers(now, minimum, cap)

    def straggler_deadline(self, minimum: float, cap: float) -> float | None:
        """When the earliest waited-on peer would become a straggler if it stays silent."""
        return self.round_waits.straggler_deadline(minimum, cap)

    def _open_votes(self, with_ops: bool = True) -> list[tuple[str, float, set[int], list[int], VoteKey]]:
        """The open votes others joined that miss accepted peers (:meth:`OpenRounds.open_votes`)."""
        return self.open_rounds.open_votes(with_ops)

    # The vote timeout and the failing of open votes (pccl/master/vote_timeouts.py).

    def vote_deadline(self, timeout: float) -> float | None:
        """When the earliest open vote (one others joined) runs out of time for its missing voters."""
        return self.vote_timeouts.deadline(timeout)

    def vote_overdue(self, now: float, timeout: float) -> list[Effect]:
        """Act on every vote open for more than ``timeout`` seconds that still misses accepted peers of
        its group (MasterConfig.vote_timeout; :meth:`VoteTimeouts.overdue` says who is blamed)."""
        return self.vote_timeouts.overdue(now, timeout)

    def fail_votes(self, peer_ids: set[int], reason: str,
                   code: Result = Result.INVALID_USAGE) -> list[Effect]:
        """Fail the calls of ``peer_ids`` in every open vote (a deadlock; :meth:`VoteTimeouts.fail_votes`)."""
        return self.vote_timeouts.fail_votes(peer_ids, reason, code)

    def admission_deadline(self, grace: float) -> float | None:
        """When the first unproven newcomer runs out of ``grace`` (see :meth:`admission_overdue`)."""
        return self.admission.deadline(grace)

    def admission_overdue(self, now: float, grace: float) -> list[Effect]:
        """Evict every newcomer that others have waited on in a vote for ``grace`` seconds without it
        ever taking part (:meth:`Admission.overdue`)."""
        self._now = now
        return self.admission.overdue(now, grace)

    def evict_for_liveness(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE,
                           now: float | None = None) -> list[Effect]:
        """Kick ``peer_id`` for stalling the others, with a strike (:meth:`Removal.evict_for_liveness`)."""
        return self.removal.evict_for_liveness(peer_id, reason, code, now)

    def _leave_votes(self, peer_id: int, group: int, was_accepted: bool) -> list[Effect]:
        return self.open_rounds.leave(peer_id, group, was_accepted)

    def peer_lost(self, peer_id: int, reason: str, now: float | None = None, *,
                  broken: bool = False) -> list[Effect]:
        """The peer's connection broke (``broken``), it was evicted, or it left (:meth:`Removal.peer_lost`).
        Unknown ids are ignored."""
        return self.removal.peer_lost(peer_id, reason, now, broken=broken)

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]:
        """Remove a peer on purpose (:meth:`Removal.kick`)."""
        return self.removal.kick(peer_id, reason, code)

    def rejoin_deadline(self) -> float | None:
        """When the earliest hold for a member whose connection broke runs out (see
        :meth:`rejoin_overdue`)."""
        return self.away.deadline()

    def rejoin_overdue(self, now: float) -> list[Effect]:
        """End the holds whose ``rejoin_grace`` ran out (:meth:`Removal.rejoin_overdue`)."""
        return self.removal.rejoin_overdue(now)

    # ---------------------------------------------------------------------------------------
    # dispatch

    def handle(self, peer_id: int, msg: m.Message, now: float) -> list[Effect]:
        """Process one message from ``peer_id``. Illegal messages kick the sender only."""
        self._now = now
        rec = self.peers.get(peer_id)
        if rec is None:
            return []
        rec.gaps.append(max(0.0, now - rec.last_seen))
        rec.last_seen = now
        handler = self._handlers.get(type(msg))
        if handler is None:
            return self.kick(peer_id, f"message {type(msg).__name__} is not allowed from a peer")
        if rec.phase is Phase.CONNECTED and not isinstance(msg, (m.Register, m.Reregister, m.Heartbeat)):
            return self.kick(peer_id, f"{type(msg).__name__} before Register")
        if rec.admitted is not None and self._takes_part(rec, msg):
            rec.admitted = None  # a newcomer proven: it reports on a round it ran with the others
        effects = handler(rec, msg)
        if self._issued.owed and self.resumed:  # (:meth:`_rows_due` written out: after every message)
            effects[:0] = self.credentials.pay()  # first: before anything this message lets the members do
        if self.heals.held:
            effects += self.heals.flush(self.context.heal_busy)
        if self.heals.observers.waiting:
            effects += self.sync_messages.join_waiting()
        return effects

    def _takes_part(self, rec: PeerRecord, msg: m.Message) -> bool:
        """``msg`` reports on a running collective or shared-state sync ``rec`` takes part in."""
        if isinstance(msg, m.CollectiveDone):
            op = self._ops.get((rec.group, msg.tag))
            return op is not None and op.running and rec.peer_id in op.participant_set
        if isinstance(msg, m.SharedStateDone):
            rnd = self._syncs.get(rec.group)
            return rnd is not None and rnd.running and rec.peer_id in rnd.participants
        return False

    def _on_heartbeat(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        return []

    # ---------------------------------------------------------------------------------------
    # what the parts reach through the dispatcher

    def _advance_generation(self, generation: int) -> None:
        """Become master ``generation`` unless this one is newer: op_seq and sync_seq move into its
        range, so no sequence number a peer saw from an older generation comes back (_SEQ_SHIFT)."""
        self.generation = max(self.generation, generation)
        self._op_seq = max(self._op_seq, min(self.generation, 255) << _SEQ_SHIFT)
        self._sync_seq = max(self._sync_seq, min(self.generation, 255) << _SEQ_SHIFT)
        self.doubts.own_from(self._op_seq, self._sync_seq)

    def _quiet_period(self) -> float:
        """The roll call's quiet period (``rebuild_quiet``; at least ``failover_quiet`` when the run's
        peers can fail over)."""
        quiet = self.rebuild_quiet or 0.0
        return max(quiet, self.failover_quiet) if self.quorum.enforced else quiet

    def _open_votes_by_age(self) -> list[OpenVote]:
        return self.records.open_votes_by_age()

    def _rows_due(self) -> list[Effect]:
        """The owed credential rows, if the master is not held (:meth:`CredentialHandout.due`). Paid
        after every message (:meth:`handle`) and when the votes resume on a timer
        (:meth:`_recheck_votes`). Nothing owed (the common case) is decided before :attr:`resumed`
        is asked: this runs after every message."""
        return self.credentials.due(self.resumed) if self._issued.owed else []

    def credentials_deadline(self) -> float | None:
        """When the rows of members taken back must go to the members holding the set (None: none is
        owed); :meth:`credentials_overdue` then sends them (``credentials_delay``)."""
        return self.credentials.deadline()

    def credentials_overdue(self, now: float) -> list[Effect]:
        """The rows owed the holders of the set issued last, once their delay ran out by ``now``."""
        self._now = now
        return self.credentials.overdue(now)

    def _recheck_votes(self) -> list[Effect]:
        """Re-check every pending vote, owed credential rows first (:meth:`OpenRounds.recheck`)."""
        return self.open_rounds.recheck()

    def _require_accepted(self, rec: PeerRecord, what: str) -> list[Effect] | None:
        if rec.phase is not Phase.ACCEPTED:
            return self.kick(rec.peer_id, f"{what} from a peer that is not accepted")
        return None

    # The topology round (pccl/master/ring_setup.py): the calls of the server and timers.

    def setup_deadline(self, timeout: float) -> float | None:
        """When the P2P setup of the topology round in progress runs out of time (None: no setup)."""
        return self.ring_setup.setup_deadline(timeout)

    def setup_overdue(self, now: float, timeout: float) -> list[Effect]:
        """Drop the members late for the P2P setup and re-run it (:meth:`RingSetup.setup_overdue`)."""
        return self.ring_setup.setup_overdue(now, timeout)

    def link_summary(self, members: list[int]) -> list[float]:
        """What the schedule choice knows of the links of ``members`` (:meth:`RingSetup.link_summary`)."""
        return self.ring_setup.link_summary(members)

    def take_improvement_job(self) -> tuple[list[int], list[list[float | None]]] | None:
        """A ``(ring ids, bandwidth matrix in that order)`` to improve off the event loop, once."""
        return self.ring_setup.take_improvement_job()

    def offer_ring(self, ring: list[int]) -> list[Effect]:
        """A background improvement finished: adopt it at the next topology change if still valid."""
        return self.ring_setup.offer_ring(ring)

    # ---------------------------------------------------------------------------------------
    # collectives and shared state (the messages: collective_messages.py, sync_messages.py)

    @property
    def go_waiting(self) -> bool:
        """True while a held-back tableless commence may still be due (:meth:`go_deadline`)."""
        return self.collectives.go_waiting

    def go_deadline(self) -> float | None:
        """When the earliest held-back tableless commence is due (None: none is held)."""
        return self.collectives.go_deadline()

    def go_overdue(self, now: float) -> list[Effect]:
        """The tableless commences held back until ``now`` (``go_delay``) for ops still running: to
        their speculating participants whose data plane has not reported yet (it starts their stall
        clocks). Ops that ended or were replaced meanwhile get nothing.

        Returns:
            The effects to execute.
        """
        self._now = now
        return self.collectives.go_overdue(now)

    def transfer_progress(self, now: float) -> list[dict[str, Any]]:
        """Each running sync's receivers, for the status page: ``{"group", "sync_seq", "receivers"}``
        with :meth:`SyncProgress.rows` as the receivers, by group."""
        return self.syncs.transfer_progress(now) + self.heals.transfer_progress(now)

    #: The handler of each message a peer may send: the dispatcher's own (a function of the state, the
    #: sender's record and the message), or a method of one of its parts (:class:`_Part`), bound when the
    #: state is built so that a message reaches its part in one call.
    _HANDLERS: dict[type[m.Message], Callable[[MasterState, PeerRecord, m.Message], list[Effect]]] = {
        m.Heartbeat: _on_heartbeat,
        m.Register: _Part("admission", "on_register"),
        m.Reregister: _Part("rejoin", "on_reregister"),
        m.Standbys: _Part("holds", "on_standbys"),
        m.PeersPendingVote: _Part("peers_pending", "on_vote"),
        m.UpdateTopologyVote: _Part("ring_setup", "on_update_vote"),
        m.OptimizeTopologyVote: _Part("ring_setup", "on_optimize_vote"),
        m.P2PConnectionsDone: _Part("ring_setup", "on_p2p_done"),
        m.BandwidthReport: _Part("ring_setup", "on_bandwidth_report"),
        m.CollectiveInitiate: _Part("collective_messages", "on_initiate"),
        m.CollectiveDone: _Part("collective_messages", "on_done"),
        m.SharedStateSync: _Part("sync_messages", "on_sync"),
        m.SharedStateEntries: _Part("sync_messages", "on_entries"),
        m.SharedStateDone: _Part("sync_messages", "on_done"),
        m.SharedStateProgress: _Part("sync_messages", "on_progress"),
    }
