"""The serving rate cap (PeerConfig.state_serve_rate): a token bucket, time passed in."""

from __future__ import annotations

import pytest

from pccl.peer.ratecap import RateCap

MIB = 1 << 20


def test_a_burst_goes_at_once_then_the_rate_holds() -> None:
    cap = RateCap(MIB, burst=2 * MIB)
    assert cap.take(MIB, 0.0) == 0.0 and cap.take(MIB, 0.0) == 0.0  # the burst
    assert cap.take(MIB, 0.0) == pytest.approx(1.0)  # one second's worth behind
    assert cap.take(MIB, 0.0) == pytest.approx(2.0)  # concurrent senders queue behind each other
    assert cap.take(MIB, 10.0) == 0.0  # refilled (up to the burst) after a quiet time
    assert cap.take(2 * MIB, 10.0) == pytest.approx(1.0)
    assert cap.waited == pytest.approx(4.0)


def test_over_a_long_run_the_average_is_the_rate() -> None:
    cap = RateCap(3 * MIB)
    now = 0.0
    for _ in range(300):
        now += cap.take(MIB, now)
    assert now == pytest.approx(300 / 3 - cap.burst / (3 * MIB), rel=1e-9)


def test_bad_rates_are_refused() -> None:
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            RateCap(bad)
