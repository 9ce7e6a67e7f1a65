"""Progress of long transfers on the terminal (a shared-state sync's fetch, a newcomer's join).

By default (``PeerConfig.progress``) a transfer that lasts more than a second shows a bar (tqdm) on
stderr when stderr is a terminal, else one line on stderr at most every 10 s and a last one at the end
(under ``pccl run``, whose peers write into a pipe, each line is prefixed with the peer's rank). The
line's text is :func:`progress_line`, pure.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

#: Seconds a transfer runs before its progress is shown (short ones stay quiet).
SHOW_AFTER = 1.0
#: Seconds between two progress lines when stderr is no terminal.
LINE_EVERY = 10.0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def progress_line(what: str, done: int, total: int, elapsed: float) -> str:
    """``"WHAT: 128.0 MiB / 256.0 MiB (50%), 85.3 MiB/s, ETA 1.5 s"`` (``"done in 3.0 s"`` at the end)."""
    pct = 100.0 * done / total if total > 0 else 100.0
    rate = done / elapsed if elapsed > 0 else 0.0
    head = f"{what}: {_size(done)} / {_size(total)} ({pct:.0f}%), {_size(rate)}/s"
    if done >= total:
        return f"{head}, done in {elapsed:.1f} s"
    if rate <= 0:
        return f"{head}, ETA unknown"
    return f"{head}, ETA {(total - done) / rate:.1f} s"


class TransferProgress:
    """A ``callback(bytes_done, bytes_total)`` that shows a transfer's progress.

    Args:
        what: what is transferred ("peer 3: shared state").
        stream: where it is shown (default ``sys.stderr``).
        tty: whether ``stream`` is a terminal (default: ask it).
        clock: seconds, monotonic (default ``time.monotonic``: the wall clock, also under a test's
            virtual clock, whose jumps would show transfers that took no time).
        show_after: seconds before anything is shown.
        every: seconds between lines (no terminal).
    """

    def __init__(self, what: str, *, stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, show_after: float = SHOW_AFTER,
                 every: float = LINE_EVERY) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.clock = clock
        self.show_after = show_after
        self.every = every
        self._start = clock()
        self._bar: Any = None
        self._shown = 0  # bytes the bar shows
        self._last_line = -float("inf")
        self.lines = 0  # lines written (no terminal)
        self.done = 0
        self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = self.clock()
        elapsed = now - self._start
        if elapsed < self.show_after and self._bar is None and not self.lines:
            return  # a short transfer shows nothing, not even its end
        if self.tty:
            self._update_bar(done, total)
        elif done >= total:
            if self.lines:
                self._line(elapsed)
        elif now - self._last_line >= self.every:
            self._last_line = now
            self._line(elapsed)

    def _update_bar(self, done: int, total: int) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self.what, unit="B", unit_scale=True, unit_divisor=1024,
                             file=self.stream, leave=True, dynamic_ncols=True)
            # The transfer began before the bar appeared: elapsed time and rate count from its start.
            self._bar.start_t -= self.clock() - self._start
        self._bar.update(done - self._shown)
        self._shown = done
        if done >= total:
            self.close()

    def _line(self, elapsed: float) -> None:
        try:
            self.stream.write(progress_line(self.what, self.done, self.total, elapsed) + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stderr must not fail the transfer
            pass
        self.lines += 1

    def close(self) -> None:
        """End the display (the bar stays on screen with its last state)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


__all__ = ["LINE_EVERY", "SHOW_AFTER", "TransferProgress", "progress_line"]
