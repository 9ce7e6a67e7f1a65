"""A rebuild in progress alone (pccl/master/rejoin.py ``Rebuild``): who must come back, and when it ends."""

from __future__ import annotations

from pccl.master.rejoin import Rebuild


def test_a_majority_of_the_expected_members_ends_it() -> None:
    rb = Rebuild(epoch=3, expected=[1, 2, 3, 4])
    assert rb.quorum == 3 and not rb.reached
    rb.returned |= {1, 2, 9}  # 9 is not expected: it does not count
    assert not rb.reached
    rb.returned.add(4)
    assert rb.reached


def test_the_expected_set_follows_a_new_expected_list() -> None:
    rb = Rebuild(epoch=3, expected=[1, 2, 3])
    first = rb.expected_set()
    assert first == {1, 2, 3} and rb.expected_set() is first  # made once per list
    rb.expected = [5, 6]
    assert rb.expected_set() == {5, 6} and rb.quorum == 2
    rb.returned = {5}
    assert not rb.reached
