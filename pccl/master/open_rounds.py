"""The walks over every open vote round: list them, check one, a peer leaving them all, re-check them all,
the open votes the vote timeout reads, and the votes a re-registration reports lost with the master.

Pure (no trio, sockets or clocks). :class:`OpenRounds` is the one loop over the rounds of
pccl/master/rounds/ (and :class:`~pccl.master.votes.PendingRound`); what a kind of round does is
dispatched here, once per action (check, peer lost), old orders kept (docs/master.md "Vote rounds"). It
works on the dispatcher through :class:`OpenRoundsCore`.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..wire import messages as m
from .context import MasterContext
from .effects import Effect, Send
from .heals import HealBook
from .lost import LostBook
from .membership import PeerRecord
from .ops_in_doubt import Key
from .peers_pending import PeersPending
from .ring_setup import RingSetup
from .round_waits import RoundWaits
from .rounds.base import Round, VoteKey
from .rounds.collective import CollectiveRound, CollectiveVotes
from .rounds.sync import SyncRound, SyncVotes
from .rounds.topology import TopologyRound
from .votes import PendingRound


class OpenRoundsCore(Protocol):
    """What :class:`OpenRounds` uses of the master's dispatcher (:class:`~pccl.master.state.MasterState`)."""

    peers: dict[int, PeerRecord]
    ring: list[int]
    context: MasterContext
    collectives: CollectiveVotes
    syncs: SyncVotes
    heals: HealBook
    lost: LostBook
    ring_setup: RingSetup
    peers_pending: PeersPending
    round_waits: RoundWaits
    _pending: PendingRound
    _topology: TopologyRound | None
    _topology_owed: set[int]
    _ops: dict[tuple[int, int], CollectiveRound]
    _syncs: dict[int, SyncRound]
    _sync_rows: dict[int, tuple[list[list[Any]], int]]

    @property
    def resumed(self) -> bool: ...

    def _rows_due(self) -> list[Effect]: ...


class OpenRounds:
    """The walks over ``core``'s open rounds (see the module docstring)."""

    def __init__(self, core: OpenRoundsCore) -> None:
        self.core = core

    def rounds(self, ordered: bool = True, with_ops: bool = True) -> list[Round]:
        """Every open vote round: are_peers_pending, topology, the collectives, the syncs; ``ordered``:
        collectives and syncs by key, else in the order they opened (the order the votes are re-checked
        in); ``with_ops`` False: without the collectives. A list: walks that act on a round may close it."""
        core = self.core
        rounds: list[Round] = [core._pending]
        if core._topology is not None:
            rounds.append(core._topology)
        if with_ops:
            rounds += [op for _, op in sorted(core._ops.items())] if ordered else list(core._ops.values())
        rounds += [sync for _, sync in sorted(core._syncs.items())] if ordered else list(core._syncs.values())
        return rounds

    def check(self, key: VoteKey) -> list[Effect]:
        """Complete the open vote ``key`` if every member it concerns voted (and the master is not held)."""
        core = self.core
        kind, which = key
        if kind == "op":
            assert isinstance(which, tuple)
            return core.context.check_op(which)
        if kind == "sync":
            assert isinstance(which, int)
            return core.context.check_sync(which)
        return core.ring_setup.check_vote() if kind == "topology" else core.peers_pending.check()

    def recheck(self) -> list[Effect]:
        """Re-check every pending vote (the rebuild ended); credential rows still owed go out first
        (:meth:`MasterState._rows_due`)."""
        effects = self.core._rows_due()
        for rnd in self.rounds(ordered=False):
            effects += self.check(rnd.key)
        return effects

    def peer_lost(self, key: VoteKey, peer_id: int) -> list[Effect]:
        """``peer_id`` left the round ``key``: its ballot or part is withdrawn, the round re-checked."""
        core = self.core
        kind, which = key
        if kind == "op":
            assert isinstance(which, tuple)
            return core.collectives.peer_lost(which, peer_id, core.context, core.resumed)
        if kind == "sync":
            assert isinstance(which, int)
            return core.syncs.peer_lost(which, peer_id, core.context, core.resumed)
        # (are_peers_pending: the ballot was dropped with the peer's other traces in leave())
        return core.ring_setup.peer_lost(peer_id) if kind == "topology" else core.peers_pending.check()

    def leave(self, peer_id: int, group: int, was_accepted: bool) -> list[Effect]:
        """Peer ``peer_id`` of ``group`` is gone: it leaves every vote, round and live heal, its group's
        reservations are revoked (it was a member: ``was_accepted``), and every vote is re-checked without
        it (the topology round first, as it always was)."""
        core = self.core
        core._pending.peer_lost(peer_id)
        core._topology_owed.discard(peer_id)
        core._sync_rows.pop(peer_id, None)
        revoked: list[Effect] = []
        if was_accepted and core.collectives.reserved.revoke(group):
            # The group changed: no speculative start until its next op completes. Members that are not
            # voting yet hear it now, so their next call takes the slow path (whose commence names the
            # living members) instead of starting on a ring with the lost peer and being aborted.
            why = f"peer {peer_id} of group {group} was lost"
            revoked = [Send(p, m.ReservationsRevoked(reason=why))
                       for p in core.ring if core.peers[p].group == group]
        effects: list[Effect] = revoked + core.heals.peer_lost(peer_id)
        rounds = self.rounds(ordered=False)
        for rnd in sorted(rounds, key=lambda r: r.key[0] != "topology"):
            effects += self.peer_lost(rnd.key, peer_id)
        return effects

    def open_votes(self, with_ops: bool = True) -> list[tuple[str, float, set[int], list[int], VoteKey]]:
        """Every vote that others have joined and that still misses some accepted peers, as
        ``(what, when its first vote came, peers that have not voted, peers that have, which vote)``
        (``with_ops`` False: all but the collective votes)."""
        core = self.core
        if not core.resumed:
            return []  # rebuilding: the votes wait for the returning members, not on anyone's vote
        groups = core.round_waits.group_sets()
        known = core.peers.keys()
        return [(rnd.vote_name, rnd.opened, live, sorted(rnd.ballots), rnd.key)
                for rnd in self.rounds(with_ops=with_ops) if rnd.voting and rnd.ballots
                if (live := groups.get(rnd.group, set()).difference(rnd.ballots) & known)]

    def fail_lost(self, keys: list[Key]) -> list[Effect]:
        """A re-registration named ``keys`` lost with the master: fail the votes for them already
        waiting here (members that voted at this master before the report came), once each."""
        core = self.core
        effects: list[Effect] = []
        for key in keys:
            kind, group, tag = key
            if kind == "op":
                effects += core.collectives.fail_lost((group, tag), lambda p: core.lost.owes(p, key))
            else:
                effects += core.syncs.fail_lost(group, lambda p: core.lost.owes(p, key))
        return effects


__all__ = ["OpenRounds", "OpenRoundsCore"]
