"""Test harness for pccl: an in-memory virtual network driven by trio's clock, and an in-process
cluster harness with fault injection (see docs/testing.md).

Import what you need from here; each submodule keeps its own ``__all__``.
"""

from __future__ import annotations

from .cluster import (
    DEFAULT_MASTER_CONFIG,
    DEFAULT_PEER_CONFIG,
    MASTER,
    PeerStatus,
    TestCluster,
    UnsupportedFault,
    open_test_cluster,
)
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
from .plans import PlanError, check_pairing, plan_times, run_plans
from .streams import BareListener, BareStream, BareTransport, RecordingStream, open_stream_pair
from .tensors import tensor_bytes
from .waiting import wait_until

__all__ = [
    "DEFAULT_MASTER_CONFIG",
    "DEFAULT_PEER_CONFIG",
    "MASTER",
    "BareListener",
    "BareStream",
    "BareTransport",
    "Close",
    "Delay",
    "Hook",
    "HookAction",
    "LinkConfig",
    "NetworkStatistics",
    "PeerStatus",
    "PlanError",
    "RecordingStream",
    "Reset",
    "Stall",
    "StreamStatistics",
    "TestCluster",
    "TrafficEvent",
    "UnsupportedFault",
    "VirtualHost",
    "VirtualListener",
    "VirtualNetwork",
    "VirtualStream",
    "check_pairing",
    "close_after",
    "delay_after",
    "open_stream_pair",
    "open_test_cluster",
    "plan_times",
    "reset_after",
    "run_plans",
    "stall_after",
    "tensor_bytes",
    "trickle",
    "wait_until",
]
