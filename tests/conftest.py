"""Fixtures shared across the test packages (the blocking-API and compatibility tests' master, the
encoding counter of the shared-message tests)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from pccl import MasterNode
from pccl.wire import messages as m
from pccl.wire import stream as stream_mod

_STATE_DIR: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Masters keep their member-token key in a per-user state file by default
    (pccl/master/token_key.py): the tests' masters keep theirs in a directory of this session (inherited
    by the processes they start), not in the user's home."""
    global _STATE_DIR
    if "PCCL_STATE_DIR" not in os.environ:
        _STATE_DIR = tempfile.mkdtemp(prefix="pccl-test-state-")
        os.environ["PCCL_STATE_DIR"] = _STATE_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    if _STATE_DIR is not None:
        shutil.rmtree(_STATE_DIR, ignore_errors=True)
        os.environ.pop("PCCL_STATE_DIR", None)


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
