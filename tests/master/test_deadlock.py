"""Deadlock and mismatch detection in the master core (pure state, time passed in)."""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.master.deadlock import DeadlockWatch, find_deadlocks
from pccl.master.describe import describe_mismatch
from pccl.master.state import MasterState
from pccl.wire import messages as m

from ._effects import sends
from .test_state import Harness

AR = m.CollectiveDescriptor("all_reduce", 10, 8, 0, -1, 0, 0)  # float32 x 8, SUM
ENTRY = [["w", 10, [8], 32, 123, False]]


def _group_of(n: int) -> tuple[Harness, list[int]]:
    hs = Harness()
    ids = [hs.join()[0] for _ in range(n)]
    hs.update([ids[0]])
    assert hs.st.accepted() == ids
    return hs, ids


def test_sync_against_all_reduce_fails_both_calls_after_the_grace() -> None:
    hs, (a, b) = _group_of(2)
    watch = DeadlockWatch(grace=1.0)
    assert not hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=ENTRY))
    assert not hs.h(b, m.CollectiveInitiate(tag=0, descriptor=AR))
    assert watch.check(hs.st, now=10.0) == []  # a candidate, not yet declared
    assert watch.deadline() == 11.0
    assert watch.check(hs.st, now=10.999) == []
    eff = watch.check(hs.st, now=11.0)
    reason = (
        "deadlock in peer group 0: peer 1 waits in sync_shared_state; peer 2 in all_reduce tag 0. "
        "These calls can never complete each other: every accepted peer of a group must make the same "
        "call (same tag and arguments)"
    )
    (pa, res), = sends(eff, m.SharedStateResult)
    (pb, ab), = sends(eff, m.CollectiveAbort)
    assert (pa, res.success, res.sync_seq, res.code) == (a, False, -1, Result.INVALID_USAGE)
    assert res.reason == reason
    assert (pb, ab.op_seq, ab.code, ab.reason) == (b, -1, Result.INVALID_USAGE, reason)
    # the votes are gone: the group can start over, and nothing is left to declare
    assert hs.st.vote_waits() == {} and watch.deadline() is None and watch.detected == 1
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    assert sends(hs.h(b, m.CollectiveInitiate(tag=0, descriptor=AR)), m.CollectiveCommence)


def test_different_tags_deadlock_and_grace_zero_declares_at_once() -> None:
    hs, (a, b, c) = _group_of(3)
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    hs.h(b, m.CollectiveInitiate(tag=1, descriptor=AR))
    assert find_deadlocks(hs.st) == []  # c is not waiting: it may still vote
    hs.h(c, m.CollectiveInitiate(tag=1, descriptor=AR))
    (dl,) = find_deadlocks(hs.st)  # a in tag 0, b and c in tag 1: nobody else to vote
    assert dl.reason.startswith("deadlock in peer group 0: peer 1 waits in all_reduce tag 0; peer 2 in "
                                "all_reduce tag 1; peer 3 in all_reduce tag 1. ")
    assert sends(hs.h(a, m.CollectiveInitiate(tag=1, descriptor=AR)), m.CollectiveCommence)  # tag 1 runs
    assert find_deadlocks(hs.st) == []
    # all three in different tags, nobody else to vote
    hs2, (x, y) = _group_of(2)
    watch = DeadlockWatch(grace=0.0)
    hs2.h(x, m.CollectiveInitiate(tag=3, descriptor=AR))
    hs2.h(y, m.CollectiveInitiate(tag=4, descriptor=m.CollectiveDescriptor("all_gather", 5, 2, 0, -1, 0, 0)))
    eff = watch.check(hs2.st, now=0.0)
    aborts = sends(eff, m.CollectiveAbort)
    assert [(p, ab.tag) for p, ab in aborts] == [(x, 3), (y, 4)]
    assert aborts[0][1].reason.startswith(
        "deadlock in peer group 0: peer 1 waits in all_reduce tag 3; peer 2 in all_gather tag 4. "
    )


def test_a_changed_wait_restarts_the_grace() -> None:
    hs, (a, b) = _group_of(2)
    watch = DeadlockWatch(grace=1.0)
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    hs.h(b, m.CollectiveInitiate(tag=1, descriptor=AR))
    watch.check(hs.st, now=0.0)
    hs.h(a, m.CollectiveInitiate(tag=1, descriptor=AR))  # tag 1 commences: no deadlock any more
    assert watch.check(hs.st, now=0.5) == [] and watch.deadline() is None
    assert find_deadlocks(hs.st) == []


def test_peers_in_a_running_collective_are_not_deadlocked() -> None:
    hs, (a, b) = _group_of(2)
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    hs.h(b, m.CollectiveInitiate(tag=0, descriptor=AR))  # running
    hs.h(a, m.CollectiveInitiate(tag=1, descriptor=AR))
    hs.h(b, m.SharedStateSync(revision=1, strategy=0, entries=ENTRY))
    assert find_deadlocks(hs.st) == []


def test_other_groups_and_topology_votes() -> None:
    hs = Harness()
    a = hs.join(group=0)[0]
    b = hs.join(group=0)[0]
    c = hs.join(group=1)[0]
    hs.update([a])
    hs.h(a, m.UpdateTopologyVote())
    hs.h(b, m.CollectiveInitiate(tag=0, descriptor=AR))
    assert find_deadlocks(hs.st) == []  # c (group 1) can still vote for the topology update
    hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=ENTRY))  # c alone: the sync runs at once
    hs2, (x, y) = _group_of(2)
    hs2.h(x, m.UpdateTopologyVote())
    hs2.h(y, m.SharedStateSync(revision=1, strategy=0, entries=ENTRY))
    eff = DeadlockWatch(0.0).check(hs2.st, now=0.0)
    (px, topo), = sends(eff, m.TopologyResult)
    assert px == x and not topo.success and topo.code == Result.INVALID_USAGE
    assert "peer 1 waits in update_topology; peer 2 in sync_shared_state" in topo.reason
    assert hs2.st.statistics()["topology_round"] is None


def test_mismatched_descriptors_name_fields_and_dtypes() -> None:
    hs, (a, b) = _group_of(2)
    desc = m.CollectiveDescriptor
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=desc("all_reduce", 11, 8, 0, -1, 0, 0)))
    eff = hs.h(b, m.CollectiveInitiate(tag=0, descriptor=desc("all_reduce", 10, 9, 1, -1, 0, 0)))
    reasons = {ab.reason for _, ab in sends(eff, m.CollectiveAbort)}
    assert reasons == {
        "peers disagree on the operation with tag 0: dtype: float64 on peer 1, float32 on peer 2; "
        "count: 8 on peer 1, 9 on peer 2; reduce op: sum on peer 1, avg on peer 2"
    }
    many: dict[int, list[Any]] = {
        1: ["all_reduce", 10, 8], 2: ["all_gather", 10, 8], 3: ["all_reduce", 10, 8],
    }
    assert describe_mismatch(5, many) == (
        "peers disagree on the operation with tag 5: "
        "operation: all_reduce on peers 1, 3, all_gather on peer 2"
    )


def test_too_few_peers_says_who_waits_to_be_accepted() -> None:
    hs = Harness()
    a = hs.join()[0]
    hs.join()
    hs.join(group=1)  # another group's newcomer does not help group 0
    eff = hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    (_, ab), = sends(eff, m.CollectiveAbort)
    assert ab.code == Result.TOO_FEW_PEERS
    assert ab.reason == (
        "a collective needs at least 2 accepted peers in peer group 0, it has 1; peer 2 is waiting to be "
        "accepted: accepted peers call update_topology()"
    )
    hs2 = Harness()
    x = hs2.join()[0]
    (_, ab2), = sends(hs2.h(x, m.CollectiveInitiate(tag=0, descriptor=AR)), m.CollectiveAbort)
    assert ab2.reason.endswith("it has 1; no peer is waiting to be accepted (start more peers)")


def test_voting_peers_is_the_set_of_peers_vote_waits_lists() -> None:
    # find_deadlocks looks at voting_peers() first and builds vote_waits() only when a group could be
    # deadlocked, so the two must name the same peers in every kind of vote.
    hs, (a, b, c) = _group_of(3)

    def same() -> set[int]:
        assert hs.st.voting_peers() == set(hs.st.vote_waits())
        return hs.st.voting_peers()

    assert same() == set()
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    assert same() == {a}
    hs.h(b, m.SharedStateSync(revision=1, strategy=0, entries=ENTRY))
    assert same() == {a, b}
    hs.h(c, m.UpdateTopologyVote())
    assert same() == {a, b, c}
    hs2, (x, y) = _group_of(2)
    hs2.h(x, m.CollectiveInitiate(tag=0, descriptor=AR))
    hs2.h(y, m.CollectiveInitiate(tag=0, descriptor=AR))  # running: no longer a vote
    assert hs2.st.voting_peers() == set(hs2.st.vote_waits()) == set()
    hs2.h(x, m.PeersPendingVote())
    assert hs2.st.voting_peers() == set(hs2.st.vote_waits()) == {x}


def test_the_candidate_bound_counts_open_votes_per_group_and_ring_wide_votes_for_all() -> None:
    hs = Harness()
    a, b, c = (hs.join(group=0)[0] for _ in range(3))
    x, y = (hs.join(group=1)[0] for _ in range(2))
    hs.update([a])
    assert hs.st.accepted() == [a, b, c, x, y]
    assert hs.st.deadlock_candidates() == []
    hs.h(a, m.CollectiveInitiate(tag=0, descriptor=AR))
    hs.h(b, m.CollectiveInitiate(tag=1, descriptor=AR))
    assert hs.st.deadlock_candidates() == []  # 2 votes open in group 0, of 3 members
    hs.h(x, m.SharedStateSync(revision=1, strategy=0, entries=ENTRY))
    assert hs.st.deadlock_candidates() == []  # 1 of group 1's 2
    hs.h(c, m.PeersPendingVote())  # ring-wide: it may count for either group
    assert sorted(hs.st.deadlock_candidates()) == [0, 1]
    # the bound is not the answer: group 1's y has no vote, and group 0 waits in a ring-wide vote that
    # group 1 can still join
    assert find_deadlocks(hs.st) == []
    hs.h(y, m.CollectiveInitiate(tag=5, descriptor=AR))  # x in a sync, y in tag 5: group 1 is stuck
    assert [d.group for d in find_deadlocks(hs.st)] == [1]


def test_a_large_group_voting_never_builds_the_voter_set(monkeypatch: Any) -> None:
    # The check runs after every message: with the voter set built each time, a vote round of n
    # peers cost the master O(n^2). While no group can have every member voting, it must not be built.
    hs, ids = _group_of(64)
    calls: list[int] = []
    real = type(hs.st).voting_peers

    def counted(self: MasterState) -> set[int]:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(type(hs.st), "voting_peers", counted)
    watch = DeadlockWatch(grace=0.0)
    for p in ids[:-1]:
        assert not hs.h(p, m.CollectiveInitiate(tag=0, descriptor=AR))
        assert watch.check(hs.st, now=0.0) == []
    assert sends(hs.h(ids[-1], m.CollectiveInitiate(tag=0, descriptor=AR)), m.CollectiveCommence)
    assert watch.check(hs.st, now=0.0) == []
    for p in ids:
        hs.h(p, m.CollectiveDone(tag=0, success=True))
        assert watch.check(hs.st, now=0.0) == []
    assert calls == []
    # the same group split over two tags is found as before, with the voter set built once
    for p in ids[:-1]:
        hs.h(p, m.CollectiveInitiate(tag=1, descriptor=AR))
    hs.h(ids[-1], m.CollectiveInitiate(tag=2, descriptor=AR))
    assert len(sends(watch.check(hs.st, now=0.0), m.CollectiveAbort)) == 64
    assert calls == [1]
