"""Own stalls are not the other side's silence (pure: times are passed in, no trio, no clock).

A heartbeat watchdog sleeps until a deadline and then judges how long the other side has been silent.
When this process itself did not run for a while (an overloaded host: at load 15-20 on 2 cores a process
that sleeps 10 ms sometimes wakes 1.4 s later; a long synchronous call in its event loop), the watchdog's
wake is late, and the other side's messages of that time sit unread in the socket buffer: the reader task
has not run yet either. Judged then, every partner looks silent at once (a master evicted all its peers
with "silent for more than 3s" and the run failed, although each had sent its heartbeats).

:class:`StallCredit` notices a wake later than planned (by more than :data:`MIN_STALL`) and credits the
whole sleep that ended in it: the process ran when it planned the wake and may have stopped any time
after (so a watchdog should not sleep much longer than a heartbeat interval at a time). For ``window``
seconds after the stall the silence judged is the silence less the credit, so the readers get to run
and bring the heartbeats in. A partner really gone is declared at most the credit later than otherwise
(once the window ends, silence counts in full again).
"""

from __future__ import annotations

__all__ = ["MIN_STALL", "StallCredit"]

#: A wake later than planned by at most this is scheduling noise, not a stall.
MIN_STALL = 0.1


class StallCredit:
    """How much of a partner's silence is this process's own stall (see the module docstring).

    Args:
        window: seconds after a stall during which it is credited (a heartbeat timeout: the readers
            run long before, and a partner gone during the stall is declared once it ends).
    """

    def __init__(self, window: float) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0, not {window}")
        self.window = window
        self._planned: float | None = None
        self._planned_at = 0.0
        self._credit = 0.0
        self._until = 0.0
        self.last_stall = 0.0  # seconds of the latest stall noticed (0: none yet)
        self.stalls_total = 0

    def plan(self, wake: float, now: float) -> None:
        """The watchdog means to wake at ``wake`` (``now``: when it plans; a wake already past is now)."""
        self._planned = max(wake, now)
        self._planned_at = now

    def woke(self, now: float) -> float:
        """The watchdog woke at ``now``: the stall credited (the whole sleep since the plan when the
        wake is later than planned by more than :data:`MIN_STALL`, else 0). A wake before the plan
        (something woke it early) is no stall."""
        planned, self._planned = self._planned, None
        if planned is None or not now - planned > MIN_STALL:
            return 0.0
        stall = now - self._planned_at
        self._credit = self.credit(now) + stall
        self._until = now + self.window
        self.last_stall = stall
        self.stalls_total += 1
        return stall

    def credit(self, now: float) -> float:
        """Seconds of silence not to count at ``now`` (0 once the window after the last stall ended)."""
        return self._credit if now < self._until else 0.0

    def until(self, now: float) -> float | None:
        """When the credit ends (a deadline to judge again at), or None when none is held at ``now``."""
        return self._until if self.credit(now) > 0 else None
