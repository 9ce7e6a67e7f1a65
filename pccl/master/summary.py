"""The master state's summary (``MasterState.statistics()``): counts of its members, votes, rounds, live
heals and holds, as the tests, the status page and the logs read them.

Pure (no trio, sockets or clocks): :func:`statistics` only reads the dispatcher, through
:class:`SummaryCore`.
"""

from __future__ import annotations

from typing import Any, Protocol

from .heals import HealBook
from .issued import IssuedSet
from .membership import PeerRecord
from .ops_in_doubt import DoubtBook
from .rejoin import Rebuild
from .rounds.collective import CollectiveRound, CollectiveVotes
from .rounds.sync import SyncRound
from .rounds.topology import TopologyRound
from .votes import PendingRound


class SummaryCore(Protocol):
    """What :func:`statistics` reads of the master's dispatcher (:class:`~pccl.master.state.MasterState`)."""

    peers: dict[int, PeerRecord]
    ring: list[int]
    epoch: int
    generation: int
    collectives: CollectiveVotes
    heals: HealBook
    doubts: DoubtBook
    last_revision: dict[int, int]
    rebuild: Rebuild | None
    _topology: TopologyRound | None
    _pending: PendingRound
    _ops: dict[tuple[int, int], CollectiveRound]
    _syncs: dict[int, SyncRound]
    _issued: IssuedSet

    @property
    def enforced(self) -> bool: ...

    @property
    def resumed(self) -> bool: ...

    def registered(self) -> list[int]: ...


def statistics(core: SummaryCore) -> dict[str, Any]:
    """A summary of the master state ``core`` (tests assert on it)."""
    groups: dict[int, int] = {}
    for p in core.ring:
        groups[core.peers[p].group] = groups.get(core.peers[p].group, 0) + 1
    topology = core._topology
    running = core.collectives.running()
    return {
        "accepted": len(core.ring),
        "registered": len(core.registered()),
        "connected": len(core.peers),
        "groups": dict(sorted(groups.items())),
        "epoch": core.epoch,
        "topology_round": topology.kind if topology else None,
        "topology_votes": len(topology.votes) if topology else 0,
        "pending_votes": len(core._pending.votes),
        "collectives_running": running,
        "collectives_voting": len(core._ops) - running,
        "collectives_fast": core.collectives.fast_starts,
        "speculative_go_held": core.collectives.go_held,
        "reservations": len(core.collectives.reserved),
        "syncs_in_progress": len(core._syncs),
        "heals": core.heals.statistics(),
        "revisions": dict(core.last_revision),
        "generation": core.generation,
        "rebuilding": core.rebuild is not None,
        "credential_batches": core._issued.batches,
        "in_doubt": len(core.doubts.open_doubts()),
        "quorum_enforced": core.enforced,
        "held": not core.resumed,
    }


__all__ = ["SummaryCore", "statistics"]
