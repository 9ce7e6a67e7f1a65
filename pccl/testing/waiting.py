"""Waiting for a condition in a test: poll it, bounded, in the run's clock (virtual time under a
``trio.testing.MockClock``, so the wait costs no real time). A condition, never a delay."""

from __future__ import annotations

from collections.abc import Callable

import trio

__all__ = ["wait_until"]


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.0005) -> float:
    """Poll ``predicate`` every ``interval`` seconds (0: on every scheduling pass) until it holds.

    Returns:
        The seconds it took (in the run's clock).

    Raises:
        trio.TooSlowError: it did not hold within ``timeout``.
    """
    t0 = trio.current_time()
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)
    return trio.current_time() - t0
