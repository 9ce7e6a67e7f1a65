"""The live quorum rule alone (pccl/master/quorum.py): who counts, when it applies, the hold clock."""

from __future__ import annotations

import pytest

from pccl.master.quorum import Quorum


def test_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="quorum must be"):
        Quorum("sometimes")


def test_auto_applies_once_a_peer_can_fail_over() -> None:
    q = Quorum("auto")
    assert not q.enforced
    q.failover = True
    assert q.enforced
    assert Quorum("on").enforced and not Quorum("off").enforced


def test_majority_of_the_base_counted_per_ring_list() -> None:
    q = Quorum("on")
    ring = [1, 2, 3]
    assert q.quorate(ring)  # no base known: nothing to count against
    q.base = [1, 2, 3, 4]
    assert not q.quorate([1, 2]) and q.held_count([1, 2]) == 2
    assert q.quorate(ring) and q.held_count(ring) == 3
    ring = [1]  # a new list: recounted
    assert not q.quorate(ring)
    assert q.ok([1, 2, 3], rebuilding=False) and not q.ok([1, 2, 3], rebuilding=True)
    assert Quorum("off").ok([], rebuilding=False)


def test_hold_clock_and_give_up() -> None:
    q = Quorum("on")
    assert q.note(False, 1.0) is None and q.deadline(5.0) is None
    assert q.note(True, 2.0) == "held" and q.note(True, 3.0) is None
    assert q.deadline(5.0) == 7.0
    assert not q.overdue(7.0, 5.0) and q.overdue(7.5, 5.0)
    q.base = [1, 2]
    q.fresh = False
    q.give_up(4)
    assert (q.base, q.held_since, q.dismissed_generation, q.fresh) == ([], None, 4, True)
    q.start_rebuild([5, 6], 9.0)
    assert (q.base, q.held_since, q.fresh) == ([5, 6], 9.0, False)
    assert q.note(False, 10.0) == "resumed"


def test_a_lone_newcomer_is_provisional_only_at_a_fresh_master() -> None:
    q = Quorum()
    q.alone(3)
    assert q.base == [3] and q.provisional == {3} and q.only_provisional([3])
    q.provisional.clear()
    q.fresh = False
    q.alone(4)
    assert q.base == [4] and q.provisional == set() and not q.only_provisional([4])


def test_only_provisional_compares_the_whole_ring() -> None:
    """Every accepted peer must be provisional: one member besides is enough to say no; with nobody
    provisional only an empty ring is (asked at every re-registration: no set built for it)."""
    q = Quorum()
    assert q.only_provisional([]) and not q.only_provisional([1])
    q.alone(3)
    assert q.only_provisional([3]) and not q.only_provisional([3, 4]) and not q.only_provisional([4])
