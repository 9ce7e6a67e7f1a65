"""How many connections a peer stripes an operation over to one partner (pure: numbers in, numbers out).

One TCP connection carries at most its window per round trip. On Linux the window a sender can keep
in flight is bounded by its send buffer, at most ``tcp_wmem``'s maximum (4 MiB by default), and by
the receiver's window, about half of ``tcp_rmem``'s maximum; of the send buffer the kernel spends
about a third on bookkeeping: measured on the WAN emulator, one stream carries 446 Mbit/s at 50 ms
with a 4 MiB maximum, i.e. about 2/3 of the buffer in flight (:data:`WINDOW_USE` = 0.6 keeps a
margin). To carry ``B`` bytes per second over a round trip of ``rtt`` seconds a peer therefore needs
``ceil(B * rtt / (window * WINDOW_USE))`` connections (:func:`stripe_count`): enough windows to
cover the bandwidth-delay product.

``B`` is not known when the first connection to a partner opens (the bandwidth is only measured by
``optimize_topology()``, which the default must not need), but the round trip is. So
:class:`StripeSizer` starts from a guess, ``B`` = ``PeerConfig.p2p_stripe_target_mbit`` (1000
Mbit/s, and at least four connections where the link needs several, :func:`guess_count`: one
connection on a LAN or loopback, 4 at 50 ms, 5 at 100 ms), and then adapts to the throughput the
partner's large transfers actually reach (:meth:`StripeSizer.observe`):

* **the extra connections of the guess**, if any: **one fewer is tried once**, at the first counted
  transfer, unless it saw **random loss** (its connections retransmitted at least :data:`LOSSY` and
  less than :data:`CONGESTED` of their segments; then at the first counted transfer without it).
  Why four, and why loss keeps them: a connection that lost a segment carries less until the hole is
  repaired, and an operation's last frames wait for it; the extra connections, open and warm from
  the start, cost nothing to keep, where connections added once loss shows start slowly under it
  (docs/topology.md "At least four connections", with the measurements);
* **the link is slower** (the connections the windows need carried less than :data:`LOW_USE` of
  their windows per round trip): more connections than the bandwidth-delay product needs only
  overflow a shallow bottleneck queue together (measured, raw TCP at 200 Mbit/s and 100 ms over a
  queue of one bandwidth-delay product: one connection 92% of the wire, two 85%, five 84% with
  39,577 queue drops), so the count drops to what the observed throughput needs with
  :data:`HEADROOM`;
* **the stripe is window-bound** (the connections carried :data:`HIGH_USE` of their windows or
  more): the link may carry more, so the count grows (by at least one, to the observed need with
  :data:`HEADROOM`);
* anything between: the count fits, nothing changes.

The first transfer over new connections is not counted (their slow start, and the machine's warm-up,
are no measure of the link). A change is a **trial**: the observation after the next one decides
whether it stays (the first transfer after a change is not counted either: new connections start
slowly, and a connection that shared the link keeps its congestion control's estimate of a share for
a while: measured with bbr at 200 Mbit/s and 100 ms, the first 64 MiB over one connection after five
took 3.7-4.3 s, the later ones 3.0-3.3 s). A lower count stays unless
the throughput fell below :data:`KEEP_LOWER` of the one before (fewer connections cost less); a
higher count stays only if the throughput rose to :data:`KEEP_RAISE` of it or more. A trial that
fails goes back to the count before and bounds the search (a failed lowering raises the floor above
the count tried, a failed raise lowers the ceiling to the count before), so the count cannot
oscillate. Only observations that span at least :data:`MIN_RTTS` round trips count: a shorter
transfer's time is mostly latency and says nothing about the bandwidth.
"""

from __future__ import annotations

import math

__all__ = [
    "CONGESTED",
    "HEADROOM",
    "HIGH_USE",
    "KEEP_LOWER",
    "KEEP_RAISE",
    "LOSSY",
    "LOW_USE",
    "MIN_RTTS",
    "MIN_STRIPES",
    "WINDOW_USE",
    "StripeSizer",
    "guess_count",
    "stripe_count",
]

#: The share of the window (``tcp_wmem``'s maximum) one connection keeps in flight, with a margin.
WINDOW_USE = 0.6
#: A transfer must last this many round trips for its throughput to count.
MIN_RTTS = 8.0
#: Below this share of their windows per round trip, the connections were more than the link needs.
#: (At 1000 Mbit/s the WAN emulator's 2-peer all-reduces use 0.4-0.7, on a loaded machine down to
#: 0.26 in the first operations; at 200 Mbit/s five connections at 100 ms use at most 0.2.)
LOW_USE = 0.2
#: At or above this share, the connections were window-bound (more would carry more).
HIGH_USE = 0.95
#: The count the observed throughput needs is sized for this much more (on top of
#: :data:`WINDOW_USE`'s margin: one connection moves about 0.665 of the window per round trip).
HEADROOM = 1.1
#: A lowered count stays unless the throughput fell below this share of the one before.
KEEP_LOWER = 0.9
#: A raised count stays only if the throughput rose to at least this share of the one before.
KEEP_RAISE = 1.05
#: The fewest connections the first guess gives a partner that needs more than one (see
#: :func:`guess_count`).
MIN_STRIPES = 4
#: A transfer whose connections retransmitted at least this share of the segments they sent (and less
#: than :data:`CONGESTED`) saw random loss on the path (1% random loss each way on the WAN emulator:
#: 0.9-1.1% per operation, 2.2% once; its loss-free 1000 Mbit/s links mostly 0-0.4%).
LOSSY = 0.005
#: At or above this share the stripe itself overflowed a queue (the emulator's loss-free 1000 Mbit/s
#: links: 2.4-17% in the operations that overflowed it); random loss this high is not told apart.
CONGESTED = 0.02


def stripe_count(rtt_s: float, *, window_bytes: int, target_bytes_per_s: float, max_stripes: int) -> int:
    """The number of connections that keeps ``target_bytes_per_s`` in flight over ``rtt_s``.

    Args:
        rtt_s: the partner's measured round trip in seconds (<= 0 or NaN: unknown, one connection).
        window_bytes: the most one connection may have unacknowledged (the send buffer's maximum).
        target_bytes_per_s: the throughput to plan for.
        max_stripes: the upper bound (>= 1).

    Returns:
        A count in ``1..max_stripes``.
    """
    if max_stripes < 1:
        raise ValueError("max_stripes must be >= 1")
    if not rtt_s > 0 or window_bytes <= 0 or not target_bytes_per_s > 0:
        return 1
    need = target_bytes_per_s * rtt_s / (window_bytes * WINDOW_USE)
    if not math.isfinite(need):
        return max_stripes
    return max(1, min(max_stripes, math.ceil(need)))


def guess_count(rtt_s: float, *, window_bytes: int, target_bytes_per_s: float, max_stripes: int) -> int:
    """The first count for a partner: :func:`stripe_count`, and at least :data:`MIN_STRIPES` where
    that is more than one connection (a partner one connection covers, on loopback or a LAN, keeps
    one). :class:`StripeSizer` tries one fewer once the first transfer counted, and goes back to
    this one only if that was slower (see its docstring).

    Args and result as :func:`stripe_count`.
    """
    need = stripe_count(rtt_s, window_bytes=window_bytes, target_bytes_per_s=target_bytes_per_s,
                        max_stripes=max_stripes)
    return need if need <= 1 else min(max_stripes, max(need, MIN_STRIPES))


class StripeSizer:
    """The connection count for one partner: the round trip's guess, then adapted to the throughput
    its transfers reach (see the module docstring). No clock, no sockets: the pool reports each
    transfer's bytes, seconds and connections, and reads :attr:`count`.

    Args:
        rtt_s: the partner's round trip in seconds (the kernel's estimate on its first connection).
        window_bytes: the usable window of one connection (:func:`pccl.peer.ring_conn.tcp_window_max`).
        guess_bytes_per_s: the bandwidth assumed until a transfer shows otherwise
            (``p2p_stripe_target_mbit``).
        max_stripes: the upper bound (``p2p_max_stripes``, >= 1).
    """

    __slots__ = ("_need", "_probe", "_settling", "_trial", "ceiling", "count", "floor", "guess",
                 "max_stripes", "rate", "rtt_s", "window_bytes")

    def __init__(
        self, rtt_s: float, *, window_bytes: int, guess_bytes_per_s: float, max_stripes: int
    ) -> None:
        self.rtt_s = rtt_s
        self.window_bytes = window_bytes
        self.max_stripes = max_stripes
        #: the round trip's count (the guess at ``guess_bytes_per_s``): whether the partner is far
        self.guess = guess_count(rtt_s, window_bytes=window_bytes, target_bytes_per_s=guess_bytes_per_s,
                                 max_stripes=max_stripes)
        #: the connections the next operation stripes over
        self.count = self.guess
        #: the counts tried and found worse bound the search to ``floor..ceiling``
        self.floor = 1
        self.ceiling = max_stripes
        #: the throughput (bytes/s) of the last observation that counted (None: none yet)
        self.rate: float | None = None
        self._trial: tuple[int, float] | None = None  # (count before the trial, its throughput)
        # the count just changed: the next observation is not counted (nor the first: the first
        # transfer over new connections includes their slow start)
        self._settling = True
        # where the guess starts above the count the windows need (MIN_STRIPES): one fewer, tried once
        self._need = stripe_count(rtt_s, window_bytes=window_bytes, target_bytes_per_s=guess_bytes_per_s,
                                  max_stripes=max_stripes)
        self._probe: int | None = self.guess - 1 if self._need < self.guess else None

    def _per_rtt(self) -> float:
        """Bytes one connection keeps in flight per round trip."""
        return self.window_bytes * WINDOW_USE

    def use(self, rate: float, connections: int) -> float:
        """The share of their windows ``connections`` connections used per round trip at ``rate``."""
        return rate * self.rtt_s / (connections * self._per_rtt())

    def observe(self, nbytes: int, seconds: float, connections: int, retransmitted: float = 0.0) -> int:
        """One transfer to the partner: ``nbytes`` sent over ``connections`` in ``seconds`` (with no other
        transfer to it at the same time), of whose segments the share ``retransmitted`` was sent again
        (0 where unknown). Returns the count for the next operations (:attr:`count`).

        Ignored (the count unchanged): a transfer over another count than the current one (it started
        before the count changed), one shorter than :data:`MIN_RTTS` round trips, an unknown round
        trip or window, and the first one over new connections or after a change of the count.
        """
        if (connections != self.count or nbytes <= 0 or not self.rtt_s > 0 or self.window_bytes <= 0
                or not seconds >= MIN_RTTS * self.rtt_s or not math.isfinite(seconds)):
            return self.count
        if self._settling:
            self._settling = False
            return self.count
        rate = nbytes / seconds
        self.rate = rate
        trial, self._trial = self._trial, None
        if trial is not None:
            before, before_rate = trial
            if connections < before and rate < before_rate * KEEP_LOWER:
                self.floor = connections + 1  # fewer was worse: never this few again
                return self._change(before)
            if connections > before and rate < before_rate * KEEP_RAISE:
                self.ceiling = before  # more did not help: never more than before
                return self._change(before)
        use = self.use(rate, connections)
        need = math.ceil(rate * self.rtt_s * HEADROOM / self._per_rtt())
        probe = self._probe
        # the guess's extra connections (MIN_STRIPES) are not "more than the link needs": the link
        # is slower than assumed only if the count the windows need was underused
        if self.use(rate, min(connections, self._need)) < LOW_USE and connections > self.floor:
            new = max(self.floor, min(connections - 1, need))
        elif use >= HIGH_USE and connections < self.ceiling:
            new = min(self.ceiling, max(connections + 1, need))
        elif probe is not None and self.floor <= probe < connections:
            if LOSSY <= retransmitted < CONGESTED:
                return self.count  # random loss: the extra connections stay (tried again without loss)
            new = probe  # one of the guess's extra connections: tried without it, once
        else:
            return self.count
        self._probe = None
        self._trial = (connections, rate)
        return self._change(new)

    def _change(self, count: int) -> int:
        self.count = count
        self._settling = True
        return count

    def __repr__(self) -> str:
        return (f"StripeSizer(rtt={self.rtt_s * 1e3:.1f} ms, window={self.window_bytes}, count={self.count}, "
                f"range={self.floor}..{self.ceiling}, rate={self.rate})")
