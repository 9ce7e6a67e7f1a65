"""The peer's pure core driven message by message (no trio, no sockets, no clock)."""

from __future__ import annotations

import pytest

import pccl
from pccl.peer.state import (
    AbortOp,
    Call,
    Establish,
    Lost,
    Measure,
    PeerState,
    Resolve,
    error_from_code,
    ring_neighbours,
)
from pccl.wire import messages as m


def row(pid: int, group: int = 0) -> m.PeerRow:
    return m.PeerRow(peer_id=pid, host=f"10.0.0.{pid}", port=4000 + pid, group=group)


TABLE = [row(1), row(2), row(7, group=1), row(3)]


def accepted(pid: int = 2, group: int = 0) -> PeerState:
    st = PeerState(peer_id=pid, group=group)
    assert st.handle(m.Accepted(peers=TABLE, epoch=4), now=1.0) == [
        Resolve(Call.ACCEPTED, m.Accepted(peers=TABLE, epoch=4))
    ]
    return st


def test_accepted_sets_the_table_and_epoch() -> None:
    st = accepted()
    assert st.table == TABLE and st.epoch == 4
    assert st.group_ring == [1, 2, 3] and st.rank == 1
    assert st.group_sizes() == {0: 3, 1: 1}
    assert accepted(pid=7, group=1).group_ring == [7]
    assert PeerState(peer_id=9).rank == -1


def test_every_message_counts_as_hearing_from_the_master() -> None:
    st = accepted()
    assert st.silence(now=3.5) == 2.5
    assert st.handle(m.Heartbeat(), now=5.0) == []
    assert st.handle(m.Registered(peer_id=2), now=6.0) == []
    assert st.silence(now=6.25) == 0.25


def test_commence_complete_and_abort_are_matched_by_tag_and_op_seq() -> None:
    st = accepted()
    st.begin_op(5)
    commence = m.CollectiveCommence(tag=5, op_seq=40, peers=TABLE[:2])
    assert st.handle(m.CollectiveCommence(tag=6, op_seq=41, peers=TABLE[:2]), 2.0) == []  # no such op here
    assert st.handle(commence, 2.0) == [Resolve(Call.COMMENCE, commence, 5)]
    assert st.ops[5].op_seq == 40 and st.statistics()["ops"] == {5: 40}
    assert st.handle(m.CollectiveComplete(tag=5, op_seq=39), 2.1) == []  # an earlier op of this tag
    complete = m.CollectiveComplete(tag=5, op_seq=40)
    assert st.handle(complete, 2.2) == [Resolve(Call.COMPLETE, complete, 5)]
    # a late abort of an earlier op with the same tag must not touch this one
    late = m.CollectiveAbort(tag=5, op_seq=39, reason="old", code=int(pccl.Result.RANK_CONNECTION_LOST))
    assert st.handle(late, 2.3) == [] and not st.ops[5].aborted
    lost = int(pccl.Result.RANK_CONNECTION_LOST)
    abort = m.CollectiveAbort(tag=5, op_seq=40, reason="peer 3 lost", code=lost)
    (eff,) = st.handle(abort, 2.4)
    assert isinstance(eff, AbortOp) and eff.tag == 5 and st.ops[5].aborted
    assert isinstance(eff.error, pccl.RankConnectionLostError) and "peer 3 lost" in str(eff.error)
    st.end_op(5)
    assert st.ops == {} and st.handle(abort, 2.5) == []


def test_an_op_refused_before_it_commenced_is_aborted_with_op_seq_minus_one() -> None:
    st = accepted()
    st.begin_op(1)
    bad = int(pccl.Result.INVALID_ARGUMENT)
    refused = m.CollectiveAbort(tag=1, op_seq=-1, reason="peers disagree", code=bad)
    (eff,) = st.handle(refused, 1.0)
    assert isinstance(eff, AbortOp) and isinstance(eff.error, pccl.InvalidArgumentError)


def test_a_tag_runs_once_per_peer() -> None:
    st = accepted()
    st.begin_op(3)
    with pytest.raises(pccl.InvalidUsageError, match="tag 3 is already running"):
        st.begin_op(3)
    with pytest.raises(pccl.InvalidUsageError):
        st.check_tag_free(3)
    st.check_tag_free(4)
    st.end_op(3)
    st.begin_op(3)


def test_one_membership_call_at_a_time() -> None:
    st = accepted()
    st.begin_op(1)
    with pytest.raises(pccl.PendingAsyncOpsError, match="1 collective"):
        st.begin_topology("update_topology")
    st.begin_sync()  # a sync may run next to collectives
    with pytest.raises(pccl.InvalidUsageError, match="another membership call"):
        st.begin_sync()
    st.end_op(1)
    with pytest.raises(pccl.InvalidUsageError, match="another membership call"):
        st.begin_topology("optimize_topology")
    assert st.statistics()["membership_call"] == "sync_shared_state"
    st.end_membership()
    st.begin_topology("optimize_topology")
    assert st.statistics()["topology_call_waiting"]
    with pytest.raises(pccl.InvalidUsageError):
        st.begin_sync()
    with pytest.raises(pccl.InvalidUsageError):
        st.begin_topology("update_topology")
    st.end_membership()
    assert st.membership is None


def test_a_topology_result_updates_the_table_and_wakes_only_a_topology_call() -> None:
    st = accepted()
    new = [row(3), row(1), row(2)]
    result = m.TopologyResult(success=True, epoch=5, peers=new)
    assert st.handle(result, 1.0) == []  # no call waiting: the table changes all the same
    assert st.table == new and st.epoch == 5 and st.group_ring == [3, 1, 2]
    st.begin_topology("update_topology")
    assert st.handle(result, 1.1) == [Resolve(Call.TOPOLOGY, result)]


def test_establish_names_this_peers_successor_in_its_group() -> None:
    st = accepted(pid=3)
    # the successor wraps around; the group's rows in ring order come along (the other schedules'
    # partners are opened too)
    group0 = (row(1), row(2), row(3))
    assert st.handle(m.EstablishP2P(epoch=6, peers=TABLE), 1.0) == [Establish(6, row(1), group0)]
    alone = accepted(pid=7, group=1).handle(m.EstablishP2P(epoch=6, peers=TABLE), 1.0)
    assert alone == [Establish(6, None, (row(7, group=1),))]
    assert ring_neighbours([row(1), row(2), row(3)], 2) == (row(3), row(1))
    assert ring_neighbours([row(1)], 1) == (None, None)
    assert ring_neighbours([row(1), row(2)], 9) == (None, None)


def test_sync_rounds_plan_then_result_and_the_plan_names_the_living() -> None:
    st = accepted()
    plan = m.SharedStatePlan(sync_seq=8, revision=3, fetch=[["w", 1, [1]]], peers=[row(1), row(2)])
    result = m.SharedStateResult(sync_seq=8, success=True, revision=3)
    assert st.handle(plan, 1.0) == [] and st.table == TABLE  # no sync running here: ignored
    st.begin_sync()
    assert st.handle(plan, 1.1) == [Resolve(Call.SYNC, plan)]
    assert st.sync is not None and st.sync.sync_seq == 8 and st.sync.plans == 1
    assert st.table == [row(1), row(2), row(7, group=1)]  # peer 3 left this group; group 1 untouched
    assert st.handle(result, 1.2) == [Resolve(Call.SYNC, result)] and st.sync.results == 1
    st.end_membership()
    assert st.sync is None and st.syncs_total == 1


def test_pending_results_and_measurements_pass_through() -> None:
    st = accepted()
    pending = m.PeersPendingResult(pending=True)
    assert st.handle(pending, 1.0) == [Resolve(Call.PENDING, pending)]
    measure = m.MeasureBandwidth(epoch=4, targets=[[1, "h", 1]], duration=0.1)
    assert st.handle(measure, 1.0) == [Measure(measure)]


def test_a_kick_or_an_unexpected_message_ends_the_master_link() -> None:
    st = accepted()
    (kick,) = st.handle(m.Refused(reason="straggler"), 1.0)
    assert isinstance(kick, Lost) and isinstance(kick.error, pccl.KickedError)
    assert "removed by the master: straggler" in str(kick.error)
    (bad,) = st.handle(m.Register(p2p_port=1), 1.0)
    assert isinstance(bad, Lost) and isinstance(bad.error, pccl.MasterConnectionError)
    assert "unexpected message from master: Register" in str(bad.error)


def test_the_first_loss_of_the_master_sticks() -> None:
    st = accepted()
    st.check_usable()
    first = pccl.MasterConnectionError("silent")
    assert st.lose(first) and not st.lose(pccl.MasterConnectionError("later"))
    with pytest.raises(pccl.MasterConnectionError, match="silent"):
        st.check_usable()
    assert st.statistics()["master_ok"] is False and "master=lost" in repr(st)


def test_reconcile_drops_only_this_groups_dead() -> None:
    st = accepted()
    st.reconcile_group([row(2), row(3)])
    assert st.table == [row(2), row(7, group=1), row(3)]


def test_error_codes_map_to_error_classes() -> None:
    assert type(error_from_code(int(pccl.Result.TOO_FEW_PEERS), "x")) is pccl.TooFewPeersError
    assert type(error_from_code(int(pccl.Result.SHARED_STATE_SYNC_FAILED), "x")) is pccl.SharedStateSyncError
    unknown = error_from_code(10_000, "what")
    assert type(unknown) is pccl.PCCLError and unknown.result == pccl.Result.INTERNAL_ERROR


def test_statistics_and_repr_show_the_state() -> None:
    st = accepted()
    st.begin_op(2)
    s = st.statistics()
    assert s["peer_id"] == 2 and s["world_size"] == 4 and s["group_world_size"] == 3 and s["epoch"] == 4
    assert s["ops_in_flight"] == 1 and s["op_tags"] == [2] and s["ops"] == {2: -1}
    assert repr(st) == "<PeerState peer=2 group=0 world=4 epoch=4 ops=[2] call=None master=ok>"


F32 = pccl.DataType.FLOAT32


def describe(st: PeerState, kind: str, send: int, recv: int, **kw: object) -> m.CollectiveDescriptor:
    kw.setdefault("op", pccl.ReduceOp.SUM)
    kw.setdefault("dtype", F32)
    return st.describe_collective(kind, tag=1, send_count=send, recv_count=recv, **kw)  # type: ignore[arg-type]


def test_a_collective_is_checked_against_the_group_before_voting() -> None:
    st = accepted()  # group 0: peers 1, 2, 3
    d = describe(st, "all_reduce", 8, 8, op=pccl.ReduceOp.MAX)
    u8 = int(pccl.DataType.UINT8)
    assert d == m.CollectiveDescriptor("all_reduce", int(F32), 8, int(pccl.ReduceOp.MAX), -1, 0, u8)
    assert describe(st, "broadcast", 4, 4, root=2).root == 3  # the root's rank, as its peer id
    with pytest.raises(pccl.InvalidArgumentError, match="root rank 3 out of range"):
        describe(st, "broadcast", 4, 4, root=3)
    describe(st, "all_gather", 2, 6)
    with pytest.raises(pccl.InvalidArgumentError, match="expected 3 x 2"):
        describe(st, "all_gather", 2, 4)
    with pytest.raises(pccl.InvalidArgumentError, match="send has 8 elements but recv has 7"):
        describe(st, "all_reduce", 8, 7)
    q = pccl.QuantizationOptions(pccl.DataType.UINT8, pccl.QuantizationAlgorithm.MIN_MAX)
    quantized = describe(st, "all_reduce", 8, 8, quantization=q)
    assert quantized.quantization == int(pccl.QuantizationAlgorithm.MIN_MAX)
    with pytest.raises(pccl.InvalidArgumentError, match="quantization"):
        describe(st, "all_reduce", 8, 8, dtype=pccl.DataType.INT32, quantization=q)
    with pytest.raises(pccl.InvalidArgumentError, match="quantization"):
        describe(st, "broadcast", 8, 8, quantization=q)
    st.begin_op(1)
    with pytest.raises(pccl.InvalidUsageError):
        describe(st, "all_reduce", 8, 8)
    with pytest.raises(pccl.TooFewPeersError, match="group 1"):
        describe(accepted(pid=7, group=1), "all_reduce", 8, 8)
    for bad in (-1, 2**63, 1.5, "3"):
        with pytest.raises(pccl.InvalidArgumentError, match="tag must be"):
            PeerState.check_tag(bad)
    PeerState.check_tag(2**63 - 1)


def test_what_stops_a_commenced_op() -> None:
    gather = m.CollectiveDescriptor("all_gather", int(F32), 2, 0, -1, 0, 0)
    assert PeerState.commence_problem(gather, 6, [1, 2, 3]) is None
    problem = PeerState.commence_problem(gather, 6, [1, 2])
    assert problem is not None and problem[0] == "group size changed"
    assert isinstance(problem[1], pccl.InvalidArgumentError) and "2 x 2" in str(problem[1])
    bcast = m.CollectiveDescriptor("broadcast", int(F32), 4, 0, 3, 0, 0)
    assert PeerState.commence_problem(bcast, 4, [1, 3]) is None
    lost = PeerState.commence_problem(bcast, 4, [1, 2])
    assert lost is not None and lost[0] == "root lost" and isinstance(lost[1], pccl.RankConnectionLostError)
