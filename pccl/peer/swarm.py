"""Which donor sends which chunk of a shared-state fetch (pure: no trio, sockets or clocks).

A fetch is a set of :class:`Item`\\ s: a *manifest* item (the chunk sums of one large tensor, checked
against its elected content hash) or a *data* item (byte ranges, :class:`Piece`\\ s: one chunk of a large
tensor, or a batch of whole small tensors). :class:`SwarmSchedule` hands items to donors as they ask
(:meth:`SwarmSchedule.next_for`): a donor that delivers faster asks more often, so each donor's share
follows its measured speed. When nothing is left to hand out, an idle donor *steals* an item that has
been in flight elsewhere for more than twice the typical item time (one copy each; the first verified
copy wins), so the slowest donor does not hold the tail. A donor that fails or stalls gives its items in
flight back; one that sends bytes that fail their sums is *excluded* for the rest of the fetch and its
items go to the others. The trio side is :mod:`pccl.peer.heal`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: Bytes per chunk of a large tensor (a multiple of :data:`pccl.kernels.hashing.CHUNK_ALIGN`).
CHUNK_BYTES = 1 << 20
#: Items a donor connection has requested and not yet delivered (the pipeline depth).
DEPTH = 2
#: An item in flight for more than this many typical item times may be stolen by an idle donor.
STEAL_FACTOR = 2.0


@dataclass(frozen=True)
class Piece:
    """A byte range of one tensor and what its bytes must hash to.

    ``whole``: the range is the whole tensor and ``expected`` its content hash; otherwise ``expected``
    is the chunk sum of the range, which starts at block ``offset // CHUNK_ALIGN``.
    """

    key: str
    offset: int
    nbytes: int
    expected: int
    whole: bool


@dataclass
class Item:
    """A unit of work for one donor: a manifest (``manifest_key``) or data ``pieces``."""

    id: int
    holders: frozenset[int]
    pieces: tuple[Piece, ...] = ()
    manifest_key: str = ""
    nbytes: int = 0
    copies: dict[int, float] = field(default_factory=dict)  # donor -> when it was handed out
    done: bool = False


@dataclass
class DonorStats:
    """What one donor delivered so far."""

    bytes: int = 0
    items: int = 0
    failed: str = ""
    excluded: str = ""


class SwarmSchedule:
    """The items of one fetch and who has them (see the module docstring).

    Args:
        items: the items known at the start (manifests and batches of whole tensors).
        donors: every donor that may serve some item.
    """

    def __init__(self, items: Iterable[Item], donors: Iterable[int]) -> None:
        self.items: dict[int, Item] = {}
        self.pending: list[int] = []
        self.donors: dict[int, DonorStats] = {d: DonorStats() for d in donors}
        self._next_id = 0
        self._typical = 0.0  # exponential average of an item's time from hand-out to delivery
        self.duplicate_bytes = 0
        self.bad_bytes = 0
        self.stolen = 0
        self.bytes_total = 0
        self.bytes_done = 0
        self._undone = 0  # items not delivered (finished: none)
        self._orphans = 0  # items without any holder (stranded from the start)
        for item in items:
            self.add(item)

    def new_id(self) -> int:
        """A fresh item id."""
        self._next_id += 1
        return self._next_id

    def add(self, item: Item) -> None:
        """Add an item to hand out (ids must be unique; :meth:`new_id` makes them)."""
        self._next_id = max(self._next_id, item.id)
        self.items[item.id] = item
        self.pending.append(item.id)
        self.bytes_total += item.nbytes
        self._undone += not item.done
        self._orphans += not item.holders

    # -- queries ---------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Every item delivered."""
        return self._undone == 0

    def usable(self, donor: int) -> bool:
        """Whether ``donor`` is neither failed nor excluded."""
        s = self.donors.get(donor)
        return s is not None and not s.failed and not s.excluded

    def stranded(self) -> list[Item]:
        """Items not delivered that no usable donor can serve (the fetch cannot complete)."""
        if not self._orphans and all(self.usable(d) for d in self.donors):
            return []  # (called after every delivery: no scan of every item while nothing was lost)
        return [i for i in self.items.values()
                if not i.done and not any(self.usable(h) for h in i.holders)]

    def next_for(self, donor: int, now: float) -> Item | None:
        """The next item for ``donor`` to send (recorded as handed out), or None.

        Pending items first, in order; then, when none is left for it, an item in flight at another
        donor for more than ``STEAL_FACTOR`` typical item times (:meth:`next_steal_at`).
        """
        if not self.usable(donor):
            return None
        for pos, item_id in enumerate(self.pending):
            item = self.items[item_id]
            if donor in item.holders:
                del self.pending[pos]
                item.copies[donor] = now
                return item
        if self._typical <= 0:
            return None
        for item in self._stealable(donor):
            if now >= self._steal_time(item):  # the same expression as next_steal_at's: no busy wait
                item.copies[donor] = now
                self.stolen += 1
                return item
        return None

    def next_steal_at(self, donor: int) -> float | None:
        """When an item first becomes stealable by ``donor`` (None: none will without other news)."""
        if self._typical <= 0 or not self.usable(donor):
            return None
        times = [self._steal_time(i) for i in self._stealable(donor)]
        return min(times) if times else None

    def _steal_time(self, item: Item) -> float:
        return min(item.copies.values()) + STEAL_FACTOR * self._typical

    def _stealable(self, donor: int) -> list[Item]:
        return [i for i in self.items.values()
                if not i.done and i.copies and donor not in i.copies and len(i.copies) == 1
                and donor in i.holders]

    # -- events ----------------------------------------------------------------------------------

    def delivered(self, item: Item, donor: int, now: float) -> bool:
        """``donor`` delivered ``item``, verified. Returns False when another copy came first (its bytes
        are to be dropped)."""
        stats = self.donors[donor]
        stats.bytes += item.nbytes
        stats.items += 1
        started = item.copies.pop(donor, now)
        if item.done:
            self.duplicate_bytes += item.nbytes
            return False
        if item.nbytes:  # data items only: a manifest's round trip says nothing of a chunk's time
            took = max(now - started, 0.0)
            self._typical = took if self._typical <= 0 else 0.8 * self._typical + 0.2 * took
        item.done = True
        self._undone -= 1
        self.bytes_done += item.nbytes
        return True

    def reopen(self, item: Item) -> None:
        """A delivered ``item``'s bytes may have been overwritten since (a copy received in place, whose
        sums then failed): it is to be delivered again (hand it back with :meth:`returned`)."""
        if item.done:
            item.done = False
            self._undone += 1
            self.bytes_done -= item.nbytes

    def manifest_items(self, items: Iterable[Item]) -> None:
        """Add the data items a verified manifest produced."""
        for item in items:
            self.add(item)

    def returned(self, item: Item, donor: int) -> None:
        """``donor`` will not deliver ``item`` (it failed, stalled or was excluded): hand it out again."""
        item.copies.pop(donor, None)
        if not item.done and not item.copies and item.id not in self.pending:
            self.pending.insert(0, item.id)

    def failed(self, donor: int, reason: str, in_flight: Iterable[Item]) -> None:
        """``donor``'s connection broke or stalled: its ``in_flight`` items go back to the others."""
        self.donors[donor].failed = reason or "failed"
        for item in reversed(list(in_flight)):  # back to the front of the queue, in their order
            self.returned(item, donor)

    def corrupt(self, donor: int, reason: str, nbytes: int, in_flight: Iterable[Item]) -> None:
        """``donor`` sent ``nbytes`` that failed their sums: excluded for the rest of the fetch."""
        self.donors[donor].excluded = reason or "corrupt"
        self.bad_bytes += nbytes
        for item in reversed(list(in_flight)):
            self.returned(item, donor)

    def statistics(self) -> dict[str, Any]:
        """Bytes and items done and in all, the donors (bytes each, failed and excluded ones), bytes
        fetched twice (``duplicate_bytes``), bytes that failed verification (``bad_bytes``), steals."""
        data = [i for i in self.items.values() if not i.manifest_key]
        return {
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "chunks_done": sum(1 for i in data if i.done),
            "chunks_total": len(data),
            "donors": {d: s.bytes for d, s in self.donors.items()},
            "donors_active": sum(1 for d in self.donors if self.usable(d)),
            "donors_failed": {d: s.failed for d, s in self.donors.items() if s.failed},
            "donors_excluded": {d: s.excluded for d, s in self.donors.items() if s.excluded},
            "duplicate_bytes": self.duplicate_bytes,
            "bad_bytes": self.bad_bytes,
            "stolen": self.stolen,
        }


#: Whole small tensors one data item may batch.
BATCH_PIECES = 256


def plan_items(schedule: SwarmSchedule, fetch: Iterable[tuple[str, int, list[int]]], sizes: dict[str, int],
               chunk_bytes: int = CHUNK_BYTES) -> list[Item]:
    """The first items of a fetch: a manifest per tensor larger than ``chunk_bytes``, and the smaller
    tensors batched (same holders, at most ``chunk_bytes`` and :data:`BATCH_PIECES` a batch).

    Args:
        schedule: gives the item ids.
        fetch: ``(key, elected content hash, holders)`` rows of the plan.
        sizes: bytes of each key.
        chunk_bytes: the chunk size.
    """
    items: list[Item] = []
    open_batches: dict[frozenset[int], Item] = {}
    for key, expected, holders in fetch:
        hs = frozenset(holders)
        n = sizes[key]
        if n > chunk_bytes:
            items.append(Item(id=schedule.new_id(), holders=hs, manifest_key=key))
            continue
        piece = Piece(key=key, offset=0, nbytes=n, expected=expected, whole=True)
        batch = open_batches.get(hs)
        if batch is None or batch.nbytes + n > chunk_bytes or len(batch.pieces) >= BATCH_PIECES:
            batch = open_batches[hs] = Item(id=schedule.new_id(), holders=hs)
            items.append(batch)
        batch.pieces += (piece,)
        batch.nbytes += n
    return items


def chunk_items(schedule: SwarmSchedule, key: str, holders: frozenset[int], nbytes: int, sums: list[int],
                local: list[int] | None, chunk_bytes: int = CHUNK_BYTES) -> list[Item]:
    """One data item per chunk of ``key`` whose elected sum (``sums``, a verified manifest) differs from
    this peer's own (``local``; None: fetch every chunk)."""
    out: list[Item] = []
    for index, expected in enumerate(sums):
        if local is not None and index < len(local) and local[index] == expected:
            continue
        offset = index * chunk_bytes
        n = min(chunk_bytes, nbytes - offset)
        piece = Piece(key=key, offset=offset, nbytes=n, expected=expected, whole=False)
        out.append(Item(id=schedule.new_id(), holders=holders, pieces=(piece,), nbytes=n))
    return out


__all__ = [
    "BATCH_PIECES", "CHUNK_BYTES", "DEPTH", "STEAL_FACTOR", "DonorStats", "Item", "Piece", "SwarmSchedule",
    "chunk_items", "plan_items",
]
