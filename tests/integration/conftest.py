"""Fixtures of the GPU integration tests (they skip, with the reason, where a library or a device is
missing)."""

from __future__ import annotations

from typing import Any

import pytest

from pccl.testing.pytest_plugin import require_cupy


@pytest.fixture
def cp() -> Any:
    """cupy, or skip the test (a fixture, so that the skip is reported with its reason)."""
    return require_cupy()


@pytest.fixture(params=["torch", "cupy"])
def lib(request: pytest.FixtureRequest) -> str:
    """Which GPU library a test's GPU tensors come from; skips when it is unusable here."""
    if request.param == "cupy":
        require_cupy()
    else:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device for torch")
    return str(request.param)
