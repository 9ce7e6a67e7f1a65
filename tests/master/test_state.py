"""The master state machine driven message by message (no trio, no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from pccl import Result
from pccl.master.state import Event, MasterState
from pccl.wire import messages as m

from ._effects import kicks, opaque_descriptor, sends

DESC = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)


class Harness:
    """Wires a MasterState to scripted peers."""

    def __init__(self) -> None:
        self.st = MasterState()
        self.now = 0.0

    def join(self, group: int = 0, host: str = "127.0.0.1") -> tuple[int, list[Any]]:
        pid = self.st.new_connection(host, self.now)
        eff = self.st.handle(pid, m.Register(p2p_port=40000 + pid, peer_group=group), self.now)
        return pid, eff

    def h(self, pid: int, msg: m.Message) -> list[Any]:
        return self.st.handle(pid, msg, self.now)

    def update(self, voters: list[int]) -> list[Any]:
        """All voters vote, then everyone told to establish confirms."""
        eff: list[Any] = []
        for p in voters:
            eff += self.h(p, m.UpdateTopologyVote())
        est = sends(eff, m.EstablishP2P)
        out: list[Any] = list(eff)
        for pid, msg in est:
            out += self.h(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True))
        return out


def test_first_peer_accepted_alone() -> None:
    hs = Harness()
    pid, eff = hs.join()
    acc = sends(eff, m.Accepted)
    assert acc and acc[0][0] == pid
    assert acc[0][1].peers == [m.PeerRow(peer_id=pid, host="127.0.0.1", port=40000 + pid, group=0)]
    assert hs.st.statistics()["accepted"] == 1


def test_second_peer_waits_for_unanimous_update_topology() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, eff = hs.join()
    assert not sends(eff, m.Accepted)
    assert hs.st.registered() == [b]
    eff = hs.h(a, m.UpdateTopologyVote())
    est = sends(eff, m.EstablishP2P)
    assert {p for p, _ in est} == {a, b}
    # b confirms first, a later; nobody is accepted until all confirmed
    epoch = est[0][1].epoch
    assert not sends(hs.h(b, m.P2PConnectionsDone(epoch=epoch, success=True)))
    eff = hs.h(a, m.P2PConnectionsDone(epoch=epoch, success=True))
    assert [p for p, _ in sends(eff, m.Accepted)] == [b]
    res = sends(eff, m.TopologyResult)
    assert [p for p, _ in res] == [a] and res[0][1].success and len(res[0][1].peers) == 2


def test_p2p_failure_fails_update_for_everyone_and_newcomer_stays_registered() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    c, _ = hs.join()
    hs.update([a])  # b, c accepted
    d, _ = hs.join()
    eff: list[Any] = []
    for p in (a, b, c):
        eff += hs.h(p, m.UpdateTopologyVote())
    epoch = sends(eff, m.EstablishP2P)[0][1].epoch
    out: list[Any] = []
    for p in (a, b, c, d):
        out += hs.h(p, m.P2PConnectionsDone(epoch=epoch, success=p != c, failed_peers=[d] if p == c else []))
    # c's failure ends the round at once (d's later confirmation is ignored)
    res = sends(out, m.TopologyResult)
    assert {p for p, _ in res} == {a, b, c}
    assert all(not r.success and r.code == Result.UPDATE_TOPOLOGY_FAILED for _, r in res)
    assert not sends(out, m.Accepted)
    assert hs.st.registered() == [d]
    assert hs.st.accepted() == [a, b, c]


def test_peers_pending_is_collective() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    hs.update([a])
    assert not sends(hs.h(a, m.PeersPendingVote()))
    eff = hs.h(b, m.PeersPendingVote())
    assert sorted((p, r.pending) for p, r in sends(eff, m.PeersPendingResult)) == [(a, False), (b, False)]
    hs.join()
    hs.h(a, m.PeersPendingVote())
    eff = hs.h(b, m.PeersPendingVote())
    assert all(r.pending for _, r in sends(eff, m.PeersPendingResult))


def test_lost_peer_rechecks_votes() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    c, _ = hs.join()
    hs.update([a])
    hs.h(a, m.PeersPendingVote())
    hs.h(b, m.PeersPendingVote())
    eff = hs.st.peer_lost(c, "left")
    assert {p for p, _ in sends(eff, m.PeersPendingResult)} == {a, b}
    assert any(isinstance(e, Event) for e in eff)


def test_illegal_message_kicks_only_sender() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    # b is registered, not accepted: a collective vote from it is illegal
    eff = hs.h(b, m.CollectiveInitiate(tag=1, descriptor=opaque_descriptor()))
    assert [k.peer_id for k in kicks(eff)] == [b]
    assert hs.st.accepted() == [a] and b not in hs.st.peers
    # a message the master never accepts from peers
    eff = hs.h(a, m.Accepted(peers=[], epoch=0))
    assert [k.peer_id for k in kicks(eff)] == [a]


def test_message_before_register_kicks() -> None:
    hs = Harness()
    pid = hs.st.new_connection("127.0.0.1", 0)
    eff = hs.h(pid, m.UpdateTopologyVote())
    assert kicks(eff) and "before Register" in kicks(eff)[0].reason


def test_loopback_mixing_refused() -> None:
    hs = Harness()
    hs.join(host="127.0.0.1")
    pid = hs.st.new_connection("10.1.2.3", 0)
    eff = hs.h(pid, m.Register(p2p_port=5000, peer_group=0))
    k = kicks(eff)
    assert k and "loopback" in k[0].reason


def test_heartbeat_expiry() -> None:
    hs = Harness()
    a, _ = hs.join()
    hs.now = 10.0
    b, _ = hs.join()
    assert hs.st.expired(12.0, timeout=3.0) == [a]
    hs.h(a, m.Heartbeat())
    assert hs.st.expired(12.0, timeout=3.0) == []
    hs.now = 14.0
    hs.h(b, m.Heartbeat())
    assert hs.st.expired(14.5, timeout=3.0) == [a]


def test_groups_and_attributes_table() -> None:
    hs = Harness()
    a, _ = hs.join(group=0)
    b, _ = hs.join(group=1)
    c, _ = hs.join(group=1)
    hs.update([a])
    assert hs.st.statistics()["groups"] == {0: 1, 1: 2}
    assert hs.st.accepted(1) == [b, c]


def _running_op(hs: Harness, peers: list[int], tag: int = 7) -> int:
    eff: list[Any] = []
    for p in peers:
        eff += hs.h(p, m.CollectiveInitiate(tag=tag, descriptor=DESC))
    com = sends(eff, m.CollectiveCommence)
    assert {p for p, _ in com} == set(peers)
    return int(com[0][1].op_seq)


def test_collective_vote_commence_complete() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    hs.update([a])
    seq = _running_op(hs, [a, b])
    assert not sends(hs.h(a, m.CollectiveDone(tag=7, success=True)))
    eff = hs.h(b, m.CollectiveDone(tag=7, success=True))
    assert {(p, c.op_seq) for p, c in sends(eff, m.CollectiveComplete)} == {(a, seq), (b, seq)}


def test_collective_duplicate_tag_refused_running_unaffected() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    hs.update([a])
    _running_op(hs, [a, b])
    eff = hs.h(a, m.CollectiveInitiate(tag=7, descriptor=DESC))
    ((p, ab),) = sends(eff, m.CollectiveAbort)
    assert p == a and ab.code == Result.INVALID_USAGE and ab.op_seq == -1
    hs.h(a, m.CollectiveDone(tag=7, success=True))
    assert sends(hs.h(b, m.CollectiveDone(tag=7, success=True)), m.CollectiveComplete)


def test_collective_peer_lost_aborts_survivors() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    c, _ = hs.join()
    hs.update([a])
    _running_op(hs, [a, b, c])
    hs.h(a, m.CollectiveDone(tag=7, success=True))
    eff = hs.st.peer_lost(c, "left")
    ab = sends(eff, m.CollectiveAbort)
    assert {p for p, _ in ab} == {a, b} and all(x.code == Result.RANK_CONNECTION_LOST for _, x in ab)
    # the retry runs with the smaller group
    _running_op(hs, [a, b])


def test_collective_voting_peer_lost_commences_without_it() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    c, _ = hs.join()
    hs.update([a])
    for p in (a, b):
        hs.h(p, m.CollectiveInitiate(tag=1, descriptor=opaque_descriptor("x")))
    eff = hs.st.peer_lost(c, "evicted")
    com = sends(eff, m.CollectiveCommence)
    assert {p for p, _ in com} == {a, b} and len(com[0][1].peers) == 2


def test_collective_descriptor_mismatch_refused() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    hs.update([a])
    hs.h(a, m.CollectiveInitiate(tag=1, descriptor=opaque_descriptor("all_reduce", 10, 4)))
    eff = hs.h(b, m.CollectiveInitiate(tag=1, descriptor=opaque_descriptor("all_reduce", 10, 5)))
    ab = sends(eff, m.CollectiveAbort)
    assert {p for p, _ in ab} == {a, b} and all(x.code == Result.INVALID_ARGUMENT for _, x in ab)


def test_collective_withdrawn_vote_aborts_voters() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    hs.join()
    hs.update([a])
    hs.h(a, m.CollectiveInitiate(tag=1, descriptor=opaque_descriptor("x")))
    hs.h(b, m.CollectiveInitiate(tag=1, descriptor=opaque_descriptor("x")))
    eff = hs.h(b, m.CollectiveDone(tag=1, success=False, reason="cancelled"))
    assert {p for p, _ in sends(eff, m.CollectiveAbort)} == {a, b}
    assert hs.st.statistics()["collectives_voting"] == 0


def test_failed_done_aborts_everyone() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    hs.update([a])
    _running_op(hs, [a, b])
    eff = hs.h(b, m.CollectiveDone(tag=7, success=False, reason="connection reset"))
    assert {p for p, _ in sends(eff, m.CollectiveAbort)} == {a, b}


def test_accept_first_when_all_accepted_left() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    eff = hs.st.peer_lost(a, "left")
    assert [p for p, _ in sends(eff, m.Accepted)] == [b]


def test_topology_update_peer_lost_during_establish_fails_round() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    c, _ = hs.join()
    hs.update([a])
    d, _ = hs.join()
    eff: list[Any] = []
    for p in (a, b, c):
        eff += hs.h(p, m.UpdateTopologyVote())
    epoch = sends(eff, m.EstablishP2P)[0][1].epoch
    hs.h(a, m.P2PConnectionsDone(epoch=epoch, success=True))
    # the round fails at once: b and c (maybe still connecting to d) are not waited for
    out = hs.st.peer_lost(d, "left")
    res = sends(out, m.TopologyResult)
    assert {p for p, _ in res} == {a, b, c} and not res[0][1].success
    # their late confirmations are ignored, and a new round can start
    assert not hs.h(b, m.P2PConnectionsDone(epoch=epoch, success=True))
    assert sends(hs.update([a, b, c]), m.TopologyResult)


@pytest.mark.parametrize("n", [2, 5])
def test_optimize_topology_measures_then_establishes(n: int) -> None:
    st = MasterState(solver=lambda bw: list(range(len(bw)))[::-1])
    hs = Harness()
    hs.st = st
    ids = [hs.join()[0] for _ in range(n)]
    hs.update([ids[0]])
    eff: list[Any] = []
    for p in ids:
        eff += hs.h(p, m.OptimizeTopologyVote())
    rounds = 0
    while True:
        meas = sends(eff, m.MeasureBandwidth)
        if not meas:
            break
        rounds += 1
        srcs = [p for p, _ in meas]
        assert len(srcs) == len(set(srcs))
        eff = []
        for p, msg in meas:
            eff += hs.h(p, m.BandwidthReport(epoch=msg.epoch, results=[[t[0], 1e9] for t in msg.targets]))
    assert rounds == n - 1
    est = sends(eff, m.EstablishP2P)
    assert {p for p, _ in est} == set(ids)
    out: list[Any] = []
    for p, msg in est:
        out += hs.h(p, m.P2PConnectionsDone(epoch=msg.epoch, success=True))
    res = sends(out, m.TopologyResult)
    assert len(res) == n and all(r.success for _, r in res)
    if n >= 3:
        assert hs.st.accepted() == ids[::-1]
    # measurements are cached: a second optimize measures nothing
    eff = []
    for p in ids:
        eff += hs.h(p, m.OptimizeTopologyVote())
    assert not sends(eff, m.MeasureBandwidth) and sends(eff, m.EstablishP2P)


def test_background_improvement_adopted_at_next_update() -> None:
    st = MasterState(solver=lambda bw: list(range(len(bw))))
    st.exact_limit = 2  # force the "heuristic" path for 3 peers
    hs = Harness()
    hs.st = st
    ids = [hs.join()[0] for _ in range(3)]
    hs.update([ids[0]])
    eff: list[Any] = []
    for p in ids:
        eff += hs.h(p, m.OptimizeTopologyVote())
    while sends(eff, m.MeasureBandwidth):
        nxt: list[Any] = []
        for p, msg in sends(eff, m.MeasureBandwidth):
            nxt += hs.h(p, m.BandwidthReport(epoch=msg.epoch, results=[[t[0], 1e9] for t in msg.targets]))
        eff = nxt
    for p, msg in sends(eff, m.EstablishP2P):
        hs.h(p, m.P2PConnectionsDone(epoch=msg.epoch, success=True))
    job = st.take_improvement_job()
    assert job is not None and job[0] == ids and st.take_improvement_job() is None
    improved = [ids[0], ids[2], ids[1]]
    assert any(isinstance(e, Event) for e in st.offer_ring(improved))
    assert st.accepted() == ids  # not adopted mid-run
    eff = hs.update(ids)
    assert st.accepted() == improved
    assert sends(eff, m.EstablishP2P)[0][1].peers == st.table(improved)
    # a stale improvement (membership changed) is dropped
    assert st.offer_ring([ids[0], ids[1]]) == []


def test_sync_two_losses_in_one_batch() -> None:
    """C never votes, D voted; both are lost in one monitor pass: the survivors get the plan and the
    failure back to back (the peer's mailbox must keep both)."""
    hs = Harness()
    a, _ = hs.join()
    ids = [a] + [hs.join()[0] for _ in range(3)]
    hs.update([a])
    _, b, c, d = ids
    entry = [["w", 7, [8], 64, 123, False]]
    for p in (a, b, d):
        assert not sends(hs.h(p, m.SharedStateSync(revision=1, strategy=0, entries=entry)))
    eff = hs.st.peer_lost(c, "evicted") + hs.st.peer_lost(d, "evicted")
    for p in (a, b):
        removed = [msg.peer_id for q, msg in sends(eff, m.MemberRemoved) if q == p]
        assert removed == [c, d]  # evicted: their P2P credentials stop working at once (issue 33)
        msgs = [msg for q, msg in sends(eff) if q == p and not isinstance(msg, m.MemberRemoved)]
        assert [type(x) for x in msgs] == [m.SharedStatePlan, m.SharedStateResult], msgs
        assert not msgs[1].success and msgs[1].code == Result.RANK_CONNECTION_LOST
    assert hs.st.statistics()["syncs_in_progress"] == 0 and hs.st.statistics()["revisions"] == {}


def test_malformed_sync_vote_refused_with_reason() -> None:
    hs = Harness()
    a, _ = hs.join()
    eff = hs.h(a, m.SharedStateSync(revision=1, strategy=9, entries=[]))
    (_, res), = sends(eff, m.SharedStateResult)
    assert not res.success and res.code == Result.INVALID_ARGUMENT and "strategy" in res.reason
    eff = hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=[["w", 7, [8], 64, 1]]))
    (_, res), = sends(eff, m.SharedStateResult)
    assert not res.success and "6-field" in res.reason


# --------------------------------------------------------------------------------------------
# straggler rule: who the others are waiting for, and when a silent one is evicted


def _three(hs: Harness) -> list[int]:
    a, _ = hs.join()
    ids = [a] + [hs.join()[0] for _ in range(2)]
    hs.update([a])
    assert hs.st.accepted() == ids
    return ids


def test_waited_on_follows_every_kind_of_vote_and_round() -> None:
    hs = Harness()
    a, b, c = _three(hs)
    assert hs.st.waited_on() == set()  # idle: nobody waits for anybody
    # collective vote: a and b voted, c is the one they wait for
    for p in (a, b):
        hs.h(p, m.CollectiveInitiate(tag=1, descriptor=DESC))
    assert hs.st.waited_on() == {c}
    hs.h(c, m.CollectiveInitiate(tag=1, descriptor=DESC))
    # running: everyone until it reports done
    assert hs.st.waited_on() == {a, b, c}
    hs.h(a, m.CollectiveDone(tag=1, success=True))
    hs.h(c, m.CollectiveDone(tag=1, success=True))
    assert hs.st.waited_on() == {b}
    hs.h(b, m.CollectiveDone(tag=1, success=True))
    assert hs.st.waited_on() == set()
    # shared-state sync vote, then the running round
    entry = [["w", 7, [8], 64, 123, False]]
    hs.h(b, m.SharedStateSync(revision=1, strategy=0, entries=entry))
    assert hs.st.waited_on() == {a, c}
    hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=entry))
    hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=entry))
    running = hs.st.waited_on()
    assert running <= {a, b, c} and running  # the plan's participants until they report done
    for p in sorted(running):
        hs.h(p, m.SharedStateDone(sync_seq=hs.st._sync_seq, success=True))
    assert hs.st.waited_on() == set()
    # topology vote, then P2P establishment
    hs.h(a, m.UpdateTopologyVote())
    assert hs.st.waited_on() == {b, c}
    hs.h(b, m.UpdateTopologyVote())
    eff = hs.h(c, m.UpdateTopologyVote())
    epoch = sends(eff, m.EstablishP2P)[0][1].epoch
    assert hs.st.waited_on() == {a, b, c}
    hs.h(a, m.P2PConnectionsDone(epoch=epoch, success=True))
    assert hs.st.waited_on() == {b, c}
    hs.h(b, m.P2PConnectionsDone(epoch=epoch, success=True))
    hs.h(c, m.P2PConnectionsDone(epoch=epoch, success=True))
    # pending-peers vote
    hs.h(c, m.PeersPendingVote())
    assert hs.st.waited_on() == {a, b}


def test_straggler_only_when_waited_on_and_silent_past_its_limit() -> None:
    hs = Harness()
    a, b, c = _three(hs)
    for t in (0.25, 0.5, 0.75, 1.0):  # regular heartbeats every 0.25 s from everyone
        hs.now = t
        for p in (a, b, c):
            hs.h(p, m.Heartbeat())
    # c goes silent at t=1.0; nobody waits for it yet: never a straggler, only heartbeat expiry
    assert hs.st.stragglers(2.5, minimum=0.5, cap=3.0) == []
    hs.now = 2.5
    for p in (a, b):
        hs.h(p, m.CollectiveInitiate(tag=1, descriptor=DESC))
    # now a and b wait for c, silent for 1.5 s > max(0.5, 2 x 0.25)
    assert hs.st.stragglers(2.5, minimum=0.5, cap=3.0) == [(c, 1.5)]
    assert hs.st.straggler_deadline(minimum=0.5, cap=3.0) == pytest.approx(1.5)
    # a and b themselves are not waited on (they voted)
    assert a not in hs.st.waited_on() and b not in hs.st.waited_on()


def test_straggler_limit_adapts_to_a_peers_usual_gaps_and_is_capped() -> None:
    hs = Harness()
    a, b, c = _three(hs)
    # c's messages routinely come 0.9 s apart (a slow, jittery link); a and b every 0.2 s
    t = 0.0
    while t < 9.0:
        t = round(t + 0.1, 3)
        hs.now = t
        if round(t * 10) % 2 == 0:
            hs.h(a, m.Heartbeat())
            hs.h(b, m.Heartbeat())
        if round(t * 10) % 9 == 0:
            hs.h(c, m.Heartbeat())
    assert hs.st.peers[c].straggler_limit(0.5, 3.0) == pytest.approx(1.8)
    assert hs.st.peers[a].straggler_limit(0.5, 3.0) == pytest.approx(0.5)
    assert hs.st.peers[c].straggler_limit(0.5, 1.0) == 1.0  # never beyond the cap
    last_c = hs.st.peers[c].last_seen
    for p in (a, b):
        hs.h(p, m.CollectiveInitiate(tag=1, descriptor=DESC))
    # 1.2 s of silence is usual for c: not a straggler; 1.9 s is not
    assert hs.st.stragglers(last_c + 1.2, minimum=0.5, cap=3.0) == []
    assert [p for p, _ in hs.st.stragglers(last_c + 1.9, minimum=0.5, cap=3.0)] == [c]


def test_pending_summary_names_whom_each_vote_waits_for() -> None:
    hs = Harness()
    a, b, c = _three(hs)
    assert hs.st.pending_summary() == []
    hs.h(a, m.CollectiveInitiate(tag=4, descriptor=DESC))
    hs.h(b, m.PeersPendingVote())
    lines = hs.st.pending_summary()
    assert f"peers-pending vote waits for {[a, c]}" in lines
    assert f"collective tag 4 (group 0) vote waits for {[b, c]}; voted {[a]}" in lines
    hs.h(b, m.CollectiveInitiate(tag=4, descriptor=DESC))
    hs.h(c, m.CollectiveInitiate(tag=4, descriptor=DESC))
    hs.h(c, m.CollectiveDone(tag=4, success=True))
    running = [ln for ln in hs.st.pending_summary() if ln.startswith("collective")]
    assert len(running) == 1 and running[0].endswith(f"waits for {[a, b]} to finish")


@pytest.mark.parametrize("lost", ["donor", "fetcher"])
def test_sync_a_lost_donor_leaves_the_running_sync_a_lost_fetcher_fails_it(lost: str) -> None:
    """Issue 35: a participant with nothing to fetch that is lost while others fetch no longer fails the
    sync (its fetchers ask the other holders); a lost fetcher still fails it for everyone."""
    hs = Harness()
    a, _ = hs.join()
    ids = [a] + [hs.join()[0] for _ in range(2)]
    hs.update([a])
    _, b, c = ids
    good, bad = [["w", 7, [8], 64, 123, False]], [["w", 7, [8], 64, 999, False]]
    hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=good))
    hs.h(b, m.SharedStateSync(revision=1, strategy=0, entries=good))
    eff = hs.h(c, m.SharedStateSync(revision=1, strategy=0, entries=bad))
    plans = dict(sends(eff, m.SharedStatePlan))
    assert plans[c].fetch and not plans[a].fetch and not plans[b].fetch
    seq = plans[c].sync_seq
    hs.h(a, m.SharedStateDone(sync_seq=seq, success=True))
    if lost == "donor":
        eff = hs.st.peer_lost(b, "evicted")
        assert not sends(eff, m.SharedStateResult)  # the sync goes on
        eff = hs.h(c, m.SharedStateDone(sync_seq=seq, success=True))
        results = dict(sends(eff, m.SharedStateResult))
        assert set(results) == {a, c} and all(r.success for r in results.values())
    else:
        eff = hs.st.peer_lost(c, "evicted")
        results = dict(sends(eff, m.SharedStateResult))
        assert set(results) == {a, b}
        assert all(not r.success and r.code == Result.RANK_CONNECTION_LOST for r in results.values())
