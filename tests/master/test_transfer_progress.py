"""A receiver's shared-state progress (issue 37 item 5), message by message: the master records
``SharedStateProgress`` only for a participant of its group's running sync, within its plan; the status
snapshot, its text and its page show bytes, rate and ETA per receiver; anything else kicks the sender."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pccl.master.metrics import MasterObserver
from pccl.master.series import RunSeries
from pccl.master.status import build_status, render_html, render_text
from pccl.master.transfers import SyncProgress
from pccl.wire import messages as m

from ._effects import kicks
from .test_state import Harness

MB = 1_000_000
# 'w': the holders' content (the last peer's differs: it fetches the elected one)
W = [["w", 10, [8_000_000], 32 * MB, 111, False]]  # 8 M float32: 32 MB


def _running(three: bool = False) -> tuple[Harness, list[int], int]:
    """A sync of 32 MB in which the last peer fetches 'w' (the others hold the popular content)."""
    hs = Harness()
    peers = [hs.join()[0] for _ in range(3 if three else 2)]
    hs.update([peers[0]])
    hs.now = 10.0
    for p in peers[:-1]:
        hs.h(p, m.SharedStateSync(revision=0, strategy=0, entries=W))
    eff = hs.h(peers[-1], m.SharedStateSync(revision=0, strategy=0,
                                            entries=[["w", 10, [8_000_000], 32 * MB, 999, False]]))
    plans = {e.peer_id: e.message for e in eff if isinstance(getattr(e, "message", None), m.SharedStatePlan)}
    assert [r[0] for r in plans[peers[-1]].fetch] == ["w"]
    return hs, peers, hs.st._sync_seq


def _progress(hs: Harness, pid: int, seq: int, rx: int, total: int = 32 * MB, **heal: int) -> list[Any]:
    return hs.h(pid, m.SharedStateProgress(sync_seq=seq, rx_bytes=rx, total_bytes=total, **heal))


def test_progress_shows_bytes_rate_and_eta_then_goes_with_the_sync() -> None:
    hs, (a, b, c), seq = _running(three=True)
    snap = build_status(hs.st, [], 10.0)
    # before any report: the receiver listed with 0 bytes, no rate, no ETA; the holders not at all
    assert snap["receiving"] == [{"group": 0, "sync_seq": seq, "receivers": [
        {"peer": c, "bytes": 0, "total": 32 * MB, "bytes_per_s": 0.0, "eta_s": None, "reported_s": None,
         "chunks": 0, "chunks_total": 0, "donors": 0, "donors_lost": 0}]}]
    hs.now = 12.0
    assert _progress(hs, c, seq, 8 * MB) == []
    hs.now = 14.0
    assert _progress(hs, c, seq, 16 * MB) == []
    snap = build_status(hs.st, [], 14.5)
    row = snap["receiving"][0]["receivers"][0]
    assert row == {"peer": c, "bytes": 16 * MB, "total": 32 * MB, "bytes_per_s": 4 * MB, "eta_s": 4.0,
                   "reported_s": 0.5, "chunks": 0, "chunks_total": 0, "donors": 0, "donors_lost": 0}
    text = render_text(snap)
    line = f"shared-state sync {seq} (group 0): peer {c}: 16.0 MB / 32.0 MB (50%), 4.0 MB/s, ETA 4.0 s"
    assert line in text
    snap["series"] = RunSeries().export(14.5)
    page = render_html(snap)
    assert f"<td>peer {c}</td><td>16 MB / 32 MB (50%)" in page
    assert 'style="width:50.0%"' in page and "<td>4 MB/s</td><td>4 s</td>" in page
    obs = MasterObserver()
    metrics = obs.render(hs.st, 14.5).decode()
    samples = {(s.name, tuple(s.labels.items())): s.value
               for fam in text_string_to_metric_families(metrics) for s in fam.samples}
    assert samples[("pccl_shared_state_receiving_bytes", (("peer", str(c)),))] == 16 * MB
    assert samples[("pccl_shared_state_receiving_total_bytes", (("peer", str(c)),))] == 32 * MB
    # the holders finish first, the receiver last: done, then the sync is over and leaves the page
    for p in (a, b):
        hs.h(p, m.SharedStateDone(sync_seq=seq, success=True))
    hs.now = 16.0
    hs.h(c, m.SharedStateDone(sync_seq=seq, success=True, rx_bytes=32 * MB))
    assert build_status(hs.st, [], 16.0)["receiving"] == []
    after = obs.render(hs.st, 16.0).decode()
    assert "pccl_shared_state_receiving_bytes{" not in after


def test_a_report_after_the_sync_failed_is_dropped() -> None:
    hs, (a, b), seq = _running()
    hs.h(a, m.SharedStateDone(sync_seq=seq, success=False, reason="disk full"))  # fails the sync
    assert hs.st.transfer_progress(hs.now) == []
    assert _progress(hs, b, seq, MB) == []  # in flight when it failed: no kick
    assert b in hs.st.peers



def test_a_report_for_another_sync_is_dropped() -> None:
    """A sync number the master does not run (a former master's, after a restart: its numbers may be
    anything here) records nothing and kicks nobody."""
    hs, (_, b), seq = _running()
    for other in (seq - 1, seq + 1, seq + (5 << 24)):
        assert _progress(hs, b, other, MB) == []
    assert b in hs.st.peers
    assert hs.st.transfer_progress(hs.now)[0]["receivers"][0]["bytes"] == 0


def test_illegal_reports_kick_their_sender_only() -> None:
    cases: list[tuple[str, Any]] = [
        ("past its total", lambda hs, p, seq: _progress(hs, p, seq, 33 * MB, 32 * MB)),
        ("its plan names", lambda hs, p, seq: _progress(hs, p, seq, MB, 64 * MB)),
    ]
    for why, send in cases:
        hs, (a, b), seq = _running()
        eff = send(hs, b, seq)
        assert [k.peer_id for k in kicks(eff)] == [b] and why in kicks(eff)[0].reason, (why, eff)
        assert a in hs.st.peers
    # more chunks done than known
    hs, (a, b), seq = _running()
    eff = _progress(hs, b, seq, MB, chunks_done=5, chunks_total=4)
    assert [k.peer_id for k in kicks(eff)] == [b] and "5 chunks, past its 4" in kicks(eff)[0].reason
    # going back
    hs, (a, b), seq = _running()
    assert _progress(hs, b, seq, 2 * MB) == []
    eff = _progress(hs, b, seq, MB)
    assert [k.peer_id for k in kicks(eff)] == [b] and "went back" in kicks(eff)[0].reason
    # the holder fetches nothing: no progress of its own to report
    hs, (a, b), seq = _running()
    eff = _progress(hs, a, seq, 0, 0)
    assert [k.peer_id for k in kicks(eff)] == [a] and "nothing to fetch" in kicks(eff)[0].reason
    # after its own SharedStateDone
    hs, (a, b), seq = _running()
    hs.h(b, m.SharedStateDone(sync_seq=seq, success=True, rx_bytes=32 * MB))
    eff = _progress(hs, b, seq, 32 * MB)
    assert [k.peer_id for k in kicks(eff)] == [b] and "after its SharedStateDone" in kicks(eff)[0].reason
    # a registered peer outside the sync (joined the group after it started)
    hs, (a, b), seq = _running()
    d = hs.join()[0]
    eff = _progress(hs, d, seq, MB)
    assert [k.peer_id for k in kicks(eff)] == [d] and "no part" in kicks(eff)[0].reason


def test_the_record_is_bounded_by_the_participants() -> None:
    sp = SyncProgress({1: 100, 2: 0}, started=0.0)
    assert sp.report(3, 1, 100, 1.0) is not None  # not a participant: refused, not recorded
    for i in range(1000):
        assert sp.report(1, i // 10, 100, 1.0 + i) is None
    assert [r["peer"] for r in sp.rows(2000.0)] == [1]  # one row, the last report's
    assert sp.rows(2000.0)[0]["bytes"] == 99
    sp.finished(1, 2000.0)
    assert sp.rows(2000.0)[0]["eta_s"] == 0.0


def test_a_healing_newcomers_chunks_and_donors_on_the_page_and_in_the_metrics() -> None:
    """Issue 35 item 5: a swarm fetch reports its chunks and donors with its bytes; the status JSON, its
    text, the page and /metrics show them while the sync runs, and they go with it."""
    hs, (a, b, c), seq = _running(three=True)
    hs.now = 12.0
    assert _progress(hs, c, seq, 8 * MB, chunks_done=7, chunks_total=31, donors=2) == []
    hs.now = 14.0
    # a donor lost, the manifest of the large tensor verified meanwhile: more chunks known
    assert _progress(hs, c, seq, 16 * MB, chunks_done=15, chunks_total=32, donors=1, donors_lost=1) == []
    snap = build_status(hs.st, [], 14.0)
    row = snap["receiving"][0]["receivers"][0]
    assert {k: row[k] for k in ("peer", "bytes", "chunks", "chunks_total", "donors", "donors_lost")} == {
        "peer": c, "bytes": 16 * MB, "chunks": 15, "chunks_total": 32, "donors": 1, "donors_lost": 1}
    assert f"peer {c}: 16.0 MB / 32.0 MB (50%), 4.0 MB/s, ETA 4.0 s, chunks 15 / 32, 1 donor (1 lost)" in (
        render_text(snap))
    page = render_html(snap)
    assert "<th>chunks, donors</th>" in page and "<td>15 / 32 chunks, 1 donor (1 lost)</td>" in page
    obs = MasterObserver()
    samples = {(s.name, tuple(s.labels.items())): s.value
               for fam in text_string_to_metric_families(obs.render(hs.st, 14.0).decode())
               for s in fam.samples}
    peer = (("peer", str(c)),)
    assert samples[("pccl_shared_state_receiving_chunks", peer)] == 15
    assert samples[("pccl_shared_state_receiving_chunks_total", peer)] == 32
    assert samples[("pccl_shared_state_receiving_donors", peer)] == 1
    assert samples[("pccl_shared_state_receiving_donors_lost", peer)] == 1
    # done: every chunk counted, no donor serving any more; then the sync is over and the rows go
    hs.h(c, m.SharedStateDone(sync_seq=seq, success=True, rx_bytes=32 * MB))
    done = build_status(hs.st, [], 15.0)["receiving"][0]["receivers"][0]
    assert (done["chunks"], done["chunks_total"], done["donors"], done["donors_lost"]) == (32, 32, 0, 1)
    for p in (a, b):
        hs.h(p, m.SharedStateDone(sync_seq=seq, success=True))
    after = obs.render(hs.st, 16.0).decode()
    assert "pccl_shared_state_receiving_chunks{" not in after
    assert "pccl_shared_state_receiving_donors{" not in after


def test_a_report_without_chunks_shows_none() -> None:
    """A fetch that reports no chunks (all 0): no chunk or donor text, "-" on the page."""
    hs, (_, b), seq = _running()
    assert _progress(hs, b, seq, MB) == []
    snap = build_status(hs.st, [], hs.now)
    assert ", chunks" not in render_text(snap)
    assert "<td>-</td>" in render_html(snap)
