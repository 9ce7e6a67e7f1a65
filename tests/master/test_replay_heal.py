"""Live heals whose fetcher observes (issue 35 item 4, replay; pccl/master/observers.py), message by
message: a sync whose every fetched key changed runs live when its fetchers would observe; the observer
counts in the group's collective votes from the heal's start and in no sync vote until its join vote; that
vote is answered at once (it replayed to the group's revision), counted in the group's open sync, kept
while the group's sync runs, or refused (other content); its loss costs the members nothing."""

from __future__ import annotations

from typing import Any

from pccl.master.observers import Observers
from pccl.master.state import Send
from pccl.wire import messages as m

from .test_live_heal import _all_reduce, _entries, _live, _to
from .test_state import Harness


def _observing() -> tuple[Harness, list[int], int]:
    """``a`` and ``b`` ran (revision 1), ``c`` joined; their next sync (revision 2) changed every key and
    ``c`` votes to observe: the heal runs live. Returns the harness, the peers and the heal's sync_seq."""
    hs, (a, b, c) = _live(entries=_entries(1, 2))
    eff = hs.h(a, m.SharedStateSync(revision=2, strategy=0, entries=_entries(11, 12)))
    eff += hs.h(b, m.SharedStateSync(revision=2, strategy=0, entries=_entries(11, 12)))
    eff += hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=_entries(1, 2), observe=True))
    plan = _to(eff, c, m.SharedStatePlan)[0]
    assert plan.live and sorted(r[0] for r in plan.fetch) == ["v", "w"]
    assert _to(eff, a, m.SharedStateResult)[0].success  # the members return at once
    stats = hs.st.heals.statistics()
    assert stats["kept_ordinary"] == 0 and stats["started"] == 1 and stats["observing"] == 1
    return hs, [a, b, c], plan.sync_seq


def _round(hs: Harness, peers: list[int], tag: int) -> list[int]:
    """A collective of ``peers`` on ``tag``, run to completion; returns the commence's ring."""
    (commence,) = _to(_all_reduce(hs, peers, tag=tag), peers[0], m.CollectiveCommence)
    for p in peers:
        hs.h(p, m.CollectiveDone(tag=tag, op_seq=commence.op_seq, success=True))
    return [r.peer_id for r in commence.peers]


def _vote(hs: Harness, peer: int, revision: int, entries: list[list[Any]]) -> list[Any]:
    return hs.h(peer, m.SharedStateSync(revision=revision, strategy=0, entries=entries))


def _sync(hs: Harness, peers: list[int], revision: int, entries: list[list[Any]]) -> list[Any]:
    eff = [e for p in peers for e in _vote(hs, p, revision, entries)]
    seq = hs.st._sync_seq
    for p in peers:
        eff += hs.h(p, m.SharedStateDone(sync_seq=seq, success=True))
    return eff


def test_an_observer_heals_live_in_the_collectives_and_joins_at_once_when_it_replayed() -> None:
    hs, (a, b, c), seq = _observing()
    # the members' collectives wait for it (it takes part, contributing nothing) and name it
    assert not _to(_all_reduce(hs, [a, b], tag=0), a, m.CollectiveCommence)
    (commence,) = _to(_all_reduce(hs, [c], tag=0), a, m.CollectiveCommence)
    assert [r.peer_id for r in commence.peers] == [a, b, c]
    for p in (a, b, c):
        hs.h(p, m.CollectiveDone(tag=0, op_seq=commence.op_seq, success=True))
    # ... their syncs and are_peers_pending votes do not
    eff = _sync(hs, [a, b], 3, _entries(21, 22))
    assert {p for p in (a, b) if _to(eff, p, m.SharedStateResult)} == {a, b}
    assert not hs.h(a, m.PeersPendingVote())
    assert _to(hs.h(b, m.PeersPendingVote()), a, m.PeersPendingResult)
    # fetched: its plain result at once (no catch-up), the pins released
    eff = hs.h(c, m.SharedStateDone(sync_seq=seq, success=True, rx_bytes=8000))
    (res,) = _to(eff, c, m.SharedStateResult)
    assert res.success and not res.catch_up and res.revision == 2 and res.sync_seq == seq
    assert _to(eff, a, m.SharedStateRelease) == [m.SharedStateRelease(sync_seq=seq)]
    assert hs.st.heals.statistics()["joining"] == 1
    # still in the collectives; in no sync vote until it votes to join
    assert _round(hs, [a, b, c], tag=1) == [a, b, c]
    eff = _sync(hs, [a, b], 4, _entries(31, 32))
    assert {p for p in (a, b) if _to(eff, p, m.SharedStateResult)} == {a, b}
    # it replayed rounds 2 and 3 and votes at revision 4 with the group's content: current at once
    eff = hs.h(c, m.SharedStateSync(revision=4, strategy=0, entries=_entries(31, 32)))
    assert _to(eff, c, m.SharedStateResult) == [m.SharedStateResult(sync_seq=-1, success=True, revision=4)]
    stats = hs.st.heals.statistics()
    assert stats["joined_current"] == 1 and stats["joining"] == stats["observing"] == 0
    assert not hs.st.heals.groups
    # a member in every vote again: the members' next sync waits for it
    eff = [e for p in (a, b) for e in _vote(hs, p, 5, _entries(4, 4))]
    assert not _to(eff, a, m.SharedStatePlan)
    assert _to(_vote(hs, c, 5, _entries(4, 4)), a, m.SharedStatePlan)


def test_an_observers_join_vote_counts_in_the_groups_next_sync() -> None:
    """It replayed to a revision the group has not synced yet: its vote is one of that sync's."""
    hs, (a, b, c), seq = _observing()
    hs.h(c, m.SharedStateDone(sync_seq=seq, success=True))
    assert _round(hs, [a, b, c], tag=0) == [a, b, c]
    eff = hs.h(c, m.SharedStateSync(revision=3, strategy=0, entries=_entries(21, 22)))  # first: it waits
    assert not _to(eff, c, m.SharedStateResult) and not _to(eff, c, m.SharedStatePlan)
    eff = hs.h(a, m.SharedStateSync(revision=3, strategy=0, entries=_entries(21, 22)))
    assert not _to(eff, a, m.SharedStatePlan)  # the vote waits for b (and counts c)
    eff = hs.h(b, m.SharedStateSync(revision=3, strategy=0, entries=_entries(21, 22)))
    plans = {p: _to(eff, p, m.SharedStatePlan)[0] for p in (a, b, c)}
    assert all(not pl.live and pl.fetch == [] for pl in plans.values())
    for p in (a, b, c):
        eff = hs.h(p, m.SharedStateDone(sync_seq=plans[a].sync_seq, success=True))
    assert {p for p in (a, b, c) if _to(eff, p, m.SharedStateResult)} == {a, b, c}
    assert hs.st.heals.statistics()["joined_in_sync"] == 1 and not hs.st.heals.groups


def test_an_observers_join_vote_waits_while_the_groups_sync_runs() -> None:
    """The group's sync at the joiner's revision runs (past its vote): the joiner's vote is kept, not
    refused or kicked, and answered once that sync committed."""
    hs, (a, b, c), seq = _observing()
    hs.h(c, m.SharedStateDone(sync_seq=seq, success=True))
    _round(hs, [a, b, c], tag=0)
    eff = [e for p in (a, b) for e in _vote(hs, p, 3, _entries(5, 6))]
    members_sync = _to(eff, a, m.SharedStatePlan)[0].sync_seq
    assert hs.h(c, m.SharedStateSync(revision=3, strategy=0, entries=_entries(5, 6))) == []
    assert c in hs.st.members.peers  # not kicked
    hs.h(a, m.SharedStateDone(sync_seq=members_sync, success=True))
    eff = hs.h(b, m.SharedStateDone(sync_seq=members_sync, success=True))
    assert _to(eff, c, m.SharedStateResult) == [m.SharedStateResult(sync_seq=-1, success=True, revision=3)]
    assert hs.st.heals.statistics()["joined_current"] == 1


def test_a_join_vote_with_other_content_is_refused() -> None:
    """A replay that diverged (other bytes at the group's revision) is refused, never counted current."""
    hs, (a, b, c), seq = _observing()
    hs.h(c, m.SharedStateDone(sync_seq=seq, success=True))
    _round(hs, [a, b, c], tag=0)
    _sync(hs, [a, b], 3, _entries(5, 6))
    eff = hs.h(c, m.SharedStateSync(revision=3, strategy=0, entries=_entries(5, 7)))
    (res,) = _to(eff, c, m.SharedStateResult)
    assert not res.success and "diverged" in res.reason and "'v'" in res.reason
    assert hs.st.heals.statistics()["join_refused"] == 1 and not hs.st.heals.groups


def test_an_observer_lost_mid_heal_costs_the_members_nothing() -> None:
    hs, (a, b, c), seq = _observing()
    assert not _to(_all_reduce(hs, [a, b], tag=0), a, m.CollectiveCommence)  # waits for c
    eff = hs.st.peer_lost(c, "killed")
    assert _to(eff, a, m.SharedStateRelease) == [m.SharedStateRelease(sync_seq=seq)]
    assert not any(isinstance(e, Send) and isinstance(e.message, m.SharedStateResult) for e in eff)
    stats = hs.st.heals.statistics()
    assert stats["lost_fetchers"] == 1 and stats["observing"] == stats["joining"] == 0
    assert _round(hs, [a, b], tag=1) == [a, b]


def test_fetchers_that_do_not_all_observe_keep_the_rule() -> None:
    """One fetcher that would not observe: the sync whose every fetched key changed stays ordinary."""
    book = Observers()
    book.voted(1, True)
    assert book.all_willing([1]) and not book.all_willing([1, 2]) and not book.all_willing([])
    book.voted(1, False)
    assert not book.all_willing([1])
    hs, (a, b, c) = _live(entries=_entries(1, 2))
    eff = hs.h(a, m.SharedStateSync(revision=2, strategy=0, entries=_entries(11, 12)))
    eff += hs.h(b, m.SharedStateSync(revision=2, strategy=0, entries=_entries(11, 12)))
    eff += hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=_entries(1, 2)))
    assert not _to(eff, c, m.SharedStatePlan)[0].live
    assert hs.st.heals.statistics()["kept_ordinary"] == 1
