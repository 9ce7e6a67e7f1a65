"""Liveness against faulty members, message by message (issue 17 item 6): members of a topology
round that never confirm their P2P setup are dropped after ``p2p_setup_timeout`` and the setup is
re-run with the others."""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.master.state import Event, Kick, MasterState
from pccl.wire import messages as m

from ._effects import sends

TIMEOUT = 15.0


class Harness:
    def __init__(self) -> None:
        self.st = MasterState()
        self.now = 0.0

    def join(self) -> int:
        pid = self.st.new_connection("127.0.0.1", self.now)
        self.st.handle(pid, m.Register(p2p_port=40000 + pid, peer_group=0), self.now)
        return pid

    def h(self, pid: int, msg: m.Message) -> list[Any]:
        return self.st.handle(pid, msg, self.now)

    def vote(self, voters: list[int]) -> tuple[int, list[Any]]:
        eff: list[Any] = []
        for p in voters:
            eff += self.h(p, m.UpdateTopologyVote())
        est = sends(eff, m.EstablishP2P)
        assert est
        return est[0][1].epoch, eff


def _two_accepted(hs: Harness) -> tuple[int, int]:
    a, b = hs.join(), hs.join()
    epoch, _ = hs.vote([a])
    hs.h(a, m.P2PConnectionsDone(epoch=epoch, success=True))
    hs.h(b, m.P2PConnectionsDone(epoch=epoch, success=True))
    assert hs.st.accepted() == [a, b]
    return a, b


def test_newcomer_ignoring_establish_is_kicked_and_round_succeeds_without_it() -> None:
    hs = Harness()
    a, b = _two_accepted(hs)
    c = hs.join()
    epoch, _ = hs.vote([a, b])
    assert hs.st.setup_deadline(TIMEOUT) == hs.now + TIMEOUT
    for p in (a, b):
        assert not sends(hs.h(p, m.P2PConnectionsDone(epoch=epoch, success=True)), m.TopologyResult)
    # c keeps heartbeating (never silent) but never confirms
    hs.now = TIMEOUT
    hs.h(c, m.Heartbeat())
    assert hs.st.setup_overdue(hs.now, TIMEOUT) == []  # not past the deadline yet
    hs.now = TIMEOUT + 0.01
    eff = hs.st.setup_overdue(hs.now, TIMEOUT)
    kicked = [e for e in eff if isinstance(e, Kick)]
    assert [k.peer_id for k in kicked] == [c]
    assert "did not finish P2P setup" in kicked[0].reason and kicked[0].code == Result.UPDATE_TOPOLOGY_FAILED
    assert any(isinstance(e, Event) and "re-run without" in e.text for e in eff)
    est = sends(eff, m.EstablishP2P)
    assert {p for p, _ in est} == {a, b}
    new_epoch = est[0][1].epoch
    assert new_epoch > epoch and [r.peer_id for r in est[0][1].peers] == [a, b]
    assert hs.st.setup_deadline(TIMEOUT) == hs.now + TIMEOUT  # a fresh deadline for the re-run
    # a late confirmation of the old epoch is ignored
    assert not hs.h(a, m.P2PConnectionsDone(epoch=epoch, success=True))
    out = hs.h(a, m.P2PConnectionsDone(epoch=new_epoch, success=True))
    out += hs.h(b, m.P2PConnectionsDone(epoch=new_epoch, success=True))
    res = sends(out, m.TopologyResult)
    assert {p for p, _ in res} == {a, b} and all(r.success for _, r in res)
    assert hs.st.accepted() == [a, b] and c not in hs.st.peers
    assert hs.st.setup_deadline(TIMEOUT) is None


def test_accepted_peer_that_never_confirms_is_kicked_and_the_rest_complete() -> None:
    hs = Harness()
    a, b = _two_accepted(hs)
    c = hs.join()
    epoch, _ = hs.vote([a, b])
    hs.h(a, m.P2PConnectionsDone(epoch=epoch, success=True))
    hs.h(c, m.P2PConnectionsDone(epoch=epoch, success=True))
    hs.now = TIMEOUT + 1
    eff = hs.st.setup_overdue(hs.now, TIMEOUT)
    assert [e.peer_id for e in eff if isinstance(e, Kick)] == [b]
    est = sends(eff, m.EstablishP2P)
    assert {p for p, _ in est} == {a, c}
    new_epoch = est[0][1].epoch
    out = hs.h(c, m.P2PConnectionsDone(epoch=new_epoch, success=True))
    out += hs.h(a, m.P2PConnectionsDone(epoch=new_epoch, success=True))
    assert [p for p, _ in sends(out, m.Accepted)] == [c]
    assert [(p, r.success) for p, r in sends(out, m.TopologyResult)] == [(a, True)]
    assert hs.st.accepted() == [a, c]


def test_the_re_run_is_bounded_too() -> None:
    hs = Harness()
    a, b = _two_accepted(hs)
    c = hs.join()
    epoch, _ = hs.vote([a, b])
    hs.h(a, m.P2PConnectionsDone(epoch=epoch, success=True))
    hs.now = TIMEOUT + 1  # b and c both late
    eff = hs.st.setup_overdue(hs.now, TIMEOUT)
    assert sorted(e.peer_id for e in eff if isinstance(e, Kick)) == [b, c]
    est = sends(eff, m.EstablishP2P)
    assert [p for p, _ in est] == [a]
    out = hs.h(a, m.P2PConnectionsDone(epoch=est[0][1].epoch, success=True))
    assert [(p, r.success) for p, r in sends(out, m.TopologyResult)] == [(a, True)]
    assert hs.st.accepted() == [a]


def test_no_setup_in_progress_is_never_overdue() -> None:
    hs = Harness()
    a, b = _two_accepted(hs)
    hs.now = 10 * TIMEOUT
    assert hs.st.setup_deadline(TIMEOUT) is None
    assert hs.st.setup_overdue(hs.now, TIMEOUT) == []
    assert hs.st.accepted() == [a, b]


# ---------------------------------------------------------------------------------------------
# vote deadline (MasterConfig.vote_timeout)

VOTE_TIMEOUT = 60.0
DESC = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)


def _three_accepted(hs: Harness) -> tuple[int, int, int]:
    a, b = _two_accepted(hs)
    c = hs.join()
    epoch, _ = hs.vote([a, b])
    for p in (a, b, c):
        hs.h(p, m.P2PConnectionsDone(epoch=epoch, success=True))
    assert hs.st.accepted() == [a, b, c]
    return a, b, c


def test_peer_that_never_votes_is_kicked_and_the_collective_runs_without_it() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)
    hs.now = 100.0  # long compute before the collective does not count
    assert hs.st.vote_deadline(VOTE_TIMEOUT) is None
    hs.h(a, m.CollectiveInitiate(tag=3, descriptor=DESC))
    hs.now = 101.0
    hs.h(b, m.CollectiveInitiate(tag=3, descriptor=DESC))
    assert hs.st.vote_deadline(VOTE_TIMEOUT) == 100.0 + VOTE_TIMEOUT  # from the first ballot
    hs.now = 100.0 + VOTE_TIMEOUT
    hs.h(c, m.Heartbeat())  # c is alive, just never votes
    assert hs.st.vote_overdue(hs.now, VOTE_TIMEOUT) == []
    hs.now += 0.01
    eff = hs.st.vote_overdue(hs.now, VOTE_TIMEOUT)
    kicked = [e for e in eff if isinstance(e, Kick)]
    assert [k.peer_id for k in kicked] == [c]
    assert "did not join the collective tag 3" in kicked[0].reason and f"{[a, b]} waited" in kicked[0].reason
    com = sends(eff, m.CollectiveCommence)
    assert {p for p, _ in com} == {a, b}
    assert hs.st.accepted() == [a, b] and hs.st.vote_deadline(VOTE_TIMEOUT) is None


def test_slow_voter_within_the_bound_is_not_kicked() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)
    for p in (a, b):
        hs.h(p, m.CollectiveInitiate(tag=3, descriptor=DESC))
    hs.now = VOTE_TIMEOUT - 1
    assert hs.st.vote_overdue(hs.now, VOTE_TIMEOUT) == []
    eff = hs.h(c, m.CollectiveInitiate(tag=3, descriptor=DESC))
    assert {p for p, _ in sends(eff, m.CollectiveCommence)} == {a, b, c}
    hs.now = 10 * VOTE_TIMEOUT
    assert hs.st.vote_overdue(hs.now, VOTE_TIMEOUT) == [] and hs.st.accepted() == [a, b, c]


def test_vote_deadline_covers_topology_and_pending_votes() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)
    hs.h(a, m.UpdateTopologyVote())
    hs.h(b, m.UpdateTopologyVote())
    hs.now = VOTE_TIMEOUT + 1
    eff = hs.st.vote_overdue(hs.now, VOTE_TIMEOUT)
    assert [e.peer_id for e in eff if isinstance(e, Kick)] == [c]
    est = sends(eff, m.EstablishP2P)  # the vote completes with a and b
    assert {p for p, _ in est} == {a, b}
    for p in (a, b):
        hs.h(p, m.P2PConnectionsDone(epoch=est[0][1].epoch, success=True))
    hs.h(a, m.PeersPendingVote())
    hs.now = 3 * VOTE_TIMEOUT
    eff = hs.st.vote_overdue(hs.now, VOTE_TIMEOUT)
    assert [e.peer_id for e in eff if isinstance(e, Kick)] == [b]
    assert [(p, r.pending) for p, r in sends(eff, m.PeersPendingResult)] == [(a, False)]
    assert hs.st.accepted() == [a]
