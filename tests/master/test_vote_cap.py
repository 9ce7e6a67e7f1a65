"""Issue 33 item 3 (the cap): a member may hold at most ``max_open_votes`` collective votes open; one more
fails for it with INVALID_USAGE naming the cap, and changes nothing else. Votes that completed or were
withdrawn no longer count."""

from __future__ import annotations

from pccl._errors import Result
from pccl.master.state import Kick, MasterState
from pccl.wire import messages as m

from ._effects import sends
from .test_liveness import DESC, Harness, _three_accepted


def test_a_member_over_the_cap_gets_a_clear_error_and_nothing_else_changes() -> None:
    hs = Harness()
    hs.st = MasterState(max_open_votes=3)
    a, b, c = _three_accepted(hs)
    for tag in (10, 11, 12):  # tags nobody else calls (yet)
        assert not hs.h(a, m.CollectiveInitiate(tag=tag, descriptor=DESC))
    eff = hs.h(a, m.CollectiveInitiate(tag=13, descriptor=DESC))
    assert not [e for e in eff if isinstance(e, Kick)]
    (refusal,) = [msg for p, msg in sends(eff, m.CollectiveAbort) if p == a]
    assert refusal.tag == 13 and refusal.code == int(Result.INVALID_USAGE)
    assert "max_open_votes = 3" in refusal.reason
    assert hs.st.statistics()["collectives_voting"] == 3 and hs.st.accepted() == [a, b, c]
    # Others may still vote on tags it holds (no new vote of its own) ...
    for p in (b, c):
        eff = hs.h(p, m.CollectiveInitiate(tag=10, descriptor=DESC))
    assert {p for p, _ in sends(eff, m.CollectiveCommence)} == {a, b, c}
    # ... and once one of its votes completed, it may open another.
    eff = hs.h(a, m.CollectiveInitiate(tag=13, descriptor=DESC))
    assert not sends(eff, m.CollectiveAbort)


def test_without_a_cap_votes_are_not_counted() -> None:
    hs = Harness()
    a, _, _ = _three_accepted(hs)
    for tag in range(300):
        assert not sends(hs.h(a, m.CollectiveInitiate(tag=tag, descriptor=DESC)), m.CollectiveAbort)
