"""Issue 18 item 3: no split brain with a live old master, and newcomer-first at a restarted master.

The pure MasterState driven message by message (docs/concepts.md "No split brain").
"""

from __future__ import annotations

from typing import Any

import pytest

from pccl import Result
from pccl.master.deadlock import DeadlockWatch, find_deadlocks
from pccl.master.state import MasterState
from pccl.wire import messages as m

from ._effects import kicks, member_reregister, sends

DESC = m.CollectiveDescriptor("all_reduce", 1, 10, 0, -1, 0, 0)


def join(st: MasterState, now: float = 0.0) -> tuple[int, list[Any]]:
    pid = st.new_connection("127.0.0.1", now)
    return pid, st.handle(pid, m.Register(p2p_port=40000 + pid), now)


def update(st: MasterState, voters: list[int], now: float = 0.0) -> list[Any]:
    eff: list[Any] = []
    for p in voters:
        eff += st.handle(p, m.UpdateTopologyVote(), now)
    out: list[Any] = []
    for pid, msg in sends(eff, m.EstablishP2P):
        out += st.handle(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True), now)
    return out


def run(n: int, *, quorum: str = "auto", standbys: bool = True) -> tuple[MasterState, list[int]]:
    """A live master with ``n`` members admitted the ordinary way; each says it can fail over."""
    st = MasterState(quorum=quorum)
    ids = [join(st)[0] for _ in range(n)]
    update(st, [ids[0]])
    assert st.accepted() == ids
    if standbys:
        for p in ids:
            st.handle(p, m.Standbys(count=1), 0.0)
    return st, ids


def all_reduce(st: MasterState, voters: list[int], now: float = 0.0, tag: int = 0) -> list[Any]:
    eff: list[Any] = []
    for p in voters:
        eff += st.handle(p, m.CollectiveInitiate(tag=tag, descriptor=DESC), now)
    return eff


def rereg(st: MasterState, pid: int, *, epoch: int, ring: list[int], generation: int = 1,
          revision: int = -1, now: float = 0.0) -> tuple[int, list[Any]]:
    got = st.new_connection("127.0.0.1", now, claim=pid)
    msg = member_reregister(st, peer_id=pid, p2p_port=40000 + pid, peer_group=0, epoch=epoch, ring=list(ring),
                       revision=revision, generation=generation)
    return got, st.handle(got, msg, now)


def test_without_a_peer_that_can_fail_over_a_live_master_keeps_serving_a_minority() -> None:
    st, ids = run(5, standbys=False)  # "auto": no peer said it has a standby master
    for p in ids[:3]:
        st.peer_lost(p, "evicted: silent", now=1.0)
    assert st.statistics()["held"] is False and not st.enforced
    commence = sends(all_reduce(st, ids[3:]), m.CollectiveCommence)
    assert sorted(p for p, _ in commence) == ids[3:]


@pytest.mark.parametrize("quorum", ["auto", "on"])
def test_a_live_master_holding_a_minority_of_the_epoch_completes_no_vote(quorum: str) -> None:
    st, ids = run(5, quorum=quorum, standbys=quorum == "auto")
    assert st.enforced and st.base == ids
    st.peer_lost(ids[0], "evicted: silent", now=1.0)
    st.peer_lost(ids[1], "evicted: silent", now=1.0)
    # 3 of 5: still a majority, votes complete
    assert sends(all_reduce(st, ids[2:], now=1.0), m.CollectiveCommence)
    for p in ids[2:]:
        st.handle(p, m.CollectiveDone(tag=0, success=True), 1.0)
    eff = st.peer_lost(ids[2], "evicted: silent", now=2.0)  # 2 of 5: held
    s = st.statistics()
    assert s["held"] and s["quorum_enforced"]
    assert st.hold_deadline(10.0) == 12.0
    minority = ids[3:]
    assert not sends(all_reduce(st, minority, now=2.0))
    eff = []
    for p in minority:
        eff += st.handle(p, m.SharedStateSync(revision=1, strategy=0, entries=[]), 2.0)
        eff += st.handle(p, m.PeersPendingVote(), 2.0)
        eff += st.handle(p, m.UpdateTopologyVote(), 2.0)
    assert not sends(eff)  # no sync plan, no pending answer, no EstablishP2P
    # a held master accepts no newcomer alone either, and its votes time nobody out
    assert st.vote_overdue(5000.0, 1.0) == []


def test_quorum_off_never_holds() -> None:
    st, ids = run(5, quorum="off")
    for p in ids[:3]:
        st.peer_lost(p, "evicted: silent", now=1.0)
    assert not st.enforced and st.statistics()["held"] is False
    assert sends(all_reduce(st, ids[3:]), m.CollectiveCommence)


def test_a_member_taken_back_restores_the_quorum_and_the_held_votes_complete() -> None:
    st, ids = run(3)
    epoch = st.epoch
    st.peer_lost(ids[0], "evicted: silent", now=1.0)
    st.peer_lost(ids[1], "evicted: silent", now=1.0)
    assert not sends(all_reduce(st, [ids[2]], now=1.0))  # 1 of 3: held
    _, eff = rereg(st, ids[1], epoch=epoch, ring=ids, now=2.0)  # 2 of 3: quorum again
    assert sends(eff, m.Reregistered) and st.statistics()["held"] is False
    assert st.hold_deadline(10.0) is None
    eff = all_reduce(st, [ids[1]], now=2.0)  # the held vote of ids[2] was kept
    assert sorted(p for p, _ in sends(eff, m.CollectiveCommence)) == [ids[1], ids[2]]


def test_a_completed_topology_round_makes_its_members_the_new_base() -> None:
    st, ids = run(5)
    st.peer_lost(ids[3], "left", now=1.0)
    st.peer_lost(ids[4], "left", now=1.0)
    update(st, ids[:3], now=1.0)  # 3 of 5 voted: a new epoch of 3
    assert st.base == ids[:3]
    st.peer_lost(ids[2], "left", now=2.0)  # 2 of 3: still a majority
    assert st.statistics()["held"] is False
    assert sends(all_reduce(st, ids[:2], now=2.0), m.CollectiveCommence)


def test_the_hold_timeout_gives_the_run_up_and_refuses_its_members() -> None:
    st, ids = run(5)
    epoch = st.epoch
    for p in ids[:3]:
        st.peer_lost(p, "evicted: silent", now=1.0)
    newcomer, _ = join(st, now=1.5)
    assert st.hold_overdue(10.9, 10.0) == []  # not yet
    eff = st.hold_overdue(11.1, 10.0)
    ks = kicks(eff)
    assert sorted(k.peer_id for k in ks) == sorted([*ids[3:], newcomer])
    assert {k.code for k in ks} == {int(Result.MASTER_CONNECTION_FAILED)}
    assert all("look for a newer master" in k.reason for k in ks)
    assert st.peers == {} and st.statistics()["held"] is False and st.hold_deadline(10.0) is None
    # the run's members (this generation) are refused from now on ...
    _, eff = rereg(st, ids[3], epoch=epoch, ring=ids, generation=1, now=12.0)
    (k,) = kicks(eff)
    assert k.code == int(Result.MASTER_CONNECTION_FAILED) and "gave the run" in k.reason
    # ... a member of a newer generation is rebuilt from, as by any empty master ...
    _, eff = rereg(st, ids[0], epoch=epoch + 3, ring=ids[:3], generation=2, now=13.0)
    assert sends(eff, m.Reregistered) and st.generation == 3
    # ... and on a master that gave up with nobody coming back, newcomers start afresh
    st2, ids2 = run(3)
    for p in ids2:
        st2.peer_lost(p, "evicted: silent", now=1.0)
    st2.hold_overdue(20.0, 10.0)
    pid, eff = join(st2, now=21.0)
    assert sends(eff, m.Accepted) and st2.accepted() == [pid]


def test_a_rebuilding_master_short_of_a_majority_gives_up_after_the_hold_timeout() -> None:
    st = MasterState()
    rereg(st, 1, epoch=7, ring=[1, 2, 3], now=5.0)
    assert st.statistics()["rebuilding"] and st.hold_deadline(30.0) == 35.0
    eff = st.hold_overdue(35.5, 30.0)
    assert [(k.peer_id, k.code) for k in kicks(eff)] == [(1, int(Result.MASTER_CONNECTION_FAILED))]
    assert not st.statistics()["rebuilding"]


def test_newcomer_first_at_a_restarted_master_the_members_win() -> None:
    st = MasterState()  # restarted: empty
    newcomer, eff = join(st)
    assert sends(eff, m.Accepted) and newcomer == 1  # accepted alone; a fresh master counts from 1
    # member 1 comes back: its id is the newcomer's, so its hello got another id
    got, eff = rereg(st, 1, epoch=7, ring=[1, 2, 3], now=1.0)
    assert got != 1
    by_peer = {k.peer_id: k for k in kicks(eff)}
    assert set(by_peer) == {newcomer, got}
    assert by_peer[newcomer].code == int(Result.KICKED) and "join again" in by_peer[newcomer].reason
    assert "retry" in by_peer[got].reason and not sends(eff, m.Reregistered)
    assert st.peers == {} and not st.statistics()["rebuilding"]
    # its retry gets its id and starts the rebuild; a second member makes the majority
    got, eff = rereg(st, 1, epoch=7, ring=[1, 2, 3], now=1.5)
    (who, ok), = sends(eff, m.Reregistered)
    assert got == who == 1 and ok.epoch == 7 and ok.generation == 2
    _, eff = rereg(st, 2, epoch=7, ring=[1, 2, 3], now=1.5)
    assert sends(eff, m.Reregistered) and not st.statistics()["rebuilding"]
    # the newcomer joins again and is admitted by the members' vote
    again, eff = join(st, now=2.0)
    assert not sends(eff, m.Accepted) and st.registered() == [again]
    eff = update(st, [1, 2], now=2.0)
    assert sends(eff, m.Accepted) and st.accepted() == [1, 2, again]


def test_newcomer_first_members_of_a_newer_generation_win_too() -> None:
    st = MasterState()  # a master restarted a second time: the run is at generation 2
    newcomer, _ = join(st)
    _, eff = rereg(st, 5, epoch=9, ring=[5, 6], generation=2)
    assert [k.peer_id for k in kicks(eff)] == [newcomer]
    assert sends(eff, m.Reregistered) and st.generation == 3


def test_other_newcomers_wait_while_the_lone_one_yields() -> None:
    st = MasterState()
    first, _ = join(st)
    second, eff = join(st)
    assert not sends(eff, m.Accepted)
    _, eff = rereg(st, 7, epoch=7, ring=[7, 8, 9])
    assert [k.peer_id for k in kicks(eff)] == [first]
    assert not sends(eff, m.Accepted) and st.registered() == [second]
    assert st.accepted() == [7]


def test_a_lone_peer_accepted_after_its_run_ended_is_no_newcomer_first() -> None:
    st, ids = run(2, standbys=False)
    epoch = st.epoch
    for p in ids:
        st.peer_lost(p, "left", now=1.0)
    pid, eff = join(st, now=2.0)
    assert sends(eff, m.Accepted)
    _, eff = rereg(st, ids[0], epoch=epoch, ring=ids, now=3.0)  # this master's own old epoch
    assert [k.code for k in kicks(eff)] == [int(Result.MASTER_CONNECTION_FAILED)]
    assert st.accepted() == [pid]


def test_standbys_from_one_peer_turns_the_rule_on_for_the_run() -> None:
    st, ids = run(3, standbys=False)
    for p in ids[:2]:
        st.peer_lost(p, "evicted: silent", now=1.0)
    assert st.statistics()["held"] is False
    st.handle(ids[2], m.Standbys(count=2), 2.0)  # the survivor can fail over: 1 of 3 is held now
    assert st.enforced and st.statistics()["held"] and st.hold_deadline(5.0) == 7.0
    assert not sends(all_reduce(st, [ids[2]], now=2.0))


def test_a_held_master_declares_no_deadlock_its_votes_wait_for_members() -> None:
    """Regression: every member a held master holds voting the same call is not a deadlock (the
    deadlock check assumed that a vote all members joined would have completed)."""
    rebuilding = MasterState()
    rereg(rebuilding, 1, epoch=7, ring=[1, 2, 3, 4, 5])
    rereg(rebuilding, 2, epoch=7, ring=[1, 2, 3, 4, 5])  # 2 of 5 back: still rebuilding
    live, ids = run(5)
    for p in ids[:3]:
        live.peer_lost(p, "evicted: silent", now=1.0)
    for st, voters in ((rebuilding, [1, 2]), (live, ids[3:])):
        assert not sends(all_reduce(st, voters, now=1.0))
        assert find_deadlocks(st) == []
        assert DeadlockWatch(0.0).check(st, 100.0) == []
