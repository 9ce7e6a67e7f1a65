"""The status snapshot and the metrics as pure functions of the master state (no HTTP, time passed in)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pccl.master.metrics import MasterObserver, eviction_kind
from pccl.master.status import EventLog, build_status, render_html, render_text
from pccl.wire import messages as m

from ._effects import sends
from .test_state import Harness

AR = m.CollectiveDescriptor("all_reduce", 10, 8, 0, -1, 0, 0)


def _value(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise KeyError(name)


class Observed(Harness):
    """A harness whose messages and effects also feed an observer and an event log."""

    def __init__(self) -> None:
        super().__init__()
        self.obs = MasterObserver(throughput_window=10.0)
        self.log = EventLog()

    def h(self, pid: int, msg: m.Message) -> list[object]:
        self.obs.on_message(self.st, pid, msg, self.now)
        eff = super().h(pid, msg)
        self.obs.on_effects(self.st, eff, self.now)  # type: ignore[arg-type]
        for e in eff:
            text = getattr(e, "text", None)
            if text is not None:
                self.log.add(text, self.now, 1000.0 + self.now)
        return eff

    def lose(self, pid: int, reason: str) -> None:
        eff = self.st.peer_lost(pid, reason)
        self.obs.on_effects(self.st, eff, self.now)  # type: ignore[arg-type]
        for e in eff:
            text = getattr(e, "text", None)
            if text is not None:
                self.log.add(text, self.now, 0.0)


def test_collective_counts_vote_waits_and_failures() -> None:
    hs = Observed()
    a = hs.join()[0]
    b = hs.join()[0]
    c = hs.join()[0]
    hs.update([a])
    hs.now = 10.0
    hs.h(a, m.CollectiveInitiate(tag=1, descriptor=AR))
    hs.h(b, m.CollectiveInitiate(tag=1, descriptor=AR))
    hs.now = 10.25
    assert sends(hs.h(c, m.CollectiveInitiate(tag=1, descriptor=AR)), m.CollectiveCommence)
    for p in (a, b, c):
        hs.h(p, m.CollectiveDone(tag=1, success=True))
    # a mismatch fails in the vote, a lost participant while running
    hs.h(a, m.CollectiveInitiate(tag=2, descriptor=AR))
    hs.h(b, m.CollectiveInitiate(tag=2, descriptor=AR))
    hs.h(c, m.CollectiveInitiate(tag=2, descriptor=m.CollectiveDescriptor("all_reduce", 11, 8, 0, -1, 0, 0)))
    for p in (a, b, c):
        hs.h(p, m.CollectiveInitiate(tag=3, descriptor=AR))
    hs.lose(c, "evicted: silent for more than 2s")
    text = hs.obs.render(hs.st).decode()
    assert _value(text, "pccl_collectives_started_total") == 2
    assert _value(text, "pccl_collectives_completed_total") == 1
    assert _value(text, "pccl_collectives_failed_total", stage="vote") == 1
    assert _value(text, "pccl_collectives_failed_total", stage="running") == 1
    assert _value(text, "pccl_evictions_total", reason="heartbeat") == 1
    assert _value(text, "pccl_peers", phase="accepted") == 2
    assert _value(text, "pccl_vote_wait_seconds_count", kind="collective") == 2
    assert _value(text, "pccl_vote_wait_seconds_sum", kind="collective") == 0.25
    assert _value(text, "pccl_vote_wait_seconds_bucket", kind="collective", le="0.5") == 2
    assert _value(text, "pccl_vote_wait_seconds_bucket", kind="collective", le="0.1") == 1
    assert hs.obs.summary(hs.now)["collectives_per_second"] == 0.1
    assert hs.obs.summary(30.0)["collectives_per_second"] == 0.0


def test_eviction_reasons() -> None:
    assert eviction_kind("peer 3 (h) evicted: silent for more than 3s") == "heartbeat"
    assert eviction_kind("peer 3 (h) evicted: silent for 0.61s while its group waited on it (straggler "
                         "timeout 0.5s)") == "straggler"
    assert eviction_kind("peer 3 (h) evicted: its send queue overflowed") == "send_queue"
    assert eviction_kind("peer 3 kicked: duplicate Register") == "kicked"
    assert eviction_kind("peer 3 (h) left (connection closed)") is None


def test_snapshot_and_its_renderings() -> None:
    hs = Observed()
    a = hs.join()[0]
    b = hs.join()[0]
    hs.update([a])
    c = hs.join(host="127.0.0.<9>")[0]  # waits to be accepted (its host is escaped in the page)
    hs.now = 5.0
    hs.h(a, m.CollectiveInitiate(tag=4, descriptor=AR))
    hs.st.bandwidth[(a, b)] = (2.5e9, 1.0)
    snap = build_status(hs.st, hs.log.recent(), 6.0, address="10.0.0.1:48148", uptime=6.0,
                        counts=hs.obs.summary(6.0))
    assert snap["ring"] == [a, b] and snap["groups"] == {"0": [a, b]}
    assert [(p["id"], p["phase"], p["waited_on"], p["calls"]) for p in snap["peers"]] == [
        (a, "accepted", False, ["all_reduce tag 4"]),
        (b, "accepted", True, []),
        (c, "registered", False, []),
    ]
    assert snap["peers"][0]["last_seen_s"] == 1.0
    assert snap["rounds"] == [{"what": "collective tag 4 (group 0) vote", "waits_for": [b],
                               "detail": f"voted [{a}]"}]
    assert snap["bandwidth"] == [{"from": a, "to": b, "bytes_per_s": 2.5e9, "age_s": 5.0}]
    assert snap["calls"] == {str(a): ["all_reduce tag 4"]}
    text = render_text(snap)
    assert "group 0: 1 -> 2 -> 1" in text
    assert "collective tag 4 (group 0) vote waits for [2] (voted [1])" in text
    assert "1->2 2.5 GB/s" in text
    page = render_html(snap, refresh_seconds=3)
    assert '<meta http-equiv="refresh" content="3">' in page
    assert "127.0.0.&lt;9&gt;" in page and "127.0.0.<9>" not in page
    assert '<tr class="waited"><td>2</td>' in page
