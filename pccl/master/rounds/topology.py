"""The update_topology / optimize_topology round (docs/protocol.md section 3): :class:`TopologyRound`.

One round at a time, ring-wide. Its phases: the vote (every accepted peer calls the same kind); for
optimize, bandwidth measurement rounds (:func:`plan_measurements`: no peer sends or receives twice per
round); then the P2P setup of its epoch (``EstablishP2P`` to every member, each confirms with
``P2PConnectionsDone``). The setup ends failed at the first failure or loss (a member busy connecting
to a dead peer must not hold the others), or done when every member confirmed.

Pure: no clock, no I/O. The round keeps its own bookkeeping and answers with decisions
(:class:`Loss`, :meth:`TopologyRound.outcome`); the master keeps what they change of the membership
(the epoch, the ring, the credentials, accepting newcomers) and routes the messages.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._errors import Result
from ...wire import messages as m
from ..describe import VoteWait
from ..votes import unanimous
from .base import Expel, VoteKey

#: The key of the (ring-wide) topology round in :class:`~pccl.master.away.AwayBook`.
TOPOLOGY_KEY = ("topology", -1, -1)


def failure_code(kind: str) -> Result:
    """The error a failed round of ``kind`` ("update" or "optimize") reports."""
    return Result.UPDATE_TOPOLOGY_FAILED if kind == "update" else Result.TOPOLOGY_OPTIMIZATION_FAILED


def failed_result(kind: str, epoch: int, table: list[m.PeerRow], reason: str) -> m.TopologyResult:
    """The TopologyResult of a failed round of ``kind`` (the members stay at ``epoch`` with ``table``)."""
    code = int(failure_code(kind))
    return m.TopologyResult(success=False, epoch=epoch, peers=table, reason=reason, code=code)


class Loss(enum.Enum):
    """What the master does after :meth:`TopologyRound.peer_lost`."""

    NOTHING = "nothing"
    CHECK_SETUP = "check_setup"  # the P2P setup may have ended (failed: a member was lost)
    NEXT_MEASUREMENT = "next_measurement"  # the measurement round in progress ended
    DROP = "drop"  # the vote lost its last ballot: the round is over
    CHECK_VOTE = "check_vote"  # the vote may complete without the lost peer


def plan_measurements(ring: list[int], measured: Callable[[int, int], float | None], now: float,
                      stale_after: float) -> list[list[tuple[int, int]]]:
    """Missing or stale directed links of ``ring``, scheduled so no peer sends or receives twice per
    round. ``measured(a, b)``: when the link a -> b was last measured (None: never)."""
    n = len(ring)
    rounds: list[list[tuple[int, int]]] = []
    for shift in range(1, n):
        rnd = []
        for i, a in enumerate(ring):
            b = ring[(i + shift) % n]
            when = measured(a, b)
            if when is None or now - when > stale_after:
                rnd.append((a, b))
        if rnd:
            rounds.append(rnd)
    return rounds


@dataclass
class TopologyRound:
    """An update_topology or optimize_topology round."""

    kind: str  # "update" | "optimize"
    votes: set[int] = field(default_factory=set)
    opened: float = 0.0  # ``now`` of the first vote (the vote deadline's start)
    # after the vote: P2P establishment
    epoch: int = -1
    members: list[int] = field(default_factory=list)  # ring order of the proposed set
    member_set: set[int] = field(default_factory=set)  # the same peers, for O(1) membership tests
    newcomers: set[int] = field(default_factory=set)
    confirmed: set[int] = field(default_factory=set)
    failed: bool = False
    failure_reason: str = ""
    # optimize only: bandwidth measurement rounds still to run
    measure_rounds: list[list[tuple[int, int]]] = field(default_factory=list)
    measuring: set[int] = field(default_factory=set)
    establishing: bool = False
    establish_started: float = 0.0  # ``now`` when EstablishP2P went out (the P2P setup deadline's start)
    # the members' epoch while the round sets up (they move at its TopologyResult; -1: not set up yet)
    from_epoch: int = -1

    # -- the round interface (pccl/master/rounds/base.py)

    group = None  # ring-wide

    @property
    def key(self) -> VoteKey:
        return ("topology", None)

    @property
    def voting(self) -> bool:
        """Still collecting votes: neither measuring bandwidth (optimize) nor setting up the P2P
        connections of its epoch (``epoch`` >= 0 exactly while ``establishing``)."""
        return not self.establishing and not self.measuring and not self.measure_rounds

    @property
    def ballots(self) -> Collection[int]:
        return self.votes

    @property
    def vote_name(self) -> str:
        return f"{self.kind}_topology vote"

    def waits(self, members: set[int]) -> tuple[str, set[int], str] | None:
        if self.establishing:
            return (f"{self.kind}_topology epoch {self.epoch}: P2P setup", set(self.members) - self.confirmed,
                    f" (newcomers {sorted(self.newcomers)})")
        if self.measuring or self.measure_rounds:
            return f"{self.kind}_topology: bandwidth measurement", set(self.measuring), ""
        if self.votes:
            return self.vote_name, members - self.votes, ""
        return None

    def busy(self, ring: list[int]) -> set[int]:
        return set() if self.voting else set(self.members) | set(self.measuring) | set(ring)

    def vote_waits(self) -> list[tuple[int, VoteWait]]:
        if not self.voting:
            return []
        return [(p, VoteWait(f"{self.kind}_topology")) for p in sorted(self.votes)]

    # -- the vote

    def refusal(self, peer_id: int, kind: str) -> Expel | None:
        """Why ``peer_id``'s ``kind`` vote breaks the protocol (None: it counts)."""
        if kind != self.kind:
            return Expel(f"{kind}_topology while the others run {self.kind}_topology")
        if peer_id in self.votes or not self.voting:
            return Expel(f"duplicate {kind} topology vote")
        return None

    def complete(self, ring: list[int]) -> bool:
        """Every accepted peer (``ring``) voted, and the round still votes."""
        return self.voting and unanimous(self.votes, len(ring), lambda: ring) is not None

    def withdraw(self, peer_ids: Collection[int]) -> list[int]:
        """Take the ballots of ``peer_ids`` back (a failed call); the voters withdrawn, sorted."""
        if not self.voting:
            return []
        gone = sorted(set(peer_ids) & self.votes)
        self.votes.difference_update(gone)
        return gone

    # -- bandwidth measurement (optimize)

    def next_measurement(self, where: Callable[[int], tuple[str, int] | None],
                         ) -> dict[int, list[list[Any]]] | None:
        """The next measurement round's targets by source peer (``[peer, host, port]`` rows; ``where``
        gives a connected peer's address), skipping rounds left empty by losses; None: none is left."""
        while self.measure_rounds:
            edges = self.measure_rounds.pop(0)
            by_src: dict[int, list[list[Any]]] = {}
            for a, b in edges:
                src, dst = where(a), where(b)
                if src is not None and dst is not None:
                    by_src.setdefault(a, []).append([b, dst[0], dst[1]])
            if by_src:
                self.measuring = set(by_src)
                return by_src
        self.measuring = set()
        return None

    def measured(self, peer_id: int) -> bool:
        """``peer_id`` reported its measurements; True when the round in progress is over."""
        self.measuring.discard(peer_id)
        return not self.measuring

    # -- the P2P setup

    def begin_setup(self, epoch: int, from_epoch: int, members: list[int], newcomers: set[int],
                    now: float) -> None:
        """EstablishP2P goes out for ``epoch`` (``members`` in ring order, ``newcomers`` among them)."""
        if self.from_epoch < 0:
            self.from_epoch = from_epoch
        self.epoch = epoch
        self.members = list(members)
        self.member_set = set(members)
        self.newcomers = set(newcomers)
        self.establishing = True
        self.establish_started = now

    def confirm(self, peer_id: int, msg: m.P2PConnectionsDone) -> Expel | None:
        """``peer_id``'s P2PConnectionsDone (the caller checked it is a member of this setup)."""
        if peer_id in self.confirmed:
            return Expel("duplicate P2PConnectionsDone")
        self.confirmed.add(peer_id)
        if not msg.success:
            self.failed = True
            why = f"peer {peer_id} could not connect to {msg.failed_peers}: {msg.reason}"
            self.failure_reason = why.rstrip(": ")
        return None

    def expects(self, peer_id: int, epoch: int) -> bool:
        """Whether a P2PConnectionsDone of ``peer_id`` for ``epoch`` belongs to this setup (a late answer
        for a round that already ended does not)."""
        return self.establishing and epoch == self.epoch and peer_id in self.member_set

    def outcome(self) -> bool | None:
        """The setup's end: False failed, True every member confirmed, None still running (or voting)."""
        if not self.establishing:
            return None
        if self.failed:
            return False
        if len(self.confirmed) < len(self.member_set) or not self.member_set <= self.confirmed:
            return None
        return True

    def late(self) -> list[int]:
        """The members that have not confirmed their setup."""
        return [p for p in self.members if p not in self.confirmed]

    def old_members(self) -> list[int]:
        """The members that were accepted before this round (they get its TopologyResult)."""
        return [p for p in self.members if p not in self.newcomers]

    # -- a peer lost

    def peer_lost(self, peer_id: int) -> Loss:
        """``peer_id`` left: its ballot is withdrawn, its measurements dropped; a member of the setup
        fails it (its neighbours were told to connect to it)."""
        self.votes.discard(peer_id)
        if self.establishing:
            if peer_id in self.member_set:
                self.members.remove(peer_id)
                self.member_set.discard(peer_id)
                self.newcomers.discard(peer_id)
                self.confirmed.discard(peer_id)
                self.failed = True
                self.failure_reason = f"peer {peer_id} was lost during the topology update"
            return Loss.CHECK_SETUP
        if self.measuring or self.measure_rounds:
            self.measuring.discard(peer_id)
            self.measure_rounds = [[e for e in r if peer_id not in e] for r in self.measure_rounds]
            return Loss.NOTHING if self.measuring else Loss.NEXT_MEASUREMENT
        return Loss.CHECK_VOTE if self.votes else Loss.DROP

    def retry(self, ring: list[int]) -> TopologyRound:
        """A fresh round of the same kind that re-runs the setup without the late members (its voters:
        the accepted peers ``ring``, the members' epoch unchanged)."""
        return TopologyRound(kind=self.kind, votes=set(ring), from_epoch=self.from_epoch)


def record_bandwidth(peer_id: int, rows: list[list[Any]], now: float,
                     bandwidth: dict[tuple[int, int], tuple[float, float]],
                     latency: dict[tuple[int, int], float]) -> None:
    """Store ``peer_id``'s BandwidthReport rows: ``[to, bytes/s]`` or ``[to, bytes/s, one-way seconds]``
    (peers before protocol 5 report bandwidth only); malformed rows are skipped."""
    for row in rows:
        if len(row) in (2, 3) and isinstance(row[0], int) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in row[1:]
        ):
            key = (peer_id, row[0])
            bw = float(row[1])
            bandwidth[key] = (bw, now)
            lat = float(row[2]) if len(row) == 3 else -1.0
            if bw > 0 and math.isfinite(lat) and lat >= 0:
                latency[key] = lat
            else:
                latency.pop(key, None)


def bandwidth_matrix(ring: list[int], bandwidth: Mapping[tuple[int, int], tuple[float, float]],
                     ) -> list[list[float | None]]:
    """The measured bytes/s between the peers of ``ring`` (None: itself, or nothing measured)."""
    return [
        [None if i == j else (bandwidth.get((a, b), (0.0, 0.0))[0] or None) for j, b in enumerate(ring)]
        for i, a in enumerate(ring)
    ]


__all__ = ["TOPOLOGY_KEY", "Loss", "TopologyRound", "bandwidth_matrix", "failed_result", "failure_code",
           "plan_measurements", "record_bandwidth"]
