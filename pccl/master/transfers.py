"""The receivers' progress in one running shared-state sync: pure (no trio, no clock; times are passed in).

A receiving peer reports ``SharedStateProgress(sync_seq, rx_bytes, total_bytes, chunks_done, chunks_total,
donors, donors_lost)`` while its fetch runs (:mod:`pccl.peer.shared_state`); :class:`SyncProgress` keeps
the last report of each participant of the sync and says what is wrong with one that breaks the rules
(the state then kicks its sender). Its size is bounded by the sync's participants: one row each,
replaced by each report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SwarmCounts:
    """What a receiver's swarm fetch reported besides bytes: items (chunks) done of those known so far,
    donors serving it now and donors lost (failed, stalled or excluded); all 0: not reported."""

    chunks_done: int = 0
    chunks_total: int = 0
    donors: int = 0
    donors_lost: int = 0

    @classmethod
    def of(cls, msg: Any) -> SwarmCounts:
        """The swarm fields of a ``SharedStateProgress`` message."""
        return cls(msg.chunks_done, msg.chunks_total, msg.donors, msg.donors_lost)


@dataclass
class _Receiver:
    rx: int
    total: int
    updated: float
    heal: SwarmCounts


class SyncProgress:
    """The last progress report of each receiver of one sync.

    Args:
        planned: peer id -> the bytes its plan makes it fetch (every participant, 0 for one that
            fetches nothing).
        started: when the plans were sent (the master's clock); rates count from then.
    """

    def __init__(self, planned: Mapping[int, int], started: float) -> None:
        self.planned = dict(planned)
        self.started = started
        self._rows: dict[int, _Receiver] = {}

    def report(self, peer_id: int, rx_bytes: int, total_bytes: int, now: float,
               heal: SwarmCounts | None = None) -> str | None:
        """Record one report; returns why it is illegal (the caller kicks the sender), None when it is not.

        Legal: the sender is a participant with bytes to fetch, ``total_bytes`` is what its plan names,
        ``rx_bytes <= total_bytes``, ``rx_bytes`` is not below its previous report, and ``heal``'s
        ``chunks_done <= chunks_total`` (the total may grow and the done count go back: a chunk found
        overwritten by bad bytes is fetched again).
        """
        heal = heal or SwarmCounts()
        planned = self.planned.get(peer_id)
        if planned is None:
            return "SharedStateProgress from a peer that takes no part in the sync"
        if planned == 0:
            return "SharedStateProgress from a peer with nothing to fetch"
        if total_bytes != planned:
            return f"SharedStateProgress total {total_bytes} bytes, but its plan names {planned}"
        if rx_bytes > total_bytes:
            return f"SharedStateProgress of {rx_bytes} bytes, past its total of {total_bytes}"
        last = self._rows.get(peer_id)
        if last is not None and rx_bytes < last.rx:
            return f"SharedStateProgress went back from {last.rx} to {rx_bytes} bytes"
        if heal.chunks_done > heal.chunks_total:
            return f"SharedStateProgress of {heal.chunks_done} chunks, past its {heal.chunks_total}"
        self._rows[peer_id] = _Receiver(rx_bytes, total_bytes, now, heal)
        return None

    def finished(self, peer_id: int, now: float) -> None:
        """``peer_id`` reported its ``SharedStateDone``: it has all of its bytes."""
        total = self.planned.get(peer_id, 0)
        if total > 0:
            last = self._rows.get(peer_id)
            h = last.heal if last is not None else SwarmCounts()
            self._rows[peer_id] = _Receiver(total, total, now, SwarmCounts(h.chunks_total, h.chunks_total, 0,
                                                                    h.donors_lost))

    def rows(self, now: float) -> list[dict[str, Any]]:
        """One JSON-able row per receiver that has bytes to fetch, by peer id: ``peer``, ``bytes``,
        ``total``, ``bytes_per_s`` (its bytes over the time since the plans went out, up to its last
        report), ``eta_s`` (None when it has not reported any byte yet; 0 when done),
        ``reported_s`` (seconds since its last report; None: none yet), and from its swarm fetch
        ``chunks``, ``chunks_total`` (known so far), ``donors`` (serving now) and ``donors_lost``
        (0 when not reported)."""
        out = []
        for pid in sorted(self.planned):
            total = self.planned[pid]
            if total <= 0:
                continue
            r = self._rows.get(pid)
            rx = r.rx if r is not None else 0
            took = (r.updated - self.started) if r is not None else 0.0
            rate = rx / took if took > 0 else 0.0
            if rx >= total:
                eta: float | None = 0.0
            elif rate > 0:
                eta = (total - rx) / rate  # as of its last report, at its rate so far
            else:
                eta = None
            h = r.heal if r is not None else SwarmCounts()
            out.append({"peer": pid, "bytes": rx, "total": total, "bytes_per_s": rate, "eta_s": eta,
                        "reported_s": None if r is None else max(0.0, now - r.updated),
                        "chunks": h.chunks_done, "chunks_total": h.chunks_total, "donors": h.donors,
                        "donors_lost": h.donors_lost})
        return out


__all__ = ["SwarmCounts", "SyncProgress"]
