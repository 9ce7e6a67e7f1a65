"""pccl.testing's GPU skip helper: a test that needs cupy skips with the reason, never errors."""

from __future__ import annotations

import sys
import types

import pytest

from pccl.testing.pytest_plugin import require_cupy


def _fake_cupy(count: int | Exception) -> types.ModuleType:
    def get_device_count() -> int:
        if isinstance(count, Exception):
            raise count
        return count

    runtime = types.SimpleNamespace(getDeviceCount=get_device_count)
    mod = types.ModuleType("cupy")
    mod.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return mod


def test_skips_when_cupy_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # "import cupy" raises ImportError
    with pytest.raises(pytest.skip.Exception, match="cupy"):
        require_cupy()


def test_skips_when_cupy_sees_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(0))
    with pytest.raises(pytest.skip.Exception, match="no CUDA device"):
        require_cupy()


def test_skips_when_the_driver_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(RuntimeError("cudaErrorNoDevice")))
    with pytest.raises(pytest.skip.Exception, match="cudaErrorNoDevice"):
        require_cupy()


def test_returns_cupy_when_a_device_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_cupy(1)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert require_cupy() is fake
