"""When a wait has gone on long enough to say so (no call waits silently; docs/concepts.md "Long waits").

Pure: no trio, no clock. Time is passed in. A :class:`WaitBoard` holds the waits in progress of one
process side (a peer's calls, the master's open votes); each wait is reported first ``first`` seconds after
it began and then at intervals that double, up to ``longest`` (5 s, 10 s, 20 s, 40 s, ... every 5 min), so
that a wait of a minute costs four lines and a wait of a day under three hundred. The trio adapters sleep
until :meth:`WaitBoard.next_deadline`, then log what :meth:`WaitBoard.due` returns at WARNING.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

#: Seconds before a wait is first reported.
FIRST_NOTICE = 5.0
#: The longest interval between two reports of one wait.
LONGEST_INTERVAL = 300.0

#: ``describe(waited_seconds)``: the sentence that says what is awaited and who could end it (None:
#: nothing to say this time, e.g. the call is moving data rather than waiting).
Describe = Callable[[float], "str | None"]


def format_wait(seconds: float) -> str:
    """``seconds`` in words a log reader takes in at a glance: "12 s", "3 min 5 s", "2 h 4 min"."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


@dataclass
class _Wait:
    began: float
    due: float
    interval: float
    describe: Describe


class WaitBoard:
    """The waits in progress and when each is to be reported next.

    Args:
        first: seconds before the first report of a wait.
        longest: cap of the doubling interval between reports.
    """

    def __init__(self, *, first: float = FIRST_NOTICE, longest: float = LONGEST_INTERVAL) -> None:
        if not 0 < first <= longest:
            raise ValueError(f"need 0 < first ({first}) <= longest ({longest})")
        self.first = first
        self.longest = longest
        self._waits: dict[Hashable, _Wait] = {}
        self.reported = 0  # reports made, over the board's life (tests, statistics)

    def __len__(self) -> int:
        return len(self._waits)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._waits

    def keys(self) -> list[Hashable]:
        """The keys of the waits in progress."""
        return list(self._waits)

    def begin(self, key: Hashable, describe: Describe, now: float) -> None:
        """A wait under ``key`` begins now (replaces one under the same key: it begins anew)."""
        self._waits[key] = _Wait(began=now, due=now + self.first, interval=self.first, describe=describe)

    def end(self, key: Hashable) -> None:
        """The wait under ``key`` is over (no error when there is none)."""
        self._waits.pop(key, None)

    def waited(self, key: Hashable, now: float) -> float | None:
        """Seconds the wait under ``key`` has lasted (None: no such wait)."""
        w = self._waits.get(key)
        return None if w is None else now - w.began

    def next_deadline(self) -> float | None:
        """When the next report is due (None: no wait in progress)."""
        return min((w.due for w in self._waits.values()), default=None)

    def due(self, now: float) -> list[str]:
        """The reports due at ``now`` (each wait at most once), and the schedule moved on for them."""
        out = []
        for w in self._waits.values():
            if now >= w.due:
                line = w.describe(now - w.began)
                if line is not None:
                    out.append(line)
                w.interval = min(w.interval * 2, self.longest)
                w.due = now + w.interval
        self.reported += len(out)
        return out


__all__ = ["FIRST_NOTICE", "LONGEST_INTERVAL", "Describe", "WaitBoard", "format_wait"]
