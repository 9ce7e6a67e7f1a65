"""A pacer for the bytes this peer serves to shared-state fetchers (pure: time is passed in).

``PeerConfig.state_serve_rate`` bounds the share of the uplink that serving a heal takes, so a member
that serves chunks while it trains keeps the rest for its collectives (issue 35 item 4). The bound must
hold over short times too, not only on average: a 1 MiB chunk released at once leaves at line rate and
fills the uplink's queue for as long as it takes (and a TCP connection idle between such bursts starts
each from a small window, overshooting the queue at its end), so the member's collectives on the same
uplink lose more than the capped share while it lasts. So the sender writes each chunk in **pieces** of
at most :attr:`RateCap.piece` bytes (16 to 64 KiB: about 10 ms of the rate) and takes each piece's
tokens before writing it; the bucket holds at most :attr:`RateCap.burst` (two pieces), so what leaves
this peer in any interval ``t`` is at most ``burst + rate * t``. The chunks (the fetcher's verification
units) stay as they are: this paces the sending, not the chunking. The trio side
(:func:`pccl.peer.shared_state.serve_state_requests`) sleeps :meth:`RateCap.take`'s answer before each
piece.
"""

from __future__ import annotations

import math

#: A piece is about this many seconds of the rate ...
PIECE_SECONDS = 0.01
#: ... and at least this many bytes (fewer wake-ups at low rates; 16 KiB leaves a 100 Mbit/s uplink in
#: 1.3 ms) ...
PIECE_MIN = 16 * 1024
#: ... and at most this many (at high rates a piece is still a short burst; 64 KiB: 5 ms at 100 Mbit/s).
PIECE_MAX = 64 * 1024


def piece_bytes(rate: float) -> int:
    """The piece size for ``rate`` bytes per second: :data:`PIECE_SECONDS` of it, within
    [:data:`PIECE_MIN`, :data:`PIECE_MAX`]."""
    return int(min(PIECE_MAX, max(PIECE_MIN, rate * PIECE_SECONDS)))


class RateCap:
    """At most ``rate`` bytes per second, released in pieces: over any interval of ``t`` seconds at
    most ``burst + rate * t`` bytes are granted.

    Args:
        rate: bytes per second (> 0, finite).
        piece: the largest write a sender makes under this cap (default :func:`piece_bytes`).
        burst: bytes that may go at once after a quiet time (default: two pieces).
    """

    def __init__(self, rate: float, burst: float | None = None, piece: int | None = None) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be > 0 bytes/s, not {rate}")
        self.rate = float(rate)
        self.piece = int(piece) if piece is not None else piece_bytes(self.rate)
        if self.piece <= 0:
            raise ValueError(f"piece must be > 0 bytes, not {piece}")
        self.burst = float(burst) if burst is not None else 2.0 * self.piece
        if not self.burst > 0:
            raise ValueError(f"burst must be > 0 bytes, not {burst}")
        self._tokens = self.burst
        self._at: float | None = None
        self.waited = 0.0  # seconds callers were told to wait, in all (statistics)

    def take(self, nbytes: int, now: float) -> float:
        """Account ``nbytes`` sent at ``now``; the seconds to wait before sending them (0: at once).

        The bytes are charged at once (the bucket may go negative): concurrent senders queue behind
        each other's debt instead of all waking together. A sender takes at most :attr:`piece` bytes
        at a time; more is allowed (charged the same way) but leaves as one burst.
        """
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.rate)
        self._at = now if self._at is None else max(self._at, now)
        self._tokens -= nbytes
        wait = 0.0 if self._tokens >= 0 else -self._tokens / self.rate
        self.waited += wait
        return wait


__all__ = ["PIECE_MAX", "PIECE_MIN", "RateCap", "piece_bytes"]
