"""The polling task of a communicator (pccl/peer/spin.py): when it polls, when it stops, who polls.

The spinner's budget runs on a clock the tests set by hand, and its give-way call is counted, so
every assertion is about passes made or not made; nothing depends on real time.
"""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from pccl import PeerConfig
from pccl.peer.spin import Spinner


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def passes_after(sp: Spinner, rounds: int = 20) -> int:
    """Let the spinner run for ``rounds`` scheduler passes of this task; its pass count then."""
    for _ in range(rounds):
        await trio.lowlevel.checkpoint()
    return sp.passes


def make(budget: float = 1e-3) -> tuple[Spinner, FakeTime, list[int]]:
    clock = FakeTime()
    ways: list[int] = []
    return Spinner(budget, now=clock, give_way=lambda: ways.append(1)), clock, ways


async def test_idle_spinner_does_not_poll() -> None:
    sp, _, ways = make()
    async with trio.open_nursery() as n:
        n.start_soon(sp.run)
        assert await passes_after(sp) == 0
        n.cancel_scope.cancel()
    assert ways == []


async def test_polls_while_an_operation_runs_and_stops_when_it_ends() -> None:
    sp, _, ways = make()
    async with trio.open_nursery() as n:
        n.start_soon(sp.run)
        sp.begin()
        busy = await passes_after(sp)
        assert busy >= 10  # about one pass per pass of this task
        assert len(ways) == busy  # every pass gave way to other runnable threads and processes
        sp.end()
        settled = await passes_after(sp, 2)
        assert await passes_after(sp) == settled  # blocked again: no further passes
        n.cancel_scope.cancel()


async def test_stops_after_its_budget_even_while_the_operation_runs() -> None:
    sp, clock, _ = make(budget=1e-3)
    async with trio.open_nursery() as n:
        n.start_soon(sp.run)
        sp.begin()
        assert await passes_after(sp) > 0
        clock.t += 0.9e-3
        before = sp.passes
        assert await passes_after(sp) > before  # still inside the budget
        clock.t += 0.2e-3  # 1.1 ms after the start
        settled = await passes_after(sp, 2)
        assert await passes_after(sp) == settled
        assert sp.inflight == 1
        # the next operation starts a new budget
        sp.begin()
        assert await passes_after(sp) > settled
        sp.end()
        sp.end()
        n.cancel_scope.cancel()


async def test_zero_budget_never_polls() -> None:
    sp, _, ways = make(budget=0.0)
    async with trio.open_nursery() as n:
        n.start_soon(sp.run)
        sp.begin()
        assert await passes_after(sp) == 0
        sp.end()
        n.cancel_scope.cancel()
    assert ways == []


async def test_no_polling_under_a_virtual_clock(autojump_clock: trio.testing.MockClock) -> None:
    sp, _, _ = make()
    async with trio.open_nursery() as n:
        n.start_soon(sp.run)
        sp.begin()
        assert await passes_after(sp) == 0
        # and the virtual clock still jumps (a polling task would keep it from doing so)
        start = trio.current_time()
        await trio.sleep(5)
        assert trio.current_time() - start == pytest.approx(5)
        sp.end()
        n.cancel_scope.cancel()


async def test_one_spinner_per_process_polls_at_a_time() -> None:
    a, _, _ = make()
    b, _, _ = make()
    async with trio.open_nursery() as n:
        n.start_soon(a.run)
        n.start_soon(b.run)
        a.begin()
        assert await passes_after(a) > 0
        b.begin()
        assert await passes_after(b) == 0  # a holds the process's token
        a.end()
        await passes_after(a, 3)
        b.end()
        b.begin()  # a released it: b's next operation polls
        assert await passes_after(b) > 0
        b.end()
        n.cancel_scope.cancel()


async def test_a_cancelled_spinner_releases_the_token() -> None:
    a, _, _ = make()
    b, _, _ = make()
    async with trio.open_nursery() as outer:
        outer.start_soon(b.run)
        async with trio.open_nursery() as n:
            n.start_soon(a.run)
            a.begin()
            assert await passes_after(a) > 0
            n.cancel_scope.cancel()  # a's communicator closes while it polls
        b.begin()
        assert await passes_after(b) > 0
        b.end()
        outer.cancel_scope.cancel()


def test_end_without_begin_is_a_bug() -> None:
    sp, _, _ = make()
    with pytest.raises(RuntimeError):
        sp.end()


@pytest.mark.parametrize("bad", [-1e-3, math.nan])
def test_bad_budgets_are_refused(bad: float) -> None:
    with pytest.raises(ValueError):
        Spinner(bad)
    with pytest.raises(ValueError):
        PeerConfig(spin_seconds=bad)


def test_default_budget() -> None:
    assert PeerConfig().spin_seconds == pytest.approx(1e-3)
