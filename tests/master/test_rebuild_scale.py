"""A rebuild of many members costs the master O(n) per return (issue 21 item 4, the master's restart):
the rings members report are kept once per distinct ring (pccl/master/reported.py), the ring grows by
insertion, and the credential rows of members back go to the holders in batches
(pccl/master/issued.py), so a rebuild of n members sends O(n) messages, not n^2 / 2.

The pure MasterState, message by message."""

from __future__ import annotations

import random
from typing import Any

from pccl.master.reported import ReportedRings
from pccl.master.state import MasterState, Send
from pccl.wire import messages as m

from ._effects import kicks, sends


def rereg(st: MasterState, pid: int, ring: list[int], now: float = 0.0, epoch: int = 7) -> list[Any]:
    got = st.new_connection("127.0.0.1", now, claim=pid)
    msg = m.Reregister(peer_id=pid, p2p_port=40000 + pid, peer_group=0, epoch=epoch, ring=list(ring),
                       revision=-1, generation=1, public_key=pid.to_bytes(32, "big"))
    return st.handle(got, msg, now)


def test_reported_rings_are_kept_once_per_distinct_ring() -> None:
    rings = ReportedRings()
    assert not rings and len(rings) == 0
    for p in (1, 2, 3):
        rings.put(p, 7, [1, 2, 3, 4])
    rings.put(4, 7, [1, 2, 4])  # 4's group dropped 3
    assert len(rings) == 4 and 2 in rings and 9 not in rings and rings.epoch(4) == 7
    assert rings.not_listing(3, 7) == [4]
    assert rings.not_listing(3, 8) == []  # only rings of that epoch or later count
    assert rings.not_listing(1, 0) == []
    assert rings.not_in({1, 2, 4}, 7) == [3]
    assert rings.not_in({1, 2, 4}, 6) == []  # only rings of that epoch or earlier count
    rings.put(4, 8, [1, 2, 3, 4])  # replaced: it lists 3 again, at a later epoch
    assert rings.not_listing(3, 0) == [] and rings.epoch(4) == 8
    rings.pop(1)
    rings.pop(1)  # no error
    assert rings.not_in(set(), 8) == [2, 3, 4] and len(rings) == 3


def test_the_ring_keeps_the_expected_order_whatever_the_order_of_return() -> None:
    expected = [9, 4, 7, 1, 12, 3, 8, 2, 11, 5, 10, 6]
    for seed in range(5):
        order = list(expected)
        random.Random(seed).shuffle(order)
        st = MasterState()
        for i, pid in enumerate(order):
            rereg(st, pid, expected)
            back = set(order[: i + 1])
            assert st.accepted() == [p for p in expected if p in back], (seed, i)
            if i == 3:
                # One leaves (the ring is assigned anew) and comes back: still in order.
                st.peer_lost(pid, "left", 0.0)
                rereg(st, pid, expected)
                assert st.accepted() == [p for p in expected if p in back], (seed, i)


def test_a_member_that_no_longer_lists_one_back_refuses_it_whichever_came_first() -> None:
    """The checks on the distinct rings decide as the walk over every member back did."""
    full, without_3 = [1, 2, 3, 4, 5, 6, 7], [1, 2, 4, 5, 6, 7]
    for first_3 in (True, False):
        st = MasterState()
        out: list[Any] = []
        order = [3, 1, 2] if first_3 else [1, 2, 3]
        for pid in order:
            out += rereg(st, pid, full if pid == 3 else without_3)
        assert [k.peer_id for k in kicks(out)] == [3], first_3
        assert sorted(st.accepted()) == [1, 2], first_3


def test_a_rebuild_of_n_members_sends_3n_minus_1_messages_with_batching() -> None:
    n = 64
    ring = list(range(1, n + 1))
    # As the server runs it: the roll call (rebuild_grace) holds the votes until everyone is back.
    st = MasterState(credentials_delay=0.01, rebuild_grace=1.0)
    sent: list[Any] = []
    for i, pid in enumerate(ring):
        sent += rereg(st, pid, ring, now=i * 1e-5)
    assert not st.statistics()["held"] and st.credentials_overdue(1.0) == []
    # Reregistered and its table to each member, and one batch to all but the one back last, sent
    # as the last one's return ended the roll call.
    assert sum(1 for e in sent if isinstance(e, Send)) == 3 * n - 1
    tables = sends(sent, m.P2PCredentials)
    assert len(tables) == 2 * n - 1
    # Unbatched (delay 0) it is n (n - 1) / 2 more rows messages than tables.
    st0 = MasterState()
    sent0: list[Any] = []
    for pid in ring:
        sent0 += rereg(st0, pid, ring)
    assert len(sends(sent0, m.P2PCredentials)) == n + n * (n - 1) // 2
