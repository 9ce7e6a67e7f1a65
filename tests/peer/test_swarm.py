"""The pure schedule of a swarm fetch (pccl/peer/swarm.py): who sends which chunk."""

from __future__ import annotations

from pccl.peer import swarm
from pccl.peer.swarm import Item, Piece, SwarmSchedule

MIB = 1 << 20


def _schedule(n_items: int, donors: tuple[int, ...] = (1, 2, 3)) -> SwarmSchedule:
    s = SwarmSchedule((), donors)
    for _ in range(n_items):
        i = s.new_id()
        s.add(Item(id=i, holders=frozenset(donors), pieces=(Piece("k", (i - 1) * MIB, MIB, 0, False),),
                   nbytes=MIB))
    return s


def test_plan_batches_small_tensors_and_describes_large_ones() -> None:
    s = SwarmSchedule((), (1, 2))
    fetch = [("a", 11, [1, 2]), ("b", 12, [1, 2]), ("big", 13, [2, 1]), ("c", 14, [1])]
    sizes = {"a": 600 * 1024, "b": 600 * 1024, "big": 3 * MIB + 1, "c": 10}
    items = swarm.plan_items(s, fetch, sizes)
    manifests = [i for i in items if i.manifest_key]
    batches = [i for i in items if not i.manifest_key]
    assert [m.manifest_key for m in manifests] == ["big"]
    # a and b do not fit one 1 MiB batch; c has other holders
    assert sorted([p.key for p in b.pieces] for b in batches) == [["a"], ["b"], ["c"]]
    assert all(p.whole for b in batches for p in b.pieces)
    chunks = swarm.chunk_items(s, "big", frozenset({1, 2}), sizes["big"], [5, 6, 7, 8], [5, 0, 7, 0])
    assert [(c.pieces[0].offset, c.pieces[0].nbytes, c.pieces[0].expected) for c in chunks] == [
        (MIB, MIB, 6), (3 * MIB, 1, 8)]


def test_a_faster_donor_gets_more_and_idle_donors_steal_the_tail() -> None:
    s = _schedule(12, (1, 2))
    now = 0.0
    fast: list[Item] = []
    slow = s.next_for(2, now)
    assert slow is not None
    # donor 1 delivers an item per second while donor 2 sits on its first one
    item = s.next_for(1, now)
    assert item is not None
    assert s.next_steal_at(1) is None  # no item time measured yet: nothing to steal
    now += 1.0
    assert s.delivered(item, 1, now)
    assert s.next_steal_at(1) == swarm.STEAL_FACTOR * 1.0  # donor 2's item, handed out at 0
    while s.pending:
        item = s.next_for(1, now)
        assert item is not None and item is not slow
        now += 1.0
        assert s.delivered(item, 1, now)
        fast.append(item)
    assert len(fast) == 10 and s.statistics()["donors"] == {1: 11 * MIB, 2: 0}
    # nothing pending: donor 1 takes donor 2's item, now more than 2x the typical time old
    stolen = s.next_for(1, now)
    assert stolen is slow and s.stolen == 1
    assert s.next_for(1, now) is None  # one extra copy at most
    assert s.delivered(slow, 1, now + 1)
    assert not s.delivered(slow, 2, now + 5)  # the slow copy is dropped, counted as fetched twice
    assert s.finished and s.duplicate_bytes == MIB


def test_a_failed_donor_returns_its_items_and_a_corrupt_one_is_excluded() -> None:
    s = _schedule(4)
    a, b = s.next_for(1, 0), s.next_for(1, 0)
    c = s.next_for(2, 0)
    assert a and b and c
    s.failed(1, "broken", [a, b])
    assert s.next_for(1, 0) is None  # a failed donor gets nothing more
    assert s.next_for(3, 0) is a and s.next_for(3, 0) is b
    s.corrupt(2, "bad sum", MIB, [c])
    assert not s.usable(2) and s.bad_bytes == MIB
    assert s.next_for(3, 0) is c
    st = s.statistics()
    assert st["donors_failed"] == {1: "broken"} and st["donors_excluded"] == {2: "bad sum"}
    assert st["donors_active"] == 1


def test_items_without_a_usable_holder_are_stranded() -> None:
    s = _schedule(2, (1,))
    item = s.next_for(1, 0)
    assert item is not None
    assert not s.stranded()
    s.failed(1, "gone", [item])
    assert len(s.stranded()) == 2 and not s.finished


def test_a_delivered_item_overwritten_by_a_bad_copy_is_delivered_again() -> None:
    # Donor 1 receives its chunk in place; donor 2 stole it and delivered first; donor 1's bytes (which
    # overwrote the staged ones) then fail their sums: the item is open again, for donor 3.
    s = _schedule(2, (1, 2, 3))
    first = s.next_for(3, 0)
    assert first is not None and s.delivered(first, 3, 1.0)  # one item time: 1 s
    item = s.next_for(1, 1.0)
    assert item is not None
    assert s.next_for(2, 3.5) is item  # stolen after more than two item times
    assert s.delivered(item, 2, 4.0) and s.finished and s.bytes_done == 2 * MIB
    s.reopen(item)
    assert not s.finished and s.bytes_done == MIB and s.statistics()["chunks_done"] == 1
    s.corrupt(1, "bad sum", MIB, [item])
    assert s.next_for(3, 5.0) is item
    assert s.delivered(item, 3, 6.0) and s.finished and s.bytes_done == 2 * MIB
    s.reopen(item)
    s.reopen(item)  # twice: undone once
    assert s.bytes_done == MIB and not s.finished
