"""Fixtures shared across the test packages (the blocking-API and compatibility tests' master, the
encoding counter of the shared-message tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pccl import MasterNode
from pccl.wire import messages as m
from pccl.wire import stream as stream_mod


@pytest.fixture
def master() -> Iterator[MasterNode]:
    """A running master on 127.0.0.1 (port chosen by the system), stopped at teardown."""
    m = MasterNode("127.0.0.1:0")
    m.run()
    try:
        yield m
    finally:
        m.interrupt()


@pytest.fixture
def encoded_types(monkeypatch: pytest.MonkeyPatch) -> list[type]:
    """The type of every message the streams encode from now on, in order (``pccl.wire.stream``'s
    ``encode`` wrapped): tests of messages shared by many receivers count that each is encoded once."""
    calls: list[type] = []

    def counting(msg: m.Message) -> bytes:
        calls.append(type(msg))
        return m.encode(msg)

    monkeypatch.setattr(stream_mod, "encode", counting)
    return calls
