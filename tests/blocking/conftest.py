"""Fixtures for the blocking-API tests: clusters of connected peers (the ``master`` fixture is in
tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from pccl.blocking import Communicator, MasterNode

from ._helpers import make_cluster


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
