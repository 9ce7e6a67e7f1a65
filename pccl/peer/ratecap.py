"""A token bucket for the bytes this peer serves to shared-state fetchers (pure: time is passed in).

``PeerConfig.state_serve_rate`` bounds the share of the uplink that serving a heal takes, so a member
that serves chunks while it trains keeps the rest for its collectives (issue 35 item 4). The trio side
sleeps :meth:`RateCap.take`'s answer before sending.
"""

from __future__ import annotations


class RateCap:
    """At most ``rate`` bytes per second on average, in bursts of at most ``burst`` bytes.

    Args:
        rate: bytes per second (> 0).
        burst: bytes that may go at once after a quiet time (default: a quarter second's worth, at
            least 1 MiB so that one chunk is never split).
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s, not {rate}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(rate / 4, float(1 << 20))
        self._tokens = self.burst
        self._at: float | None = None
        self.waited = 0.0  # seconds callers were told to wait, in all (statistics)

    def take(self, nbytes: int, now: float) -> float:
        """Account ``nbytes`` sent at ``now``; the seconds to wait before sending them (0: at once).

        The bytes are charged at once (the bucket may go negative): concurrent senders queue behind
        each other's debt instead of all waking together.
        """
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= nbytes
        wait = 0.0 if self._tokens >= 0 else -self._tokens / self.rate
        self.waited += wait
        return wait


__all__ = ["RateCap"]
