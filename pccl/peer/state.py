"""The peer's pure core: the protocol rules of one peer, without trio, sockets or clocks.

:class:`PeerState` is fed the master's messages one at a time, with the time they arrived, and returns
effects (:class:`Resolve`, :class:`AbortOp`, :class:`Establish`, :class:`Measure`, :class:`Lost`,
:class:`Dismissed`);
:class:`pccl.peer.communicator.Communicator` executes them, the way :mod:`pccl.master.server` executes
:class:`pccl.master.state.MasterState`'s. The data plane never passes through here: frames are routed by
the P2P pool. See docs/protocol.md for the messages.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .._errors import (
    InvalidArgumentError,
    InvalidUsageError,
    KickedError,
    MasterConnectionError,
    NoSharedStateAvailableError,
    PCCLError,
    PendingAsyncOpsError,
    RankConnectionLostError,
    Result,
    SharedStateSyncError,
    TooFewPeersError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)
from ..wire import messages as m
from .op_rules import CollectiveRules

_ERRORS_BY_RESULT: dict[Result, type[PCCLError]] = {
    Result.RANK_CONNECTION_LOST: RankConnectionLostError,
    Result.TOO_FEW_PEERS: TooFewPeersError,
    Result.INVALID_USAGE: InvalidUsageError,
    Result.INVALID_ARGUMENT: InvalidArgumentError,
    Result.UPDATE_TOPOLOGY_FAILED: UpdateTopologyFailedError,
    Result.TOPOLOGY_OPTIMIZATION_FAILED: TopologyOptimizationFailedError,
    Result.SHARED_STATE_SYNC_FAILED: SharedStateSyncError,
    Result.NO_SHARED_STATE_AVAILABLE: NoSharedStateAvailableError,
}


def error_from_code(code: int, reason: str) -> PCCLError:
    """Build the PCCLError subclass matching a result code sent by the master.

    Args:
        code: the wire result code (an unknown one becomes INTERNAL_ERROR).
        reason: the master's explanation.

    Returns:
        The error to raise in the waiting call.
    """
    try:
        result = Result(code)
    except ValueError:
        return PCCLError(reason, Result.INTERNAL_ERROR)
    return _ERRORS_BY_RESULT.get(result, PCCLError)(reason, result)


# ============================================================================================
# effects: what the communicator must do after a message


class Call(enum.Enum):
    """A kind of call waiting for the master."""

    ACCEPTED = "accepted"  # open_communicator, until Accepted
    TOPOLOGY = "topology"  # update_topology / optimize_topology, until TopologyResult
    PENDING = "pending"  # are_peers_pending (oldest waiting query first), until PeersPendingResult
    COMMENCE = "commence"  # a collective's vote, until CollectiveCommence
    COMPLETE = "complete"  # a collective's confirmation, until CollectiveComplete
    SYNC = "sync"  # sync_shared_state: its plan and its result, in order


@dataclass(frozen=True)
class Resolve:
    """Hand ``message`` to the call waiting on ``call`` (for COMMENCE/COMPLETE: the op ``tag``)."""

    call: Call
    message: m.Message
    tag: int = -1


@dataclass(frozen=True)
class AbortOp:
    """The master aborted collective ``tag``: fail its call with ``error`` and stop its data plane."""

    tag: int
    error: PCCLError


@dataclass(frozen=True)
class Establish:
    """Open the ring connections to ``successor`` (None: alone in the group) and, when the peer
    runs other schedules too, to the other ranks its plans may send to (``group``: the group's rows
    in ring order), then answer ``P2PConnectionsDone(epoch)``."""

    epoch: int
    successor: m.PeerRow | None
    group: tuple[m.PeerRow, ...] = ()
    links: tuple[float, ...] = ()  # EstablishP2P.links


@dataclass(frozen=True)
class InstallCredentials:
    """Use the master's P2P credentials ``message`` from now on (docs/security.md)."""

    message: m.P2PCredentials


@dataclass(frozen=True)
class RemoveMember:
    """The master removed member ``peer_id``: revoke its P2P credential and close its connections."""

    peer_id: int
    reason: str


@dataclass(frozen=True)
class ReleasePin:
    """The master ended live heal ``sync_seq``: drop the snapshot pinned for it (docs/concepts.md)."""

    sync_seq: int


@dataclass(frozen=True)
class Measure:
    """Probe the links of ``request`` and answer ``BandwidthReport``."""

    request: m.MeasureBandwidth


@dataclass(frozen=True)
class Forget:
    """Drop every frame of these speculative op_seqs (other voters started under them; nobody will
    run them now): ``P2PPool.forget_op`` each."""

    op_seqs: tuple[int, ...]


@dataclass(frozen=True)
class Lost:
    """The master link is over (kicked, or the master broke the protocol): fail everything, close it."""

    error: PCCLError


@dataclass(frozen=True)
class Dismissed:
    """The master closed the link with ``MASTER_CONNECTION_FAILED`` (it gave the run up for lack of a
    quorum: docs/concepts.md "No split brain"): the link is down as if it broke, so a member with a
    reconnect window fails over through its address list; otherwise the master is lost."""

    error: PCCLError


Effect = (Resolve | AbortOp | Establish | Measure | Forget | Lost | Dismissed | InstallCredentials
          | RemoveMember | ReleasePin)

#: Reserved op_seqs a peer keeps (per tag, the oldest go first): the master keeps as many per group,
#: in the same order (pccl.master.state.RESERVATIONS_PER_GROUP).
RESERVATIONS_KEPT = 1024


# ============================================================================================
# the state machine


@dataclass
class OpRecord:
    """A collective in flight on this peer, registered under its tag."""

    tag: int
    op_seq: int = -1  # the master's sequence number, once commenced (or the reserved one, speculating)
    aborted: bool = False
    # This peer's part is finished (CollectiveDone sent or being sent): from here on the op is in doubt
    # if the master is lost before it answers (docs/concepts.md "Operations in doubt").
    done: bool = False
    participants: list[int] = field(default_factory=list)  # the commenced ring's peer ids
    speculative: bool = False  # running under the reserved op_seq before the master answered


@dataclass
class SyncRecord:
    """A shared-state sync in flight on this peer."""

    sync_seq: int = -1  # from the plan
    plans: int = 0
    results: int = 0
    revision: int = -1  # the plan's revision
    members: list[int] = field(default_factory=list)  # peer ids of the plan's table
    done: bool = False  # SharedStateDone(success) sent or being sent: in doubt if the master is lost
    # A live heal's fetch (SharedStatePlan(live=True) with rows to fetch): a round of this peer alone, the
    # holders having committed it at once; lost with the master it fails here and nowhere else.
    live_fetch: bool = False


_TOPOLOGY_CALLS = ("update_topology", "optimize_topology")

#: Operations whose receive buffer is larger than this start speculatively only on far links (the
#: caller's ``far`` in :meth:`PeerState.speculate`; docs/protocol.md section 4): on loopback or a LAN the
#: saved master round trip is sub-millisecond, and there a speculative 16 MB all-reduce at 4 peers measured
#: 1.1-1.2x slower than the slow path (issue 34).
SPECULATIVE_NEAR_MAX_BYTES = 4 << 20

#: How many tags' last committed op a peer remembers for a re-registration (the tags in use at once;
#: older ones cannot be in doubt anywhere).
COMMITTED_TAGS_KEPT = 64


class PeerState(CollectiveRules):
    """One peer's protocol rules, fed message by message (see docs/protocol.md).

    Owns the peer table and its epoch, the collectives in flight and their op_seq matching, the rule
    that one membership call (update_topology, optimize_topology, sync_shared_state) runs at a time,
    the shared-state round bookkeeping and the master's liveness. :meth:`handle` returns effects the
    communicator executes; the ``begin_*``/``end_*`` methods are the calls' admission rules.

    Args:
        peer_id: this peer's id (from HelloOk).
        group: this peer's group.
    """

    def __init__(self, peer_id: int = -1, group: int = 0) -> None:
        self.peer_id = peer_id
        self.group = group
        self.table: list[m.PeerRow] = []  # accepted peers, ring order
        self.epoch = 0
        # The epoch's members (peer ids, ring order) as the master established them (Accepted, a
        # successful TopologyResult); unlike ``table`` never reconciled with collectives: the set the
        # masters' quorum rule counts, reported in Reregister (docs/concepts.md "No split brain").
        self.members: list[int] = []
        self.members_epoch = -1  # the epoch ``members`` came from
        self.ops: dict[int, OpRecord] = {}
        self.membership: str | None = None  # the membership call running, by name
        self.sync: SyncRecord | None = None
        self.lost: PCCLError | None = None
        # The last successful sync's word on group members it refused ("" when none): why a partner
        # that then left is gone (said again by waits for peers, e.g. TrainingRun's min_world_size).
        self.refused_note = ""
        self.last_heard = 0.0
        self.syncs_total = 0
        self.topology_calls_total = 0
        # Surviving the master (docs/concepts.md): the master generation this peer follows (it never
        # follows an older one), its group's last shared-state revision (-1: none), and until when it
        # keeps trying to reconnect after losing the master (None: the link is up, or lost for good).
        self.generation = 0
        # The member token the master gave this peer (Registered / Reregistered): its proof of
        # membership when it re-registers (pccl/master/tokens.py).
        self.member_token = b""
        self.revision = -1
        self.reconnecting_until: float | None = None
        # Operations in doubt (docs/concepts.md "Operations in doubt"): the last committed op_seq per
        # recently used tag and the last applied sync_seq, and what the master's loss failed here.
        self.committed_ops: OrderedDict[int, int] = OrderedDict()
        self.sync_committed = -1
        self.abandoned_ops: list[list[int]] = []
        self.sync_abandoned = -1
        # The speculative start (docs/protocol.md section 4): tag -> (op_seq the master reserved for
        # this group's next op with the tag, the epoch it was reserved in), oldest first.
        self.reserved: dict[int, tuple[int, int]] = {}
        self.speculative_starts = 0
        # Membership rounds in doubt (docs/concepts.md "Rounds in doubt"): the last EstablishP2P of the
        # running topology call (epoch, table) and the epoch whose setup it confirmed; the epoch of a
        # topology call the master's loss failed here (-1: none); the are_peers_pending answers got at
        # this epoch, the last one (-1: none) and the votes waiting for one.
        self.setup: tuple[int, list[m.PeerRow]] | None = None
        self.setup_confirmed = -1
        self.topology_abandoned = -1
        self.pending_answers = 0
        self.pending_last = -1
        self.pending_waiting = 0

    # ---------------------------------------------------------------------------------------
    # queries

    def group_rows(self, rows: list[m.PeerRow] | None = None) -> list[m.PeerRow]:
        """This peer's group in ``rows`` (default: the table), ring order."""
        return [r for r in (self.table if rows is None else rows) if r.group == self.group]

    @property
    def group_ring(self) -> list[int]:
        """Peer ids of this peer's group in ring order."""
        return [r.peer_id for r in self.table if r.group == self.group]

    @property
    def rank(self) -> int:
        """This peer's position in its group's ring (-1 if not in it)."""
        ring = self.group_ring
        return ring.index(self.peer_id) if self.peer_id in ring else -1

    def group_sizes(self) -> Counter[int]:
        """Accepted peers per group."""
        return Counter(r.group for r in self.table)

    def silence(self, now: float) -> float:
        """Seconds since the master was last heard from."""
        return now - self.last_heard

    def statistics(self) -> dict[str, Any]:
        """What this peer's protocol state is (tests and operators read it)."""
        return {
            "peer_id": self.peer_id,
            "world_size": len(self.table),
            "group_world_size": self.group_sizes().get(self.group, 0),
            "epoch": self.epoch,
            "ops_in_flight": len(self.ops),
            "op_tags": sorted(self.ops),
            "ops": {tag: op.op_seq for tag, op in sorted(self.ops.items())},
            "membership_call": self.membership,
            "topology_call_waiting": self.membership in _TOPOLOGY_CALLS,
            "master_ok": self.lost is None and self.reconnecting_until is None,
            "reconnecting": self.reconnecting_until is not None,
            "generation": self.generation,
            "ops_in_doubt": sorted(t for t, op in self.ops.items() if op.done),
            "sync_in_doubt": self.sync is not None and self.sync.done,
            "topology_in_doubt": self.topology_in_doubt,
            "pending_votes_waiting": self.pending_waiting,
            "reserved_tags": len(self.reserved),
            "speculative_starts": self.speculative_starts,
        }

    def __repr__(self) -> str:
        return (
            f"<PeerState peer={self.peer_id} group={self.group} world={len(self.table)} epoch={self.epoch} "
            f"ops={sorted(self.ops)} call={self.membership} master={'ok' if self.lost is None else 'lost'}>"
        )

    # ---------------------------------------------------------------------------------------
    # admission of calls

    def check_usable(self) -> None:
        """Raises the error that ended the master link, if it ended."""
        if self.lost is not None:
            raise self.lost

    def begin_topology(self, name: str) -> None:
        """Admit ``update_topology`` / ``optimize_topology``.

        Raises:
            PendingAsyncOpsError: collectives are in flight.
            InvalidUsageError: another membership call is running.
        """
        if self.ops:
            raise PendingAsyncOpsError(f"{name} while {len(self.ops)} collective(s) are in flight")
        if self.membership is not None:
            raise InvalidUsageError(f"{name} while another membership call is running")
        self.membership = name
        self.topology_calls_total += 1

    def begin_sync(self) -> None:
        """Admit ``sync_shared_state`` (collectives may be in flight).

        Raises:
            InvalidUsageError: another membership call is running.
        """
        if self.membership is not None:
            raise InvalidUsageError("sync_shared_state while another membership call is running")
        self.membership = "sync_shared_state"
        self.sync = SyncRecord()
        self.syncs_total += 1

    def end_membership(self) -> None:
        """The membership call returned (or failed)."""
        self.membership = None
        self.sync = None
        self.setup, self.setup_confirmed = None, -1

    def setup_done(self, epoch: int, success: bool) -> None:
        """This peer reports ``P2PConnectionsDone(epoch, success)`` now. A success confirming the running
        topology call's latest setup puts the call *in doubt* (:attr:`topology_in_doubt`): a master
        lost before its ``TopologyResult`` may have committed the round at the other members."""
        if success and self.membership in _TOPOLOGY_CALLS and self.setup is not None \
                and self.setup[0] == epoch:
            self.setup_confirmed = epoch

    @property
    def topology_in_doubt(self) -> bool:
        """True when the running topology call confirmed its setup and waits for its TopologyResult."""
        return self.membership in _TOPOLOGY_CALLS and self.setup is not None \
            and self.setup_confirmed == self.setup[0]

    def begin_pending(self) -> None:
        """An are_peers_pending vote goes out: until its answer it is in doubt if the master is lost."""
        self.pending_waiting += 1

    def end_pending(self) -> None:
        """An are_peers_pending call returned (or failed)."""
        self.pending_waiting = max(0, self.pending_waiting - 1)

    def _set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``: the are_peers_pending rounds are counted per epoch (every member alike)."""
        if epoch != self.epoch:
            self.pending_answers, self.pending_last = 0, -1
        self.epoch = epoch

    def check_tag_free(self, tag: int) -> None:
        """Raises InvalidUsageError if collective ``tag`` is already running here."""
        if tag in self.ops:
            raise InvalidUsageError(f"tag {tag} is already running on this peer")

    def begin_op(self, tag: int) -> None:
        """Register collective ``tag``.

        Raises:
            InvalidUsageError: ``tag`` is already running here.
        """
        self.check_tag_free(tag)
        self.ops[tag] = OpRecord(tag)

    def end_op(self, tag: int) -> None:
        """Collective ``tag`` returned (or failed)."""
        self.ops.pop(tag, None)

    def commenced(self, tag: int, participants: list[int]) -> None:
        """Collective ``tag`` commenced with the ring ``participants`` (peer ids)."""
        op = self.ops.get(tag)
        if op is not None:
            op.participants = list(participants)

    def op_done(self, tag: int) -> None:
        """This peer's part of collective ``tag`` is finished: it reports CollectiveDone(success) now.

        From here on the op is *in doubt* while the master has not answered: a master loss keeps it
        (reported in :meth:`reregister`) instead of failing it.
        """
        op = self.ops.get(tag)
        if op is not None:
            op.done = True

    def op_committed(self, tag: int, op_seq: int) -> None:
        """Collective ``tag`` (``op_seq``) was committed into the caller's buffer here."""
        self.committed_ops[tag] = op_seq
        self.committed_ops.move_to_end(tag)
        while len(self.committed_ops) > COMMITTED_TAGS_KEPT:
            self.committed_ops.popitem(last=False)

    def in_doubt(self, tag: int) -> bool:
        """True when collective ``tag`` is finished here and waits for the master's decision."""
        op = self.ops.get(tag)
        return op is not None and op.done

    def revote_sync(self) -> None:
        """The running sync votes again (a live heal that ended behind the group): a fresh record."""
        if self.sync is not None:
            self.sync = SyncRecord()

    def sync_done(self) -> None:
        """This peer's part of the running sync is finished: it reports SharedStateDone(success) now
        (in doubt from here on, like :meth:`op_done`)."""
        if self.sync is not None and self.sync.sync_seq >= 0:
            self.sync.done = True

    @property
    def sync_in_doubt(self) -> bool:
        """True when the running sync is finished here and waits for the master's result."""
        return self.sync is not None and self.sync.done

    def speculate(self, tag: int, nbytes: int = 0, far: bool = True) -> int:
        """Start registered op ``tag`` under its reserved op_seq, if it has one for this epoch and
        either its receive buffer (``nbytes``) is at most :data:`SPECULATIVE_NEAR_MAX_BYTES` or its
        links are ``far`` (any size then: what the data plane sends before every participant voted
        is bounded by :mod:`pccl.collectives.gate`). Peers may decide differently: a voter without
        a proposal joins the others' number through the master's commence.

        The number is used once (taken out either way). The op then runs on the current group ring
        before the master answered: its ``CollectiveComplete`` commits, its ``CollectiveAbort``
        aborts (also when the other voters did not start under the same number).

        Returns:
            The op_seq to vote with and run under, or -1: vote and wait for ``CollectiveCommence``.
        """
        res = self.reserved.pop(tag, None)
        op = self.ops.get(tag)
        if res is None or op is None or res[1] != self.epoch or len(self.group_ring) < 2 \
                or (nbytes > SPECULATIVE_NEAR_MAX_BYTES and not far):
            return -1
        op.op_seq, op.speculative = res[0], True
        op.participants = self.group_ring  # the ring it runs on (for an in-doubt report)
        self.speculative_starts += 1
        return res[0]

    def drop_reservations(self) -> None:
        """The epoch, the group or the master changed: every op waits for CollectiveCommence again."""
        self.reserved.clear()

    def reconcile_group(self, group_rows: list[m.PeerRow]) -> None:
        """A collective or sync named who takes part in this group: drop the others from the table; a
        member it names that the table lacks (left out while it healed, docs/concepts.md "Live heals")
        comes back, the group's rows then in the order the master named them."""
        alive = {r.peer_id for r in group_rows}
        known = {r.peer_id for r in self.table if r.group == self.group}
        if alive <= known:
            table = [r for r in self.table if r.group != self.group or r.peer_id in alive]
        else:
            at = next((i for i, r in enumerate(self.table) if r.group == self.group), len(self.table))
            others = [r for r in self.table if r.group != self.group]
            table = [*others[:at], *group_rows, *others[at:]]
        if [r.peer_id for r in table] != [r.peer_id for r in self.table]:
            self.drop_reservations()
        self.table = table

    def lose(self, error: PCCLError) -> bool:
        """The master link ended with ``error`` for good; True the first time (later errors are ignored)."""
        if self.lost is not None:
            return False
        self.lost = error
        self.reconnecting_until = None
        return True

    # ---------------------------------------------------------------------------------------
    # surviving the master (docs/concepts.md "Surviving the master")

    def link_down(self, now: float, window: float) -> bool:
        """The master link broke at ``now``: start reconnecting for ``window`` seconds, if this peer may.

        Only an accepted member reconnects (it has a place to keep); a peer still waiting to be
        accepted, or with ``window`` <= 0, loses the master for good (the caller then calls
        :meth:`lose`). Already reconnecting: the deadline stays.

        Returns:
            True when the peer is (now) reconnecting.
        """
        if self.lost is not None or window <= 0 or self.peer_id < 0 or not self.table:
            return False
        if self.reconnecting_until is None:
            self.reconnecting_until = now + window
            # What this loss fails here (unfinished): nobody can have committed it. Also a call that
            # voted but was not commenced (op_seq -1, a sync without its plan), so that the master fails
            # the others' votes for it alike (docs/concepts.md "Operations lost with the master").
            self.abandoned_ops = [[t, op.op_seq] for t, op in sorted(self.ops.items()) if not op.done]
            sync = self.sync
            # (A live heal's unfinished fetch is abandoned here alone: reported, it would abort at the
            # rebuilt master the round its holders committed, and refuse them as a step ahead.)
            self.sync_abandoned = -1 if sync is None or sync.done or sync.live_fetch else \
                sync.sync_seq if sync.sync_seq >= 0 else m.SYNC_ABANDONED_VOTED
            if self.membership in _TOPOLOGY_CALLS and not self.topology_in_doubt:
                self.topology_abandoned = self.setup[0] if self.setup is not None else self.epoch
        self.drop_reservations()
        return True

    @property
    def reconnecting(self) -> bool:
        """True between the master's loss and the reconnection (or the window's end)."""
        return self.reconnecting_until is not None

    def reregister(
        self, p2p_port: int, *, epoch_members: bool = True, public_key: bytes = b""
    ) -> m.Reregister:
        """What this peer tells a master it reconnects to: everything the master needs to rebuild.

        Args:
            p2p_port: this peer's P2P listener port.
            public_key: this peer's X25519 public key for P2P credentials (docs/security.md).
            epoch_members: report the epoch's members as the master established them (a peer that
                can fail over to a standby: both masters must count the same list); False: the
                table as collectives reconciled it (a single-master peer: a restarted master then
                expects only the members that took part in the last operations).
        """
        ring = self.members if epoch_members and self.members else [r.peer_id for r in self.table]
        return m.Reregister(
            peer_id=self.peer_id,
            p2p_port=p2p_port,
            peer_group=self.group,
            epoch=self.epoch,
            ring=list(ring),
            revision=self.revision,
            generation=self.generation,
            ops_in_doubt=[[t, op.op_seq, list(op.participants)] for t, op in sorted(self.ops.items())
                          if op.done],
            ops_abandoned=[list(x) for x in self.abandoned_ops],
            ops_committed=[[t, seq] for t, seq in self.committed_ops.items()],
            sync_in_doubt=[self.sync.sync_seq, self.sync.revision, list(self.sync.members)]
            if self.sync is not None and self.sync.done else [],
            sync_abandoned=self.sync_abandoned,
            sync_committed=self.sync_committed,
            public_key=public_key,
            members_epoch=self.members_epoch,
            topology_in_doubt=[self.setup[0], [r.peer_id for r in self.setup[1]],
                               "optimize" if self.membership == "optimize_topology" else "update"]
            if self.setup is not None and self.topology_in_doubt else [],
            topology_abandoned=self.topology_abandoned,
            pending=[self.epoch, self.pending_answers, 1 if self.pending_waiting else 0, self.pending_last],
            token=self.member_token,
        )

    def reregistered(self, msg: m.Message, now: float) -> PCCLError | None:
        """The first answer of a master this peer reconnects to (heartbeats skipped by the caller).

        Returns:
            None: taken back (the link is up again, generation remembered); else why this master
            is not followed (refused us, names another id, or is of an older generation: fencing).
            A :class:`KickedError` is final: the run went on without this peer, it must join again.
        """
        if isinstance(msg, m.Refused):
            if msg.code == int(Result.KICKED):
                # Final (the run went on without this peer): the caller stops reconnecting.
                return KickedError(f"the master refused the re-registration: {msg.reason}")
            return MasterConnectionError(f"the master refused the re-registration: {msg.reason}")
        if not isinstance(msg, m.Reregistered):
            return MasterConnectionError(f"unexpected answer to Reregister: {type(msg).__name__}")
        if msg.peer_id != self.peer_id:
            return MasterConnectionError(
                f"the master took peer {msg.peer_id} back, this is peer {self.peer_id}")
        if msg.generation < self.generation:
            return MasterConnectionError(
                f"the master is of generation {msg.generation}, older than the generation {self.generation} "
                "this peer followed: not following it")
        self.generation = msg.generation
        self.member_token = msg.token
        self._set_epoch(msg.epoch)
        self.reconnecting_until = None
        self.drop_reservations()
        self.last_heard = now
        self.abandoned_ops, self.sync_abandoned = [], -1
        self.topology_abandoned = -1
        return None

    # ---------------------------------------------------------------------------------------
    # messages from the master

    def handle(self, msg: m.Message, now: float) -> list[Effect]:
        """Apply one message from the master received at ``now``.

        Returns:
            The effects to execute, in order. A message that does not belong on this link yields
            :class:`Lost` (the master broke the protocol).
        """
        self.last_heard = now
        handler = self._DISPATCH.get(type(msg))
        if handler is None:
            return [Lost(MasterConnectionError(f"master protocol error: unexpected message from master: "
                                               f"{type(msg).__name__}"))]
        return handler(self, msg)

    def _on_heartbeat(self, msg: m.Message) -> list[Effect]:
        return []

    def _on_refused(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.Refused)
        if msg.code == int(Result.MASTER_CONNECTION_FAILED):
            return [Dismissed(MasterConnectionError(f"the master closed the connection: {msg.reason}"))]
        return [Lost(KickedError(f"removed by the master: {msg.reason}"))]

    def _on_registered(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.Registered)
        if msg.generation >= self.generation:
            self.generation = msg.generation
            self.member_token = msg.token
        return []

    def _on_accepted(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.Accepted)
        self.table = list(msg.peers)
        self._set_epoch(msg.epoch)
        self.members = [r.peer_id for r in msg.peers]
        self.members_epoch = msg.epoch
        self.drop_reservations()
        return [Resolve(Call.ACCEPTED, msg)]

    def _on_pending_result(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.PeersPendingResult)
        self.pending_answers += 1
        self.pending_last = int(msg.pending)
        return [Resolve(Call.PENDING, msg)]

    def _on_establish(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.EstablishP2P)
        if self.membership in _TOPOLOGY_CALLS:
            self.setup = (msg.epoch, list(msg.peers))
        group = self.group_rows(msg.peers)
        return [Establish(msg.epoch, ring_neighbours(group, self.peer_id)[0], tuple(group), tuple(msg.links))]

    def _on_topology_result(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.TopologyResult)
        peers = list(msg.peers)
        if not peers:
            # The decision on a round in doubt (a rebuilt master): commit means the table of the round's
            # EstablishP2P, which the other members got in their TopologyResult; abort keeps the table.
            setup = self.setup
            peers = list(setup[1]) if msg.success and setup is not None and setup[0] == msg.epoch \
                else list(self.table)
        self.table = peers
        self._set_epoch(msg.epoch)
        if msg.success:
            self.members = [r.peer_id for r in peers]
            self.members_epoch = msg.epoch
        self.drop_reservations()
        return [Resolve(Call.TOPOLOGY, msg)] if self.membership in _TOPOLOGY_CALLS else []

    def _on_commence(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.CollectiveCommence)
        effects: list[Effect] = [Forget(tuple(msg.forget))] if msg.forget else []
        op = self.ops.get(msg.tag)
        if op is None:
            return effects
        if op.speculative:
            # Ours runs speculatively: a commence under its number says that every participant voted
            # (its stall clock starts); any other is not for this op (the master aborts or confirms).
            return [*effects, Resolve(Call.COMMENCE, msg, msg.tag)] if msg.op_seq == op.op_seq else effects
        op.op_seq = msg.op_seq
        return [*effects, Resolve(Call.COMMENCE, msg, msg.tag)]

    def _on_complete(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.CollectiveComplete)
        op = self.ops.get(msg.tag)
        if op is None or op.op_seq != msg.op_seq:
            return []
        if msg.next_op_seq >= 0:
            self.reserved.pop(msg.tag, None)
            self.reserved[msg.tag] = (msg.next_op_seq, self.epoch)
            while len(self.reserved) > RESERVATIONS_KEPT:
                del self.reserved[next(iter(self.reserved))]
        return [Resolve(Call.COMPLETE, msg, msg.tag)]

    def _on_abort(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.CollectiveAbort)
        effects: list[Effect] = [Forget(tuple(msg.forget))] if msg.forget else []
        op = self.ops.get(msg.tag)
        # An abort names the op it ends: -1 for an op that never commenced (refused or withdrawn),
        # else the commenced (or speculative) op's sequence number. Anything else is a late abort of an
        # earlier op with the same tag (e.g. its retry already voted) and must not touch the current one.
        if op is None or msg.op_seq != op.op_seq:
            return effects
        op.aborted = True
        self.reserved.pop(msg.tag, None)
        return [*effects, AbortOp(msg.tag, error_from_code(msg.code, msg.reason))]

    def _on_revoked(self, msg: m.Message) -> list[Effect]:
        self.drop_reservations()
        return []

    def _on_sync_plan(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.SharedStatePlan)
        if self.sync is None:
            return []
        self.sync.sync_seq = msg.sync_seq
        self.sync.plans += 1
        self.sync.revision = msg.revision
        self.sync.members = [r.peer_id for r in msg.peers]
        self.sync.live_fetch = bool(msg.live and msg.fetch)
        self.reconcile_group(msg.peers)
        return [Resolve(Call.SYNC, msg)]

    def _on_sync_result(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.SharedStateResult)
        if self.sync is None:
            return []
        self.sync.results += 1
        if msg.success:
            self.revision = msg.revision
            self.sync_committed = msg.sync_seq
            if msg.reason:
                self.refused_note = msg.reason  # co-voters refused by this sync, and why
        return [Resolve(Call.SYNC, msg)]

    def _on_release(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.SharedStateRelease)
        return [ReleasePin(msg.sync_seq)]

    def _on_measure(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.MeasureBandwidth)
        return [Measure(msg)]

    def _on_member_removed(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.MemberRemoved)
        if msg.peer_id == self.peer_id:
            return []
        return [RemoveMember(msg.peer_id, msg.reason)]

    def _on_credentials(self, msg: m.Message) -> list[Effect]:
        assert isinstance(msg, m.P2PCredentials)
        return [InstallCredentials(msg)]

    _DISPATCH: ClassVar[dict[type[m.Message], Callable[[PeerState, m.Message], list[Effect]]]] = {
        m.Heartbeat: _on_heartbeat,
        m.Refused: _on_refused,
        m.Registered: _on_registered,
        m.Accepted: _on_accepted,
        m.PeersPendingResult: _on_pending_result,
        m.EstablishP2P: _on_establish,
        m.TopologyResult: _on_topology_result,
        m.CollectiveCommence: _on_commence,
        m.CollectiveComplete: _on_complete,
        m.CollectiveAbort: _on_abort,
        m.ReservationsRevoked: _on_revoked,
        m.SharedStatePlan: _on_sync_plan,
        m.SharedStateResult: _on_sync_result,
        m.SharedStateRelease: _on_release,
        m.MeasureBandwidth: _on_measure,
        m.P2PCredentials: _on_credentials,
        m.MemberRemoved: _on_member_removed,
    }


def ring_neighbours(rows: Sequence[m.PeerRow], me: int) -> tuple[m.PeerRow | None, m.PeerRow | None]:
    """(next, prev) rows of ``me`` in ring-ordered ``rows``; None when alone or absent."""
    ids = [r.peer_id for r in rows]
    if me not in ids or len(ids) < 2:
        return None, None
    i = ids.index(me)
    return rows[(i + 1) % len(rows)], rows[(i - 1) % len(rows)]


__all__ = [
    "RESERVATIONS_KEPT",
    "SPECULATIVE_NEAR_MAX_BYTES",
    "AbortOp",
    "Call",
    "Dismissed",
    "Effect",
    "Establish",
    "Forget",
    "InstallCredentials",
    "Lost",
    "Measure",
    "OpRecord",
    "PeerState",
    "ReleasePin",
    "Resolve",
    "SyncRecord",
    "error_from_code",
    "ring_neighbours",
]
