"""The held-back tableless commence (MasterConfig.speculative_go_delay), message by message on the pure
MasterState: a speculative start's confirmation that everyone voted only starts the participants' stall
clocks, so the master sends it ``go_delay`` after the vote completed, and only to participants whose
data plane has not reported yet; an op that completes or aborts sooner gets its one answer alone.
"""

from __future__ import annotations

from pccl import Result
from pccl.master.state import FastStart
from pccl.wire import messages as m

from ._effects import sends
from .test_speculative import Harness as BaseHarness

DELAY = 0.01


class Harness(BaseHarness):
    """A master holding the go back for ``DELAY`` with ``n`` accepted peers; ``t`` is its clock."""

    def __init__(self, n: int, delay: float = DELAY) -> None:
        super().__init__(n, go_delay=delay)


def test_an_op_that_completes_within_the_delay_gets_only_its_complete() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    eff = hs.vote(dict.fromkeys(hs.peers, r))
    assert sends(eff) == [] and FastStart(0, 1, r) in eff  # confirmed, nothing sent yet
    assert hs.st.go_deadline() == DELAY
    hs.t = DELAY / 2
    comp = sends(hs.done(hs.peers, r))
    assert [type(c).__name__ for _, c in comp] == ["CollectiveComplete"] * 3
    assert hs.st.go_deadline() is None and not hs.st.go_waiting
    assert sends(hs.st.go_overdue(1.0)) == []
    assert hs.st.statistics()["speculative_go_held"] == 1


def test_a_longer_op_gets_the_go_at_the_delay_only_where_the_data_plane_still_runs() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    a, b, c = hs.peers
    assert sends(hs.vote(dict.fromkeys(hs.peers, r))) == []
    hs.t = DELAY / 2
    assert sends(hs.done([a], r)) == []
    assert sends(hs.st.go_overdue(DELAY * 0.9)) == []  # not due yet
    hs.t = DELAY
    go = sends(hs.st.go_overdue(DELAY))
    assert sorted(p for p, _ in go) == [b, c]  # a's data plane already finished: it needs none
    assert all(isinstance(g, m.CollectiveCommence) and g.op_seq == r and not g.peers for _, g in go)
    assert sends(hs.st.go_overdue(2 * DELAY)) == []  # once
    comp = sends(hs.done([b, c], r))
    assert sorted(p for p, x in comp if isinstance(x, m.CollectiveComplete)) == hs.peers
    assert hs.st.statistics()["speculative_go_held"] == 0


def test_an_op_aborted_within_the_delay_gets_no_go_and_the_next_op_of_the_tag_is_not_confused() -> None:
    hs = Harness(2)
    r = hs.slow_op()
    a, b = hs.peers
    assert sends(hs.vote(dict.fromkeys(hs.peers, r))) == []
    aborts = sends(hs.h(a, m.CollectiveDone(tag=1, success=False, reason="boom", op_seq=r)))
    assert sorted(p for p, x in aborts if isinstance(x, m.CollectiveAbort)) == [a, b]
    assert all(x.code == int(Result.RANK_CONNECTION_LOST) for _, x in aborts)
    # the retry takes the slow path (the abort dropped the reservation) before the go would be due
    com = sends(hs.vote(dict.fromkeys(hs.peers, -1)), m.CollectiveCommence)
    assert sorted(p for p, x in com if x.peers) == [a, b]
    seq = com[0][1].op_seq
    # the old op's held go never goes out, not even under the retry's number
    assert sends(hs.st.go_overdue(DELAY)) == []
    assert sends(hs.done([a, b], seq), m.CollectiveComplete)
    assert hs.st.statistics()["speculative_go_held"] == 1


def test_a_voter_without_the_number_gets_the_table_at_once_the_others_their_go_later() -> None:
    hs = Harness(3)
    r = hs.slow_op()
    a, b, c = hs.peers
    eff = hs.vote({a: r, b: r, c: -1})  # c missed the last Complete (it reconnected, say)
    com = sends(eff)
    assert [(p, x.op_seq, bool(x.peers)) for p, x in com] == [(c, r, True)]
    go = sends(hs.st.go_overdue(DELAY))
    assert sorted(p for p, _ in go) == [a, b] and all(not x.peers for _, x in go)


def test_no_delay_sends_the_go_with_the_last_ballot_as_before() -> None:
    hs = Harness(2, delay=0.0)
    r = hs.slow_op()
    go = sends(hs.vote(dict.fromkeys(hs.peers, r)))
    assert sorted(p for p, _ in go) == hs.peers and all(not x.peers for _, x in go)
    assert hs.st.go_deadline() is None


def test_concurrent_tags_each_hold_their_own_go() -> None:
    hs = Harness(2)
    r1, r2 = hs.slow_op(tag=1), hs.slow_op(tag=2)
    assert sends(hs.vote(dict.fromkeys(hs.peers, r1), tag=1)) == []
    hs.t = DELAY / 2
    assert sends(hs.vote(dict.fromkeys(hs.peers, r2), tag=2)) == []
    assert hs.st.go_deadline() == DELAY
    assert sends(hs.done(hs.peers, r1, tag=1), m.CollectiveComplete)  # tag 1 ends within its delay
    assert hs.st.go_deadline() == DELAY / 2 + DELAY
    assert sends(hs.st.go_overdue(DELAY)) == []
    go = sends(hs.st.go_overdue(DELAY / 2 + DELAY))
    assert [(x.tag, x.op_seq) for _, x in go] == [(2, r2), (2, r2)]
