"""The status page's time series and transfers (issue 37 item 5): pure, fed message by message, time
passed in; the charts are inline SVG (no script, nothing fetched)."""

from __future__ import annotations

from pccl.master.series import RunSeries, render_series_svg, render_transfers_html
from pccl.master.status import build_status, render_html
from pccl.wire import messages as m

from .test_state import Harness

AR = m.CollectiveDescriptor("all_reduce", 10, 1000, 0, -1, 0, 0)  # 1000 float32: 4000 bytes
ENTRY = [["w", 10, [8], 32, 123, False]]


class Fed(Harness):
    def __init__(self) -> None:
        super().__init__()
        self.series = RunSeries(interval=2.0, length=10)

    def h(self, pid: int, msg: m.Message) -> list[object]:
        self.series.on_message(self.st, pid, msg, self.now)
        eff = super().h(pid, msg)
        self.series.on_effects(self.st, eff, self.now)  # type: ignore[arg-type]
        return eff


def test_collectives_bytes_and_step_time_per_interval() -> None:
    hs = Fed()
    a = hs.join()[0]
    b = hs.join()[0]
    hs.update([a])
    for step, t in enumerate((10.0, 10.5, 13.0)):  # two collectives in [10, 12), one in [12, 14)
        hs.now = t
        for p in (a, b):
            hs.h(p, m.CollectiveInitiate(tag=step, descriptor=AR))
        for p in (a, b):
            hs.h(p, m.CollectiveDone(tag=step, success=True))
    for t in (14.0, 15.0, 17.5):  # three syncs: steps of 1 s and 2.5 s
        hs.now = t
        for p in (a, b):
            hs.h(p, m.SharedStateSync(revision=hs.st.last_revision.get(0, -1) + 1, strategy=0, entries=ENTRY))
        for p in (a, b):
            hs.h(p, m.SharedStateDone(sync_seq=hs.st._sync_seq, success=True, rx_bytes=0))
    out = hs.series.export(19.0)
    # From the first interval with activity (10 s) to the current one: 10, 12, 14, 16, 18.
    assert out["collectives_per_s"] == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert out["bytes_per_s"] == [4000.0, 2000.0, 0.0, 0.0, 0.0]
    assert out["step_s"] == [None, None, 1.0, 2.5, None]
    assert len(hs.series.export(100.0)["collectives_per_s"]) == 10  # at most `length` points
    svg = render_series_svg(out)
    assert svg.count("<svg") == 3 and "<polyline" in svg and "<script" not in svg
    assert "now 0/s" in svg and "max 1/s" in svg and "max 2.5 s" in svg


def test_a_transfer_is_listed_while_it_runs_and_with_its_rate_after() -> None:
    hs = Fed()
    a = hs.join()[0]
    b = hs.join()[0]
    hs.update([a])
    hs.now = 1.0
    hs.h(a, m.SharedStateSync(revision=0, strategy=0, entries=ENTRY))
    hs.h(b, m.SharedStateSync(revision=0, strategy=0, entries=[["w", 10, [8], 32, 999, False]]))
    hs.now = 3.0
    hs.h(a, m.SharedStateDone(sync_seq=hs.st._sync_seq, success=True, rx_bytes=0))
    running = hs.series.export(3.5)["transfers"]["running"]
    # the two contents of 'w' differ: one of the peers fetches the elected one's 32 bytes
    assert running == [{"group": 0, "sync_seq": hs.st._sync_seq, "running_s": 2.5, "participants": 2,
                        "reported": 1, "bytes_so_far": 0, "bytes_planned": 32}]
    assert "1 / 2 peers done, 0 B of 32 B done" in render_transfers_html(hs.series.export(3.5))
    hs.now = 5.0
    hs.h(b, m.SharedStateDone(sync_seq=hs.st._sync_seq, success=True, rx_bytes=32_000_000))
    done = hs.series.export(6.0)["transfers"]
    assert done["running"] == []
    assert done["finished"] == [{"group": 0, "sync_seq": hs.st._sync_seq, "bytes": 32_000_000, "seconds": 4.0,
                                 "bytes_per_s": 8_000_000.0, "ok": True, "ago_s": 1.0}]
    assert "32 MB at 8 MB/s" in render_transfers_html(hs.series.export(6.0))
    snap = build_status(hs.st, [], 6.0)
    snap["series"] = hs.series.export(6.0)
    page = render_html(snap)
    assert "<h2>Activity</h2>" in page and "<h2>Shared-state transfers</h2>" in page
    assert "<h2>Activity</h2>" not in render_html(build_status(hs.st, [], 6.0))
