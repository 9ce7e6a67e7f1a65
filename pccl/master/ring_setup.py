"""The topology round's setup: the update/optimize vote, the bandwidth measurements, the ring solve and
the P2P setup that admits newcomers and moves every member to a new epoch.

Pure (no trio, sockets or clocks). :class:`RingSetup` takes the ``UpdateTopologyVote`` /
``OptimizeTopologyVote`` ballots, completes the vote (docs/protocol.md section 3), plans and collects the
bandwidth measurements of an optimize round, solves the ring (ATSP, pccl/master/topology.py; a large
world's ring is improved in the background and adopted at the next topology change), and runs the P2P
setup (``EstablishP2P`` -> ``P2PConnectionsDone``): a new epoch, its credentials, the
newcomers accepted, the members told the result. It also re-runs a setup whose late members were dropped
(:meth:`RingSetup.setup_overdue`) and fails, once each, the calls of a round a member's broken link
failed (:meth:`RingSetup.fail_lost`). The round itself (its ballots, its phase) is
:class:`~pccl.master.rounds.topology.TopologyRound`; the data (the round, the measurements, the solver
settings) stay on the dispatcher, which this works on through :class:`RingSetupCore`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .._errors import Result
from ..wire import messages as m
from .away import AwayBook
from .effects import Effect, Event, Send
from .issued import IssuedSet
from .lost import REASON as LOST_REASON
from .membership import PeerRecord, Phase
from .ops_in_doubt import DoubtBook
from .quorum import Quorum
from .rounds.topology import TOPOLOGY_KEY as _TOPOLOGY_KEY
from .rounds.topology import (
    Loss,
    TopologyRound,
    bandwidth_matrix,
    failed_result,
    failure_code,
    plan_measurements,
    record_bandwidth,
)
from .rounds_in_doubt import RoundBook
from .vote_records import VoteRecords


class RingSetupCore(Protocol):
    """What :class:`RingSetup` uses of the master's dispatcher (:class:`~pccl.master.state.MasterState`)."""

    peers: dict[int, PeerRecord]
    ring: list[int]
    base: list[int]
    records: VoteRecords
    epoch: int
    generation: int
    quorum: Quorum
    doubts: DoubtBook
    rounds: RoundBook
    away: AwayBook
    bandwidth: dict[tuple[int, int], tuple[float, float]]
    latency: dict[tuple[int, int], float]
    bandwidth_probe_seconds: float
    bandwidth_stale_after: float
    solver_time_budget: float
    exact_limit: int
    improved_ring: list[int] | None
    _topology: TopologyRound | None
    _topology_owed: set[int]
    _improvement_job: tuple[list[int], list[list[float | None]]] | None
    _solver: Callable[[list[list[float | None]]], list[int]] | None
    _clock: Callable[[], float]
    _issued: IssuedSet
    _now: float

    @property
    def resumed(self) -> bool: ...

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]: ...

    def table(self, ids: list[int]) -> list[m.PeerRow]: ...

    def registered(self) -> list[int]: ...


class RingSetup:
    """The topology round of ``core`` from its first ballot to its result (see the module docstring)."""

    def __init__(self, core: RingSetupCore) -> None:
        self.core = core

    def setup_deadline(self, timeout: float) -> float | None:
        """When the P2P setup of the topology round in progress runs out of time (None: no setup)."""
        core = self.core
        rnd = core._topology
        if rnd is None or not rnd.establishing:
            return None
        return rnd.establish_started + timeout

    def setup_overdue(self, now: float, timeout: float) -> list[Effect]:
        """Drop the members that have not confirmed their P2P setup ``timeout`` seconds after
        EstablishP2P went out, and re-run the setup with the rest.

        Each late member (a newcomer that ignores EstablishP2P, or an accepted peer that never
        reports) is kicked with the reason logged; the remaining members get a fresh EstablishP2P
        for a new epoch (their neighbours changed) with a fresh deadline, so the others'
        update_topology() / optimize_topology() completes without the late ones. Nothing happens
        before the deadline or when no setup is in progress.

        Args:
            now: the current time (same clock as ``handle``).
            timeout: seconds a member has to confirm (MasterConfig.p2p_setup_timeout).

        Returns:
            The effects to execute.
        """
        core = self.core
        core._now = now
        rnd = core._topology
        if rnd is None or not rnd.establishing or now <= rnd.establish_started + timeout:
            return []
        late = rnd.late()
        if not late:
            return []
        # The round is taken out first: the late members' removal must not fail it.
        core._topology = None
        core.rounds.settle(rnd.epoch, False)
        effects: list[Effect] = []
        code = failure_code(rnd.kind)
        for p in late:
            reason = f"did not finish P2P setup of epoch {rnd.epoch} within {timeout:g}s"
            effects += core.kick(p, reason, code)
        if core._topology is not None or not core.ring:
            return effects  # the kicks started something else (world of one): nothing to re-run
        members = [p for p in rnd.members if p in core.peers]
        newcomers = rnd.newcomers & set(members)
        retry = rnd.retry(core.ring)
        core._topology = retry
        effects.append(Event(f"{rnd.kind}_topology: P2P setup re-run without {late}"))
        return effects + self.start_establish(retry, members, newcomers)

    def on_update_vote(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        """An ``UpdateTopologyVote`` (:meth:`vote`)."""
        return self.vote(rec, "update")

    def on_optimize_vote(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        """An ``OptimizeTopologyVote`` (:meth:`vote`)."""
        return self.vote(rec, "optimize")

    def vote(self, rec: PeerRecord, kind: str) -> list[Effect]:
        core = self.core
        if rec.phase is not Phase.ACCEPTED:
            return core.kick(rec.peer_id, f"{kind} topology vote from a peer that is not accepted")
        if rec.peer_id in core._topology_owed:
            # Another member's topology call failed when its link to this master broke: this member's
            # call of that round fails too, once (docs/concepts.md "A member's link breaks").
            core._topology_owed.discard(rec.peer_id)
            return [Send(rec.peer_id, self.lost_result(kind))]
        rnd = core._topology
        if rnd is None:
            rnd = core._topology = TopologyRound(kind=kind, opened=core._now)
            core.away.opened(_TOPOLOGY_KEY)
        refused = rnd.refusal(rec.peer_id, kind)
        if refused is not None:
            return core.kick(rec.peer_id, refused.reason)
        rnd.votes.add(rec.peer_id)
        return self.check_vote()

    def lost_result(self, kind: str) -> m.TopologyResult:
        core = self.core
        return failed_result(kind, core.epoch, core.table(core.ring), LOST_REASON)

    def fail_lost(self, peer_id: int, others: list[int]) -> list[Effect]:
        """Member ``peer_id`` re-registered at this live master reporting the topology call its broken
        link failed: the others' calls of that round fail too, once each (the votes waiting here now,
        the others' next topology vote), unless that round ended for everybody since its drop."""
        core = self.core
        if not core.records.kept(peer_id, _TOPOLOGY_KEY):
            return []
        rnd = core._topology
        failed: list[Effect] = []
        if rnd is not None and rnd.votes and rnd.voting:
            result = self.lost_result(rnd.kind)
            failed = [Send(p, result) for p in sorted(rnd.votes)]
            core._topology = None
        voted = {e.peer_id for e in failed if isinstance(e, Send)}
        core._topology_owed |= {p for p in others if p not in voted}
        return failed

    def check_vote(self) -> list[Effect]:
        core = self.core
        rnd = core._topology
        ring = core.ring
        # (the count first: every ballot but the last, see votes.unanimous; then whether the master is held)
        if rnd is None or len(rnd.votes) < len(ring) or not core.resumed or not rnd.complete(ring):
            return []
        if rnd.kind == "update":
            newcomers = core.registered()
            effects: list[Effect] = []
            if core.improved_ring is not None and sorted(core.improved_ring) == sorted(core.ring):
                effects.append(Event(f"adopting background-improved ring {core.improved_ring}"))
                core.ring = list(core.improved_ring)
            core.improved_ring = None
            return effects + self.start_establish(rnd, core.ring + newcomers, set(newcomers))
        # optimize: measure what is missing, then solve
        rnd.measure_rounds = plan_measurements(core.ring, self._measured_at, core._now,
                                               core.bandwidth_stale_after)
        return self.next_measure_round(rnd)

    def _measured_at(self, a: int, b: int) -> float | None:
        """When the link a -> b was last measured (None: never)."""
        core = self.core
        got = core.bandwidth.get((a, b))
        return None if got is None else got[1]

    def start_establish(self, rnd: TopologyRound, members: list[int], newcomers: set[int]) -> list[Effect]:
        """The round's P2P setup: a new epoch, its credentials, EstablishP2P to every member."""
        core = self.core
        core.epoch += 1
        rnd.begin_setup(core.epoch, core.epoch - 1, members, newcomers, core._now)
        table = core.table(rnd.members)
        by_group: dict[int, list[int]] = {}
        for p in rnd.members:
            by_group.setdefault(core.peers[p].group, []).append(p)
        links = {g: self.link_summary(ps) for g, ps in by_group.items()}
        # One set for every member (the same object: encoded once), O(n) to build.
        creds = core._issued.issue(core.generation, rnd.epoch,
                                   ((p, core.peers[p].public_key) for p in rnd.members))
        effects: list[Effect] = []
        # One EstablishP2P per group (the same object for its members: encoded once).
        ests = {g: m.EstablishP2P(epoch=rnd.epoch, peers=table, links=links[g]) for g in by_group}
        for p in rnd.members:
            # The credentials first: the peer connects as soon as it reads EstablishP2P.
            effects.append(Send(p, creds))
            effects.append(Send(p, ests[core.peers[p].group]))
        return effects

    def link_summary(self, members: list[int]) -> list[float]:
        """What the peers' schedule choice knows of the links between ``members``: the same for every
        member of a group, so every member chooses the same schedule (docs/topology.md).

        Returns:
            ``[slowest bytes/s, fastest / slowest, slowest one-way latency in seconds]`` over the
            measured reachable pairs of ``members``; without the latency (two entries) when no pair
            has one (measured by a peer that reports bandwidth only); ``[]`` when nothing is measured
            (the peers then use the model's defaults).
        """
        core = self.core
        inside = set(members)
        pairs = [
            (k, bw) for k, (bw, _t) in core.bandwidth.items() if k[0] in inside and k[1] in inside and bw > 0
        ]
        if not pairs:
            return []
        vals = [bw for _k, bw in pairs]
        lo = min(vals)
        summary = [lo, max(vals) / lo]
        lats = [core.latency[k] for k, _bw in pairs if k in core.latency]
        if lats:
            # the slowest: a ring step, and a round of the other schedules, waits for its slowest link
            summary.append(max(lats))
        return summary

    def on_p2p_done(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        core = self.core
        assert isinstance(msg, m.P2PConnectionsDone)
        rnd = core._topology
        # (TopologyRound.expects written out: every member's confirmation passes here)
        if rnd is None or not rnd.establishing or msg.epoch != rnd.epoch or rec.peer_id not in rnd.member_set:
            # A late answer for a round that already ended (e.g. failed because a peer died): ignore.
            return []
        refused = rnd.confirm(rec.peer_id, msg)
        if refused is not None:
            return core.kick(rec.peer_id, refused.reason)
        if not rnd.failed and len(rnd.confirmed) < len(rnd.member_set):
            return []  # (every confirmation but the last: the count says the setup runs on, as outcome())
        return self.check_establish()

    def check_establish(self) -> list[Effect]:
        core = self.core
        rnd = core._topology
        # A failed round ends at once: members still busy connecting (possibly to a peer that just
        # died or hangs, which can take a connect timeout) must not hold everyone else back.
        done = None if rnd is None else rnd.outcome()
        if rnd is None or done is None:
            return []
        core._topology = None
        old = rnd.old_members()
        effects: list[Effect] = []
        if not done:
            failed = failed_result(rnd.kind, core.epoch, core.table(core.ring), rnd.failure_reason)
            effects += [Send(p, failed) for p in old]  # one object for all: encoded once
            effects.append(Event(f"{rnd.kind}_topology failed: {rnd.failure_reason}"))
            core.rounds.settle(rnd.epoch, False)
            return effects
        core.rounds.settle(rnd.epoch, True)
        core._topology_owed.clear()
        for group in {core.peers[p].group for p in rnd.members if p in core.peers}:
            # Its members went on: one dropped before it is refused when it comes back (moved_on).
            core.doubts.progressed(group)
        core.ring = list(rnd.members)
        core.base = list(core.ring)
        core.quorum.fresh = False
        core.quorum.provisional.clear()
        table = core.table(core.ring)
        # One Accepted and one TopologyResult object for all (SHARED: each encoded once).
        accepted = m.Accepted(peers=table, epoch=rnd.epoch)
        for p in rnd.newcomers:
            core.peers[p].phase = Phase.ACCEPTED
            core.peers[p].admitted = core._now
            effects.append(Send(p, accepted))
            effects.append(Event(f"peer {p} accepted (world size {len(core.ring)})"))
        result = m.TopologyResult(success=True, epoch=rnd.epoch, peers=table)
        effects += [Send(p, result) for p in old]
        if rnd.kind == "optimize":
            effects.append(Event(f"ring optimized: {core.ring}"))
        return effects

    def peer_lost(self, peer_id: int) -> list[Effect]:
        core = self.core
        rnd = core._topology
        if rnd is None:
            return []
        loss = rnd.peer_lost(peer_id)
        if loss is Loss.CHECK_SETUP:
            effects = self.check_establish()
            if core._topology is rnd and not any(p in core.ring for p in rnd.members):
                core._topology = None
                core.rounds.settle(rnd.epoch, False)
            return effects
        if loss is Loss.NEXT_MEASUREMENT:
            return self.next_measure_round(rnd)
        if loss is Loss.DROP:
            core._topology = None
            return []
        return self.check_vote() if loss is Loss.CHECK_VOTE else []

    def next_measure_round(self, rnd: TopologyRound) -> list[Effect]:
        core = self.core
        by_src = rnd.next_measurement(self._address)
        if by_src is None:
            return self.solve_and_establish(rnd)
        return [
            Send(a, m.MeasureBandwidth(epoch=core.epoch, targets=t, duration=core.bandwidth_probe_seconds))
            for a, t in by_src.items()
        ]

    def _address(self, peer_id: int) -> tuple[str, int] | None:
        """A connected peer's P2P address (None: not connected)."""
        core = self.core
        rec = core.peers.get(peer_id)
        return None if rec is None else (rec.host, rec.p2p_port)

    def on_bandwidth_report(self, rec: PeerRecord, msg: m.Message) -> list[Effect]:
        core = self.core
        assert isinstance(msg, m.BandwidthReport)
        rnd = core._topology
        if rnd is None or rec.peer_id not in rnd.measuring:
            return []
        record_bandwidth(rec.peer_id, msg.results, core._now, core.bandwidth, core.latency)
        if not rnd.measured(rec.peer_id):
            return []
        return self.next_measure_round(rnd)

    def solve_and_establish(self, rnd: TopologyRound) -> list[Effect]:
        core = self.core
        ring = list(core.ring)
        n = len(ring)
        effects: list[Effect] = []
        if n >= 3:
            bw = bandwidth_matrix(ring, core.bandwidth)
            try:
                order = self._solve(bw)
            except Exception as exc:
                isolated = list(getattr(exc, "isolated", []) or [])
                if isolated:
                    for idx in isolated:
                        pid = ring[idx]
                        effects += core.kick(
                            pid,
                            "no other peer can reach this peer (bandwidth tests failed)",
                            Result.TOPOLOGY_OPTIMIZATION_FAILED,
                        )
                    if core._topology is rnd:
                        effects += self.start_establish(rnd, list(core.ring), set())
                    return effects
                order = list(range(n))
                effects.append(Event(f"topology solver failed ({exc}); keeping the current ring"))
            ring = [ring[i] for i in order]
            if n > core.exact_limit:
                # The heuristic stopped at its budget: keep improving in the background.
                core._improvement_job = (list(ring), [[bw[i][j] for j in order] for i in order])
        return effects + self.start_establish(rnd, ring, set())

    def take_improvement_job(self) -> tuple[list[int], list[list[float | None]]] | None:
        """A ``(ring ids, bandwidth matrix in that order)`` to improve off the event loop, once."""
        core = self.core
        job, core._improvement_job = core._improvement_job, None
        return job

    def offer_ring(self, ring: list[int]) -> list[Effect]:
        """A background improvement finished: adopt it at the next topology change if still valid."""
        core = self.core
        if sorted(ring) != sorted(core.ring) or ring == core.ring:
            return []
        core.improved_ring = list(ring)
        return [Event(f"background ring improvement ready: {ring}")]

    def _solve(self, bw: list[list[float | None]]) -> list[int]:
        core = self.core
        if core._solver is not None:
            return core._solver(bw)
        from . import topology

        # A short budget: this runs inside the master's event loop. Exact (Held-Karp) up to 12 peers
        # takes ~10 ms; beyond that the heuristic stops at the budget.
        return list(topology.solve_ring(bw, time_budget=core.solver_time_budget, clock=core._clock).order)
