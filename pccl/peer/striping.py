"""How many connections a peer stripes an operation over to one partner (pure: numbers in, a number out).

One TCP connection carries at most its window per round trip. On Linux the window a sender can keep
in flight is bounded by its send buffer, at most ``tcp_wmem``'s maximum (4 MiB by default), of which
the kernel spends about a third on bookkeeping: measured on the WAN emulator, one stream carries
446 Mbit/s at 50 ms with a 4 MiB maximum, i.e. about 2/3 of the buffer in flight
(:data:`WINDOW_USE` = 0.6 keeps a margin). To carry ``target`` bytes per second over a round trip of
``rtt`` seconds a peer therefore needs ``ceil(target * rtt / (window * WINDOW_USE))`` connections:
one on a LAN or loopback (the same as before), 3 at 50 ms and 5 at 100 ms for the default target of
1000 Mbit/s, never more than ``max_stripes``.
"""

from __future__ import annotations

import math

__all__ = ["WINDOW_USE", "stripe_count"]

WINDOW_USE = 0.6


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
