"""The WAN emulator's self-test: ``python -m pccl.testing.wan [--rtt-ms 50] [--rate-mbit 1000]``.

Three checks between two hosts: the ping round trip is the target within 0.5 ms; one TCP stream is
window-limited (below the link rate when ``tcp_wmem``'s maximum cannot cover the bandwidth-delay
product); eight streams get near the rate (at least ``--min-fill`` of it). Each check reports what
it measured; the result says which failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from .emulator import WanEmulator

__all__ = ["SelfTestResult", "main", "run_selftest"]


@dataclass
class SelfTestResult:
    """What the self-test measured and which checks passed."""

    rtt_target_ms: float
    rtt_ms: float | None
    rate_mbit: float
    one_stream_mbit: float
    window_bound_mbit: float
    eight_streams_mbit: float
    min_fill: float
    forwarder_late_ms: float

    @property
    def rtt_ok(self) -> bool:
        return self.rtt_ms is not None and abs(self.rtt_ms - self.rtt_target_ms) <= 0.5

    @property
    def one_stream_ok(self) -> bool:
        # window-limited: well below the rate, and not above what the window allows
        one = self.one_stream_mbit
        return one < 0.9 * self.rate_mbit and one <= 1.15 * self.window_bound_mbit

    @property
    def eight_streams_ok(self) -> bool:
        return self.eight_streams_mbit >= self.min_fill * self.rate_mbit

    @property
    def ok(self) -> bool:
        return self.rtt_ok and self.one_stream_ok and self.eight_streams_ok

    def table(self) -> str:
        def mark(ok: bool) -> str:
            return "ok" if ok else "FAIL"

        return "\n".join([
            f"ping RTT        {self.rtt_ms if self.rtt_ms is None else round(self.rtt_ms, 2)} ms "
            f"(target {self.rtt_target_ms} +- 0.5)  {mark(self.rtt_ok)}",
            f"1 TCP stream    {self.one_stream_mbit:.0f} Mbit/s (window bound ~{self.window_bound_mbit:.0f}, "
            f"rate {self.rate_mbit:.0f})  {mark(self.one_stream_ok)}",
            f"8 TCP streams   {self.eight_streams_mbit:.0f} Mbit/s (>= {self.min_fill:.0%} of "
            f"{self.rate_mbit:.0f})  {mark(self.eight_streams_ok)}",
            f"forwarder: worst delivery lateness {self.forwarder_late_ms:.2f} ms",
        ])


def _probe(wan: WanEmulator, host: int, *args: str) -> subprocess.Popen[str]:
    return wan.popen(host, [sys.executable, "-m", "pccl.testing.wan.probe", *args],
                     stdout=subprocess.PIPE, text=True)


def _streams(wan: WanEmulator, n: int, seconds: float, port: int) -> float:
    sink = _probe(wan, 1, "sink", str(port), str(n), str(seconds))
    time.sleep(0.3)  # the sink binds; the source retries below if it has not yet
    for _ in range(50):
        src = _probe(wan, 0, "source", wan.addresses[1], str(port), str(n), str(seconds))
        if src.wait(timeout=seconds + 30) == 0:
            break
        time.sleep(0.1)
    out, _ = sink.communicate(timeout=seconds + 30)
    return float(json.loads(out)["mbit"])


def _wmem_max() -> int:
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        return int(f.read().split()[2])


def run_selftest(rtt_ms: float = 50.0, rate_mbit: float = 1000.0, seconds: float = 6.0,
                 min_fill: float = 0.8) -> SelfTestResult:
    """Run the three checks on a fresh two-host emulator (root only)."""
    with WanEmulator(2) as wan:
        wan.set_pair(0, 1, rtt_ms=rtt_ms, rate_mbit=rate_mbit)
        ping = _probe(wan, 0, "ping", wan.addresses[1], "20")
        out, _ = ping.communicate(timeout=60)
        rtt = json.loads(out)["median_ms"]
        wan.stats()
        one = _streams(wan, 1, seconds, 9001)
        eight = _streams(wan, 8, seconds, 9002)
        late = float(wan.stats()["max_lateness_ms"])
    # Linux gives about half of the send buffer to payload (tcp_adv_win_scale / skb overhead)
    bound = _wmem_max() * 8 / (rtt_ms / 1000) / 1e6
    return SelfTestResult(rtt_ms, rtt, rate_mbit, one, bound, eight, min_fill, late)


def main(argv: list[str] | None = None) -> int:
    """CLI: run the self-test, print what it measured; exit 0 when every check passed."""
    ap = argparse.ArgumentParser(prog="python -m pccl.testing.wan", description=__doc__)
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=6.0, help="duration of each TCP test")
    ap.add_argument("--min-fill", type=float, default=0.8, help="8 streams must reach this share of the rate")
    a = ap.parse_args(argv)
    from .netns import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    res = run_selftest(a.rtt_ms, a.rate_mbit, a.seconds, a.min_fill)
    print(f"WAN emulator self-test: RTT {a.rtt_ms} ms, {a.rate_mbit} Mbit/s, queue 1 BDP "
          f"(load average {os.getloadavg()[0]:.1f})")
    print(res.table())
    return 0 if res.ok else 1
