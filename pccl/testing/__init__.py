"""Test harness for pccl: an in-memory virtual network driven by trio's clock (more to come).

Import what you need from here; each submodule keeps its own ``__all__``.
"""

from __future__ import annotations

from .network import (
    Close,
    Delay,
    Hook,
    HookAction,
    LinkConfig,
    NetworkStatistics,
    Reset,
    Stall,
    StreamStatistics,
    TrafficEvent,
    VirtualHost,
    VirtualListener,
    VirtualNetwork,
    VirtualStream,
    close_after,
    delay_after,
    reset_after,
    stall_after,
    trickle,
)

__all__ = [
    "Close",
    "Delay",
    "Hook",
    "HookAction",
    "LinkConfig",
    "NetworkStatistics",
    "Reset",
    "Stall",
    "StreamStatistics",
    "TrafficEvent",
    "VirtualHost",
    "VirtualListener",
    "VirtualNetwork",
    "VirtualStream",
    "close_after",
    "delay_after",
    "reset_after",
    "stall_after",
    "trickle",
]
