"""A running master's status as data, HTML and text: pure functions over :class:`MasterState`.

:func:`build_status` turns the state's public queries, the recent membership events and the
observer's counts into one JSON-able snapshot (served as ``/status``); :func:`render_html` (``/``)
and :func:`render_text` (``pccl status``) only format a snapshot. No I/O, no clock: times are passed in.
"""

from __future__ import annotations

import html
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .describe import describe_call
from .series import SERIES_CSS, render_series_section
from .state import MasterState

#: Snapshot format version (``/status``'s ``"version"``); bump on incompatible changes.
STATUS_VERSION = 1


@dataclass(frozen=True)
class LoggedEvent:
    """One membership event: when (the master's clock and the wall clock) and what."""

    at: float
    wall: float
    text: str


class EventLog:
    """The most recent membership events, oldest first."""

    def __init__(self, maxlen: int = 100) -> None:
        self._events: deque[LoggedEvent] = deque(maxlen=maxlen)

    def add(self, text: str, at: float, wall: float) -> None:
        """Record one event."""
        self._events.append(LoggedEvent(at=at, wall=wall, text=text))

    def recent(self, n: int | None = None) -> list[LoggedEvent]:
        """The last ``n`` events (all when None), oldest first."""
        items = list(self._events)
        return items if n is None else items[-n:]


def build_status(
    state: MasterState,
    events: Iterable[LoggedEvent],
    now: float,
    *,
    address: str = "",
    uptime: float = 0.0,
    counts: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The master's status as a JSON-able dict.

    Args:
        state: the master's state machine (read only).
        events: recent membership events, oldest first.
        now: the master's clock (the one ``last_seen`` and event times use).
        address: the master's ``HOST:PORT`` (shown as is).
        uptime: seconds since the master started.
        counts: the observer's counters (:meth:`MasterObserver.summary`).

    Returns:
        ``{"version", "master", "epoch", "ring", "groups", "peers", "rounds", "calls", "revisions",
        "bandwidth", "counts", "events", "receiving"}``; peer ids are ints, times are seconds ago;
        ``receiving``: each running shared-state sync's receivers with their bytes, rate and ETA
        (:meth:`MasterState.transfer_progress`, from their ``SharedStateProgress`` reports).
    """
    waited = state.waited_on()
    calls = {pid: [describe_call(w) for w in ws] for pid, ws in state.vote_waits().items()}
    peers = [
        {
            "id": rec.peer_id,
            "host": rec.host,
            "p2p_port": rec.p2p_port,
            "group": rec.group,
            "phase": rec.phase.value,
            "last_seen_s": round(max(0.0, now - rec.last_seen), 3),
            "waited_on": rec.peer_id in waited,
            "calls": calls.get(rec.peer_id, []),
        }
        for rec in sorted(state.peers.values(), key=lambda r: r.peer_id)
    ]
    groups: dict[str, list[int]] = {}
    for pid in state.accepted():
        groups.setdefault(str(state.peers[pid].group), []).append(pid)
    rounds = [{"what": what, "waits_for": waits, "detail": detail.strip(" ;")}
              for what, waits, detail in state.pending_rounds()]
    bandwidth = [
        {"from": a, "to": b, "bytes_per_s": bw, "age_s": round(max(0.0, now - when), 3)}
        for (a, b), (bw, when) in sorted(state.bandwidth.items())
    ]
    return {
        "version": STATUS_VERSION,
        "master": {"address": address, "uptime_s": round(uptime, 3)},
        "epoch": state.epoch,
        "ring": state.accepted(),
        "groups": groups,
        "peers": peers,
        "rounds": rounds,
        "calls": {str(p): c for p, c in sorted(calls.items())},
        "revisions": {str(g): r for g, r in sorted(state.last_revision.items())},
        "bandwidth": bandwidth,
        "counts": dict(counts or {}),
        "events": [{"ago_s": round(max(0.0, now - e.at), 3), "wall": e.wall, "text": e.text} for e in events],
        "receiving": state.transfer_progress(now),
    }


# ------------------------------------------------------------------------------------------------
# formatting


def _rate(bps: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} B/s"


def receiver_text(r: Mapping[str, Any]) -> str:
    """One receiver of a running sync: ``"peer 2: 64.0 MB / 256 MB (25%), 85.3 MB/s, ETA 2.3 s"``, then,
    when its swarm fetch reported them, ``", chunks 61 / 244, 3 donors (1 lost)"``."""
    total = max(int(r["total"]), 1)
    eta = r["eta_s"]
    when = "done" if r["bytes"] >= r["total"] else ("ETA unknown" if eta is None else f"ETA {eta:.1f} s")
    return (f"peer {r['peer']}: {_size(r['bytes'])} / {_size(r['total'])} ({100 * r['bytes'] // total}%), "
            f"{_rate(r['bytes_per_s'])}, {when}{heal_text(r)}")


def heal_text(r: Mapping[str, Any]) -> str:
    """A receiver's chunks and donors (``", chunks 61 / 244, 3 donors (1 lost)"``; "" when it reported
    none)."""
    if not r.get("chunks_total"):
        return ""
    lost = int(r.get("donors_lost", 0))
    donors = int(r.get("donors", 0))
    return (f", chunks {r['chunks']} / {r['chunks_total']}, {donors} donor{'' if donors == 1 else 's'}"
            f"{f' ({lost} lost)' if lost else ''}")


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _ring_line(snapshot: Mapping[str, Any]) -> list[str]:
    lines = []
    for group, ids in sorted(snapshot["groups"].items(), key=lambda kv: int(kv[0])):
        chain = " -> ".join(str(p) for p in ids)
        lines.append(f"group {group}: {chain}" + (f" -> {ids[0]}" if len(ids) > 1 else ""))
    return lines or ["(no accepted peer)"]


def _waiting_lines(snapshot: Mapping[str, Any]) -> list[str]:
    return [f"{r['what']} waits for {r['waits_for']}" + (f" ({r['detail']})" if r["detail"] else "")
            for r in snapshot["rounds"]]


def render_text(snapshot: Mapping[str, Any]) -> str:
    """The snapshot for a terminal (``pccl status``)."""
    c = snapshot.get("counts", {})
    out = [
        f"pccl master {snapshot['master']['address']}  up {snapshot['master']['uptime_s']:.0f}s  "
        f"epoch {snapshot['epoch']}  {len(snapshot['ring'])} accepted / {len(snapshot['peers'])} connected",
        "",
        "ring:",
        *("  " + line for line in _ring_line(snapshot)),
        "",
        f"{'peer':>5}  {'host':<22} {'group':>5}  {'phase':<10} {'seen':>7}  calls",
    ]
    for p in snapshot["peers"]:
        mark = " *" if p["waited_on"] else ""
        out.append(f"{p['id']:>5}  {p['host'] + ':' + str(p['p2p_port']):<22} {p['group']:>5}  "
                   f"{p['phase']:<10} {p['last_seen_s']:>6.1f}s  {', '.join(p['calls']) or '-'}{mark}")
    out += ["", "waiting:"] + ["  " + line for line in _waiting_lines(snapshot) or ["nothing"]]
    if c:
        out += ["", f"collectives: {c.get('collectives_started', 0)} started, "
                    f"{c.get('collectives_completed', 0)} completed, "
                    f"{c.get('collectives_failed', 0)} failed; "
                    f"{c.get('collectives_per_second', 0.0):.2f}/s; syncs {c.get('syncs_completed', 0)}; "
                    f"evictions {c.get('evictions', 0)}; deadlocks {c.get('deadlocks', 0)}"]
    if snapshot["revisions"]:
        out.append("shared-state revision: " + ", ".join(f"group {g}: {r}"
                                                         for g, r in snapshot["revisions"].items()))
    for t in snapshot.get("receiving", []):
        out.append(f"shared-state sync {t['sync_seq']} (group {t['group']}): " + "; ".join(
            receiver_text(r) for r in t["receivers"]))
    if snapshot["bandwidth"]:
        out.append("bandwidth: " + ", ".join(f"{b['from']}->{b['to']} {_rate(b['bytes_per_s'])}"
                                             for b in snapshot["bandwidth"]))
    out += ["", "recent events:"]
    out += [f"  {e['ago_s']:>7.1f}s ago  {e['text']}" for e in snapshot["events"][-10:]] or ["  none"]
    out.append("(* = others wait for this peer)")
    return "\n".join(out) + "\n"


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .2em} h2{font-size:1.05em;margin:1.2em 0 .4em;color:#444}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left}
th{background:#f0f0f0} .waited{background:#fff3cd} .muted{color:#777}
.ring{font-family:monospace;font-size:1.1em} .cards{display:flex;gap:1em;flex-wrap:wrap}
.card{background:#fff;border:1px solid #ddd;padding:.5em 1em;border-radius:6px}
.card b{display:block;font-size:1.4em}
""" + SERIES_CSS


def render_html(snapshot: Mapping[str, Any], *, refresh_seconds: int = 2) -> str:
    """The snapshot as a self-refreshing HTML page (the status server's ``/``)."""
    e = html.escape
    c = snapshot.get("counts", {})
    cards = [
        ("accepted peers", len(snapshot["ring"])),
        ("connected", len(snapshot["peers"])),
        ("epoch", snapshot["epoch"]),
        ("collectives / s", f"{c.get('collectives_per_second', 0.0):.2f}"),
        ("completed", c.get("collectives_completed", 0)),
        ("failed", c.get("collectives_failed", 0)),
        ("evictions", c.get("evictions", 0)),
    ]
    rows = []
    for p in snapshot["peers"]:
        cls = ' class="waited"' if p["waited_on"] else ""
        rows.append(
            f"<tr{cls}><td>{p['id']}</td><td>{e(p['host'])}:{p['p2p_port']}</td><td>{p['group']}</td>"
            f"<td>{e(p['phase'])}</td><td>{p['last_seen_s']:.1f} s ago</td>"
            f"<td>{e(', '.join(p['calls'])) or '-'}</td><td>{'yes' if p['waited_on'] else ''}</td></tr>"
        )
    waiting = _waiting_lines(snapshot)
    bw = "".join(f"<tr><td>{b['from']} &rarr; {b['to']}</td><td>{_rate(b['bytes_per_s'])}</td>"
                 f"<td>{b['age_s']:.0f} s ago</td></tr>" for b in snapshot["bandwidth"])
    events = "".join(f"<tr><td class=muted>{ev['ago_s']:.1f} s ago</td><td>{e(ev['text'])}</td></tr>"
                     for ev in reversed(snapshot["events"][-20:]))
    bw_table = (f"<table><tr><th>link</th><th>measured</th><th>when</th></tr>{bw}</table>" if bw
                else "<div class=muted>not measured (optimize_topology measures it)</div>")
    revisions = ", ".join(f"group {e(g)}: {r}" for g, r in snapshot["revisions"].items()) or "none yet"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_seconds}">
<title>pccl master {e(snapshot['master']['address'])}</title><style>{_CSS}</style></head><body>
<h1>pccl master {e(snapshot['master']['address'])}</h1>
<div class=muted>up {snapshot['master']['uptime_s']:.0f} s &middot; refreshes every {refresh_seconds} s
&middot; <a href="/status">/status</a> &middot; <a href="/metrics">/metrics</a></div>
<div class=cards>{''.join(f'<div class=card><b>{e(str(v))}</b>{e(k)}</div>' for k, v in cards)}</div>
{render_series_section(snapshot)}
<h2>Ring</h2><div class=ring>{'<br>'.join(e(line) for line in _ring_line(snapshot))}</div>
<h2>Membership</h2>
<table><tr><th>peer</th><th>address</th><th>group</th><th>phase</th><th>last seen</th><th>waits in</th>
<th>waited on</th></tr>{''.join(rows) or '<tr><td colspan=7>no peer</td></tr>'}</table>
<h2>Who is waited on</h2>
<ul>{''.join(f'<li>{e(w)}</li>' for w in waiting) or '<li class=muted>nothing is waiting</li>'}</ul>
<h2>Shared state</h2><div>revision: {revisions}</div>
<h2>Bandwidth</h2>
{bw_table}
<h2>Recent events</h2>
<table>{events or '<tr><td class=muted>none</td></tr>'}</table>
</body></html>
"""


__all__ = ["STATUS_VERSION", "EventLog", "LoggedEvent", "build_status", "render_html", "render_text"]
