"""Liveness against faulty members, message by message (issue 17 item 6): members of a topology
round that never confirm their P2P setup are dropped after ``p2p_setup_timeout`` and the setup is
re-run with the others."""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.master.state import Event, Kick, MasterState, Send
from pccl.wire import messages as m

TIMEOUT = 15.0


def sends(effects: list[Any], cls: type) -> list[tuple[int, Any]]:
    return [(e.peer_id, e.message) for e in effects if isinstance(e, Send) and isinstance(e.message, cls)]


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
