"""Membership alone: the peer table, the ring and its caches (pccl/master/membership.py)."""

from __future__ import annotations

from pccl.master.membership import Membership, Phase


def _members(*groups: int) -> Membership:
    ms = Membership()
    for g in groups:
        pid = ms.new_connection("127.0.0.1", 0.0)
        ms.peers[pid].group = g
    return ms


def test_ids_count_up_and_a_free_claim_is_granted() -> None:
    ms = Membership()
    assert [ms.new_connection("127.0.0.1", 0.0) for _ in range(2)] == [1, 2]
    assert ms.new_connection("127.0.0.1", 0.0, claim=7) == 7
    assert ms.new_connection("127.0.0.1", 0.0, claim=7) == 8  # held: a fresh id, counted past the claim
    assert ms.new_connection("127.0.0.1", 0.0) == 9


def test_group_sizes_follow_ring_assignment() -> None:
    ms = _members(0, 0, 1)
    ms.ring = [1, 2, 3]
    assert ms.sizes_by_group() == {0: 2, 1: 1}
    ms.ring = [1, 3]
    assert ms.group_size(0) == 1 and ms.group_size(1) == 1 and ms.group_size(5) == 0
    assert ms.accepted(0) == [1] and ms.accepted() == [1, 3]


def test_take_into_ring_keeps_the_given_order() -> None:
    ms = _members(0, 0, 0, 0, 0)
    order = [4, 2, 5, 1]
    for p in (1, 5, 3, 4):
        ms.take_into_ring(p, order)
    assert ms.ring == [4, 5, 1, 3]  # in ``order``; 3, which it does not name, last
    ms.take_into_ring(2, [2, 1])  # another order: sorted by that one
    assert ms.ring == [2, 1, 3, 4, 5]


def test_address_kind_fixed_by_the_first() -> None:
    ms = Membership()
    assert ms.address_mismatch("10.0.0.1") is None
    assert ms.address_mismatch("10.0.0.2") is None
    why = ms.address_mismatch("127.0.0.1")
    assert why is not None and "via loopback (127.0.0.1)" in why and "non-loopback" in why
    other = Membership()
    other.note_address("::1")
    assert other.address_mismatch("localhost") is None
    assert other.address_mismatch("192.168.0.3") is not None


def test_registered_and_table() -> None:
    ms = _members(0, 3)
    ms.peers[2].phase = Phase.REGISTERED
    ms.peers[2].p2p_port = 4000
    assert ms.registered() == [2]
    row = ms.table([2])[0]
    assert (row.peer_id, row.host, row.port, row.group) == (2, "127.0.0.1", 4000, 3)


def test_silence_and_straggler_deadlines() -> None:
    ms = _members(0, 0, 0)
    ms.peers[1].last_seen, ms.peers[2].last_seen, ms.peers[3].last_seen = 1.0, 5.0, 9.0
    assert ms.expired(10.0, 4.5) == [1, 2] and ms.expired(10.0, 9.0) == []
    ms.peers[2].gaps.extend([0.5, 3.0])  # an irregular peer: twice its longest gap, under the cap
    assert ms.straggler_deadlines([3, 2], 1.0, 10.0) == {2: 11.0, 3: 10.0}
    assert ms.straggler_deadlines([2], 1.0, 4.0) == {2: 9.0}  # capped
    assert ms.straggler_deadlines([], 1.0, 4.0) == {}
