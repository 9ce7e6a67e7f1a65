"""Live heals (issue 35 item 4), message by message: holders are answered with the plan, so their call
returns; the fetcher is out of its group's collective, sync and peers-pending votes while it heals; its
result waits while the group runs a sync; it rejoins at the group's next sync; its loss fails nobody."""

from __future__ import annotations

from typing import Any

import pytest

from pccl.master.heals import HealBook
from pccl.master.state import MasterState, Send
from pccl.master.status import build_status, render_text
from pccl.wire import messages as m

from .test_state import Harness

MB = 1_000_000
HELD = [["w", 10, [1000], 4000, 111, False]]
ZERO = [["w", 10, [1000], 4000, 999, False]]


def _live(rounds: int = 2, first: bool = True, entries: list[list[Any]] | None = None
          ) -> tuple[Harness, list[int]]:
    """A master with live heals and three members. ``first``: ``a`` and ``b`` run first (their first sync,
    holding ``entries`` (default HELD) at revision 1, and a collective of the two), then ``c`` joins: a
    newcomer to a running group. Otherwise all three join at once (nothing run yet)."""
    hs = Harness()
    hs.st = MasterState(live_heal_rounds=rounds)
    if not first:
        peers = [hs.join()[0] for _ in range(3)]
        hs.update([peers[0]])
        assert hs.st.ring == peers
        return hs, peers
    a, b = hs.join()[0], hs.join()[0]
    hs.update([a])
    for p in (a, b):
        hs.h(p, m.SharedStateSync(revision=1, strategy=0, entries=entries or HELD))
    seq = hs.st._sync_seq
    for p in (a, b):
        hs.h(p, m.SharedStateDone(sync_seq=seq, success=True))
    (commence,) = _to(_all_reduce(hs, [a, b], tag=99), a, m.CollectiveCommence)
    for p in (a, b):
        hs.h(p, m.CollectiveDone(tag=99, op_seq=commence.op_seq, success=True))
    c = hs.join()[0]
    hs.update([a, b])
    assert hs.st.ring == [a, b, c] and hs.st.last_revision[0] == 1 and not hs.st._syncs
    return hs, [a, b, c]


def _to(eff: list[Any], pid: int, kind: type[m.Message]) -> list[Any]:
    return [e.message for e in eff
            if isinstance(e, Send) and e.peer_id == pid and isinstance(e.message, kind)]


def _start(hs: Harness, peers: list[int]) -> tuple[list[Any], int]:
    a, b, c = peers
    eff = hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=HELD))
    eff += hs.h(b, m.SharedStateSync(revision=1, strategy=0, entries=HELD))
    eff += hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=ZERO))
    return eff, hs.st._sync_seq


def _all_reduce(hs: Harness, voters: list[int], tag: int = 0) -> list[Any]:
    desc = m.CollectiveDescriptor(kind="all_reduce", dtype=10, element_count=4, op=0, root=-1, quantization=0,
                                  quantized_dtype=10)
    eff: list[Any] = []
    for p in voters:
        eff += hs.h(p, m.CollectiveInitiate(tag=tag, descriptor=desc, op_seq=-1))
    return eff


def test_holders_are_answered_with_their_plan_and_pin_what_the_fetcher_fetches() -> None:
    hs, (a, b, c) = _live()
    eff, seq = _start(hs, [a, b, c])
    for p in (a, b):
        (plan,) = _to(eff, p, m.SharedStatePlan)
        assert plan.live and plan.fetch == [] and plan.pin == ["w"]
        (res,) = _to(eff, p, m.SharedStateResult)
        assert res.success and res.sync_seq == seq and res.revision == 1
    (plan,) = _to(eff, c, m.SharedStatePlan)
    assert plan.live and plan.pin == [] and [r[0] for r in plan.fetch] == ["w"]
    assert not _to(eff, c, m.SharedStateResult)
    assert hs.st.last_revision[0] == 1 and not hs.st._syncs
    assert hs.st.heals.is_healing(c) and hs.st.statistics()["heals"]["healing"] == 1


def test_the_members_vote_without_the_fetcher_and_it_rejoins_at_their_next_sync() -> None:
    hs, (a, b, c) = _live()
    _, seq = _start(hs, [a, b, c])
    # the members' collectives and syncs complete without it; the next op's number is reserved on their
    # ring, so their next collective starts speculatively (no master round trip while it heals)
    eff = _all_reduce(hs, [a, b])
    (commence,) = _to(eff, a, m.CollectiveCommence)
    assert [r.peer_id for r in commence.peers] == [a, b]
    for p in (a, b):
        eff = hs.h(p, m.CollectiveDone(tag=0, op_seq=commence.op_seq, success=True))
    (complete,) = _to(eff, a, m.CollectiveComplete)
    assert complete.next_op_seq >= 0
    desc = m.CollectiveDescriptor(kind="all_reduce", dtype=10, element_count=4, op=0, root=-1, quantization=0,
                                  quantized_dtype=10)
    eff = [e for p in (a, b) for e in hs.h(p, m.CollectiveInitiate(tag=0, descriptor=desc,
                                                                      op_seq=complete.next_op_seq))]
    assert not any(isinstance(e, Send) and isinstance(e.message, m.CollectiveAbort) for e in eff)
    assert not [c for c in _to(eff, a, m.CollectiveCommence) if c.peers]  # no table: the fast start held
    assert hs.st.collectives.fast_starts == 1
    for p in (a, b):
        eff = hs.h(p, m.CollectiveDone(tag=0, op_seq=complete.next_op_seq, success=True))
    assert _to(eff, a, m.CollectiveComplete)
    assert not hs.h(a, m.PeersPendingVote())  # its answer waits for b only, not for the fetcher
    eff = hs.h(b, m.PeersPendingVote())
    assert [msg.pending for msg in _to(eff, a, m.PeersPendingResult)] == [False]
    eff = hs.h(a, m.SharedStateSync(revision=2, strategy=0, entries=HELD))
    eff += hs.h(b, m.SharedStateSync(revision=2, strategy=0, entries=HELD))
    (plan,) = _to(eff, a, m.SharedStatePlan)
    assert not plan.live and [r.peer_id for r in plan.peers] == [a, b]
    members_sync = plan.sync_seq
    # the fetcher is done while that sync runs: its result waits for the sync's end
    assert hs.h(c, m.SharedStateDone(sync_seq=seq, success=True, rx_bytes=4000)) == [
        Send(a, m.SharedStateRelease(sync_seq=seq)), Send(b, m.SharedStateRelease(sync_seq=seq))]
    hs.h(a, m.SharedStateDone(sync_seq=members_sync, success=True))
    eff = hs.h(b, m.SharedStateDone(sync_seq=members_sync, success=True))
    (res,) = _to(eff, c, m.SharedStateResult)
    assert res.success and res.catch_up and res.revision == 1 and res.sync_seq == seq
    # behind: out of collectives, in the sync vote, which waits for it now
    eff = _all_reduce(hs, [a, b], tag=1)
    assert _to(eff, a, m.CollectiveCommence)
    eff = hs.h(a, m.SharedStateSync(revision=3, strategy=0, entries=HELD))
    eff += hs.h(b, m.SharedStateSync(revision=3, strategy=0, entries=HELD))
    assert not _to(eff, a, m.SharedStatePlan)
    eff = hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=HELD))  # same content: nothing to fetch
    plans = {p: _to(eff, p, m.SharedStatePlan)[0] for p in (a, b, c)}
    assert all(not pl.live and pl.fetch == [] for pl in plans.values())
    for p in (a, b, c):
        eff = hs.h(p, m.SharedStateDone(sync_seq=plans[a].sync_seq, success=True))
    assert {p for p in (a, b, c) if _to(eff, p, m.SharedStateResult)} == {a, b, c}
    assert hs.st.heals.statistics()["rejoined"] == 1 and not hs.st.heals.groups
    # current: the next collective needs all three
    assert not _to(_all_reduce(hs, [a, b], tag=2), a, m.CollectiveCommence)
    assert _to(_all_reduce(hs, [c], tag=2), a, m.CollectiveCommence)


def test_live_rounds_are_bounded_then_the_sync_holds_everyone() -> None:
    hs, (a, b, c) = _live(rounds=1)
    _, seq = _start(hs, [a, b, c])
    _all_reduce(hs, [a, b])  # the members go on while it heals: it must catch up at their next sync
    hs.h(c, m.SharedStateDone(sync_seq=seq, success=True))  # (flushed: no sync runs)
    eff = hs.h(a, m.SharedStateSync(revision=2, strategy=0, entries=HELD))
    eff += hs.h(b, m.SharedStateSync(revision=2, strategy=0, entries=HELD))
    eff += hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=ZERO))  # it still differs
    plan = _to(eff, c, m.SharedStatePlan)[0]
    assert not plan.live and plan.fetch  # its second round is an ordinary one: the members wait
    assert not _to(eff, a, m.SharedStateResult)


def test_a_fetcher_lost_mid_heal_fails_no_member_and_releases_the_pins() -> None:
    hs, (a, b, c) = _live()
    _, seq = _start(hs, [a, b, c])
    eff = hs.st.peer_lost(c, "killed")
    assert _to(eff, a, m.SharedStateRelease) == [m.SharedStateRelease(sync_seq=seq)]
    assert not any(isinstance(e, Send) and isinstance(e.message, (m.SharedStateResult, m.CollectiveAbort))
                   for e in eff)
    assert hs.st.heals.statistics()["lost_fetchers"] == 1 and not hs.st.heals.heals
    assert _to(_all_reduce(hs, [a, b]), a, m.CollectiveCommence)


def test_a_failed_fetch_fails_the_fetcher_alone() -> None:
    hs, (a, b, c) = _live()
    _, seq = _start(hs, [a, b, c])
    eff = hs.h(c, m.SharedStateDone(sync_seq=seq, success=False, reason="no holder left"))
    (res,) = _to(eff, c, m.SharedStateResult)
    assert not res.success and "no holder left" in res.reason
    assert not _to(eff, a, m.SharedStateResult) and _to(eff, a, m.SharedStateRelease)
    assert not hs.st.heals.groups


def test_off_by_default_and_with_nothing_to_fetch() -> None:
    hs = Harness()  # live_heal_rounds=0: an ordinary sync
    peers = [hs.join()[0] for _ in range(3)]
    hs.update([peers[0]])
    eff, _ = _start(hs, peers)
    assert not any(_to(eff, p, m.SharedStateResult) for p in peers)
    assert not any(pl.live for p in peers for pl in _to(eff, p, m.SharedStatePlan))
    book = HealBook(2)
    assert not book.may_go_live({1: [], 2: []}) and not book.may_go_live({1: [["w", 1, [2]]]})
    assert not book.may_go_live({1: [["w", 1, [2]]], 2: []})  # 2 never ran a collective without 1
    book.collective_started(0, [2, 3])
    assert not book.may_go_live({1: [["w", 1, [2]]], 2: []})  # ... nor alone
    book.collective_started(0, [2])
    assert book.may_go_live({1: [["w", 1, [2]]], 2: []})
    with pytest.raises(ValueError):
        HealBook(-1)


def test_a_collective_vote_that_waited_for_the_fetcher_completes_when_its_heal_starts() -> None:
    hs, (a, b, c) = _live()
    assert not _to(_all_reduce(hs, [a, b], tag=5), a, m.CollectiveCommence)  # waits for c
    eff, _ = _start(hs, [a, b, c])
    (commence,) = _to(eff, a, m.CollectiveCommence)
    assert commence.tag == 5 and [r.peer_id for r in commence.peers] == [a, b]


def test_a_healing_peers_progress_shows_on_the_status_page_until_it_is_done() -> None:
    hs, (a, b, c) = _live()
    _, seq = _start(hs, [a, b, c])
    assert hs.st.transfer_progress(0.0)[0]["receivers"][0]["bytes"] == 0
    hs.now = 2.0
    assert hs.h(c, m.SharedStateProgress(sync_seq=seq, rx_bytes=1000, total_bytes=4000)) == []
    (row,) = hs.st.transfer_progress(2.0)
    assert row["live"] and row["sync_seq"] == seq and row["receivers"][0]["peer"] == c
    assert row["receivers"][0]["bytes"] == 1000 and row["receivers"][0]["bytes_per_s"] == 500.0
    snap = build_status(hs.st, [], 2.0)
    assert f"sync {seq} (group 0): peer {c}: 1.0 kB / 4.0 kB (25%), 500 B/s, ETA 6.0 s" in render_text(snap)
    # a report that goes back kicks the sender; one for another sync is dropped
    assert hs.h(c, m.SharedStateProgress(sync_seq=seq + 5, rx_bytes=0, total_bytes=4000)) == []
    hs.h(c, m.SharedStateDone(sync_seq=seq, success=True))
    assert hs.st.transfer_progress(3.0) == []


def test_a_fetcher_whose_group_did_nothing_meanwhile_is_current_at_once() -> None:
    """The members made no call since the heal's sync (a one-shot sync, then local work): the fetcher is
    where they are, so its call returns as after an ordinary sync (no catch-up round, which would wait for
    a next sync the members may never make) and their next collective waits for it again."""
    hs, (a, b, c) = _live()
    _, seq = _start(hs, [a, b, c])
    eff = hs.h(c, m.SharedStateDone(sync_seq=seq, success=True))
    res = _to(eff, c, m.SharedStateResult)
    assert len(res) == 1 and res[0].success and not res[0].catch_up and res[0].revision == 1
    assert not hs.st.heals.is_healing(c) and not hs.st.heals.out_of_ops(0)
    eff = _all_reduce(hs, [a, b])
    assert not _to(eff, a, m.CollectiveCommence)  # c counts again: the vote waits for it
    eff = _all_reduce(hs, [c])
    assert _to(eff, c, m.CollectiveCommence)
    assert hs.st.heals.statistics()["fetched"] == 1


def _entries(w: int, v: int) -> list[list[Any]]:
    return [["w", 10, [1000], 4000, w, False], ["v", 10, [1000], 4000, v, False]]


def _two_syncs(second: dict[str, list[list[Any]]]) -> tuple[Harness, list[Any], list[int]]:
    """``a`` and ``b`` run (their first sync holding ``_entries(1, 2)``, a collective), ``c`` joins, then a
    sync where ``a`` and ``b`` hold ``second["held"]`` (revision 2) and ``c`` votes ``second["c"]``
    (revision 1)."""
    hs, (a, b, c) = _live(entries=_entries(1, 2))
    eff = hs.h(a, m.SharedStateSync(revision=2, strategy=0, entries=second["held"]))
    eff += hs.h(b, m.SharedStateSync(revision=2, strategy=0, entries=second["held"]))
    eff += hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=second["c"]))
    return hs, eff, [a, b, c]


def test_a_sync_is_kept_ordinary_when_every_key_fetched_changed_since_the_last_one() -> None:
    """The group changed every key since its previous sync (data-parallel, DiLoCo): a live round could
    not catch up (the fetcher would fetch it all again at its join while the members wait), so the
    sync is an ordinary one: the fetcher receives the state once."""
    hs, eff, (a, _, c) = _two_syncs({"held": _entries(11, 12), "c": _entries(1, 2)})
    plan = _to(eff, c, m.SharedStatePlan)[0]
    assert not plan.live and sorted(r[0] for r in plan.fetch) == ["v", "w"]
    assert not _to(eff, a, m.SharedStateResult)  # the members wait for it, as before live heals
    assert hs.st.heals.statistics()["kept_ordinary"] == 1 and hs.st.heals.statistics()["started"] == 0


def test_a_key_unchanged_since_the_last_sync_keeps_the_heal_live() -> None:
    """Part of what the fetcher fetches did not change (frozen layers): a live round can catch up on the
    rest, so the heal is live."""
    hs, eff, (a, _, c) = _two_syncs({"held": _entries(11, 2), "c": _entries(0, 0)})
    plan = _to(eff, c, m.SharedStatePlan)[0]
    assert plan.live and sorted(r[0] for r in plan.fetch) == ["v", "w"]
    assert _to(eff, a, m.SharedStateResult)[0].success
    assert hs.st.heals.statistics()["kept_ordinary"] == 0 and hs.st.heals.statistics()["started"] == 1


def test_only_the_fetched_keys_decide() -> None:
    """``c`` fetches only ``w``, which changed; ``v`` did not change but ``c`` holds it already."""
    _, eff, (_, _, c) = _two_syncs({"held": _entries(11, 2), "c": _entries(1, 2)})
    plan = _to(eff, c, m.SharedStatePlan)[0]
    assert not plan.live and [r[0] for r in plan.fetch] == ["w"]
    book = HealBook(1)
    book.collective_started(0, [2])
    book.collective_started(5, [2])
    rows = {1: [["w", 11, [2]]], 2: []}
    assert not book.may_go_live(rows, 0, {"w": 1}, started=False)  # the group's first sync: ordinary
    assert not book.may_go_live(rows, 0, {"w": 11})  # w changed since: ordinary
    assert book.may_go_live(rows, 0, {"w": 11})  # unchanged since: live
    assert book.may_go_live(rows, 5, {"w": 7})  # another group: its own history (none: no evidence)


def test_the_groups_first_sync_is_never_live() -> None:
    """The run starts at the group's first sync: everyone leaves it together (the holders would otherwise
    start training in a world without the fetchers, which were to be part of it from the first step)."""
    hs, (a, b, c) = _live(first=False)
    eff, _ = _start(hs, [a, b, c])
    assert not any(pl.live for p in (a, b, c) for pl in _to(eff, p, m.SharedStatePlan))
    assert _to(eff, c, m.SharedStatePlan)[0].fetch and not _to(eff, a, m.SharedStateResult)
    assert hs.st.heals.statistics()["started"] == 0


def test_holders_that_did_not_train_together_without_the_fetcher_wait_for_it() -> None:
    """The holders' last collective had the fetcher in it (here: all three ran one; then ``c``'s state went
    wrong): their loop has not accepted a world without it (a driver waiting for ``min_world_size`` peers
    would wait for ``c`` while ``c`` waits for its next sync), so the sync is ordinary."""
    hs, (a, b, c) = _live(first=False)
    for p in (a, b, c):
        hs.h(p, m.SharedStateSync(revision=1, strategy=0, entries=HELD))
    seq = hs.st._sync_seq
    for p in (a, b, c):
        hs.h(p, m.SharedStateDone(sync_seq=seq, success=True))
    (commence,) = _to(_all_reduce(hs, [a, b, c], tag=7), a, m.CollectiveCommence)
    for p in (a, b, c):
        hs.h(p, m.CollectiveDone(tag=7, op_seq=commence.op_seq, success=True))
    eff, _ = _start(hs, [a, b, c])
    assert not any(pl.live for p in (a, b, c) for pl in _to(eff, p, m.SharedStatePlan))
    assert _to(eff, c, m.SharedStatePlan)[0].fetch and hs.st.heals.statistics()["started"] == 0
