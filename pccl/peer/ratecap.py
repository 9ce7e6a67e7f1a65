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

**Yielding to the member's own collectives** (``PeerConfig.state_serve_idle_rate``): a cap may have two
rates, ``rate`` while one of this peer's collectives moves data (its data plane: the uplink is what the
collective waits on) and a larger ``idle_rate`` between them (the master round trip that ends each
collective, a sync's hashing, a real step's compute: the uplink idles). The owner reports
:meth:`RateCap.collective_started` and :meth:`RateCap.collective_ended`; tokens accrue at the rate in
force over each interval, so a debt taken at the idle rate is repaid at ``rate`` once a collective starts
(the sender's wait grows: :meth:`RateCap.wait` answers again after a change). ``rate`` > 0 is the floor:
a donor whose collectives never pause still serves at it, so a heal always ends.
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
    most ``burst + rate * t`` bytes are granted (with an ``idle_rate``: at most ``burst`` plus the
    integral of the rate in force, ``idle_rate`` while no collective of this peer runs).

    Args:
        rate: bytes per second (> 0, finite); with ``idle_rate``, the rate while a collective runs.
        burst: bytes that may go at once after a quiet time (default: two pieces).
        piece: the largest write a sender makes under this cap (default :func:`piece_bytes` of
            ``rate``: small pieces, so a collective that starts finds little of ours queued).
        idle_rate: bytes per second while none of this peer's collectives runs (>= ``rate``,
            finite); None: ``rate`` always.
    """

    def __init__(self, rate: float, burst: float | None = None, piece: int | None = None,
                 idle_rate: float | None = None) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be > 0 bytes/s, not {rate}")
        if idle_rate is not None and not (idle_rate >= rate and math.isfinite(idle_rate)):
            raise ValueError(f"idle_rate must be >= rate ({rate}) and finite, not {idle_rate}")
        self.rate = float(rate)
        self.idle_rate = float(idle_rate) if idle_rate is not None else self.rate
        self.piece = int(piece) if piece is not None else piece_bytes(self.rate)
        if self.piece <= 0:
            raise ValueError(f"piece must be > 0 bytes, not {piece}")
        self.burst = float(burst) if burst is not None else 2.0 * self.piece
        if not self.burst > 0:
            raise ValueError(f"burst must be > 0 bytes, not {burst}")
        self._tokens = self.burst
        self._at: float | None = None
        self.running = 0  # this peer's collectives moving data now
        self.waited = 0.0  # seconds callers were told to wait, in all (statistics)
        self.busy_seconds = 0.0  # time spent with a collective running, since the first report
        self._busy_since: float | None = None

    @property
    def yields(self) -> bool:
        """Whether the rate depends on this peer's collectives (an ``idle_rate`` above ``rate``)."""
        return self.idle_rate > self.rate

    @property
    def rate_now(self) -> float:
        """The rate in force: ``rate`` while a collective runs, else ``idle_rate``."""
        return self.rate if self.running else self.idle_rate

    def _accrue(self, now: float) -> None:
        """Credit the tokens earned since the last reading at the rate in force (a late reading earns
        nothing)."""
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.rate_now)
        self._at = now if self._at is None else max(self._at, now)

    def take(self, nbytes: int, now: float) -> float:
        """Account ``nbytes`` sent at ``now``; the seconds to wait before sending them (0: at once), at
        the rate in force now (a change of it: ask :meth:`wait` again).

        The bytes are charged at once (the bucket may go negative): concurrent senders queue behind
        each other's debt instead of all waking together. A sender takes at most :attr:`piece` bytes
        at a time; more is allowed (charged the same way) but leaves as one burst.
        """
        self._accrue(now)
        self._tokens -= nbytes
        wait = self.wait(now)
        self.waited += wait
        return wait

    def wait(self, now: float) -> float:
        """The seconds until the debt is repaid at the rate in force (0: none), without charging."""
        self._accrue(now)
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate_now

    def collective_started(self, now: float) -> bool:
        """One of this peer's collectives starts moving data. True when the rate in force changed (a
        sender waiting should ask :meth:`wait` again; the kernel's pacing follows :attr:`rate_now`)."""
        self._accrue(now)  # what was earned until now, at the rate that was in force
        self.running += 1
        if self.running == 1:
            self._busy_since = now
        return self.running == 1 and self.yields

    def collective_ended(self, now: float) -> bool:
        """One of this peer's collectives stopped moving data (however it ended). True when the rate
        in force changed. More ends than starts is a bug of the caller: refused."""
        if self.running <= 0:
            raise ValueError("collective_ended without a collective running")
        self._accrue(now)
        self.running -= 1
        if self.running == 0 and self._busy_since is not None:
            self.busy_seconds += max(0.0, now - self._busy_since)
            self._busy_since = None
        return self.running == 0 and self.yields


__all__ = ["PIECE_MAX", "PIECE_MIN", "RateCap", "piece_bytes"]
