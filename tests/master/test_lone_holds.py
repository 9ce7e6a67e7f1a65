"""pccl/master/lone_holds.py: holds shorter than ``LONE`` add up to a strike (issue 33 item 6)."""

from __future__ import annotations

import pytest

from pccl.master import held_ops
from pccl.master.blame import WINDOW
from pccl.master.held_ops import LONE
from pccl.master.lone_holds import BUCKET, LoneHolds


def test_one_hold_of_lone_or_more_is_a_strike_at_once_and_restarts_the_ledger() -> None:
    h = LoneHolds()
    assert h.add(3, 1.0, 0.0) is None
    why = h.add(3, LONE, 1.0)
    assert why is not None and f"held alone for {LONE:g}s or more" in why
    assert h.held(3, 1.0) == (0.0, 0)  # restarted


def test_shorter_holds_add_up_to_a_strike_with_the_sum_count_and_window() -> None:
    h = LoneHolds()
    for i in range(4):  # 4 x 1.2 s = 4.8 s: under the budget
        assert h.add(3, 1.2, 30.0 * i) is None
    assert h.held(3, 90.0) == pytest.approx((4.8, 4))
    assert h.add(4, 1.2, 95.0) is None  # another member's holds are its own
    why = h.add(3, 0.2, 100.0)  # 5.0 s: the budget
    assert why is not None
    assert "it failed 5 operations it held alone" in why
    assert f"5.0s held alone in all within {WINDOW:g}s (budget {LONE:g}s)" in why
    assert h.held(3, 100.0) == (0.0, 0)  # the ledger starts again
    assert h.add(3, 4.9, 101.0) is None  # so the next strike needs a whole budget again
    assert h.held(4, 101.0) == pytest.approx((1.2, 1))


def test_holds_older_than_the_window_no_longer_count() -> None:
    h = LoneHolds()
    assert h.add(3, 4.0, 0.0) is None
    assert h.held(3, WINDOW) == (4.0, 1)  # still within
    assert h.held(3, WINDOW + 0.1) == (0.0, 0)
    assert h.add(3, 4.0, WINDOW + 0.1) is None  # the first expired: 4 s, not 8
    assert h.held(3, WINDOW + 0.1) == (4.0, 1)
    # a hold counts for at least WINDOW - BUCKET: one late in a bucket expires with the bucket
    h = LoneHolds()
    assert h.add(5, 1.0, 0.0) is None
    assert h.add(5, 3.0, BUCKET - 0.5) is None  # joins the bucket begun at 0
    assert h.held(5, WINDOW) == (4.0, 2)
    assert h.held(5, WINDOW + 0.1) == (0.0, 0)  # after WINDOW - BUCKET + 0.6 s for the second


def test_a_ledger_keeps_a_bounded_number_of_entries_without_losing_time() -> None:
    h = LoneHolds()
    tiny = LONE / 20_000
    t = 0.0
    for _ in range(10_000):  # one failure every 0.1 s, for 1000 s
        assert h.add(3, tiny, t) is None
        t += 0.1
    assert h.entries(3) <= WINDOW / BUCKET + 1
    held, count = h.held(3, t)
    assert WINDOW - BUCKET <= count * 0.1 <= WINDOW + 0.1  # what the window holds, no entry lost in it
    assert held == pytest.approx(count * tiny)


def test_a_member_that_leaves_is_forgotten() -> None:
    h = LoneHolds()
    assert not h
    for p in (1, 2, 3):
        assert h.add(p, 1.0, 0.0) is None
    assert h
    h.retain({1, 3})
    assert h.held(2, 0.0) == (0.0, 0) and h.entries(2) == 0
    assert h.held(1, 0.0) == (1.0, 1) and h.held(3, 0.0) == (1.0, 1)
    h.forget(1)
    h.retain({1, 3})
    assert h.entries(1) == 0 and h.held(3, 0.0) == (1.0, 1)
    h.retain(set())
    assert not h


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        LoneHolds(lone=0.0)
    with pytest.raises(ValueError):
        LoneHolds(bucket=WINDOW + 1)


def test_the_hold_counts_only_for_the_holder() -> None:
    from .test_held_ops import Op

    op = Op(done={1, 2, 4}, alone_since=10.0)
    assert held_ops.lone_hold(op, 3, 11.0) == 1.0
    assert held_ops.lone_hold(op, 2, 11.0) is None
    assert held_ops.lone_hold(Op(done={1}, alone_since=None), 3, 11.0) is None
    assert held_ops.lone_hold(None, 3, 11.0) is None
