"""The registry of collective kinds (pccl.collectives.kinds): every kind is complete (plans and a cost
under each schedule it runs, a fallback for each it does not), names resolve, and the peer's descriptor
rules come from the kind."""

from __future__ import annotations

import math

import pytest

import pccl
from pccl.collectives.cost import predict, schedule_for
from pccl.collectives.kinds import KINDS, REGISTRY, Kind, get_kind
from pccl.collectives.schedule import SCHEDULES, all_plans
from pccl.peer.state import PeerState
from pccl.wire import messages as m


@pytest.mark.parametrize("name", KINDS)
def test_every_kind_runs_under_every_request(name: str) -> None:
    kind = get_kind(name)
    assert kind.name == name and REGISTRY[name] is kind and get_kind(kind) is kind
    n = 5
    count = kind.plannable_count(n, 40)
    for requested in SCHEDULES:
        ran = kind.run_schedule(requested)
        assert ran in kind.schedules, (name, requested)
        assert schedule_for(requested, name, n, count * 4) == ran
        plans = all_plans(ran, name, n, count, 7, root=3)
        assert len(plans) == n and all(p.schedule in (ran, "exchange") for p in plans)
        assert math.isfinite(predict(ran, name, n, count * 4, root=3))
    for schedule in SCHEDULES:
        if schedule not in kind.schedules:
            assert predict(schedule, name, n, 4096) == math.inf
            with pytest.raises(ValueError, match="no plan"):
                all_plans(schedule, name, n, count, 7)


def test_unknown_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        get_kind("gather")
    st = PeerState(peer_id=1)
    with pytest.raises(pccl.InvalidArgumentError, match="unknown collective kind"):
        st.describe_collective("gather", tag=0, dtype=pccl.DataType.FLOAT32, send_count=4, recv_count=4,
                               op=pccl.ReduceOp.SUM)
    assert all(isinstance(k, Kind) for k in REGISTRY.values())


def _accepted() -> PeerState:
    st = PeerState(peer_id=1)
    rows = [m.PeerRow(peer_id=i, host="h", port=i, group=0) for i in (1, 2, 3)]
    st.handle(m.Accepted(peers=rows, epoch=1), now=0.0)
    assert st.group_ring == [1, 2, 3]
    return st


def test_the_descriptor_rules_of_the_new_kinds() -> None:
    st = _accepted()
    f32 = pccl.DataType.FLOAT32
    d = st.describe_collective("reduce", tag=1, dtype=f32, send_count=4, recv_count=4, op=pccl.ReduceOp.AVG,
                               root=2)
    assert d.kind == "reduce" and d.root == st.group_ring[2]
    with pytest.raises(pccl.InvalidArgumentError, match="root rank 3 out of range"):
        st.describe_collective("reduce", tag=1, dtype=f32, send_count=4, recv_count=4, op=pccl.ReduceOp.SUM,
                               root=3)
    sum_ = pccl.ReduceOp.SUM
    d = st.describe_collective("all_to_all", tag=1, dtype=f32, send_count=6, recv_count=6, op=sum_)
    assert d.kind == "all_to_all" and d.root == -1
    with pytest.raises(pccl.InvalidArgumentError, match="not 3 equal blocks"):
        st.describe_collective("all_to_all", tag=1, dtype=f32, send_count=7, recv_count=7, op=sum_)
    with pytest.raises(pccl.InvalidArgumentError, match="quantization"):
        st.describe_collective("reduce", tag=1, dtype=f32, send_count=4, recv_count=4, op=pccl.ReduceOp.SUM,
                               quantization=pccl.QuantizationOptions(
                                   algorithm=pccl.QuantizationAlgorithm.MIN_MAX))
    # commenced on a smaller group: all_to_all's blocks were cut for 3 peers; a reduce's root is gone
    a2a = m.CollectiveDescriptor("all_to_all", int(f32), 6, 0, -1, 0, 0)
    assert PeerState.commence_problem(a2a, 6, [1, 2, 3], 3) is None
    changed = PeerState.commence_problem(a2a, 6, [1, 2], 3)
    assert changed is not None and changed[0] == "group size changed"
    assert isinstance(changed[1], pccl.InvalidArgumentError)
    red = m.CollectiveDescriptor("reduce", int(f32), 4, 0, 3, 0, 0)
    assert PeerState.commence_problem(red, 4, [1, 3], 3) is None and PeerState.root_position(red, [1, 3]) == 1
    lost = PeerState.commence_problem(red, 4, [1, 2], 3)
    assert lost is not None and lost[0] == "root lost" and isinstance(lost[1], pccl.RankConnectionLostError)
