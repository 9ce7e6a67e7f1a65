"""pccl.torch tests: not collected where torch is not installed (pccl itself never needs it)."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py", "_*.py"]
