"""What a running master counts: collectives, evictions, vote waits, bytes; as Prometheus metrics.

:class:`MasterObserver` is fed what the server already sees (each message a peer sends, each batch
of effects the state returns, with the time) and keeps

* Prometheus metrics in its own :class:`prometheus_client.CollectorRegistry` (``/metrics``), and
* the same counts as plain numbers for the JSON status (``/status``) and the terminal.

No I/O and no clock: times are passed in.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..wire import messages as m
from .state import Effect, Event, FastStart, Kick, MasterState, Phase, Send

#: Content type of :meth:`MasterObserver.render` (Prometheus text exposition format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

VOTE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0)

# Substrings of the state's membership events -> the eviction reason label.
_EVICTION_KINDS = (
    ("while its group waited on it", "straggler"),
    ("silent for more than", "heartbeat"),
    ("send queue overflowed", "send_queue"),
    ("the master cannot send it", "frame_size"),
)


def eviction_kind(text: str) -> str | None:
    """The eviction reason label for a membership event line, or None if it is not an eviction."""
    if " kicked: " in text:
        return "kicked"
    for needle, kind in _EVICTION_KINDS:
        if needle in text:
            return kind
    return None


class MasterObserver:
    """Counts what a master does; see the module docstring.

    Args:
        throughput_window: seconds over which :meth:`throughput` averages.
    """

    def __init__(self, *, throughput_window: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.peers = Gauge("pccl_peers", "Peers connected to the master, by phase", ["phase"], registry=r)
        self.epoch = Gauge("pccl_topology_epoch", "Current topology epoch", registry=r)
        self.started = Counter("pccl_collectives_started", "Collectives that commenced", registry=r)
        self.completed = Counter("pccl_collectives_completed", "Collectives every participant finished",
                                 registry=r)
        self.failed = Counter("pccl_collectives_failed",
                              "Collectives aborted or refused, by stage (vote: before they commenced)",
                              ["stage"], registry=r)
        self.evictions = Counter("pccl_evictions", "Peers removed by the master, by reason", ["reason"],
                                 registry=r)
        self.vote_wait = Histogram("pccl_vote_wait_seconds",
                                   "Time from a vote's first ballot until it completed, by kind",
                                   ["kind"], buckets=VOTE_BUCKETS, registry=r)
        self.state_bytes = Counter("pccl_shared_state_received_bytes",
                                   "Shared-state bytes the peers reported receiving", registry=r)
        self.receiving = Gauge("pccl_shared_state_receiving_bytes",
                               "Bytes each receiver of a running shared-state sync has reported so far "
                               "(its SharedStateProgress)", ["peer"], registry=r)
        self.receiving_total = Gauge("pccl_shared_state_receiving_total_bytes",
                                     "Bytes each receiver of a running shared-state sync fetches in all",
                                     ["peer"], registry=r)
        self.receiving_chunks = Gauge("pccl_shared_state_receiving_chunks",
                                      "Chunks each receiver of a running shared-state sync has verified "
                                      "(its swarm fetch)", ["peer"], registry=r)
        self.receiving_chunks_total = Gauge("pccl_shared_state_receiving_chunks_total",
                                            "Chunks each receiver of a running shared-state sync knows it "
                                            "fetches so far", ["peer"], registry=r)
        self.receiving_donors = Gauge("pccl_shared_state_receiving_donors",
                                      "Donors serving each receiver of a running shared-state sync now",
                                      ["peer"], registry=r)
        self.receiving_donors_lost = Gauge("pccl_shared_state_receiving_donors_lost",
                                           "Donors each receiver of a running shared-state sync lost "
                                           "(failed, stalled or excluded for bad bytes)", ["peer"],
                                           registry=r)
        self.deadlocks = Counter("pccl_deadlocks", "Deadlocks detected (every call of the group failed)",
                                 registry=r)
        self.counts: dict[str, int] = {
            "collectives_started": 0, "collectives_completed": 0, "collectives_failed": 0,
            "syncs_completed": 0, "shared_state_bytes": 0, "evictions": 0, "deadlocks": 0,
        }
        self._vote_start: dict[tuple[str, int, int], float] = {}  # (kind, group, tag) -> first ballot
        self._failed_ops: set[int] = set()
        self._completions: deque[float] = deque()
        self.throughput_window = throughput_window

    # --- feeding ----------------------------------------------------------------------------------

    def on_message(self, state: MasterState, peer_id: int, msg: m.Message, now: float) -> None:
        """A message from ``peer_id`` (call before the state handles it)."""
        rec = state.peers.get(peer_id)
        group = rec.group if rec is not None else 0
        if isinstance(msg, m.CollectiveInitiate):
            self._vote_start.setdefault(("collective", group, msg.tag), now)
        elif isinstance(msg, m.SharedStateSync):
            self._vote_start.setdefault(("sync", group, -1), now)
        elif isinstance(msg, (m.UpdateTopologyVote, m.OptimizeTopologyVote)):
            self._vote_start.setdefault(("topology", -1, -1), now)
        elif isinstance(msg, m.SharedStateDone) and msg.success:
            self.state_bytes.inc(msg.rx_bytes)
            self.counts["shared_state_bytes"] += msg.rx_bytes

    def on_effects(self, state: MasterState, effects: list[Effect], now: float) -> None:
        """Effects the state returned (call after the server executed them)."""
        commenced: set[int] = set()
        completed: set[int] = set()
        synced: set[int] = set()
        for eff in effects:
            if isinstance(eff, Send):
                rec = state.peers.get(eff.peer_id)
                group = rec.group if rec is not None else 0
                self._on_send(eff.message, group, now, commenced, completed, synced)
            elif isinstance(eff, Event):
                kind = eviction_kind(eff.text)
                if kind is not None:
                    self.evictions.labels(reason=kind).inc()
                    self.counts["evictions"] += 1
                if eff.text.startswith("deadlock in peer group"):
                    self.deadlocks.inc()
                    self.counts["deadlocks"] += 1
            elif isinstance(eff, FastStart) and eff.op_seq not in commenced:
                # a speculative start the vote confirmed: started without a CollectiveCommence (or with
                # one under the same number, for voters that missed the reservation)
                commenced.add(eff.op_seq)
                self.started.inc()
                self.counts["collectives_started"] += 1
                self._vote_done(("collective", eff.group, eff.tag), now)
            elif isinstance(eff, Kick):
                pass  # counted through its "kicked:" event
        while self._completions and now - self._completions[0] > self.throughput_window:
            self._completions.popleft()

    def _on_send(self, msg: m.Message, group: int, now: float, commenced: set[int], completed: set[int],
                 synced: set[int]) -> None:
        if isinstance(msg, m.CollectiveCommence) and msg.op_seq not in commenced:
            commenced.add(msg.op_seq)
            self.started.inc()
            self.counts["collectives_started"] += 1
            self._vote_done(("collective", group, msg.tag), now)
        elif isinstance(msg, m.CollectiveComplete) and msg.op_seq not in completed:
            completed.add(msg.op_seq)
            self.completed.inc()
            self.counts["collectives_completed"] += 1
            self._completions.append(now)
        elif isinstance(msg, m.CollectiveAbort):
            if msg.op_seq < 0:
                if self._vote_start.pop(("collective", group, msg.tag), None) is not None:
                    self.failed.labels(stage="vote").inc()
                    self.counts["collectives_failed"] += 1
            elif msg.op_seq not in self._failed_ops:
                self._failed_ops.add(msg.op_seq)
                if len(self._failed_ops) > 4096:
                    self._failed_ops.clear()
                self.failed.labels(stage="running").inc()
                self.counts["collectives_failed"] += 1
        elif isinstance(msg, m.SharedStatePlan):
            self._vote_done(("sync", group, -1), now)
        elif isinstance(msg, m.SharedStateResult):
            self._vote_done(("sync", group, -1), now)
            if msg.success and msg.sync_seq not in synced:
                synced.add(msg.sync_seq)
                self.counts["syncs_completed"] += 1
        elif isinstance(msg, (m.EstablishP2P, m.MeasureBandwidth, m.TopologyResult)):
            self._vote_done(("topology", -1, -1), now)

    def _vote_done(self, key: tuple[str, int, int], now: float) -> None:
        t0 = self._vote_start.pop(key, None)
        if t0 is not None:
            self.vote_wait.labels(kind=key[0]).observe(max(0.0, now - t0))

    # --- reading ----------------------------------------------------------------------------------

    def throughput(self, now: float) -> float:
        """Collectives completed per second over the last ``throughput_window`` seconds."""
        recent = [t for t in self._completions if now - t <= self.throughput_window]
        return len(recent) / self.throughput_window

    def render(self, state: MasterState, now: float = 0.0) -> bytes:
        """The metrics in the Prometheus text format, gauges refreshed from ``state`` (``now``: the
        master's clock)."""
        by_phase = dict.fromkeys((p.value for p in Phase), 0)
        for rec in state.peers.values():
            by_phase[rec.phase.value] += 1
        for phase, n in by_phase.items():
            self.peers.labels(phase=phase).set(n)
        self.epoch.set(state.epoch)
        per_receiver = ((self.receiving, "bytes"), (self.receiving_total, "total"),
                        (self.receiving_chunks, "chunks"), (self.receiving_chunks_total, "chunks_total"),
                        (self.receiving_donors, "donors"), (self.receiving_donors_lost, "donors_lost"))
        for gauge, _ in per_receiver:
            gauge.clear()  # only the receivers of syncs running now
        for t in state.transfer_progress(now):
            for row in t["receivers"]:
                for gauge, field in per_receiver:
                    gauge.labels(peer=str(row["peer"])).set(row[field])
        return generate_latest(self.registry)

    def summary(self, now: float) -> dict[str, Any]:
        """The counts as plain numbers (for the JSON status)."""
        return {**self.counts, "collectives_per_second": self.throughput(now)}


__all__ = ["CONTENT_TYPE", "MasterObserver", "eviction_kind"]
