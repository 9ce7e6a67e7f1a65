"""Issue 21 item 3: one master round trip per collective (the speculative start), message by message.

The pure MasterState: each CollectiveComplete reserves the op_seq of the group's next op with that tag;
peers that vote with it are confirmed without a CollectiveCommence; everything else falls back to the
slow path or aborts everyone with the speculative numbers to forget (docs/protocol.md section 4).
"""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.master.deadlock import DeadlockWatch
from pccl.master.metrics import MasterObserver
from pccl.master.state import RESERVATIONS_PER_GROUP, FastStart, MasterState
from pccl.wire import messages as m

from ._effects import sends

DESC = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)


def go_only(effects: list[Any], op_seq: int) -> list[int]:
    """The peers told that a speculative start is confirmed (a commence under its number without a
    table: their data planes already run), checking that nothing else was sent."""
    out = sends(effects)
    assert all(isinstance(c, m.CollectiveCommence) and c.op_seq == op_seq and not c.peers
               for _, c in out), out
    return sorted(p for p, _ in out)


class Harness:
    """A master with ``n`` accepted peers in group 0; ``t`` is its clock, ``go_delay`` its
    MasterConfig.speculative_go_delay (0: the tableless commence goes with the vote's last message)."""

    def __init__(self, n: int, go_delay: float = 0.0) -> None:
        self.st = MasterState(go_delay=go_delay)
        self.t = 0.0
        self.peers: list[int] = []
        for _ in range(n):
            self.join()
        eff: list[Any] = []
        for p in self.peers[:1]:
            eff += self.h(p, m.UpdateTopologyVote())
        for pid, msg in sends(eff, m.EstablishP2P):
            self.h(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True))
        assert self.st.accepted() == self.peers

    def join(self, group: int = 0) -> int:
        pid = self.st.new_connection("127.0.0.1", 0.0)
        self.st.handle(pid, m.Register(p2p_port=40000 + pid, peer_group=group), 0.0)
        self.peers.append(pid)
        return pid

    def h(self, pid: int, msg: m.Message) -> list[Any]:
        return self.st.handle(pid, msg, self.t)

    def vote(self, proposals: dict[int, int], tag: int = 1, desc: m.CollectiveDescriptor = DESC) -> list[Any]:
        eff: list[Any] = []
        for p, seq in proposals.items():
            eff += self.h(p, m.CollectiveInitiate(tag=tag, descriptor=desc, op_seq=seq))
        return eff

    def done(self, peers: list[int], op_seq: int, tag: int = 1) -> list[Any]:
        eff: list[Any] = []
        for p in peers:
            eff += self.h(p, m.CollectiveDone(tag=tag, success=True, op_seq=op_seq))
        return eff

    def slow_op(self, tag: int = 1) -> int:
        """One op on the slow path; returns the op_seq its completion reserved for the tag."""
        eff = self.vote(dict.fromkeys(self.peers, -1), tag)
        com = sends(eff, m.CollectiveCommence)
        assert sorted(p for p, c in com if c.peers) == sorted(self.peers)  # each with the table, at once
        comp = sends(self.done(self.peers, com[0][1].op_seq, tag), m.CollectiveComplete)
        assert sorted(p for p, _ in comp) == sorted(self.peers)
        nxt: set[int] = {c.next_op_seq for _, c in comp}
        assert len(nxt) == 1
        return nxt.pop()


def test_a_reserved_number_runs_with_one_answer_per_peer_and_reserves_the_next() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    eff = hs.vote(dict.fromkeys(hs.peers, r))
    # no table, nothing to wait for: the peers already run (the tableless commence only starts their
    # stall clocks)
    assert go_only(eff, r) == hs.peers
    assert [e for e in eff if isinstance(e, FastStart)] == [FastStart(0, 1, r)]
    assert hs.st.statistics()["collectives_running"] == 1
    assert sends(hs.done(hs.peers[:2], r)) == []
    comp = sends(hs.done(hs.peers[2:], r))
    assert [p for p, _ in comp] == hs.peers  # the one answer: CollectiveComplete, to everyone
    assert all(isinstance(c, m.CollectiveComplete) and c.op_seq == r for _, c in comp)
    r2 = comp[0][1].next_op_seq
    assert r2 > r and {c.next_op_seq for _, c in comp} == {r2}
    # and again: a steady run costs one master message per peer and op
    eff = hs.vote(dict.fromkeys(hs.peers, r2))
    assert go_only(eff, r2) == hs.peers
    assert [type(c).__name__ for _, c in sends(hs.done(hs.peers, r2))] == ["CollectiveComplete"] * 3
    assert hs.st.statistics()["collectives_fast"] == 2


def test_reserved_numbers_are_unique_across_tags_and_commenced_ops() -> None:
    hs = Harness(2)
    seen: list[int] = []
    reserved = {tag: hs.slow_op(tag) for tag in (1, 2, 3)}
    seen += reserved.values()
    # the three tags run concurrently on their reservations, interleaved
    for tag, r in reserved.items():
        assert not sends(hs.vote({hs.peers[0]: r}, tag))
    for tag, r in reversed(list(reserved.items())):
        assert go_only(hs.vote({hs.peers[1]: r}, tag), r) == hs.peers
    assert hs.st.statistics()["collectives_running"] == 3
    for tag, r in reserved.items():
        comp = sends(hs.done(hs.peers, r, tag), m.CollectiveComplete)
        seen.append(comp[0][1].next_op_seq)
    # a slow op of a fourth tag takes yet another number
    eff = hs.vote(dict.fromkeys(hs.peers, -1), tag=4)
    seen.append(sends(eff, m.CollectiveCommence)[0][1].op_seq)
    assert len(set(seen)) == len(seen), seen


def test_a_descriptor_mismatch_aborts_every_speculative_voter_under_its_own_number() -> None:
    hs = Harness(2)
    r = hs.slow_op()
    a, b = hs.peers
    eff = hs.vote({a: r}) + hs.vote({b: r}, desc=DESC._replace(element_count=5))
    aborts = sends(eff, m.CollectiveAbort)
    assert sorted(p for p, _ in aborts) == [a, b] and not sends(eff, m.CollectiveCommence)
    for _, ab in aborts:
        assert ab.op_seq == r and ab.code == Result.INVALID_ARGUMENT and ab.forget == [r]
    # the number is spent: a retry that proposes it again is not confirmed
    eff = hs.vote({a: r, b: r})
    aborts = sends(eff, m.CollectiveAbort)
    assert {(ab.op_seq, ab.code) for _, ab in aborts} == {(r, Result.RANK_CONNECTION_LOST)}
    # the slow path works (and reserves afresh)
    assert hs.slow_op() > r


def test_a_lost_member_voids_the_reservation_and_the_survivors_retry_on_the_slow_path() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    a, b, c = hs.peers
    hs.st.peer_lost(c, "left")
    hs.peers.remove(c)
    eff = hs.vote({a: r, b: r})
    aborts = sends(eff, m.CollectiveAbort)
    assert sorted(p for p, _ in aborts) == [a, b]
    assert all(ab.op_seq == r and ab.code == Result.RANK_CONNECTION_LOST and ab.forget == [r]
               and "not confirmed" in ab.reason for _, ab in aborts)
    r2 = hs.slow_op()  # the retry: Commence with the smaller ring
    assert go_only(hs.vote({a: r2, b: r2}), r2) == [a, b]  # and the next op is fast again


def test_a_member_lost_while_the_others_run_speculatively_aborts_them() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    a, b, c = hs.peers
    eff = hs.vote({a: r, b: r, c: r})
    assert go_only(eff, r) == hs.peers
    eff = hs.st.peer_lost(c, "connection reset")
    aborts = sends(eff, m.CollectiveAbort)
    assert sorted(p for p, _ in aborts) == [a, b] and all(ab.op_seq == r for _, ab in aborts)
    # the late voter was lost before the vote completed: the others' speculative start is void
    hs2 = Harness(3)
    r = hs2.slow_op()
    a, b, c = hs2.peers
    assert not sends(hs2.vote({a: r, b: r}))
    aborts = sends(hs2.st.peer_lost(c, "left"), m.CollectiveAbort)
    assert sorted(p for p, _ in aborts) == [a, b]
    assert all(ab.op_seq == r and ab.code == Result.RANK_CONNECTION_LOST for _, ab in aborts)


def test_an_epoch_change_voids_the_reservation() -> None:
    hs = Harness(2)
    r = hs.slow_op()
    d = hs.join()
    eff: list[Any] = []
    for p in hs.peers[:2]:
        eff += hs.h(p, m.UpdateTopologyVote())
    for pid, msg in sends(eff, m.EstablishP2P):
        hs.h(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True))
    assert hs.st.accepted() == hs.peers and d in hs.peers
    # peers that kept the number across the epoch change (they must not) are aborted
    eff = hs.vote({hs.peers[0]: r, hs.peers[1]: r, d: -1})
    aborts = sends(eff, m.CollectiveAbort)
    assert sorted(p for p, _ in aborts) == sorted(hs.peers)
    assert {ab.op_seq for p, ab in aborts if p != d} == {r}
    assert [ab.op_seq for p, ab in aborts if p == d] == [-1]
    assert all("epoch" in ab.reason for _, ab in aborts)
    hs.slow_op()


def test_a_voter_without_the_number_is_commenced_under_it_and_the_others_keep_running() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    a, b, c = hs.peers
    eff = hs.vote({a: r, b: -1, c: r})  # b missed the last confirmation (it cancelled its call)
    assert [e for e in eff if isinstance(e, FastStart)] == [FastStart(0, 1, r)]
    com = dict(sends(eff, m.CollectiveCommence))
    assert set(com) == {a, b, c} and all(x.op_seq == r for x in com.values())
    assert [row.peer_id for row in com[b].peers] == hs.peers  # b gets the table and runs under r
    assert com[a].peers == com[c].peers == []
    comp = sends(hs.done(hs.peers, r), m.CollectiveComplete)
    assert sorted(p for p, _ in comp) == sorted(hs.peers)


def test_another_proposed_number_aborts_everyone_and_names_it() -> None:
    hs = Harness(2)
    r = hs.slow_op()
    a, b = hs.peers
    eff = hs.vote({a: r, b: r + 1000})
    aborts = dict(sends(eff, m.CollectiveAbort))
    assert aborts[a].op_seq == r and aborts[b].op_seq == r + 1000
    assert aborts[a].forget == [r, r + 1000] and f"[{b}]" in aborts[a].reason


def test_a_speculative_success_before_the_vote_completes_counts_once_confirmed() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    a, b, c = hs.peers
    # a broadcast's root finishes before the last peer voted
    assert not sends(hs.vote({a: r}) + hs.done([a], r))
    assert go_only(hs.vote({b: r, c: r}), r) == hs.peers
    assert not sends(hs.done([b], r))
    comp = sends(hs.done([c], r), m.CollectiveComplete)
    assert sorted(p for p, _ in comp) == sorted(hs.peers)


def test_an_early_success_does_not_count_when_the_start_is_not_confirmed() -> None:
    hs = Harness(2)
    r = hs.slow_op()
    a, b = hs.peers
    hs.vote({a: r})
    assert not sends(hs.done([a], r))
    eff = hs.vote({b: r + 7})
    assert {p for p, _ in sends(eff, m.CollectiveAbort)} == {a, b}
    # nothing is left running, and the slow path works
    assert hs.st.statistics()["collectives_running"] == 0
    hs.slow_op()


def test_reports_are_matched_by_op_seq() -> None:
    hs = Harness(2)
    r = hs.slow_op()
    a, b = hs.peers
    assert go_only(hs.vote({a: r, b: r}), r) == [a, b]
    # a report under another number (e.g. of an attempt that was replaced) is ignored ...
    assert not sends(hs.h(a, m.CollectiveDone(tag=1, success=True, op_seq=r + 1)))
    assert not sends(hs.h(a, m.CollectiveDone(tag=1, success=False, op_seq=r + 1, reason="old")))
    # ... -1 means the current op (a withdrawal, or an old peer's report)
    assert not sends(hs.h(a, m.CollectiveDone(tag=1, success=True)))
    assert sends(hs.done([b], r), m.CollectiveComplete)


def test_a_speculative_voter_that_withdraws_aborts_everyone_under_their_numbers() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    a, b, _ = hs.peers
    hs.vote({a: r, b: -1})
    eff = hs.h(a, m.CollectiveDone(tag=1, success=False, reason="cancelled on peer"))
    aborts = dict(sends(eff, m.CollectiveAbort))
    assert aborts[a].op_seq == r and aborts[b].op_seq == -1 and set(aborts) == {a, b}
    assert aborts[a].forget == [r] == aborts[b].forget
    # the reservation went with the op: the next op takes the slow path
    assert sends(hs.vote(dict.fromkeys(hs.peers, -1)), m.CollectiveCommence)


def test_a_deadlock_fails_a_speculative_vote_under_its_number_and_the_number_is_never_rerun() -> None:
    hs = Harness(2)
    r = hs.slow_op()
    a, b = hs.peers
    hs.vote({a: r})  # a runs tag 1 speculatively ...
    hs.h(b, m.CollectiveInitiate(tag=2, descriptor=DESC))  # ... while b waits in tag 2: a deadlock
    eff = DeadlockWatch(grace=0.0).check(hs.st, 0.0)
    aborts = dict(sends(eff, m.CollectiveAbort))
    assert aborts[a].tag == 1 and aborts[a].op_seq == r and aborts[a].forget == [r]
    assert aborts[b].tag == 2 and aborts[b].op_seq == -1
    # a retries without the number (its core dropped it); b now joins tag 1 with it: a's aborted
    # attempt already ran under r, so r is never confirmed
    eff = hs.vote({a: -1}) + hs.vote({b: r})
    aborts = dict(sends(eff, m.CollectiveAbort))
    assert set(aborts) == {a, b} and aborts[b].op_seq == r and aborts[b].forget == [r]


def test_reservations_are_bounded_per_group_oldest_first() -> None:
    hs = Harness(2)
    first = hs.slow_op(tag=0)
    for tag in range(1, RESERVATIONS_PER_GROUP + 1):
        hs.slow_op(tag)
    assert hs.st.statistics()["reservations"] == RESERVATIONS_PER_GROUP
    # tag 0's reservation was the oldest: dropped, so its speculative start is not confirmed
    assert sends(hs.vote(dict.fromkeys(hs.peers, first), tag=0), m.CollectiveAbort)
    last = hs.slow_op(tag=RESERVATIONS_PER_GROUP + 1)
    assert go_only(hs.vote(dict.fromkeys(hs.peers, last), tag=RESERVATIONS_PER_GROUP + 1), last) == hs.peers


def test_groups_reserve_apart() -> None:
    hs = Harness(2)
    c = hs.join(group=1)
    d = hs.join(group=1)
    eff: list[Any] = []
    for p in hs.peers[:2]:
        eff += hs.h(p, m.UpdateTopologyVote())
    for pid, msg in sends(eff, m.EstablishP2P):
        hs.h(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True))
    g0 = hs.peers[:2]
    hs.peers = g0
    r0 = hs.slow_op()
    hs.peers = [c, d]
    r1 = hs.slow_op()
    assert r0 != r1
    hs.st.peer_lost(d, "left")  # group 1 changed; group 0's reservation holds
    hs.peers = g0
    assert go_only(hs.vote(dict.fromkeys(g0, r0)), r0) == g0


def test_a_rebuilt_master_never_confirms_an_old_generations_number() -> None:
    hs = Harness(2)
    r = hs.slow_op()
    st = MasterState()  # the restarted master, rebuilding from re-registrations
    for pid in hs.peers:
        got = st.new_connection("127.0.0.1", 0.0, claim=pid)
        st.handle(got, m.Reregister(peer_id=pid, p2p_port=40000 + pid, peer_group=0, epoch=hs.st.epoch,
                                    ring=list(hs.peers), revision=-1, generation=1), 0.0)
    eff: list[Any] = []
    for pid in hs.peers:
        eff += st.handle(pid, m.CollectiveInitiate(tag=1, descriptor=DESC, op_seq=r), 0.0)
    aborts = sends(eff, m.CollectiveAbort)
    assert len(aborts) == 2 and all(ab.op_seq == r and ab.forget == [r] for _, ab in aborts)
    eff = []
    for pid in hs.peers:
        eff += st.handle(pid, m.CollectiveInitiate(tag=1, descriptor=DESC), 0.0)
    seq = sends(eff, m.CollectiveCommence)[0][1].op_seq
    eff = []
    for pid in hs.peers:
        eff += st.handle(pid, m.CollectiveDone(tag=1, success=True, op_seq=seq), 0.0)
    nxt = sends(eff, m.CollectiveComplete)[0][1].next_op_seq
    assert seq >= 2 << 24 and nxt >= 2 << 24 and nxt != seq  # generation 2's range, above generation 1's


def test_the_status_metrics_count_fast_starts_once() -> None:
    hs = Harness(3)
    obs = MasterObserver()
    a, b, c = hs.peers

    def feed(pid: int, msg: m.Message) -> list[Any]:
        obs.on_message(hs.st, pid, msg, 0.0)
        eff = hs.h(pid, msg)
        obs.on_effects(hs.st, eff, 0.0)
        return eff

    r = -1
    # slow, fast, then fast with b lacking the number (it gets a commence under it: counted once)
    for proposals in ({a: -1, b: -1, c: -1}, {a: 0, b: 0, c: 0}, {a: 0, b: -1, c: 0}):
        eff: list[Any] = []
        for p, seq in proposals.items():
            eff += feed(p, m.CollectiveInitiate(tag=1, descriptor=DESC, op_seq=r if seq == 0 else -1))
        com = sends(eff, m.CollectiveCommence)
        seq = com[0][1].op_seq if com else r
        for p in hs.peers:
            eff = feed(p, m.CollectiveDone(tag=1, success=True, op_seq=seq))
        r = sends(eff, m.CollectiveComplete)[0][1].next_op_seq
    counts = obs.summary(0.0)
    assert counts["collectives_started"] == 3 and counts["collectives_completed"] == 3
    assert counts["collectives_failed"] == 0 and hs.st.statistics()["collectives_fast"] == 2


def test_a_lost_member_revokes_the_groups_reservations_at_the_other_members() -> None:
    hs = Harness(3)
    hs.slow_op()
    a, b, c = hs.peers
    eff = hs.st.peer_lost(c, "left")
    revoked = sends(eff, m.ReservationsRevoked)
    assert sorted(p for p, _ in revoked) == [a, b] and all(f"peer {c}" in r.reason for _, r in revoked)
    hs.peers.remove(c)
    # nothing reserved any more: a second loss tells nobody anything
    d = hs.peers.pop()
    assert not sends(hs.st.peer_lost(d, "left"), m.ReservationsRevoked)
    # a loss in a group with no reservation sends nothing either
    hs2 = Harness(3)
    assert not sends(hs2.st.peer_lost(hs2.peers[2], "left"), m.ReservationsRevoked)
