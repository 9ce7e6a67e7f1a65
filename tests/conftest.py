"""Fixtures shared by the blocking-API and compatibility tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pccl import MasterNode


@pytest.fixture
def master() -> Iterator[MasterNode]:
    """A running master on 127.0.0.1 (port chosen by the system), stopped at teardown."""
    m = MasterNode("127.0.0.1:0")
    m.run()
    try:
        yield m
    finally:
        m.interrupt()
