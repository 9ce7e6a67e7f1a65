"""What the vote rounds ask of the master: :class:`MasterContext`, the one object that answers the rounds'
context Protocols (:class:`~pccl.master.rounds.base.RoundContext`, :class:`~pccl.master.rounds.collective.
CollectiveContext`, :class:`~pccl.master.rounds.sync.SyncContext`) by holding the master core's parts,
with the live-heal hooks the sync rounds call (pccl/master/heals.py).

Pure (no trio, sockets or clocks). It is on the hot path of every ballot (``group_size``, ``left_out``,
the vote checks): the parts it reads are looked up once, when it is built; the scalars that change (the
time of the event, the epoch, the sequence numbers, whether the master is held) are read from the
dispatcher through :class:`ContextCore`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from ..wire import messages as m
from .effects import Effect, Send
from .heals import HealBook
from .lost import LostBook
from .membership import Membership
from .ops_in_doubt import DoubtBook, Key
from .peers_pending import PeersPending
from .rounds.collective import CollectiveVotes
from .rounds.sync import SyncVotes
from .transfers import SyncProgress

_NOBODY: frozenset[int] = frozenset()


class ContextCore(Protocol):
    """What :class:`MasterContext` reads of the master's dispatcher
    (:class:`~pccl.master.state.MasterState`)."""

    members: Membership
    heals: HealBook
    collectives: CollectiveVotes
    syncs: SyncVotes
    doubts: DoubtBook
    lost: LostBook
    peers_pending: PeersPending
    last_revision: dict[int, int]
    epoch: int
    _now: float
    _op_seq: int
    _sync_seq: int

    @property
    def resumed(self) -> bool: ...

    def accepted(self, group: int | None = None) -> list[int]: ...


class MasterContext:
    """The vote rounds' view of the master ``core`` (see the module docstring); also where a vote is
    checked for completion (:meth:`check_op`, :meth:`check_sync`: not while the master is held)."""

    def __init__(self, core: ContextCore) -> None:
        self._core = core
        self._members = core.members
        self._peers = core.members.peers
        self._heals = core.heals
        self._collectives = core.collectives
        self._syncs = core.syncs

    # -- every round (RoundContext)

    @property
    def now(self) -> float:
        """The time of the event being handled."""
        return self._core._now

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._core.epoch

    def group_size(self, group: int) -> int:
        """How many accepted peers ``group`` has (counted once per ring change, not per vote)."""
        return self._members.group_size(group)

    def accepted(self, group: int | None = None) -> list[int]:
        """Accepted peers in ring order (optionally of one group): the membership walk, asked of the
        dispatcher (:meth:`MasterState.accepted`), at most once per vote."""
        return self._core.accepted(group)

    def table(self, ids: list[int]) -> list[m.PeerRow]:
        """Peer-table rows for ``ids`` (in that order)."""
        return self._members.table(ids)

    def known(self, peer_id: int) -> bool:
        """Whether ``peer_id`` is connected."""
        return peer_id in self._peers

    def left_out(self, group: int, kind: str) -> frozenset[int]:
        """Peers of ``group`` that no vote of ``kind`` ("op" or "sync") waits on: they heal (or, for
        collectives, are behind after a heal). Asked by the group's votes only: a vote that leaves a
        healing peer out means the group went on without it (:meth:`HealBook.group_voted`). With no
        live heal and nobody behind (the common case) nothing else is asked."""
        heals = self._heals
        if kind == "op":
            if not heals.groups:
                return _NOBODY
            out = heals.out_of_ops(group)
        else:
            if not heals.healing and not heals.observers.joining:
                return _NOBODY
            out = heals.out_of_syncs(group)
        if out and heals.healing:
            heals.group_voted(group)
        return out

    def _settled(self, key: Key, seq: int, committed: bool) -> None:
        """Round ``key`` (kind, group, tag) of ``seq`` ended: the books in doubt learn it; committed, the
        lost book forgets the round and the group made progress."""
        core = self._core
        core.doubts.settle(key, seq, committed)
        if committed:
            core.lost.settled(key)
            core.doubts.progressed(key[1])

    # -- collectives (CollectiveContext)

    def registered_in(self, group: int) -> list[int]:
        """The peers of ``group`` waiting to be accepted."""
        peers = self._peers
        return [r for r in self._members.registered() if peers[r].group == group]

    def next_op_seq(self) -> int:
        """A fresh op_seq of this master's generation."""
        core = self._core
        core._op_seq += 1
        return core._op_seq

    def op_settled(self, group: int, tag: int, seq: int, committed: bool) -> None:
        """A running collective ended: the books in doubt (and, committed, the lost book) learn it."""
        self._settled(("op", group, tag), seq, committed)

    def check_op(self, key: tuple[int, int]) -> list[Effect]:
        """Complete the collective vote of ``key`` if its group voted (not while the master is held)."""
        return self._collectives.check(key, self) if self._core.resumed else []

    # -- shared state (SyncContext)

    def revision_of(self, group: int) -> int | None:
        """The revision ``group``'s last sync committed (None: none)."""
        return self._core.last_revision.get(group)

    def next_sync_seq(self) -> int:
        """A fresh sync_seq of this master's generation."""
        core = self._core
        core._sync_seq += 1
        return core._sync_seq

    def sync_settled(self, group: int, seq: int, committed: bool, revision: int) -> None:
        """A running sync ended: committed, its revision is the group's; the books in doubt learn it."""
        if committed:
            self._core.last_revision[group] = revision
        self._settled(("sync", group, -1), seq, committed)

    def check_sync(self, group: int) -> list[Effect]:
        """Complete the sync vote of ``group`` if it voted (not while the master is held)."""
        return self._syncs.check(group, self) if self._core.resumed else []

    # -- live heals (pccl/master/heals.py)

    def may_go_live(self, rows_of: dict[int, list[list[Any]]], group: int = 0,
                    content: dict[str, int] | None = None) -> bool:
        """Whether a sync whose participants fetch ``rows_of`` runs as a live heal (HealBook.may_go_live)."""
        return self._heals.may_go_live(rows_of, group, content, started=group in self._core.last_revision)

    def collective_started(self, group: int, voters: list[int]) -> None:
        """A collective of ``group`` starts with ``voters`` (HealBook.collective_started)."""
        self._heals.collective_started(group, voters)

    def go_live(self, group: int, seq: int, revision: int, rows_of: dict[int, list[list[Any]]],
                table: list[m.PeerRow], note: str, progress: SyncProgress | None) -> list[Effect]:
        """Sync ``seq`` of ``group`` (its round already closed) runs as a live heal: settled for its
        holders now; the group's reservations revoked (its next commence names the ring without the
        fetchers, the numbers reserved after it are for that ring); the votes that waited for a fetcher
        are checked again."""
        self.sync_settled(group, seq, True, revision)
        effects: list[Effect] = []
        for p in rows_of:
            self._peers[p].admitted = None  # (proven: it takes part in a sync; no admission grace)
        if self._collectives.reserved.revoke(group):  # the members' next rings leave the fetchers out
            revoked = m.ReservationsRevoked(reason="a member of the group heals")
            effects += [Send(p, revoked) for p in rows_of]
        effects += self._heals.go_live(seq, group, revision, rows_of, table, note, progress)
        for key in [k for k in self._collectives.ops if k[0] == group]:
            effects += self.check_op(key)
        return effects + self._core.peers_pending.check()

    def synced(self, peers: Collection[int]) -> None:
        """``peers`` ended an ordinary sync successfully: one behind after a live heal is current again."""
        for p in peers:
            self._heals.joined(p)

    def heal_busy(self, group: int, final: bool) -> bool:
        """Whether a healed peer's result must wait: its group runs a sync (or, for a final result, a
        collective) that it could not join."""
        rnd = self._syncs.rounds.get(group)
        return (rnd is not None and rnd.running) or (
            final and any(op.running for (g, _), op in self._collectives.ops.items() if g == group))


__all__ = ["ContextCore", "MasterContext"]
