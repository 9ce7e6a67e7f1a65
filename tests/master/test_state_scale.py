"""The master's rounds are O(n): no per-message work proportional to the world size (issue 21).

Counted, not timed: every vote but the last must not walk the membership. The behaviour around
membership changes during a vote (which the counts must follow) is checked too.
"""

from __future__ import annotations

from typing import Any

import pytest

from pccl.master.state import MasterState
from pccl.wire import messages as m

from ._effects import sends
from .test_state import Harness

DESCRIPTOR = m.CollectiveDescriptor("all_reduce", 6, 8, 0, 0, 0, 0)


def _world(n: int, group_of: Any = lambda i: 0) -> tuple[Harness, list[int]]:
    hs = Harness()
    first, _ = hs.join(group_of(0))
    rest = [hs.join(group_of(i + 1))[0] for i in range(n - 1)]
    hs.update([first])
    ids = [first, *rest]
    assert hs.st.accepted() == ids
    return hs, ids


class _Counting:
    """Counts calls of MasterState.accepted (the membership walk) and of the ring's reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = MasterState.accepted

        def counted(st: MasterState, group: int | None = None) -> list[int]:
            self.calls += 1
            return real(st, group)

        monkeypatch.setattr(MasterState, "accepted", counted)


def test_a_collective_round_walks_the_membership_once(monkeypatch: pytest.MonkeyPatch) -> None:
    hs, ids = _world(64)
    count = _Counting(monkeypatch)
    eff: list[Any] = []
    for p in ids:
        eff += hs.h(p, m.CollectiveInitiate(tag=3, descriptor=DESCRIPTOR))
    assert [p for p, _ in sends(eff, m.CollectiveCommence)] == ids
    assert count.calls == 1  # at the last vote, not at each of the 64
    for p in ids:
        eff = hs.h(p, m.CollectiveDone(tag=3, success=True))
    assert [p for p, _ in sends(eff, m.CollectiveComplete)] == ids
    assert count.calls == 1


def test_a_sync_vote_round_walks_the_membership_once(monkeypatch: pytest.MonkeyPatch) -> None:
    hs, ids = _world(32)
    count = _Counting(monkeypatch)
    eff: list[Any] = []
    for p in ids:
        eff += hs.h(p, m.SharedStateSync(revision=1, strategy=0, entries=[]))
    answered = {p for p, _ in sends(eff, m.SharedStatePlan)} | {p for p, _ in sends(eff, m.SharedStateResult)}
    assert answered == set(ids)
    assert count.calls == 1


def test_group_counts_follow_losses_and_newcomers_during_a_vote() -> None:
    """A collective vote waits for exactly the accepted members of its group, as they are when the
    last vote arrives: a peer lost mid-vote no longer counts, a peer accepted mid-vote must vote."""
    hs, ids = _world(6, group_of=lambda i: i % 2)
    group0 = [p for i, p in enumerate(ids) if i % 2 == 0]
    for p in group0[:2]:
        assert not sends(hs.h(p, m.CollectiveInitiate(tag=1, descriptor=DESCRIPTOR)))
    # the third member of group 0 leaves: the two votes are now everyone's
    eff = hs.st.peer_lost(group0[2], "left")
    assert [p for p, _ in sends(eff, m.CollectiveCommence)] == group0[:2]
    for p in group0[:2]:
        hs.h(p, m.CollectiveDone(tag=1, success=True))
    # a newcomer joins group 0 while group 0 votes on tag 2
    members = hs.st.accepted(0)
    assert not sends(hs.h(members[0], m.CollectiveInitiate(tag=2, descriptor=DESCRIPTOR)))
    newcomer, _ = hs.join(0)
    hs.update(hs.st.accepted())
    assert newcomer in hs.st.accepted(0)
    eff = hs.h(members[1], m.CollectiveInitiate(tag=2, descriptor=DESCRIPTOR))
    assert not sends(eff, m.CollectiveCommence)
    eff = hs.h(newcomer, m.CollectiveInitiate(tag=2, descriptor=DESCRIPTOR))
    assert sorted(p for p, _ in sends(eff, m.CollectiveCommence)) == sorted([*members, newcomer])


def test_topology_and_pending_rounds_finish_on_the_last_message() -> None:
    hs, ids = _world(40)
    for p in ids[:-1]:
        assert not sends(hs.h(p, m.PeersPendingVote()))
    assert len(sends(hs.h(ids[-1], m.PeersPendingVote()), m.PeersPendingResult)) == 40
    eff: list[Any] = []
    for p in ids:
        eff += hs.h(p, m.UpdateTopologyVote())
    est = sends(eff, m.EstablishP2P)
    assert len(est) == 40
    for pid, msg in est[:-1]:
        assert not sends(hs.h(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True)))
    pid, msg = est[-1]
    res = sends(hs.h(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True)), m.TopologyResult)
    assert len(res) == 40 and all(r.success for _, r in res)
    # a confirmation from a peer outside the round is ignored, as before
    assert hs.h(ids[0], m.P2PConnectionsDone(epoch=msg.epoch, success=True)) == []


class _Ring(list):  # type: ignore[type-arg]
    """A reported ring that counts the membership tests made on it."""

    tests = 0

    def __contains__(self, item: object) -> bool:
        _Ring.tests += 1
        return super().__contains__(item)


def test_a_rebuild_tests_each_reported_ring_a_bounded_number_of_times() -> None:
    # Each member back is checked against the rings the others reported, and theirs against its: with a
    # membership test on its reported list per earlier member, a rebuild of n members cost O(n^3) (2 s
    # of master CPU at 1024 members, benchmarks/control_plane.py "rebuild").
    st = MasterState()
    ring = list(range(1, 49))
    _Ring.tests = 0
    for p in ring:
        got = st.new_connection("127.0.0.1", 0.0, claim=p)
        msg = m.Reregister(peer_id=p, p2p_port=40000 + p, peer_group=0, epoch=5, ring=_Ring(ring),
                           revision=-1, generation=1)
        assert sends(st.handle(got, msg, 0.0), m.Reregistered)
    assert st.accepted() == ring
    assert _Ring.tests <= 2 * len(ring)
