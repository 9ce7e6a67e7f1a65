"""Where a benchmark's CPU went: a thread samples the CPU seconds of named processes (``/proc/PID/stat``,
all their threads) and of the whole machine (``/proc/stat``: every process, this benchmark's and
others') every ``period`` seconds, stamped with wall time, so that a window of the run (alone, during a
heal) can be told in cores used. Linux only; elsewhere it records nothing and reports nothing."""

from __future__ import annotations

import os
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (None: gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of stat)


def _machine_busy_seconds() -> float | None:
    """CPU seconds the machine spent busy (all CPUs: everything but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(cpu[:8]) - cpu[3] - cpu[4]) / _TICK


class CpuSampler:
    """Samples in a daemon thread until :meth:`stop`; :meth:`cores` tells a window's use.

    Args:
        period: seconds between samples.
    """

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self._pids: dict[str, list[int]] = {}
        self._samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")
        self._lock = threading.Lock()

    def watch(self, name: str, pid: int) -> None:
        """Count process ``pid`` under ``name`` (several pids may share one)."""
        with self._lock:
            self._pids.setdefault(name, []).append(pid)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last: dict[int, float] = {}  # a process that ended keeps its last reading
        while True:
            with self._lock:
                pids = {k: list(v) for k, v in self._pids.items()}
            row: dict[str, float] = {}
            busy = _machine_busy_seconds()
            if busy is not None:
                row["machine"] = busy
            for name, group in pids.items():
                total = 0.0
                for pid in group:
                    s = _proc_seconds(pid)
                    if s is not None:
                        last[pid] = s
                    total += last.get(pid, 0.0)
                row[name] = total
            self._samples.append((time.time(), row))
            if self._stop.wait(self.period):
                return

    def cores(self, t0: float, t1: float) -> dict[str, float]:
        """Cores each name used on average over wall times ``[t0, t1]`` (the samples nearest inside
        it); empty when there are too few samples."""
        inside = [(t, row) for t, row in self._samples if t0 <= t <= t1]
        if len(inside) < 2:
            return {}
        (ta, a), (tb, b) = inside[0], inside[-1]
        if tb <= ta:
            return {}
        # a name first seen inside the window (a process started in it) counts from zero
        return {k: (b[k] - a.get(k, 0.0)) / (tb - ta) for k in b}


__all__ = ["CpuSampler"]
