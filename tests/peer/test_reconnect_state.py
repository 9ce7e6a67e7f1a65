"""Issue 18: the peer core's rules for surviving the master, message by message (no trio)."""

from __future__ import annotations

import pytest

import pccl
from pccl._address import parse_addresses
from pccl._env import master_address
from pccl.peer.state import COMMITTED_TAGS_KEPT, AbortOp, Call, PeerState, Resolve
from pccl.wire import messages as m


def member(peer_id: int = 2) -> PeerState:
    st = PeerState(peer_id=peer_id, group=0)
    st.handle(m.Registered(peer_id=peer_id, generation=3), now=0.0)
    rows = [m.PeerRow(p, "10.0.0.1", 40000 + p, 0) for p in (3, 2, 1)]
    st.handle(m.Accepted(peers=rows, epoch=5), now=0.0)
    return st


def test_registered_sets_the_generation_and_reregister_reports_what_the_master_needs() -> None:
    st = member()
    st.begin_sync()
    st.handle(m.SharedStateResult(sync_seq=1, success=True, revision=9), now=0.0)
    st.end_membership()
    assert st.generation == 3 and st.revision == 9
    want = m.Reregister(peer_id=2, p2p_port=41002, peer_group=0, epoch=5, ring=[3, 2, 1], revision=9,
                        generation=3, sync_committed=1,  # the last sync it applied (operations in doubt)
                        members_epoch=5, pending=[5, 0, 0, -1])  # where it is in membership rounds
    assert st.reregister(41002) == want


def test_only_an_accepted_member_with_a_window_reconnects() -> None:
    assert not PeerState(peer_id=4).link_down(1.0, 60.0)  # not accepted: nothing to keep
    st = member()
    assert not st.link_down(1.0, 0.0)  # no window: the loss is final
    assert st.link_down(1.0, 60.0) and st.reconnecting_until == 61.0
    assert st.link_down(2.0, 60.0) and st.reconnecting_until == 61.0  # the deadline stays
    assert st.statistics()["reconnecting"] and not st.statistics()["master_ok"]
    st.lose(pccl.MasterConnectionError("gone"))
    assert not st.reconnecting and not st.link_down(3.0, 60.0)


def test_reregistered_takes_the_peer_back_and_fences_older_generations() -> None:
    st = member()
    st.link_down(1.0, 60.0)
    older = st.reregistered(m.Reregistered(peer_id=2, generation=2, epoch=5), now=2.0)
    assert isinstance(older, pccl.MasterConnectionError) and "older" in older.message and st.reconnecting
    other = st.reregistered(m.Reregistered(peer_id=7, generation=4, epoch=5), now=2.0)
    assert other is not None and st.reconnecting
    refused = st.reregistered(m.Refused(reason="epoch moved on", code=9), now=2.0)
    assert refused is not None and "epoch moved on" in refused.message
    assert st.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=5), now=2.5) is None
    assert not st.reconnecting and st.generation == 4 and st.last_heard == 2.5
    assert [r.peer_id for r in st.table] == [3, 2, 1]  # it kept its place


def test_master_address_lists() -> None:
    assert parse_addresses("h1:1,h2:2") == [("h1", 1), ("h2", 2)]
    assert parse_addresses(["h1:1", ("h2", 2), "h1:1"]) == [("h1", 1), ("h2", 2)]
    assert parse_addresses(("h", 5)) == [("h", 5)]
    assert master_address(None, {"PCCL_MASTER": "a:1,b:2"}) == "a:1,b:2"
    with pytest.raises(pccl.InvalidArgumentError):
        parse_addresses([])
    with pytest.raises(pccl.InvalidArgumentError):
        parse_addresses("h1:1,,h2:2")


# ---------------------------------------------------------------------------------------------
# operations in doubt (docs/concepts.md "Operations in doubt")

ROWS = [m.PeerRow(p, "10.0.0.1", 40000 + p, 0) for p in (3, 2, 1)]


def commenced(st: PeerState, tag: int, op_seq: int) -> None:
    st.begin_op(tag)
    st.handle(m.CollectiveCommence(tag=tag, op_seq=op_seq, peers=ROWS), now=0.0)
    st.commenced(tag, [3, 2, 1])


def test_a_finished_op_stays_in_doubt_and_is_reported_with_what_the_loss_failed() -> None:
    st = member()
    commenced(st, 1, 10)
    st.op_done(1)  # its part is finished: CollectiveDone(success) goes out now
    commenced(st, 2, 11)  # still in its ring when the master goes
    st.op_committed(5, 8)  # an earlier op of another tag, committed
    assert st.in_doubt(1) and not st.in_doubt(2)
    assert st.link_down(1.0, 60.0)
    st.end_op(2)  # the loss fails op 2 (its call raises); op 1 waits
    rr = st.reregister(41002)
    assert rr.ops_in_doubt == [[1, 10, [3, 2, 1]]]
    assert rr.ops_abandoned == [[2, 11]]
    assert rr.ops_committed == [[5, 8]]
    assert st.statistics()["ops_in_doubt"] == [1]
    # The master's decision arrives on the new link, with the old op_seq: it completes the waiting call.
    assert st.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=5), now=2.0) is None
    assert st.reregister(41002).ops_abandoned == []  # reported once
    (effect,) = st.handle(m.CollectiveComplete(tag=1, op_seq=10), now=2.1)
    assert effect == Resolve(Call.COMPLETE, m.CollectiveComplete(tag=1, op_seq=10), 1)


def test_an_aborted_in_doubt_op_fails_its_call() -> None:
    st = member()
    commenced(st, 1, 10)
    st.op_done(1)
    st.link_down(1.0, 60.0)
    st.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=5), now=2.0)
    (effect,) = st.handle(m.CollectiveAbort(tag=1, op_seq=10, code=8, reason="in doubt: aborted"), now=2.1)
    assert isinstance(effect, AbortOp) and effect.tag == 1
    assert isinstance(effect.error, pccl.RankConnectionLostError)


def test_committed_tags_are_bounded() -> None:
    st = member()
    for tag in range(COMMITTED_TAGS_KEPT + 10):
        st.op_committed(tag, tag + 100)
    st.op_committed(3, 999)  # a reused tag moves to the newest end
    rr = st.reregister(41002)
    assert len(rr.ops_committed) == COMMITTED_TAGS_KEPT and rr.ops_committed[-1] == [3, 999]


def test_a_finished_sync_stays_in_doubt() -> None:
    st = member()
    st.begin_sync()
    st.handle(m.SharedStatePlan(sync_seq=4, revision=7, fetch=[], peers=ROWS), now=0.0)
    st.sync_done()
    assert st.sync_in_doubt
    st.link_down(1.0, 60.0)
    rr = st.reregister(41002)
    assert rr.sync_in_doubt == [4, 7, [3, 2, 1]] and rr.sync_abandoned == -1
    st.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=5), now=2.0)
    (effect,) = st.handle(m.SharedStateResult(sync_seq=4, success=True, revision=7), now=2.1)
    assert effect.call is Call.SYNC and st.revision == 7 and st.sync_committed == 4  # type: ignore[union-attr]


def test_an_unfinished_sync_is_reported_abandoned() -> None:
    st = member()
    st.begin_sync()
    st.handle(m.SharedStatePlan(sync_seq=4, revision=7, fetch=[], peers=ROWS), now=0.0)
    st.link_down(1.0, 60.0)
    rr = st.reregister(41002)
    assert rr.sync_in_doubt == [] and rr.sync_abandoned == 4


def test_a_live_heals_unfinished_fetch_is_not_reported_abandoned() -> None:
    """A live heal's fetch is the fetcher's round alone (its holders committed the sync at once): reported,
    the rebuilt master would abort what the holders committed and refuse them (docs/concepts.md "Live
    heals"). An ordinary sync's unfinished fetch still is."""
    st = member()
    st.begin_sync()
    rows = [["big", "h", [1]]]
    st.handle(m.SharedStatePlan(sync_seq=4, revision=7, fetch=rows, peers=ROWS, live=True), now=0.0)
    st.link_down(1.0, 60.0)
    rr = st.reregister(41002)
    assert rr.sync_in_doubt == [] and rr.sync_abandoned == -1
    other = member()
    other.begin_sync()
    other.handle(m.SharedStatePlan(sync_seq=4, revision=7, fetch=rows, peers=ROWS), now=0.0)
    other.link_down(1.0, 60.0)
    assert other.reregister(41002).sync_abandoned == 4  # an ordinary sync's fetch: the group's round


def test_a_refusal_because_the_run_went_on_is_final() -> None:
    st = member()
    st.link_down(1.0, 60.0)
    gone = m.Refused(reason="group 0 went on without this peer", code=int(pccl.Result.KICKED))
    final = st.reregistered(gone, now=2.0)
    assert isinstance(final, pccl.KickedError)
    epoch = m.Refused(reason="epoch", code=int(pccl.Result.MASTER_CONNECTION_FAILED))
    retry = st.reregistered(epoch, now=2.0)
    assert retry is not None and not isinstance(retry, pccl.KickedError)


# ---------------------------------------------------------------------------------------------
# membership rounds in doubt (docs/concepts.md "Rounds in doubt")

NEW_ROWS = [*ROWS, m.PeerRow(4, "10.0.0.1", 40004, 0)]  # the ring of epoch 6, with a newcomer


def topology_call(st: PeerState, *, confirm: bool) -> None:
    st.begin_topology("update_topology")
    st.handle(m.EstablishP2P(epoch=6, peers=NEW_ROWS), now=0.0)
    st.setup_done(6, confirm)


def test_a_confirmed_topology_call_is_in_doubt_and_a_commit_takes_the_setup_table() -> None:
    st = member()
    topology_call(st, confirm=True)
    assert st.topology_in_doubt and st.statistics()["topology_in_doubt"]
    st.link_down(1.0, 60.0)
    rr = st.reregister(41002)
    assert rr.topology_in_doubt == [6, [3, 2, 1, 4], "update"] and rr.topology_abandoned == -1
    assert rr.epoch == 5 and rr.members_epoch == 5 and rr.ring == [3, 2, 1]
    assert st.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=6), now=2.0) is None
    (effect,) = st.handle(m.TopologyResult(success=True, epoch=6, peers=[]), now=2.1)
    assert isinstance(effect, Resolve) and effect.call is Call.TOPOLOGY
    # the table of the round's EstablishP2P: the one the other members got in their TopologyResult
    assert st.table == NEW_ROWS and st.members == [3, 2, 1, 4] and st.members_epoch == 6 and st.epoch == 6
    st.end_membership()
    assert not st.topology_in_doubt and st.reregister(41002).topology_in_doubt == []


def test_an_aborted_topology_call_keeps_the_table() -> None:
    st = member()
    topology_call(st, confirm=True)
    st.link_down(1.0, 60.0)
    st.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=6), now=2.0)
    code = int(pccl.Result.UPDATE_TOPOLOGY_FAILED)
    (effect,) = st.handle(m.TopologyResult(success=False, epoch=6, peers=[], code=code), now=2.1)
    assert isinstance(effect, Resolve)
    assert st.table == ROWS and st.members == [3, 2, 1] and st.members_epoch == 5 and st.epoch == 6


def test_an_unconfirmed_topology_call_is_reported_abandoned() -> None:
    st = member()
    topology_call(st, confirm=False)  # its connections failed: the round fails everywhere
    assert not st.topology_in_doubt
    st.link_down(1.0, 60.0)
    st.end_membership()  # the loss fails the call
    rr = st.reregister(41002)
    assert rr.topology_in_doubt == [] and rr.topology_abandoned == 6
    st2 = member()
    st2.begin_topology("optimize_topology")  # no EstablishP2P yet
    st2.link_down(1.0, 60.0)
    assert st2.reregister(41002).topology_abandoned == 5
    assert st2.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=5), now=2.0) is None
    assert st2.reregister(41002).topology_abandoned == -1  # reported once


def test_pending_answers_are_counted_per_epoch_and_a_waiting_vote_is_reported() -> None:
    st = member()
    for answer in (False, True):
        st.begin_pending()
        st.handle(m.PeersPendingResult(pending=answer), now=0.0)
        st.end_pending()
    assert st.reregister(41002).pending == [5, 2, 0, 1]
    st.begin_pending()  # the third vote of epoch 5 waits when the master goes
    st.link_down(1.0, 60.0)
    assert st.reregister(41002).pending == [5, 2, 1, 1]
    # a new epoch starts the count again, at every member alike
    st.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=6), now=2.0)
    assert st.reregister(41002).pending == [6, 0, 1, -1]
