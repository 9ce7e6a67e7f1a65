"""Fixtures for the blocking-API tests: a master on port 0 and clusters of connected peers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from pccl.blocking import Communicator, MasterNode

from ._helpers import make_cluster


@pytest.fixture
def master() -> Iterator[MasterNode]:
    """A master on 127.0.0.1 with a system-chosen port."""
    m = MasterNode("127.0.0.1:0")
    m.run()
    try:
        yield m
    finally:
        m.interrupt()


@pytest.fixture
def cluster_factory(master: MasterNode) -> Iterator[Callable[..., list[Communicator]]]:
    """``cluster_factory(n, groups=None)`` connects n peers to ``master``; all are closed at teardown."""
    made: list[Communicator] = []

    def factory(n: int, groups: Sequence[int] | None = None) -> list[Communicator]:
        comms = make_cluster(master.address, n, groups)
        made.extend(comms)
        return comms

    yield factory
    for c in made:
        c.close()


@pytest.fixture
def pair(cluster_factory: Callable[..., list[Communicator]]) -> list[Communicator]:
    """Two connected peers in group 0."""
    return cluster_factory(2)


@pytest.fixture
def master_address(master: MasterNode) -> str:
    """``"HOST:PORT"`` of the ``master`` fixture."""
    return master.address
