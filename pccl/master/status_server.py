"""The master's status port: ``/`` (HTML), ``/status`` (JSON) and ``/metrics`` (Prometheus).

:class:`StatusService` is the thin glue between :class:`~pccl.master.server.MasterServer` and the pure
parts: it feeds the :class:`~pccl.master.metrics.MasterObserver` and the :class:`~pccl.master.status.EventLog`
from what the server sees, and answers requests with :func:`~pccl.master.status.build_status` and friends.
"""

from __future__ import annotations

import json
import time

import trio

from ..wire import messages as m
from .http import Response
from .metrics import CONTENT_TYPE, MasterObserver
from .series import RunSeries
from .state import Effect, Event, MasterState
from .status import EventLog, build_status, render_html


class StatusService:
    """Observes one master and serves its status pages.

    Args:
        state: the master's state machine.
        address: a callable returning the master's ``HOST:PORT`` (known once it listens).
    """

    def __init__(self, state: MasterState, address: str = "") -> None:
        self.state = state
        self.address = address
        self.observer = MasterObserver()
        self.events = EventLog()
        self.series = RunSeries()  # the page's time series and transfers (pccl/master/series.py)
        self.started_at = trio.current_time()

    def on_message(self, peer_id: int, msg: m.Message, now: float) -> None:
        """A message from ``peer_id``, before the state handles it."""
        self.observer.on_message(self.state, peer_id, msg, now)
        self.series.on_message(self.state, peer_id, msg, now)

    def on_effects(self, effects: list[Effect]) -> None:
        """Record what the state decided (membership events, collectives, evictions)."""
        now = trio.current_time()
        wall = time.time()
        for eff in effects:
            if isinstance(eff, Event):
                self.events.add(eff.text, now, wall)
        self.observer.on_effects(self.state, effects, now)
        self.series.on_effects(self.state, effects, now)

    def snapshot(self) -> dict[str, object]:
        """The current ``/status`` document."""
        now = trio.current_time()
        snap = build_status(self.state, self.events.recent(), now, address=self.address,
                            uptime=now - self.started_at, counts=self.observer.summary(now))
        snap["series"] = self.series.export(now)
        return snap

    def route(self, path: str) -> Response | None:
        """Answer one GET."""
        if path == "/status":
            body = json.dumps(self.snapshot(), indent=1).encode()
            return Response(200, "application/json", body)
        if path == "/metrics":
            return Response(200, CONTENT_TYPE, self.observer.render(self.state, trio.current_time()))
        if path in ("/", "/index.html"):
            return Response(200, "text/html; charset=utf-8", render_html(self.snapshot()).encode())
        return None


__all__ = ["StatusService"]
