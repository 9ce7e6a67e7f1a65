"""Issue 33 finding 7 (item 6): a member that stops reading its P2P connections stalled every operation for
``p2p_stall_timeout`` and stayed a member, so it could do it at every operation. Now the peer whose frames it
does not take reports it (``CollectiveDone.stalled_on``); at the second report of the same pair the master
removes the accused and its accuser together (pccl/master/blame.py: a report cannot be checked, so a
false one costs its maker its place). Bound: two stalled operations, each ended after
``p2p_stall_timeout``; the other members then run exact, without further stalls. Virtual network and time."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import trio
import trio.testing

from pccl.master.blame import STRIKES, StallBlame
from pccl.master.testimony import StallTestimony
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster

from ._helpers import stalled_rounds, stop_reading

STALL = 5.0
CFG = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=STALL)
COUNT = 1 << 18  # 1 MiB of int32 per peer: far more than the virtual link's window


def test_blame_needs_the_same_pair_twice_and_removes_both() -> None:
    b = StallBlame()
    members = {1, 2, 3}
    assert b.report(1, 2, 0.0, members) == []
    assert b.report(3, 2, 1.0, members) == []  # another accuser: its own count
    assert b.report(1, 9, 1.0, members) == [] and b.report(1, 1, 1.0, members) == []  # not members / self
    gone = b.report(1, 2, 2.0, members)
    assert [p for p, _ in gone] == [2, 1] and "not taken in 2 operations" in gone[0][1]
    assert b.report(3, 2, 3.0, members) == []  # forgotten with them
    assert b.report(3, 1, 0.0, members) == [] and b.report(3, 1, 700.0, members) == []  # outside the window


async def test_a_member_that_stops_reading_is_removed_after_two_stalls(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    # A 64 KiB window (the stand-in for the kernel's socket buffers): the 256 KiB ring chunks do not fit,
    # so the frames the member does not read hold its predecessor's send (the report needs that).
    net = VirtualNetwork(latency=0.0005, buffer_size=64 << 10)
    async with open_test_cluster(4, network=net, config=CFG) as cl:
        evil = cl.peer(2)
        stop_reading(monkeypatch, evil)
        t0 = trio.current_time()
        stalls = await stalled_rounds(cl, COUNT, STRIKES + 2)
        assert stalls == STRIKES  # then it was gone, and nothing stalled again
        assert evil.peer_id not in cl.master.state.peers
        assert f"peer {evil.peer_id} evicted: " in caplog.text and "not taken in 2 operations" in caplog.text
        # Remembered (pccl/master/penalties.py): both removed peers' identities hold a strike, so a rejoin
        # from the non-reader is refused for a back-off and then removed at its first report.
        assert cl.master.state.offenders.struck_total == 2 and "[strike 1]" in caplog.text
        assert trio.current_time() - t0 < STRIKES * (STALL + 2) + 5


async def test_a_member_that_stops_reading_small_operations_is_removed_by_the_bytes_testified(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same member, but each operation's chunks fit the links' buffers (4 KiB of data, 1 MiB
    windows): every send completes and the members wait on receives, so nobody is send-blocked to name
    it. The members whose operation stood still testify their bytes per partner; the master finds the
    pair whose sender sent more than its receiver took (pccl/master/testimony.py) and, at the second
    operation, removes that pair. Bound: two stalled operations; then exact without it."""
    caplog.set_level(logging.WARNING, logger="pccl")
    small = 1024
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=CFG) as cl:
        evil = cl.peer(2)
        stop_reading(monkeypatch, evil)
        t0 = trio.current_time()
        stalls = await stalled_rounds(cl, small, STRIKES + 2)
        assert "did not take its frames" not in caplog.text  # nobody was send-blocked
        assert "peer 2 took 0 of them" in caplog.text or f"peer {evil.peer_id} took" in caplog.text
        assert stalls == STRIKES  # then it was gone, and nothing stalled again
        assert evil.peer_id not in cl.master.state.peers
        assert f"peer {evil.peer_id} evicted: " in caplog.text and "not taken in 2 operations" in caplog.text
        assert trio.current_time() - t0 < STRIKES * (STALL + 2) + 5


def test_testimony_names_the_receiver_that_took_less_than_was_sent_once_per_operation() -> None:
    # A ring 1 -> 2 -> 3 -> 1 stuck at 2, which did not read: 1 sent 2 4096 bytes, 2 took none.
    t2 = StallTestimony()
    assert t2.add(7, 1, [(2, 4096, 0), (3, 0, 1024)]) == []  # alone: nothing to compare with
    assert t2.add(7, 3, [(1, 1024, 1024), (2, 0, 1024)]) == []  # 3 -> 1 agrees both ways
    assert t2.add(7, 2, [(1, 0, 0), (3, 1024, 0)]) == [(1, 2, 4096, 0)]  # 1 sent, 2 took nothing
    assert t2.first(7, 1, 2) and not t2.first(7, 1, 2)  # an operation counts once per pair
    assert t2.first(8, 1, 2)
    # A member that claims what it did not read is not found (the limitation, docs/security.md).
    t3 = StallTestimony()
    t3.add(9, 1, [(2, 4096, 0)])
    assert t3.add(9, 2, [(1, 0, 4096)]) == []
    # Bounded: the oldest operations are forgotten.
    t4 = StallTestimony(keep=2)
    t4.add(1, 1, [(2, 10, 0)])
    t4.add(2, 1, [(2, 10, 0)])
    t4.add(3, 1, [(2, 10, 0)])
    assert t4.add(1, 2, [(1, 0, 0)]) == []  # operation 1's first testimony is gone


def test_testimonies_are_bounded_in_rows_and_ignore_non_members() -> None:
    t = StallTestimony(keep=16, max_rows=100)
    for op in range(50):  # an insider testifying for operations that never stalled, a row per member
        t.add(op, 1, [(p, 10, 0) for p in range(2, 40)], members=range(1, 40))
        assert t.rows <= 100
    assert t.add(49, 2, [(1, 0, 0)], members={1, 2}) == [(1, 2, 10, 0)]  # the latest is still there
    assert t.add(60, 1, [(99, 10, 0)], members={1, 2}) == []
    assert t.add(60, 99, [(1, 0, 0)], members={1, 2}) == []  # 1 named no member
