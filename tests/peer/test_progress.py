"""The progress display of long transfers (issue 37 item 5): its line, a line every 10 s without a
terminal and a last one at the end, nothing for a transfer shorter than a second, a tqdm bar on a
terminal. The clock is a fake."""

from __future__ import annotations

import io

from pccl.peer.progress import TransferProgress, progress_line


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


MiB = 1 << 20


def test_the_line_says_bytes_rate_and_eta() -> None:
    assert progress_line("x", 128 * MiB, 256 * MiB, 2.0) == \
        "x: 128.0 MiB / 256.0 MiB (50%), 64.0 MiB/s, ETA 2.0 s"
    assert progress_line("x", 256 * MiB, 256 * MiB, 4.0) == \
        "x: 256.0 MiB / 256.0 MiB (100%), 64.0 MiB/s, done in 4.0 s"
    assert progress_line("x", 0, 10, 0.0).endswith("ETA unknown")


def test_without_a_terminal_a_line_every_ten_seconds_and_one_at_the_end() -> None:
    out, clock = io.StringIO(), Clock()
    shown = TransferProgress("peer 1: shared state", stream=out, clock=clock)
    assert not shown.tty
    for step in range(1, 26):  # 25 s, 10 MiB/s
        clock.t += 1.0
        shown(step * 10 * MiB, 250 * MiB)
    lines = out.getvalue().splitlines()
    assert lines[0] == "peer 1: shared state: 10.0 MiB / 250.0 MiB (4%), 10.0 MiB/s, ETA 24.0 s"
    assert len(lines) == 4 and lines[1].startswith("peer 1: shared state: 110.0 MiB")  # at 1, 11, 21 s
    assert lines[-1].endswith("done in 25.0 s")


def test_a_short_transfer_shows_nothing() -> None:
    out, clock = io.StringIO(), Clock()
    shown = TransferProgress("x", stream=out, clock=clock)
    clock.t += 0.5
    shown(5, 10)
    clock.t += 0.2
    shown(10, 10)
    assert out.getvalue() == ""


def test_on_a_terminal_a_bar() -> None:
    out, clock = Tty(), Clock()
    shown = TransferProgress("peer 1: shared state", stream=out, clock=clock)
    assert shown.tty
    clock.t += 2.0
    shown(64 * MiB, 256 * MiB)
    clock.t += 2.0
    shown(256 * MiB, 256 * MiB)
    text = out.getvalue()
    assert "peer 1: shared state" in text and "256M/256M" in text and "100%" in text, text
