"""The master keeps each measured link's latency beside its bandwidth and sends the group's summary
(slowest bandwidth, spread, slowest latency) with EstablishP2P: the same to every member."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pccl.master.state import MasterState
from pccl.wire import messages as m

from ._effects import sends as _sends


def _cluster(n: int) -> tuple[MasterState, list[int]]:
    """``n`` accepted peers of group 0 (one update round)."""
    st = MasterState(solver=lambda bw: list(range(len(bw))))
    ids = []
    for _ in range(n):
        pid = st.new_connection("127.0.0.1", 0.0)
        st.handle(pid, m.Register(p2p_port=40000 + pid, peer_group=0), 0.0)
        ids.append(pid)
    eff: list[Any] = []
    eff += st.handle(ids[0], m.UpdateTopologyVote(), 0.0)
    for pid, msg in _sends(eff, m.EstablishP2P):
        st.handle(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True), 0.0)
    assert st.accepted() == ids
    return st, ids


def _optimize(
    st: MasterState, ids: list[int], row: Callable[[int, int], list[Any]], now: float = 1.0
) -> dict[int, list[float]]:
    """Run optimize_topology, answering every probe of ``a`` to ``b`` with ``row(a, b)``; returns
    the link summary each member got in EstablishP2P."""
    eff: list[Any] = []
    for p in ids:
        eff += st.handle(p, m.OptimizeTopologyVote(), now)
    while meas := _sends(eff, m.MeasureBandwidth):
        eff = []
        for p, msg in meas:
            eff += st.handle(
                p, m.BandwidthReport(epoch=msg.epoch, results=[row(p, t[0]) for t in msg.targets]), now
            )
    est = _sends(eff, m.EstablishP2P)
    assert {p for p, _ in est} == set(ids)
    for p, msg in est:
        st.handle(p, m.P2PConnectionsDone(epoch=msg.epoch, success=True), now)
    return {p: list(msg.links) for p, msg in est}


def test_measured_latency_is_kept_and_summarized_the_same_for_every_member() -> None:
    st, ids = _cluster(4)
    slow = (ids[1], ids[2])

    def row(a: int, b: int) -> list[Any]:
        return [b, 1.25e9 if (a, b) != slow else 125e6, 0.030 if (a, b) == slow else 0.025]

    links = _optimize(st, ids, row)
    assert len(st.latency) == 12
    assert st.latency[slow] == 0.030 and st.latency[(ids[2], ids[1])] == 0.025
    expect = [125e6, 10.0, 0.030]
    assert all(v == expect for v in links.values()), links
    assert st.link_summary(ids) == expect
    # a member's links leave with it
    st.kick(ids[1], "test")
    assert all(ids[1] not in k for k in st.latency)
    assert st.link_summary([ids[0], ids[2], ids[3]]) == [1.25e9, 1.0, 0.025]


def test_links_without_a_latency_fall_back_to_the_defaults() -> None:
    """Rows of two entries (a peer of protocol 4) record bandwidth only: the summary then has no
    latency (the peers use the model's default); unreachable links and malformed latencies record none."""
    st, ids = _cluster(3)
    st.bandwidth_stale_after = 0.5  # every optimize below measures everything again
    links = _optimize(st, ids, lambda a, b: [b, 1e9])
    assert not st.latency and all(v == [1e9, 1.0] for v in links.values())

    links = _optimize(st, ids, lambda a, b: [b, 1e9, 0.002], now=2.0)  # measured again: stale
    assert len(st.latency) == 6 and all(v == [1e9, 1.0, 0.002] for v in links.values())

    bad: dict[int, Any] = {0: math.nan, 1: -1.0, 2: True}

    def row(a: int, b: int) -> list[Any]:
        if (a, b) == (ids[0], ids[1]):
            return [b, 0.0, 0.0]  # unreachable
        return [b, 2e9, bad[ids.index(a)]]

    links = _optimize(st, ids, row, now=4.0)
    # ids[0]'s rows: an unreachable link and a NaN latency; ids[1]'s: a negative latency: their
    # bandwidths are recorded, their old latencies dropped. ids[2]'s rows carry a bool (not a
    # number): ignored whole, the old measurement stays.
    assert set(st.latency) == {(ids[2], ids[0]), (ids[2], ids[1])}
    assert st.bandwidth[(ids[2], ids[0])][0] == 1e9 and st.bandwidth[(ids[0], ids[2])][0] == 2e9
    assert st.link_summary(ids) == [1e9, 2.0, 0.002]
    assert st.link_summary(ids[:2]) == [2e9, 1.0]  # no latency measured between these two
    assert all(v == [1e9, 2.0, 0.002] for v in links.values())
