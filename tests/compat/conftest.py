"""Fixtures for the compatibility tests: a master on a free port, stopped at teardown."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pccl import MasterNode


@pytest.fixture
def master() -> Iterator[MasterNode]:
    """A running master on 127.0.0.1 (port chosen by the system)."""
    m = MasterNode("127.0.0.1:0")
    m.run()
    try:
        yield m
    finally:
        m.interrupt()
