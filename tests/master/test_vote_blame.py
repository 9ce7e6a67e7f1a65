"""Issue 33 item 4: vote deadlines blame the right peer. A vote that only a minority of its group joined
(a call the others never make: another tag, a sync, a topology call) fails for its voters at
``vote_timeout``, and nobody is evicted; a vote most members joined still evicts the stragglers.

Before, a member that called ``all_reduce(tag=99)`` nobody else called made the master kick every other
member at the vote timeout ("did not join the collective tag 99 vote ... while [3] waited")."""

from __future__ import annotations

from pccl._errors import Result
from pccl.master.state import Kick
from pccl.wire import messages as m

from ._effects import sends
from .test_liveness import DESC, VOTE_TIMEOUT, Harness, _three_accepted


def test_a_collective_only_one_member_calls_fails_for_it_and_evicts_nobody() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)
    hs.h(a, m.CollectiveInitiate(tag=99, descriptor=DESC))
    for p in (a, b, c):  # the group's real work goes on meanwhile
        hs.h(p, m.CollectiveInitiate(tag=0, descriptor=DESC))
    hs.now = VOTE_TIMEOUT + 0.01
    eff = hs.st.vote_overdue(hs.now, VOTE_TIMEOUT)
    assert not [e for e in eff if isinstance(e, Kick)]
    (abort,) = [msg for p, msg in sends(eff, m.CollectiveAbort) if p == a]
    assert abort.tag == 99 and abort.code == int(Result.INVALID_USAGE)
    assert "no other member joined the collective tag 99" in abort.reason
    assert hs.st.accepted() == [a, b, c] and hs.st.vote_deadline(VOTE_TIMEOUT) is None
    # The tag is free again: the group can use it together.
    eff = []
    for p in (a, b, c):
        eff += hs.h(p, m.CollectiveInitiate(tag=99, descriptor=DESC))
    assert {p for p, _ in sends(eff, m.CollectiveCommence)} == {a, b, c}


def test_a_sync_and_a_topology_call_only_one_member_makes_fail_for_it() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)
    hs.h(a, m.SharedStateSync(revision=1, strategy=0, entries=[]))
    hs.now = VOTE_TIMEOUT + 0.01
    eff = hs.st.vote_overdue(hs.now, VOTE_TIMEOUT)
    assert not [e for e in eff if isinstance(e, Kick)]
    (res,) = sends(eff, m.SharedStateResult)
    assert res[0] == a and not res[1].success and res[1].code == int(Result.INVALID_USAGE)
    hs.h(b, m.UpdateTopologyVote())
    hs.now = 2 * VOTE_TIMEOUT + 0.1
    eff = hs.st.vote_overdue(hs.now, VOTE_TIMEOUT)
    assert not [e for e in eff if isinstance(e, Kick)]
    (top,) = sends(eff, m.TopologyResult)
    assert top[0] == b and not top[1].success and "no other member joined" in top[1].reason
    assert hs.st.accepted() == [a, b, c]


def test_stragglers_the_majority_waits_on_are_still_evicted() -> None:
    hs = Harness()
    a, b, c = _three_accepted(hs)
    for p in (a, b):
        hs.h(p, m.CollectiveInitiate(tag=5, descriptor=DESC))
    hs.now = VOTE_TIMEOUT + 0.01
    eff = hs.st.vote_overdue(hs.now, VOTE_TIMEOUT)
    assert [e.peer_id for e in eff if isinstance(e, Kick)] == [c]
    assert {p for p, _ in sends(eff, m.CollectiveCommence)} == {a, b}
