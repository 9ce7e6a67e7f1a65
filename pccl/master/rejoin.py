"""Re-registration: a member that lost its master comes back, and a master rebuilds a run from such returns
(docs/concepts.md "Surviving the master", docs/security.md "Re-registration").

Pure (no trio, sockets or clocks). :class:`Rejoin` holds the rules a ``Reregister`` goes through, in
order, each a method: the member token (``_unproven``), newcomer-first (rule 0), the claimed id (1,
1b), fencing (2), what it reports in doubt, the rebuild of an empty master (3), the epoch (4, 5), a
member dropped while away, and the take-back (6) with its report. It works on the dispatcher through
:class:`RejoinCore`, the members of :class:`~pccl.master.state.MasterState` it reads and calls (the
votes' re-checks among them: a returning member may complete one). :class:`Rebuild` is the state of a
rebuild in progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .._errors import Result
from ..wire import messages as m
from ..wire.credentials import check_public_key
from .away import AwayBook
from .effects import Effect, Event, Send
from .handout import CredentialHandout
from .holds import Holds
from .lost import LostBook
from .membership import Membership, PeerRecord, Phase
from .open_rounds import OpenRounds
from .ops_in_doubt import DoubtBook
from .peers_pending import PeersPending
from .quorum import Quorum
from .reported import ReportedRings
from .ring_setup import RingSetup
from .rounds_in_doubt import RoundBook, reported_epoch
from .tokens import MemberTokens
from .vote_records import VoteRecords


@dataclass
class Rebuild:
    """A master rebuilding its run from re-registrations (docs/concepts.md "Surviving the master").

    ``expected``: the last epoch's members (the ring of the re-registration with the highest epoch);
    ``returned``: those that re-registered. Collectives, syncs and votes resume once a majority of
    ``expected`` returned (:attr:`quorum`).
    """

    epoch: int
    expected: list[int]
    returned: set[int] = field(default_factory=set)
    generations: dict[int, int] = field(default_factory=dict)  # the generation each returned one followed
    epochs: dict[int, int] = field(default_factory=dict)  # the epoch each returned one reported
    _members: tuple[list[int], frozenset[int]] | None = field(default=None, repr=False, compare=False)

    def expected_set(self) -> frozenset[int]:
        """``expected`` as a set, made again only when ``expected`` is replaced (not per return)."""
        got = self._members
        if got is None or got[0] is not self.expected:
            got = self._members = (self.expected, frozenset(self.expected))
        return got[1]

    @property
    def quorum(self) -> int:
        """How many of ``expected`` must return: more than half."""
        return len(self.expected) // 2 + 1

    @property
    def reached(self) -> bool:
        return len(self.returned & self.expected_set()) >= self.quorum


def _reregister_report(msg: m.Reregister) -> str:
    """What a re-registration says about operations across the master's loss, for the log line."""
    parts = [f"{name} {val}" for name, val in (
        ("in doubt", [r[:2] for r in msg.ops_in_doubt]), ("abandoned", msg.ops_abandoned),
        ("committed", msg.ops_committed)) if val]
    if msg.sync_in_doubt:
        parts.append(f"sync in doubt {msg.sync_in_doubt[:1]}")
    if msg.sync_abandoned != -1:
        parts.append(f"sync abandoned {msg.sync_abandoned}")
    return f": ops {'; '.join(parts)}" if parts else ""


class RejoinCore(Protocol):
    """What :class:`Rejoin` uses of the master's dispatcher (:class:`~pccl.master.state.MasterState`)."""

    peers: dict[int, PeerRecord]
    members: Membership
    ring: list[int]
    base: list[int]
    quorum: Quorum
    generation: int
    epoch: int
    rebuild: Rebuild | None
    doubts: DoubtBook
    rounds: RoundBook
    away: AwayBook
    lost: LostBook
    tokens: MemberTokens
    credentials: CredentialHandout
    holds: Holds
    records: VoteRecords
    ring_setup: RingSetup
    peers_pending: PeersPending
    open_rounds: OpenRounds
    last_revision: dict[int, int]
    rebuild_grace: float
    rebuild_quiet: float | None
    _rings: ReportedRings
    _now: float

    @property
    def resumed(self) -> bool: ...

    @property
    def enforced(self) -> bool: ...

    @property
    def _topology(self) -> object: ...

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]: ...

    def accepted(self, group: int | None = None) -> list[int]: ...

    def _advance_generation(self, generation: int) -> None: ...

    def _recheck_votes(self) -> list[Effect]: ...

    def _note_quorum(self) -> list[Effect]: ...

    def _quiet_period(self) -> float: ...


class Rejoin:
    """The rules of a ``Reregister`` (see the module docstring), on ``core``.

    ``adopted``: the generations of other masters this one rebuilt a run from (a member back late from
    one of them is taken on trust without a shared secret: :meth:`_unproven`).
    """

    def __init__(self, core: RejoinCore) -> None:
        self.core = core
        self._adopted: set[int] = set()

    def on_reregister(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        """A member that lost its master comes back (docs/concepts.md "Surviving the master").

        Rules, in order:

        0. newcomer-first: a master whose only accepted peers are newcomers it accepted alone while
           holding no run (and that have completed no topology round) kicks them (``KICKED``: join
           again): the run's members win;
        1. its connection must hold the id it claims (granted at the hello), which ``msg.ring`` names;
        1b. a master that gave a run up for lack of a quorum (:meth:`hold_overdue`) and holds none
           refuses members of that generation or an older one ("look for a newer master");
        2. a peer that followed a newer generation than this master's refuses this master: kicked
           (this master is stale; fencing);
        3. a master with no members (restarted or standby) starts rebuilding: it adopts the epoch,
           ring, revision and ``generation + 1`` the re-registration reports;
        4. while rebuilding, a re-registration with a newer epoch replaces the expected ring;
           one with the expected epoch is taken back; an older one is kicked;
        5. a master not rebuilding takes a member back only when its epoch is the master's
           (it was dropped for a lost connection, nothing moved on); otherwise it is kicked and
           must join again as a newcomer;
        6. taken back: accepted at once (no admission vote), ``Reregistered`` sent, and once a
           majority of the expected members returned, the rebuild ends and every vote resumes.
        """
        core = self.core
        assert isinstance(msg, m.Reregister)
        if rec.phase is not Phase.CONNECTED:
            return core.kick(rec.peer_id, "Reregister after Register")
        unproven = self._unproven(msg)
        if unproven is not None:
            # Before anything else (the newcomer-first kicks, a rebuild): an outsider's claim changes
            # nothing, and its refusal says nothing about the run (issue 33).
            return core.kick(rec.peer_id, *unproven)
        effects = self._yield_to_members(msg)  # rule 0
        listed = frozenset(msg.ring)  # (once: a rebuild's n returns each carry the n-member ring)
        refused = self._refuse_claim(rec, msg, listed)  # rules 1, 1b
        if refused is not None:
            return effects + refused
        gen, refused = self._generation_rule(rec, msg, effects)  # rule 2
        if refused is None:
            refused = self._refuse_in_doubt(rec, msg)  # its report contradicts what was decided here
        if refused is not None:
            return effects + refused
        at = self._rebuild_rule(msg, effects)  # rule 3: the epoch it is at
        refused = self._epoch_rule(rec, msg, at, effects)  # rules 4, 5
        if refused is None:
            refused = self._dropped_while_away(rec, msg, listed, effects)
        if refused is not None:
            return effects + refused
        return self._take_back(rec, msg, listed, gen, at, effects)  # rule 6

    def _yield_to_members(self, msg: m.Reregister) -> list[Effect]:
        """Rule 0, newcomer-first: the newcomers accepted alone at a master that held no run yield."""
        core = self.core
        effects: list[Effect] = []
        if core.ring and core.rebuild is None and core.quorum.only_provisional(core.ring):
            # Newcomer-first at a master that held no run: the run's members win over the lone
            # newcomer accepted meanwhile, which must join again (docs/concepts.md rule 0). Its id
            # (a fresh master counts from 1 again) may be the one this member claims: then the
            # claim below fails once, and the member's next attempt gets it.
            core.quorum.yielding = True  # no other newcomer is accepted alone meanwhile
            for p in sorted(core.quorum.provisional):
                effects += core.kick(p, f"member {msg.peer_id} of the run this master serves re-registered: "
                                        "join again as a newcomer", Result.KICKED)
            core.quorum.yielding = False
            core.quorum.provisional.clear()
        return effects

    def _refuse_claim(
        self, rec: PeerRecord, msg: m.Reregister, listed: frozenset[int]
    ) -> list[Effect] | None:
        """Rules 1 and 1b: the claimed id, the port and key, a run given up (None: none applies)."""
        core = self.core
        if rec.peer_id != msg.peer_id or msg.peer_id not in listed:
            why = (f"Reregister as peer {msg.peer_id}: that id is still held by a connected peer or was "
                   "not claimed in the hello (retry later)")
            return core.kick(rec.peer_id, why)
        if not 0 < msg.p2p_port < 65536:
            return core.kick(rec.peer_id, f"invalid p2p port {msg.p2p_port}")
        bad_key = check_public_key(msg.public_key)
        if bad_key is not None:
            return core.kick(rec.peer_id, f"invalid Reregister: {bad_key}")
        if (not core.ring and core.rebuild is None and core.quorum.dismissed_generation is not None
                and msg.generation <= core.quorum.dismissed_generation):
            return core.kick(
                rec.peer_id, f"this master gave the run of generation {core.quorum.dismissed_generation} up "
                             "for lack of a quorum: look for a newer master", Result.MASTER_CONNECTION_FAILED)
        return None

    def _generation_rule(
        self, rec: PeerRecord, msg: m.Reregister, effects: list[Effect]
    ) -> tuple[int, list[Effect] | None]:
        """Rule 2, fencing: the generation it counts as having followed, or its refusal (a newer
        generation than the others' moves the rebuild on: ``effects`` gets those kicks)."""
        core = self.core
        rb0 = core.rebuild
        gen = msg.generation
        if rb0 is not None and rec.peer_id in rb0.generations:
            # Back once already during this rebuild, and it left since: this report replaces that one.
            # If this master took it back, the generation it reports is this master's own, not a newer
            # master's: it counts as the one it had followed then.
            before = rb0.generations.pop(rec.peer_id)
            rb0.epochs.pop(rec.peer_id, None)
            rb0.returned.discard(rec.peer_id)
            if gen == core.generation:
                gen = before
        if rb0 is not None and rb0.generations and gen < max(rb0.generations.values()):
            # It missed a master the others followed: the run went on there without it (final).
            return gen, core.kick(rec.peer_id, f"this peer followed master generation {msg.generation}, "
                                                    f"the run went on at generation "
                                                    f"{max(rb0.generations.values())} without it: join again",
                                       Result.KICKED)
        if rb0 is not None and rb0.generations and gen > max(rb0.generations.values()):
            # Rebuilding from members that had missed a newer master: this one followed it. Those
            # were away while the run went on at the newer master: they must join again (final), and
            # the rebuild goes on at a newer generation. (Either order of arrival ends the same way.)
            effects += self._newer_generation(gen)
        elif gen > core.generation and (core.ring or core.rebuild is not None):
            return gen, core.kick(rec.peer_id, f"this master (generation {core.generation}) is older "
                                                    f"than the peer's (generation {msg.generation})",
                                       Result.MASTER_CONNECTION_FAILED)
        return gen, None

    def _refuse_in_doubt(self, rec: PeerRecord, msg: m.Reregister) -> list[Effect] | None:
        """Its report of operations and rounds in doubt contradicts what this master decided."""
        core = self.core
        conflict = core.doubts.conflict(msg.peer_group, msg)
        if conflict is not None:
            return core.kick(rec.peer_id, conflict, Result.MASTER_CONNECTION_FAILED)
        conflict = (core.rounds.conflict(msg) or core.doubts.behind(msg.peer_group, msg)
                    or core.peers_pending.behind(msg))
        if conflict is not None:
            return core.kick(rec.peer_id, conflict, Result.KICKED)
        return None

    def _rebuild_rule(self, msg: m.Reregister, effects: list[Effect]) -> int:
        """Rule 3: a master with no members starts rebuilding from this report; the epoch it is at."""
        core = self.core
        # The epochs it may be at: its table's, up to that of a topology round it was in (in doubt, or
        # failed by the loss after its EstablishP2P): docs/concepts.md "Rounds in doubt".
        at = reported_epoch(msg)
        # (A master that lost every member's link while it lived is not a restarted one: a member it
        # dropped that followed it last is taken back by the live rules, no rebuild.)
        own = (not core.quorum.fresh and msg.generation == core.generation
               and core.doubts.was_dropped(msg.peer_id))
        if not core.ring and core.rebuild is None and core._topology is None and not own:
            core._advance_generation(msg.generation + 1)
            at = core.epoch = msg.epoch
            core.rebuild = Rebuild(epoch=at, expected=list(msg.ring))
            core._rings = ReportedRings()
            core.rounds = RoundBook()
            core.doubts.roll_call(list(msg.ring), set(), core._now, core.rebuild_grace)
            core.quorum.start_rebuild(msg.ring, core._now)
            effects.append(Event(f"rebuilding the run from re-registrations: epoch {at}, "
                                 f"{len(msg.ring)} member(s), generation {core.generation}"))
        rb = core.rebuild
        run_epoch = rb.epoch if rb is not None else core.epoch
        if msg.epoch <= run_epoch <= at:
            at = run_epoch  # the run's epoch is one it may be at: the round it was in decides the rest
        elif at < run_epoch and msg.topology_abandoned >= 0 and core.rounds.round_above(at):
            at = run_epoch  # it voted in the round in doubt (or aborted) but got no EstablishP2P
        elif at > run_epoch and rb is None and core.rounds.is_open(at):
            at = run_epoch  # it committed the round the members here wait on: its report decides it
        return at

    def _epoch_rule(
        self, rec: PeerRecord, msg: m.Reregister, at: int, effects: list[Effect]
    ) -> list[Effect] | None:
        """Rules 4 (rebuilding: a newer epoch replaces the expected ring, an older one is refused) and 5
        (live: only in the current epoch, and only when its group did not go on without it)."""
        core = self.core
        rb = core.rebuild
        if rb is not None:
            if at > rb.epoch:
                rb.epoch = core.epoch = at
                rb.expected = list(msg.ring)
                # Those back with an older epoch that are not members of the newer one are refused as
                # if they had come after it (the outcome must not depend on the order of arrival).
                for p, e in sorted(rb.epochs.items()):
                    if e < at and p not in rb.expected:
                        rb.returned.discard(p)
                        rb.generations.pop(p, None)
                        core._rings.pop(p)
                        del rb.epochs[p]
                        why = "re-registered with an older epoch than the run's: join again"
                        effects += core.kick(p, why, Result.KICKED)
                core.doubts.roll_call(rb.expected, rb.returned, core._now, core.rebuild_grace)
                core.base = list(msg.ring)
            elif at < rb.epoch:
                # KICKED (final): the run moved on to a newer epoch without it, at whatever master.
                why = "re-registered with an older epoch than the run's: join again"
                return core.kick(rec.peer_id, why, Result.KICKED)
        elif core.records.runs_without(msg.peer_id, msg.peer_group):
            # An operation its group started after dropping it may still complete (then the group went
            # on without it) or fail (then it is taken back): it tries again once that is decided.
            return core.kick(rec.peer_id, f"group {msg.peer_group} is running an operation without "
                                                    "this peer: retry later", Result.MASTER_CONNECTION_FAILED)
        elif at != core.epoch and set(core.ring) & set(msg.ring):
            # KICKED (final): the run this master serves (members the peer knows) moved to another
            # epoch without it. (A master now serving another run refuses it with the retryable code
            # below: a standby may hold its run.)
            return core.kick(rec.peer_id, "re-registered with another epoch than the run's: "
                                                    "join again", Result.KICKED)
        elif at != core.epoch:
            # (The refusals name no epoch of the run: issue 33.)
            return core.kick(rec.peer_id, "re-registered with another epoch than the run's: "
                                                    "join again", Result.MASTER_CONNECTION_FAILED)
        elif core.doubts.moved_on(msg.peer_id, msg.peer_group, absent=not core.enforced):
            # KICKED: final for the peer (it stops reconnecting), unlike the refusals above, which a
            # standby of the right epoch may not share.
            return core.kick(rec.peer_id, f"group {msg.peer_group} went on without this peer "
                                                    "since it was dropped: join again", Result.KICKED)
        return None

    def _dropped_while_away(
        self, rec: PeerRecord, msg: m.Reregister, listed: frozenset[int], effects: list[Effect]
    ) -> list[Effect] | None:
        """A member its group no longer lists was dropped while away (either order of arrival)."""
        core = self.core
        rb = core.rebuild
        if core._rings:
            # A peer drops the dead of its own group from its table at every operation: one that a
            # member of its group back here no longer lists was dropped from the group while it was
            # away (the run went on without it). Refused in either order of arrival (KICKED: final).
            # (Only a ring of the same or a later epoch counts: an older one may not know newer members.)
            for p in core._rings.not_listing(rec.peer_id, msg.epoch):
                if p in core.peers and core.peers[p].group == msg.peer_group:
                    return core.kick(rec.peer_id, f"peer {p} of group {msg.peer_group} no longer "
                                                            "lists this peer: the run went on without it, "
                                                            "join again", Result.KICKED)
            for p in core._rings.not_in(listed, msg.epoch):
                if p in core.peers and core.peers[p].group == msg.peer_group:
                    core._rings.pop(p)
                    if rb is not None:
                        rb.returned.discard(p)
                        rb.generations.pop(p, None)
                        rb.epochs.pop(p, None)
                    why = (f"peer {rec.peer_id} of group {msg.peer_group} no longer lists this peer: the run "
                           "went on without it, join again")
                    effects += core.kick(p, why, Result.KICKED)
        return None

    def _take_back(
        self, rec: PeerRecord, msg: m.Reregister, listed: frozenset[int], gen: int, at: int,
        effects: list[Effect],
    ) -> list[Effect]:
        """Rule 6: accepted at once in its old place, ``Reregistered``, its report of what is in doubt
        decided; once a majority is back the rebuild ends and the votes resume."""
        core = self.core
        rb = core.rebuild
        if msg.revision >= 0:
            core.last_revision[msg.peer_group] = max(core.last_revision.get(msg.peer_group, -1), msg.revision)
        rec.phase = Phase.ACCEPTED
        was_away = core.away.back(rec.peer_id)
        rec.p2p_port = msg.p2p_port
        rec.group = msg.peer_group
        rec.public_key = msg.public_key
        core.members.note_address(rec.host)
        core.members.take_into_ring(rec.peer_id, rb.expected if rb is not None else msg.ring)
        back = m.Reregistered(peer_id=rec.peer_id, generation=core.generation, epoch=core.epoch,
                              token=core.tokens.issue(core.generation, rec.peer_id))
        effects.append(Send(rec.peer_id, back))
        # After Reregistered (the peer reads that one itself): this master's set of the epoch.
        effects += core.credentials.on_return(rec.peer_id, core.generation, core.epoch, core._now)
        effects.append(Event(f"peer {rec.peer_id} re-registered from {rec.host}:{msg.p2p_port} "
                             f"(group {msg.peer_group}){_reregister_report(msg)}"))
        if rb is not None or core._rings:
            core._rings.put(rec.peer_id, msg.epoch, listed)
        msg = self._report_back(rec, msg, effects)
        expected = rb.expected_set() if rb is not None else frozenset(core.base)
        effects += core.holds.execute_rounds(*core.rounds.report(rec.peer_id, msg, core._now, expected))
        if rb is not None:
            self._adopted.add(msg.generation)
            rb.returned.add(rec.peer_id)
            rb.generations[rec.peer_id] = gen
            rb.epochs[rec.peer_id] = at
            if rb.reached:
                core.rebuild = None
                effects.append(Event(f"{len(rb.returned)} of the last epoch's {len(rb.expected)} member(s) "
                                     "re-registered: resuming"))
        if was_away and core.resumed:
            effects += core._recheck_votes()  # the last member the votes waited for is back
        if core.rebuild is None and core.rebuild_quiet is not None:
            # A majority is back: the roll call waits for the others only while they keep coming.
            core.doubts.quiet(core._now, core._quiet_period())
        return effects + core._note_quorum()

    def _report_back(self, rec: PeerRecord, msg: m.Reregister, effects: list[Effect]) -> m.Reregister:
        """What the member back reports in doubt, abandoned or pending, decided here (``effects`` gets
        the answers); the report as the rounds in doubt should read it."""
        core = self.core
        rb = core.rebuild
        was = core.doubts.undecided
        missing = core.doubts.missing
        decisions = core.doubts.report(rec.peer_id, msg.peer_group, msg, core._now)
        if missing and not core.doubts.missing:
            effects.append(Event("roll call over: every member is back"))
        effects += core.holds.execute_decisions(decisions, was)
        # At a live master, the members that never left vote next for what the returning one reports
        # abandoned, unless that call ended here for everybody since its drop (pccl/master/away.py).
        group = msg.peer_group
        lost = core.lost.report(rec.peer_id, group, msg, core.doubts.outcome,
                                live=lambda: core.accepted(group),
                                kept=lambda k: core.records.kept(rec.peer_id, k))
        if lost:
            effects += core.open_rounds.fail_lost(lost)
        if rb is None and msg.topology_abandoned >= 0 and not msg.topology_in_doubt:
            effects += core.ring_setup.fail_lost(rec.peer_id, [p for p in core.ring if p != rec.peer_id])
        was_dropped = core.away.forget(rec.peer_id)
        return core.peers_pending.back(rec.peer_id, msg, was_dropped, effects)

    def _unproven(self, msg: m.Reregister) -> tuple[str, Result] | None:
        """Why ``msg`` does not prove its sender is member ``msg.peer_id`` (None: it does, or it is
        taken on trust while this master holds no run of its own; pccl/master/tokens.py)."""
        core = self.core
        if msg.token and core.tokens.valid(msg.generation, msg.peer_id, msg.token):
            return None
        if core.tokens.shared:  # every master of the run verifies every generation's tokens
            return ("Reregister without a valid member token (every master of a run needs its token key: the "
                    "same --token-key-file or --secret): join again as a newcomer", Result.KICKED)
        # No shared secret: another master process's token (a restarted or standby master) cannot be
        # told from a stranger's. Taken on trust while this master holds no run of its own (it may
        # rebuild one from re-registrations), while it rebuilds, and for the generations it rebuilt its
        # run from (a member back late); the rules below decide as before (a newer generation than
        # this master's: they refuse it as stale, changing nothing). Otherwise refused with the
        # retryable code, as a stale or foreign master refuses it: a standby may hold the peer's run.
        if (core.rebuild is not None or not core.ring or core.quorum.only_provisional(core.ring)
                or msg.generation in self._adopted or msg.generation > core.generation):
            return None
        return ("Reregister without a member token of this master (no shared secret to verify another "
                "master's): look for the master of its run", Result.MASTER_CONNECTION_FAILED)

    def _newer_generation(self, generation: int) -> list[Effect]:
        """While rebuilding, a member that followed master ``generation`` (newer than what the members
        back so far followed) re-registers: move to ``generation + 1`` and refuse, for good, the
        members back so far that followed an older one."""
        core = self.core
        rb = core.rebuild
        assert rb is not None
        core._advance_generation(generation + 1)
        effects: list[Effect] = [Event(f"a member followed master generation {generation}: rebuilding as "
                                       f"generation {core.generation}")]
        for p, g in sorted(rb.generations.items()):
            if g < generation:
                rb.returned.discard(p)
                del rb.generations[p]
                rb.epochs.pop(p, None)
                core._rings.pop(p)
                effects += core.kick(p, f"this peer followed master generation {g}, the run went on at "
                                        f"generation {generation} without it: join again", Result.KICKED)
        return effects
