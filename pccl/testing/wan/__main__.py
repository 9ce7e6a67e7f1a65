"""``python -m pccl.testing.wan``: the emulator's self-test (see :mod:`pccl.testing.wan.selftest`)."""

from __future__ import annotations

import sys

from .selftest import main

sys.exit(main())
