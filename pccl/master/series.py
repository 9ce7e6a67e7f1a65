"""The status page's time series and transfers: pure (no trio, no clock; times are passed in).

:class:`RunSeries` counts, per interval of the master's clock (2 s by default, the last 5 minutes), the
collectives completed, the bytes they and the shared-state syncs moved, and the step time (the time
between two successful syncs of a group: one training step in the recipe's loop), and keeps the
shared-state transfers running and the last ones done. It is fed by the same messages and effects as
:class:`~pccl.master.metrics.MasterObserver` (:class:`~pccl.master.status_server.StatusService` calls both).
:func:`render_series_svg` draws the series as inline SVG (no script, nothing fetched), and
:func:`render_transfers_html` the transfers.
"""

from __future__ import annotations

import html
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._types import DataType
from ..wire import messages as m
from .state import Effect, MasterState, Send


@dataclass
class _Bucket:
    index: int
    collectives: int = 0
    nbytes: int = 0
    step_sum: float = 0.0
    steps: int = 0


@dataclass
class _Transfer:
    group: int
    sync_seq: int
    started: float
    participants: int
    planned: int = 0  # bytes the plans name (from the votes' entry sizes)
    received: int = 0
    reported: set[int] = field(default_factory=set)


class RunSeries:
    """Per-interval counts of one master's run and its shared-state transfers.

    Args:
        interval: seconds per point.
        length: points kept (the plot's width in intervals).
        transfers_kept: finished transfers listed.
    """

    def __init__(self, *, interval: float = 2.0, length: int = 150, transfers_kept: int = 8) -> None:
        if interval <= 0 or length < 2:
            raise ValueError("need interval > 0 and length >= 2")
        self.interval = interval
        self.length = length
        self._buckets: deque[_Bucket] = deque(maxlen=length)
        self._op_bytes: dict[tuple[int, int], int] = {}  # (group, tag) -> bytes of its last vote
        self._last_sync: dict[int, float] = {}  # group -> when its last sync succeeded
        self._sizes: dict[int, dict[str, int]] = {}  # group -> key -> nbytes, from the votes' rows
        self._running: dict[int, _Transfer] = {}  # group -> its sync in progress
        self.finished: deque[dict[str, Any]] = deque(maxlen=transfers_kept)

    def _bucket(self, now: float) -> _Bucket:
        index = int(now // self.interval)
        if not self._buckets or self._buckets[-1].index != index:
            self._buckets.append(_Bucket(index))
        return self._buckets[-1]

    # --- feeding ----------------------------------------------------------------------------------

    def on_message(self, state: MasterState, peer_id: int, msg: m.Message, now: float) -> None:
        """A message from ``peer_id`` (before the state handles it)."""
        rec = state.peers.get(peer_id)
        group = rec.group if rec is not None else 0
        if isinstance(msg, m.CollectiveInitiate):
            d = msg.descriptor
            try:
                size = DataType(d.dtype).itemsize
            except ValueError:
                return  # the state refuses it
            self._op_bytes[(group, msg.tag)] = max(0, d.element_count) * size
            if len(self._op_bytes) > 4096:
                self._op_bytes.clear()
        elif isinstance(msg, (m.SharedStateSync, m.SharedStateEntries)):
            sizes = self._sizes.setdefault(group, {})
            for row in msg.entries:
                ok = len(row) > 3 and isinstance(row[0], str) and isinstance(row[3], int)
                if ok and len(sizes) < 65536:
                    sizes[row[0]] = max(0, row[3])
        elif isinstance(msg, m.SharedStateDone) and msg.success:
            t = self._running.get(group)
            if t is not None and msg.sync_seq == t.sync_seq and peer_id not in t.reported:
                t.reported.add(peer_id)
                t.received += msg.rx_bytes
            self._bucket(now).nbytes += msg.rx_bytes

    def on_effects(self, state: MasterState, effects: Sequence[Effect], now: float) -> None:
        """Effects the state returned."""
        completed: set[tuple[int, int]] = set()
        synced: set[int] = set()
        for eff in effects:
            if not isinstance(eff, Send):
                continue
            rec = state.peers.get(eff.peer_id)
            group = rec.group if rec is not None else 0
            msg = eff.message
            if isinstance(msg, m.CollectiveComplete) and (group, msg.op_seq) not in completed:
                completed.add((group, msg.op_seq))
                b = self._bucket(now)
                b.collectives += 1
                b.nbytes += self._op_bytes.get((group, msg.tag), 0)
            elif isinstance(msg, m.SharedStatePlan) and group not in self._running:
                sent = [e.message for e in effects
                        if isinstance(e, Send) and isinstance(e.message, m.SharedStatePlan)]
                sizes = self._sizes.get(group, {})
                planned = sum(sizes.get(str(row[0]), 0) for p in sent for row in p.fetch if row)
                self._running[group] = _Transfer(group, msg.sync_seq, now, len(sent), planned)
            elif isinstance(msg, m.SharedStateResult) and msg.sync_seq not in synced:
                synced.add(msg.sync_seq)
                self._sync_over(group, msg, now)

    def _sync_over(self, group: int, msg: m.SharedStateResult, now: float) -> None:
        t = self._running.pop(group, None)
        if t is not None and t.sync_seq == msg.sync_seq and t.received > 0:
            took = max(now - t.started, 1e-9)
            self.finished.append({"group": group, "sync_seq": t.sync_seq, "bytes": t.received,
                                  "seconds": took, "bytes_per_s": t.received / took, "ok": msg.success,
                                  "ended": now})
        if msg.success:
            last = self._last_sync.get(group)
            if last is not None:
                b = self._bucket(now)
                b.step_sum += now - last
                b.steps += 1
            self._last_sync[group] = now

    # --- reading ----------------------------------------------------------------------------------

    def export(self, now: float) -> dict[str, Any]:
        """The series (oldest first, one point per interval from the first recorded one, at most
        ``length`` back, up to the current one; missing intervals as zeros, step time None where no step
        ended) and the transfers, JSON-able."""
        end = int(now // self.interval)
        start = end - self.length + 1
        if self._buckets:
            start = max(start, min(self._buckets[0].index, end))
        by_index = {b.index: b for b in self._buckets if b.index >= start}
        coll: list[float] = []
        rate: list[float] = []
        step: list[float | None] = []
        for i in range(start, end + 1):
            b = by_index.get(i)
            coll.append(b.collectives / self.interval if b else 0.0)
            rate.append(b.nbytes / self.interval if b else 0.0)
            step.append(b.step_sum / b.steps if b and b.steps else None)
        running = [{"group": t.group, "sync_seq": t.sync_seq, "running_s": now - t.started,
                    "participants": t.participants, "reported": len(t.reported), "bytes_so_far": t.received,
                    "bytes_planned": t.planned}
                   for t in self._running.values()]
        finished = [{**f, "ago_s": now - f["ended"]} for f in self.finished]
        for f in finished:
            f.pop("ended", None)
        return {"interval_s": self.interval, "collectives_per_s": coll, "bytes_per_s": rate, "step_s": step,
                "transfers": {"running": running, "finished": finished}}


# ------------------------------------------------------------------------------------------------
# HTML


def _bytes(n: float) -> str:
    for u in ("B", "KB", "MB", "GB"):
        if n < 1000 or u == "GB":
            return f"{n:.3g} {u}"
        n /= 1000
    return f"{n:.3g} GB"


def _fmt(v: float, unit: str) -> str:
    if unit == "B/s":
        for u in ("B/s", "KB/s", "MB/s", "GB/s"):
            if v < 1000 or u == "GB/s":
                return f"{v:.3g} {u}"
            v /= 1000
    if unit == "s":
        return f"{v * 1000:.3g} ms" if v < 1 else f"{v:.3g} s"
    return f"{v:.3g}{unit}"


def _chart(title: str, values: Sequence[float | None], unit: str, interval: float, *, width: int = 640,
           height: int = 70, color: str = "#3366cc") -> str:
    e = html.escape
    present = [v for v in values if v is not None]
    top = max(present, default=0.0)
    last = next((v for v in reversed(values) if v is not None), None)
    n = len(values)
    scale = top if top > 0 else 1.0
    x = [width * i / max(n - 1, 1) for i in range(n)]
    # One polyline per run of present points (step time has gaps).
    lines: list[list[str]] = []
    run: list[str] = []
    for xi, v in zip(x, values, strict=True):
        if v is None:
            if run:
                lines.append(run)
            run = []
            continue
        run.append(f"{xi:.1f},{height - 4 - (height - 8) * v / scale:.1f}")
    if run:
        lines.append(run)
    paths = "".join(
        f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(pts)}"/>'
        if len(pts) > 1 else
        f'<circle cx="{pts[0].split(",")[0]}" cy="{pts[0].split(",")[1]}" r="2" fill="{color}"/>'
        for pts in lines
    )
    now_text = "no data yet" if last is None else f"now {_fmt(last, unit)}"
    seconds = n * interval
    span = f"last {seconds / 60:.0f} min" if seconds >= 120 else f"last {seconds:.0f} s"
    return (
        f'<div class=chart><div class=charthead><b>{e(title)}</b> <span class=muted>{e(now_text)} &middot; '
        f'max {e(_fmt(top, unit))} &middot; {e(span)}</span></div>'
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{e(title)}"><rect width="{width}" height="{height}" fill="#fff" stroke="#ddd"/>'
        f'<line x1="0" y1="{height - 4}" x2="{width}" y2="{height - 4}" stroke="#eee"/>{paths}</svg></div>'
    )


def render_series_section(snapshot: Mapping[str, Any]) -> str:
    """The status page's "Activity" and "Shared-state transfers" sections (without a series: only the
    receivers of running syncs, if any)."""
    series = snapshot.get("series")
    receiving = render_receiving_html(snapshot.get("receiving", []))
    if not isinstance(series, Mapping):
        return f"<h2>Shared-state transfers</h2>{receiving}" if receiving else ""
    return (f"<h2>Activity</h2>{render_series_svg(series)}"
            f"<h2>Shared-state transfers</h2>{receiving}{render_transfers_html(series)}")


def render_receiving_html(receiving: Sequence[Mapping[str, Any]]) -> str:
    """Each running sync's receivers (``/status``'s ``receiving``): bytes, a bar, rate and ETA."""
    rows = []
    for t in receiving:
        for r in t.get("receivers", []):
            total = max(int(r["total"]), 1)
            pct = min(100.0, 100.0 * int(r["bytes"]) / total)
            eta = r["eta_s"]
            when = ("done" if r["bytes"] >= r["total"] else "unknown (no report yet)" if eta is None
                    else _fmt(float(eta), "s"))
            rows.append(
                f"<tr><td>group {t['group']}, sync {t['sync_seq']}</td><td>peer {r['peer']}</td>"
                f"<td>{_bytes(float(r['bytes']))} / {_bytes(float(r['total']))} ({pct:.0f}%)"
                f'<div class=bar><div style="width:{pct:.1f}%"></div></div></td>'
                f"<td>{_fmt(float(r['bytes_per_s']), 'B/s')}</td><td>{when}</td>"
                f"<td>{_heal_cells(r)}</td></tr>")
    if not rows:
        return ""
    return ("<table><tr><th>sync</th><th>receiver</th><th>received</th><th>rate</th><th>ETA</th>"
            "<th>chunks, donors</th></tr>"
            + "".join(rows) + "</table>")


def _heal_cells(r: Mapping[str, Any]) -> str:
    """A receiver's chunks done of those known and its donors (lost ones too), "-" when not reported."""
    if not r.get("chunks_total"):
        return "-"
    lost = int(r.get("donors_lost", 0))
    donors = int(r.get("donors", 0))
    return (f"{r['chunks']} / {r['chunks_total']} chunks, {donors} donor{'' if donors == 1 else 's'}"
            f"{f' ({lost} lost)' if lost else ''}")


def render_series_svg(series: Mapping[str, Any]) -> str:
    """The three charts (collectives per second, step time, bytes per second) as inline SVG."""
    interval = float(series.get("interval_s", 2.0))
    return "".join([
        _chart("collectives / s", series.get("collectives_per_s", []), "/s", interval),
        _chart("step time (between shared-state syncs)", series.get("step_s", []), "s", interval,
               color="#cc6633"),
        _chart("bytes / s (collectives and shared-state transfers)", series.get("bytes_per_s", []), "B/s",
               interval, color="#339966"),
    ])


def render_transfers_html(series: Mapping[str, Any]) -> str:
    """The shared-state transfers running and the last ones done, as HTML."""
    t = series.get("transfers", {})
    rows = []
    for r in t.get("running", []):
        rows.append(f"<tr class=waited><td>group {r['group']}, sync {r['sync_seq']}</td><td>running</td>"
                    f"<td>{r['running_s']:.1f} s</td><td>{r['reported']} / {r['participants']} peers done, "
                    f"{_bytes(float(r['bytes_so_far']))} of {_bytes(float(r['bytes_planned']))} done "
                    f"(each receiver's live progress above)</td></tr>")
    for f in reversed(t.get("finished", [])):
        state = "done" if f["ok"] else "failed"
        rows.append(f"<tr><td>group {f['group']}, sync {f['sync_seq']}</td><td>{state}"
                    f" {f['ago_s']:.0f} s ago</td><td>{f['seconds']:.2f} s</td>"
                    f"<td>{_bytes(float(f['bytes']))} at {_fmt(float(f['bytes_per_s']), 'B/s')}"
                    f"</td></tr>")
    if not rows:
        return "<div class=muted>no shared-state transfer yet</div>"
    return ("<table><tr><th>transfer</th><th>state</th><th>time</th><th>bytes</th></tr>"
            + "".join(rows) + "</table>")


SERIES_CSS = (".chart{margin:.3em 0 .8em} .charthead{font-size:.9em;margin-bottom:.15em} "
              "svg{display:block} .bar{background:#eee;height:.4em;width:12em;margin-top:.15em} "
              ".bar div{background:#339966;height:100%}")


__all__ = ["SERIES_CSS", "RunSeries", "render_receiving_html", "render_series_section", "render_series_svg",
           "render_transfers_html"]
