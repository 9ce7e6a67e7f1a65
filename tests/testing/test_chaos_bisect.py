"""scripts/chaos_bisect.py's search, on made-up traces: every change is found, with few runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos_bisect.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chaos_bisect", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


cb = _load()

Trace = list[tuple[float, str]]


class FakeRunner:
    """Traces by point index: the run at point i has every event of ``base``, with each change at or before
    i applied (a change moves one event's time); counts the full and the stopped runs."""

    def __init__(self, n: int, changes: dict[int, tuple[int, float]]) -> None:
        self.base: Trace = [(float(t), f"event {t}") for t in range(50)]
        self.n = n
        self.changes = changes  # point index -> (event index, new time)
        self.full_runs = 0
        self.stopped_runs = 0

    def full(self, i: int) -> Trace:
        events = list(self.base)
        for at, (k, t) in sorted(self.changes.items()):
            if at <= i:
                events[k] = (t, events[k][1])
        return sorted(events)

    def trace(self, point: object, seed: int, until: float | None = None) -> Trace:
        i = int(point)  # type: ignore[call-overload]
        if until is None:
            self.full_runs += 1
            return self.full(i)
        self.stopped_runs += 1
        return [e for e in self.full(i) if e[0] <= until]


def _search(n: int, changes: dict[int, tuple[int, float]], **kwargs: object) -> tuple[list[int], FakeRunner]:
    runner = FakeRunner(n, changes)
    found = cb.changes(runner, list(range(n)), seed=0, **kwargs)
    return [i for i, _ in found], runner


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {37: (10, 10.5)},
        {1: (3, 3.5), 73: (40, 40.5)},
        # an early change, and one later in the range that only moves a late event: found as well
        {20: (5, 5.5), 30: (45, 45.5)},
        # a late-only change before an early one
        {10: (45, 45.5), 40: (5, 5.5)},
        {5: (1, 1.5), 6: (2, 2.5), 7: (3, 3.5)},
    ],
)
@pytest.mark.parametrize("prefixes", [True, False])
def test_every_change_found(changes: dict[int, tuple[int, float]], prefixes: bool) -> None:
    found, _ = _search(74, changes, prefixes=prefixes)
    assert found == sorted(changes)


def test_first_difference_and_part_time() -> None:
    a: Trace = [(1.0, "x"), (2.0, "y"), (3.0, "z")]
    b: Trace = [(1.0, "x"), (2.5, "y"), (3.0, "z")]
    assert cb.first_difference(a, a) is None
    assert cb.first_difference(a, b) is not None
    assert cb.part_time(a, b) == 2.0  # the entries up to 2.0 differ: one has y there, the other not
    assert [e for e in a if e[0] <= 2.0] != [e for e in b if e[0] <= 2.0]
    assert cb.part_time(a, a[:2]) == 3.0  # one trace ends early
    assert "ends" in cb.first_difference(a, a[:2])


def test_a_hint_saves_bisection_steps() -> None:
    changes = {41: (10, 10.5)}
    _, plain = _search(74, changes)
    found, hinted = _search(74, changes, hints=frozenset({41}))
    assert found == [41]
    assert hinted.stopped_runs < plain.stopped_runs
    # a wrong hint costs a run or two and finds the change all the same
    found, _ = _search(74, changes, hints=frozenset({12}))
    assert found == [41]


def test_parse_seeds() -> None:
    assert cb.parse_seeds("0-2,5") == [0, 1, 2, 5]
    assert cb.parse_seeds("3") == [3]
