"""Shared-state votes whose rows arrive in several frames (issue 17 item 4), message by message."""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.wire import limits
from pccl.wire import messages as m

from ._effects import kicks, sends
from .test_state import Harness


def rows(n: int, prefix: str = "k") -> list[list[Any]]:
    return [[f"{prefix}{i}", 7, [2], 16, i, False] for i in range(n)]  # dtype 7: 8-byte items


def _pair(hs: Harness) -> tuple[int, int]:
    a, _ = hs.join()
    b, _ = hs.join()
    hs.update([a])
    assert hs.st.accepted() == [a, b]
    return a, b


def test_chunks_then_the_vote_make_one_vote_in_order() -> None:
    hs = Harness()
    a, b = _pair(hs)
    full = rows(20000)
    chunks = limits.split_rows(full)
    assert len(chunks) > 3
    for p in (a, b):
        for chunk in chunks[:-1]:
            assert hs.h(p, m.SharedStateEntries(entries=chunk)) == []  # held, nothing said yet
        eff = hs.h(p, m.SharedStateSync(revision=1, strategy=0, entries=chunks[-1]))
    plans = sends(eff, m.SharedStatePlan)
    assert sorted(p for p, _ in plans) == [a, b]
    assert all(plan.fetch == [] for _, plan in plans)  # equal content: nothing to fetch
    votes = hs.st._syncs[0].votes
    assert [e.key for e in votes[a].entries] == [r[0] for r in full]
    assert [e.hash for e in votes[b].entries] == list(range(20000))
    assert hs.st._sync_rows == {}


def test_rows_of_another_chunked_vote_differ_and_are_fetched() -> None:
    hs = Harness()
    a, b = _pair(hs)
    mine, theirs = rows(6000), rows(6000)
    theirs[5999] = ["k5999", 7, [2], 16, 1, False]  # another hash for the last key, in the last chunk
    # a sends (SEND_ONLY), b receives (RECEIVE_ONLY): b fetches the one key it holds otherwise.
    for p, table in ((a, mine), (b, theirs)):
        *ahead, last = limits.split_rows(table)
        for chunk in ahead:
            hs.h(p, m.SharedStateEntries(entries=chunk))
        eff = hs.h(p, m.SharedStateSync(revision=1, strategy=2 if p == a else 1, entries=last))
    plans = dict(sends(eff, m.SharedStatePlan))
    assert [row[0] for row in plans[b].fetch] == ["k5999"] and plans[a].fetch == []


def test_a_malformed_row_in_an_early_chunk_refuses_the_vote_and_is_not_kept() -> None:
    hs = Harness()
    a, _ = _pair(hs)
    hs.h(a, m.SharedStateEntries(entries=[["w", 7, [8], 64, 1]]))
    eff = hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=rows(1)))
    (_, res), = sends(eff, m.SharedStateResult)
    assert not res.success and res.code == Result.INVALID_ARGUMENT
    assert "entry 0 is not a 6-field row" in res.reason
    assert hs.st._sync_rows == {}
    # The next vote starts afresh: its rows only.
    assert hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=rows(1))) == []
    assert [e.key for e in hs.st._syncs[0].votes[a].entries] == ["k0"]


def test_chunks_over_the_bound_kick_the_sender_only() -> None:
    hs = Harness()
    a, b = _pair(hs)
    c, _ = hs.join()
    hs.update([a, b])
    assert hs.st.accepted() == [a, b, c]
    hs.h(b, m.SharedStateEntries(entries=rows(10)))
    eff: list[Any] = []
    frames = 0
    while not kicks(eff):
        frames += 1
        eff = hs.h(a, m.SharedStateEntries(entries=[]))
    assert frames == limits.SHARED_STATE_MAX_FRAMES + 1
    (kick,) = kicks(eff)
    assert kick.peer_id == a and "over its bound" in kick.reason and "128 frames" in kick.reason
    assert a not in hs.st.peers and a not in hs.st._sync_rows
    # The other peers are untouched: b's held rows still lead its vote.
    assert hs.h(b, m.SharedStateSync(revision=1, strategy=0, entries=rows(1, "z"))) == []
    assert [e.key for e in hs.st._syncs[0].votes[b].entries][-2:] == ["k9", "z0"]


def test_entries_over_the_row_bound_kick() -> None:
    hs = Harness()
    a, _ = _pair(hs)
    big = rows(limits.SHARED_STATE_MAX_ENTRIES // 2)
    assert hs.h(a, m.SharedStateEntries(entries=big)) == []
    assert hs.h(a, m.SharedStateEntries(entries=big)) == []
    eff = hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=rows(1)))
    (kick,) = kicks(eff)
    assert "at most 131072 entries" in kick.reason and not sends(eff, m.SharedStatePlan)
    assert a not in hs.st._sync_rows


def test_chunks_out_of_phase_are_a_protocol_error() -> None:
    hs = Harness()
    a, _ = _pair(hs)
    hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=rows(3)))
    # a voted: rows for another vote before this sync ends are out of phase.
    (kick,) = kicks(hs.h(a, m.SharedStateEntries(entries=rows(3))))
    assert kick.peer_id == a
    assert "SharedStateEntries while this peer's previous sync is still running" in kick.reason
    # From a peer that is not accepted yet.
    hs2 = Harness()
    x, _ = hs2.join()
    y, _ = hs2.join()  # pending until the next topology update
    (kick,) = kicks(hs2.h(y, m.SharedStateEntries(entries=rows(1))))
    assert kick.peer_id == y and "not accepted" in kick.reason
    assert y not in hs2.st._sync_rows and x in hs2.st.peers


def test_held_chunks_are_dropped_when_the_peer_is_lost() -> None:
    hs = Harness()
    a, b = _pair(hs)
    hs.h(a, m.SharedStateEntries(entries=rows(100)))
    assert a in hs.st._sync_rows
    hs.st.peer_lost(a, "connection closed")
    assert hs.st._sync_rows == {}
    # b syncs alone now, unaffected.
    eff = hs.h(b, m.SharedStateSync(revision=1, strategy=0, entries=rows(2)))
    assert [p for p, _ in sends(eff, m.SharedStatePlan)] == [b]
