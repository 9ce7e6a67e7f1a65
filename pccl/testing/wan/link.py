"""The model of one direction of an emulated WAN link (pure: time is an argument, no I/O).

A packet offered to a :class:`LinkModel` at time ``now`` is either dropped (random loss, or the
drop-tail queue is full) or given the time it leaves the far end of the link:

* **rate**: the link serializes one packet after another at ``rate_mbit`` (a token bucket one packet
  deep); ``busy_until`` is when the last admitted byte is on the wire.
* **drop-tail queue**: the bytes admitted but not yet serialized, ``(busy_until - now) * rate``, may
  not exceed ``queue_bytes`` (default one bandwidth-delay product of the round trip); a burst that
  does not fit keeps its head (the segments that fit) and loses its tail.
* **delay**: every packet then travels ``delay_ms`` (one way), plus a uniform jitter of
  ``+-jitter_ms``; packets never overtake each other (like netem with a rate).
* **loss**: each TCP segment (a GSO burst counts as its segments) is lost with probability ``loss``,
  independently; the gap between two losses is drawn from the geometric distribution, so the cost
  does not grow with the number of segments.

Sizes are IP bytes on the wire: a burst of ``k`` segments costs its length plus ``k - 1`` more
copies of its IP and TCP headers (what the segments would carry).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

__all__ = ["Admission", "LinkModel", "LinkSpec", "LinkStats"]


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """Settings of one direction of a link.

    Args:
        delay_ms: one-way propagation delay.
        jitter_ms: uniform jitter added to the delay (+-), without reordering.
        rate_mbit: serialization rate in Mbit/s (``None``: unlimited).
        queue_bytes: drop-tail queue limit in bytes (``None``: one bandwidth-delay product of
            ``rtt_ms``, at least 128 KiB).
        loss: probability that a segment is lost (0 <= loss < 1).
        rtt_ms: the round trip the default queue is sized for (``None``: twice ``delay_ms``).
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float | None = None
    queue_bytes: int | None = None
    loss: float = 0.0
    rtt_ms: float | None = None

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError("rate_mbit must be > 0 (or None for unlimited)")
        if self.queue_bytes is not None and self.queue_bytes < 1500:
            raise ValueError("queue_bytes must be >= 1500")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError("loss must be in [0, 1)")

    @property
    def bytes_per_s(self) -> float | None:
        """The rate in bytes per second (``None``: unlimited)."""
        return None if self.rate_mbit is None else self.rate_mbit * 1e6 / 8

    def queue_limit(self) -> float:
        """The drop-tail limit in bytes (infinite when the rate is unlimited)."""
        bps = self.bytes_per_s
        if bps is None:
            return math.inf
        if self.queue_bytes is not None:
            return float(self.queue_bytes)
        rtt_s = (self.rtt_ms if self.rtt_ms is not None else 2 * self.delay_ms) / 1000
        return max(bps * rtt_s, 128 * 1024.0)


@dataclass
class LinkStats:
    """Counters of one link direction."""

    packets: int = 0
    segments: int = 0
    bytes: int = 0
    lost_segments: int = 0
    queue_dropped_segments: int = 0


@dataclass(frozen=True)
class Admission:
    """What happens to one offered burst of ``segments`` segments.

    ``deliver_at`` is ``None`` when nothing gets through. Otherwise the segments whose indices are in
    ``kept`` (ascending runs ``(start, stop)``) leave the link at ``deliver_at``.
    """

    deliver_at: float | None
    kept: tuple[tuple[int, int], ...]


@dataclass
class LinkModel:
    """One direction of a link: rate, drop-tail queue, delay, jitter and loss (see the module doc)."""

    spec: LinkSpec
    rng: random.Random = field(default_factory=random.Random)
    busy_until: float = 0.0
    last_delivery: float = 0.0
    stats: LinkStats = field(default_factory=LinkStats)
    _until_loss: int = -1

    def set_spec(self, spec: LinkSpec) -> None:
        """Change the settings; packets already admitted keep their delivery time."""
        self.spec = spec
        self._until_loss = -1

    def _draw_gap(self) -> int:
        p = self.spec.loss
        if p <= 0.0:
            return 1 << 62
        u = 1.0 - self.rng.random()  # (0, 1]
        return int(math.log(u) / math.log1p(-p))

    def _lost_indices(self, segments: int) -> list[int]:
        """Indices of the segments (0..segments-1) that random loss takes."""
        if self.spec.loss <= 0.0:
            return []
        if self._until_loss < 0:
            self._until_loss = self._draw_gap()
        lost: list[int] = []
        pos = self._until_loss
        while pos < segments:
            lost.append(pos)
            pos += 1 + self._draw_gap()
        self._until_loss = pos - segments
        return lost

    def offer(self, now: float, segments: int, wire_bytes: int) -> Admission:
        """Offer a burst of ``segments`` segments costing ``wire_bytes`` on the wire at ``now``.

        Args:
            now: the current time in seconds (any monotonic origin).
            segments: how many TCP segments the burst carries (1 for a plain packet).
            wire_bytes: their total size on the wire, headers of every segment included.

        Returns:
            The :class:`Admission`: which segments get through and when they leave the link.
        """
        if segments < 1 or wire_bytes < 1:
            raise ValueError("a burst has at least one segment and one byte")
        st = self.stats
        st.packets += 1
        st.segments += segments
        lost = set(self._lost_indices(segments))
        st.lost_segments += len(lost)
        per_seg = wire_bytes / segments
        bps = self.spec.bytes_per_s
        if bps is None:
            fit = segments
        else:
            queued = max(0.0, self.busy_until - now) * bps
            room = self.spec.queue_limit() - queued
            fit = min(segments, max(0, int(room // per_seg)))
        st.queue_dropped_segments += segments - fit
        kept: list[tuple[int, int]] = []
        start: int | None = None
        n_kept = 0
        if not lost and fit:
            kept.append((0, fit))
            n_kept = fit
        for i in range(fit if lost else 0):
            if i in lost:
                if start is not None:
                    kept.append((start, i))
                    start = None
            else:
                n_kept += 1
                if start is None:
                    start = i
        if lost and start is not None:
            kept.append((start, fit))
        if bps is not None and fit:
            # Lost segments still took their turn on the wire (loss happens on the path);
            # queue-dropped ones never entered it.
            self.busy_until = max(self.busy_until, now) + per_seg * fit / bps
        if not kept:
            return Admission(None, ())
        st.bytes += int(per_seg * n_kept)
        leave = self.busy_until if bps is not None else now
        delay = self.spec.delay_ms / 1000
        if self.spec.jitter_ms > 0:
            delay += self.rng.uniform(-self.spec.jitter_ms, self.spec.jitter_ms) / 1000
        deliver = max(leave + max(0.0, delay), self.last_delivery)
        self.last_delivery = deliver
        return Admission(deliver, tuple(kept))
