"""A userspace WAN emulator: hosts in network namespaces behind TUN devices, joined by links with
one-way delay, jitter, rate, a drop-tail queue and random loss (root only). See docs/testing.md."""

from __future__ import annotations

from .emulator import WanEmulator, WanUnavailable
from .link import LinkModel, LinkSpec
from .netns import unavailable_reason

__all__ = ["LinkModel", "LinkSpec", "WanEmulator", "WanUnavailable", "unavailable_reason"]
