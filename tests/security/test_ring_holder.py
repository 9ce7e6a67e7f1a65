"""Issue 33 finding 7 (item 6), the liar: a member that stops reading and testifies that it took the
bytes its predecessor sent. The pairs agree then (pccl/master/testimony.py), so before the ring rule it
stalled every operation for ``p2p_stall_timeout`` and stayed. The ring rule (``ring_holders``): in a
ring all-reduce every frame a peer takes, except the last step's, releases one frame of the same bytes
to its successor, so an honest peer at a standstill holds back at most one chunk; a peer that testifies
it took more than that beyond what its successor took from it holds the ring and is struck alone."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import trio
import trio.testing

from pccl._types import DataType
from pccl.master import plan_rule
from pccl.master.blame import STRIKES, StallBlame
from pccl.master.testimony import StallTestimony, ring_holders
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster
from pccl.wire.messages import CollectiveDescriptor

from ._helpers import lie_about_reading, stalled_rounds

STALL = 5.0
CFG = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=STALL, schedule="ring")
CHUNK = 100

# A ring 1 -> 2 -> 3 -> 4 -> 1 stalled with peer 2 holding: 1 sent it 400 bytes, it passed 100 to 3.
HOLDING = {
    1: {2: (400, 0), 4: (0, 300)},
    2: {1: (0, 400), 3: (100, 0)},  # the liar says it took all 400
    3: {2: (0, 100), 4: (200, 0)},
    4: {3: (0, 200), 1: (300, 0)},
}


def test_ring_holder_is_the_peer_that_took_more_than_a_chunk_beyond_what_it_passed() -> None:
    assert ring_holders([1, 2, 3, 4], CHUNK, HOLDING, {}) == [(2, 3, 400, 100)]
    # Honest at the last step: it holds exactly the last chunk it took (its send of it is not owed).
    honest = {1: {2: (600, 0), 3: (0, 500)}, 2: {1: (0, 600), 3: (500, 0)}, 3: {2: (0, 500), 1: (500, 0)}}
    assert ring_holders([1, 2, 3], CHUNK, honest, {}) == []
    one_more = {**honest, 2: {1: (0, 601), 3: (500, 0)}}
    assert ring_holders([1, 2, 3], CHUNK, one_more, {}) == [(2, 3, 601, 500)]


def test_ring_rule_leaves_what_other_rules_judge_or_cannot_tell() -> None:
    order = [1, 2, 3, 4]
    # the successor is behind on the holder's frames (took less than it was sent): the pair rule's case
    behind = {**HOLDING, 3: {2: (0, 50), 4: (200, 0)}}
    assert ring_holders(order, CHUNK, behind, {}) == []
    # a send of the holder to its successor, or of its predecessor to it, was under way: released frames
    # not written are not in the bytes (a successor that does not read can hold the holder's sends)
    assert ring_holders(order, CHUNK, HOLDING, {2: {3}}) == []
    assert ring_holders(order, CHUNK, HOLDING, {1: {2}}) == []
    # every one of the three must have testified
    for gone in (1, 2, 3):
        assert ring_holders(order, CHUNK, {k: v for k, v in HOLDING.items() if k != gone}, {}) == []
    # a two-peer "ring" is no ring (predecessor and successor are one peer)
    assert ring_holders([1, 2], CHUNK, {1: {2: (400, 0)}, 2: {1: (100, 400)}}, {}) == []


def test_testimony_names_a_holder_once_per_operation_and_only_for_recorded_rings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (the coarse ring rule judges ring all-reduces whose plans are too large to rebuild)
    monkeypatch.setattr(plan_rule, "MAX_FRAMES", 0)
    ring = CollectiveDescriptor(kind="all_reduce", dtype=int(DataType.UINT8), element_count=4 * CHUNK, op=0,
                                root=-1, quantization=0, quantized_dtype=0, schedule="ring")
    t = StallTestimony()
    for peer, rows in HOLDING.items():
        t.add(7, peer, [(p, s, k) for p, (s, k) in rows.items()])
    assert t.holders(7) == []  # not recorded
    t.plans.note(7, ring._replace(schedule="tree"), [1, 2, 3, 4])
    assert t.holders(7) == []  # not a ring all-reduce
    t.plans.note(8, ring, [1, 2, 3, 4])
    for peer, rows in HOLDING.items():
        t.add(8, peer, [(p, s, k) for p, (s, k) in rows.items()])
    assert t.holders(8) == [(2, 3, 400, 100)]
    assert t.holders(8) == []  # once per operation
    t.plans.note(9, ring, [1, 2, 3, 4])
    for peer, rows in HOLDING.items():
        t.add(9, peer, [(p, s, k) for p, (s, k) in rows.items()], blocked=[3] if peer == 2 else [])
    assert t.holders(9) == []  # its send to its successor was under way


def test_a_holder_is_struck_alone() -> None:
    b = StallBlame()
    members = {1, 2, 3, 4}
    assert b.hold(2, 0.0, members) == [] and b.hold(9, 0.0, members) == []
    gone = b.hold(2, 1.0, members)
    assert [p for p, _ in gone] == [2] and "testimony contradicted itself in 2 operations" in gone[0][1]
    assert b.hold(2, 2.0, members) == []  # forgotten with it
    assert b.hold(3, 0.0, members) == [] and b.hold(3, 700.0, members) == []  # outside the window
    assert b.hold(4, 0.0, members, repeat=lambda p: p == 4) != []  # a repeat offender: one is enough


async def test_a_member_that_stops_reading_and_lies_about_it_is_removed_alone_after_two_stalls(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    small = 1024  # 1 KiB chunks in 1 MiB windows: every send completes, nobody is send-blocked
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=CFG) as cl:
        evil = cl.peer(2)
        lie_about_reading(monkeypatch, cl, evil)  # it claims it took every byte: the pairs then agree
        honest = [cl.peer(i).peer_id for i in cl.alive if cl.peer(i) is not evil]
        t0 = trio.current_time()
        stalls = await stalled_rounds(cl, small, STRIKES + 2, members_are=honest)
        assert "took 0 of them" not in caplog.text  # the pairs agreed: the lie hid it from them
        assert stalls == STRIKES  # then it was gone, and nothing stalled again
        assert evil.peer_id not in cl.master.state.peers
        assert all(p in cl.master.state.peers for p in honest)  # the successor was not struck with it
        assert f"peer {evil.peer_id} evicted: its testimony contradicted itself in 2 operations" \
            in caplog.text
        assert trio.current_time() - t0 < STRIKES * (STALL + 2) + 5
