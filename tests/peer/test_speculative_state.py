"""Issue 21 item 3 on the peer's pure core: reserved op_seqs, the speculative start and its fallbacks."""

from __future__ import annotations

import pccl
from pccl.peer.state import (
    RESERVATIONS_KEPT,
    AbortOp,
    Call,
    Forget,
    PeerState,
    Resolve,
)
from pccl.wire import messages as m


def row(pid: int, group: int = 0) -> m.PeerRow:
    return m.PeerRow(peer_id=pid, host=f"10.0.0.{pid}", port=4000 + pid, group=group)


TABLE = [row(1), row(2), row(3)]
LOST = int(pccl.Result.RANK_CONNECTION_LOST)


def completed(tag: int = 5, next_op_seq: int = 41) -> PeerState:
    """A peer (id 2) whose first op on ``tag`` ran the slow way and reserved ``next_op_seq``."""
    st = PeerState(peer_id=2)
    st.handle(m.Accepted(peers=TABLE, epoch=4), 1.0)
    st.begin_op(tag)
    assert st.speculate(tag) == -1  # nothing reserved yet: vote and wait for the commence
    st.handle(m.CollectiveCommence(tag=tag, op_seq=40, peers=TABLE), 1.1)
    complete = m.CollectiveComplete(tag=tag, op_seq=40, next_op_seq=next_op_seq)
    assert st.handle(complete, 1.2) == [Resolve(Call.COMPLETE, complete, tag)]
    st.end_op(tag)
    return st


def test_a_confirmation_reserves_the_next_number_which_is_used_once() -> None:
    st = completed()
    assert st.statistics()["reserved_tags"] == 1
    st.begin_op(5)
    assert st.speculate(5) == 41 and st.ops[5].op_seq == 41 and st.ops[5].speculative
    assert st.statistics()["ops"] == {5: 41} and st.statistics()["speculative_starts"] == 1
    # the master's one answer commits (and reserves the next)
    complete = m.CollectiveComplete(tag=5, op_seq=41, next_op_seq=57)
    assert st.handle(complete, 2.0) == [Resolve(Call.COMPLETE, complete, 5)]
    st.end_op(5)
    st.begin_op(5)
    assert st.speculate(5) == 57
    st.end_op(5)
    st.begin_op(5)
    assert st.speculate(5) == -1  # 57 was taken (and this op never completed)


def test_only_the_tag_that_completed_is_reserved() -> None:
    st = completed(tag=5)
    st.begin_op(6)
    assert st.speculate(6) == -1
    st.begin_op(5)
    assert st.speculate(5) == 41


def test_a_speculative_op_is_aborted_under_its_number_and_forgets_the_others() -> None:
    st = completed()
    st.begin_op(5)
    st.speculate(5)
    # an abort of a never-commenced op (-1) is not this op's: only the forget list applies
    assert st.handle(m.CollectiveAbort(tag=5, op_seq=-1, reason="x", code=LOST, forget=[99]), 2.0) == [
        Forget((99,))]
    assert not st.ops[5].aborted
    (forget, abort) = st.handle(m.CollectiveAbort(tag=5, op_seq=41, reason="not confirmed", code=LOST,
                                                  forget=[41, 43]), 2.1)
    assert forget == Forget((41, 43))
    assert isinstance(abort, AbortOp) and isinstance(abort.error, pccl.RankConnectionLostError)
    assert "not confirmed" in str(abort.error) and st.ops[5].aborted
    st.end_op(5)
    st.begin_op(5)
    assert st.speculate(5) == -1  # the retry takes the slow path


def test_a_commence_never_restarts_a_speculative_op_but_its_forget_list_applies() -> None:
    st = completed()
    st.begin_op(5)
    st.speculate(5)
    assert st.handle(m.CollectiveCommence(tag=5, op_seq=77, peers=TABLE, forget=[12]), 2.0) == [Forget((12,))]
    assert st.ops[5].op_seq == 41
    # a voter without the number is commenced under it and runs the ordinary way
    other = completed()
    other.reserved.clear()
    other.begin_op(5)
    assert other.speculate(5) == -1
    com = m.CollectiveCommence(tag=5, op_seq=41, peers=TABLE)
    assert other.handle(com, 2.0) == [Resolve(Call.COMMENCE, com, 5)] and other.ops[5].op_seq == 41


def test_an_epoch_change_a_smaller_group_or_a_lost_link_drops_the_reservations() -> None:
    st = completed()
    st.handle(m.TopologyResult(success=True, epoch=5, peers=TABLE), 2.0)
    assert st.statistics()["reserved_tags"] == 0
    st = completed()
    st.handle(m.Accepted(peers=TABLE, epoch=4), 2.0)
    assert not st.reserved
    st = completed()
    st.reconcile_group(TABLE)  # nobody dropped: kept
    assert st.reserved
    st.reconcile_group(TABLE[:2])  # a sync named peer 3 gone
    assert not st.reserved
    st = completed()
    assert st.link_down(now=3.0, window=10.0) and not st.reserved
    st = completed()
    st.reserved[5] = (41, 3)  # reserved in an older epoch (cannot happen through handle: belt and braces)
    st.begin_op(5)
    assert st.speculate(5) == -1


def test_a_group_of_one_never_speculates() -> None:
    st = completed()
    st.table = TABLE[1:2]
    st.begin_op(5)
    assert st.speculate(5) == -1


def test_reservations_are_bounded_oldest_first() -> None:
    st = completed(tag=0, next_op_seq=1000)
    for tag in range(1, RESERVATIONS_KEPT + 1):
        st.begin_op(tag)
        st.handle(m.CollectiveCommence(tag=tag, op_seq=tag, peers=TABLE), 2.0)
        st.handle(m.CollectiveComplete(tag=tag, op_seq=tag, next_op_seq=1000 + tag), 2.0)
        st.end_op(tag)
    assert len(st.reserved) == RESERVATIONS_KEPT and 0 not in st.reserved
    st.begin_op(0)
    assert st.speculate(0) == -1
    st.begin_op(RESERVATIONS_KEPT)
    assert st.speculate(RESERVATIONS_KEPT) == 1000 + RESERVATIONS_KEPT


def test_a_revocation_drops_every_reservation_and_touches_no_running_op() -> None:
    st = completed(tag=5)
    st.begin_op(6)
    assert st.handle(m.ReservationsRevoked(reason="peer 3 of group 0 was lost"), 2.0) == []
    assert not st.reserved and 6 in st.ops and not st.ops[6].aborted
    st.begin_op(5)
    assert st.speculate(5) == -1
