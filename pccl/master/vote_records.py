"""What the dispatcher's parts read of the vote records: which rounds are open or running, whether a
dropped member's group went on without it, the open votes by age.

Pure (no trio, sockets or clocks). :class:`VoteRecords` answers, from the open rounds, the questions the
rules of a returning member (pccl/master/rejoin.py, pccl/master/away.py), of a peer leaving
(pccl/master/removal.py), of the newcomers' grace (pccl/master/admission.py) and of a topology round a
broken link lost (pccl/master/ring_setup.py) ask, so that the votes' own code stays in their rounds. It
only reads; it works on the dispatcher through :class:`VoteRecordsCore`.
"""

from __future__ import annotations

from typing import Protocol

from . import away as _away
from .admission import OpenVote
from .away import AwayBook
from .ops_in_doubt import DoubtBook, Key
from .rounds.base import Round
from .rounds.collective import CollectiveRound
from .rounds.sync import SyncRound
from .rounds.topology import TOPOLOGY_KEY as _TOPOLOGY_KEY
from .rounds.topology import TopologyRound


class VoteRecordsCore(Protocol):
    """What :class:`VoteRecords` reads of the master's dispatcher
    (:class:`~pccl.master.state.MasterState`)."""

    away: AwayBook
    doubts: DoubtBook
    _ops: dict[tuple[int, int], CollectiveRound]
    _syncs: dict[int, SyncRound]
    _topology: TopologyRound | None

    def _open_rounds(self, ordered: bool = True, with_ops: bool = True) -> list[Round]: ...


class VoteRecords:
    """The reads of ``core``'s vote records (see the module docstring)."""

    def __init__(self, core: VoteRecordsCore) -> None:
        self.core = core

    def runs_without(self, peer_id: int, group: int) -> bool:
        """True when ``group`` runs a collective or sync, or a topology round sets up, without member
        ``peer_id``, which this (live) master dropped: its outcome decides whether to take it back."""
        core = self.core
        if not core.doubts.was_dropped(peer_id):
            return False
        if any(op.running and g == group for (g, _), op in core._ops.items()):
            return True
        sync = core._syncs.get(group)
        topology = core._topology
        return (sync is not None and sync.running) or (topology is not None and topology.establishing)

    def round_state(self, key: Key) -> str:
        """The vote round of ``key`` now: none, open (votes, not started) or running."""
        core = self.core
        kind, group, tag = key
        if kind == "topology":
            topology = core._topology
            if topology is None:
                return _away.NONE
            voting = topology.voting
            return _away.OPEN if voting else _away.RUNNING
        rnd: CollectiveRound | SyncRound | None = core._ops.get((group, tag)) if kind == "op" \
            else core._syncs.get(group)
        return _away.NONE if rnd is None else _away.RUNNING if rnd.running else _away.OPEN

    def kept(self, peer_id: int, key: Key) -> bool | None:
        """Whether the others still vote for the call of ``key`` that ``peer_id`` abandoned (see
        :meth:`AwayBook.kept_votes`)."""
        core = self.core
        return core.away.kept_votes(peer_id, key, self.round_state(key))

    def rounds_of(self, group: int) -> dict[Key, str]:
        """``group``'s collective and sync rounds now, by key (open or running)."""
        core = self.core
        rounds = {("op", g, t): _away.RUNNING if op.running else _away.OPEN
                  for (g, t), op in core._ops.items() if g == group}
        sync = core._syncs.get(group)
        if sync is not None:
            rounds[("sync", group, -1)] = _away.RUNNING if sync.running else _away.OPEN
        if core._topology is not None:
            rounds[_TOPOLOGY_KEY] = self.round_state(_TOPOLOGY_KEY)
        return rounds

    def open_votes_by_age(self) -> list[OpenVote]:
        """Every vote others joined that has not completed, for the newcomers' grace
        (:func:`~pccl.master.admission.newcomer_waits`): the ring-wide ones, the syncs, the collective
        votes, in that order (the first of equally old ones is blamed)."""
        core = self.core
        rounds = sorted(core._open_rounds(ordered=False), key=lambda r: r.key[0] == "op")
        out: list[OpenVote] = []
        for rnd in rounds:
            if rnd.voting and rnd.ballots:
                kind, which = rnd.key
                if kind == "op":
                    assert isinstance(which, tuple)
                    out.append(OpenVote("collective", rnd.opened, rnd.group, rnd.ballots, which[1]))
                elif kind == "sync":
                    out.append(OpenVote("sync", rnd.opened, rnd.group, rnd.ballots))
                else:
                    out.append(OpenVote(rnd.vote_name.removesuffix(" vote"), rnd.opened, None, rnd.ballots))
        return out
