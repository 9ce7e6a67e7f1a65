"""Helpers for the blocking-API tests: clusters of peers, each peer used from its own thread.

Written the way a user of the established library writes code: ``MasterNode`` / ``Communicator`` /
``connect`` / ``are_peers_pending`` / ``update_topology``, no trio in sight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import pytest

from pccl import PeerConfig
from pccl.blocking import Communicator

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Thunk(Protocol[T_co]):
    """Anything callable with no arguments, ``lambda r=r: ...`` included.

    Such a lambda's default only binds a loop value; mypy cannot infer it against ``Callable[[], T]``
    (the parameter counts differ), but it can against this protocol's ``__call__``.
    """

    def __call__(self) -> T_co: ...


#: Upper bound on any thread a test waits for: a hang fails the test instead of blocking the suite.
JOIN_TIMEOUT = 30.0


def run_threads(fns: Sequence[Thunk[T]], timeout: float = JOIN_TIMEOUT) -> list[T]:
    """Run each callable in its own thread, concurrently; return their results in order.

    The first exception raised by any of them is re-raised here; a thread still running after ``timeout``
    fails the test.
    """
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    if hung:
        pytest.fail(f"thread(s) {hung} still running after {timeout}s")
    for e in errors:
        if e is not None:
            raise e
    return results


def admit(accepted: Sequence[Communicator]) -> None:
    """Every accepted peer (each in its own thread) waits for a pending peer, then votes to admit it.

    ``are_peers_pending`` is a collective vote, so all accepted peers see the same answer in the same round.
    """

    def one(c: Communicator) -> None:
        while not c.are_peers_pending():
            pass
        c.update_topology()

    run_threads([lambda c=c: one(c) for c in accepted])


def make_cluster(address: str, n: int, groups: Sequence[int] | None = None,
                 config: PeerConfig | None = None) -> list[Communicator]:
    """Connect ``n`` peers one by one (the first is accepted alone, the others are admitted by a vote)."""
    groups = list(groups) if groups is not None else [0] * n
    comms: list[Communicator] = []
    try:
        for i in range(n):
            c = Communicator(address, groups[i], config=config)
            if comms:
                connecting = threading.Thread(target=c.connect, daemon=True)
                connecting.start()
                admit(comms)
                connecting.join(JOIN_TIMEOUT)
                assert not connecting.is_alive(), "connect() did not return after update_topology()"
            else:
                c.connect()
            comms.append(c)
    except BaseException:
        for c in comms:
            c.close()
        raise
    return comms


def wait_until(cond: Callable[[], bool]) -> None:
    """Block until ``cond()`` holds (bounded by JOIN_TIMEOUT); an event, not a timing."""
    done = threading.Event()
    for _ in range(int(JOIN_TIMEOUT / 0.002)):
        if cond():
            return
        done.wait(0.002)
    pytest.fail("the condition never held")
