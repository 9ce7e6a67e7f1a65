"""pccl: fault-tolerant collective communications over plain TCP/IP, built on trio."""

from __future__ import annotations

from ._config import DEFAULT_MASTER_PORT, PROTOCOL_VERSION, MasterConfig, PeerConfig
from ._errors import (
    InvalidArgumentError,
    InvalidUsageError,
    KickedError,
    MasterConnectionError,
    PCCLError,
    PendingAsyncOpsError,
    RankConnectionFailedError,
    RankConnectionLostError,
    Result,
    SharedStateSyncError,
    TooFewPeersError,
    UpdateTopologyFailedError,
)
from ._types import (
    Attribute,
    DataType,
    DeviceType,
    DistributionHint,
    QuantizationAlgorithm,
    QuantizationOptions,
    ReduceInfo,
    ReduceOp,
    SharedStateSyncInfo,
    SharedStateSyncStrategy,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MASTER_PORT",
    "PROTOCOL_VERSION",
    "Attribute",
    "DataType",
    "DeviceType",
    "DistributionHint",
    "InvalidArgumentError",
    "InvalidUsageError",
    "KickedError",
    "MasterConfig",
    "MasterConnectionError",
    "PCCLError",
    "PeerConfig",
    "PendingAsyncOpsError",
    "QuantizationAlgorithm",
    "QuantizationOptions",
    "RankConnectionFailedError",
    "RankConnectionLostError",
    "ReduceInfo",
    "ReduceOp",
    "Result",
    "SharedStateSyncError",
    "SharedStateSyncInfo",
    "SharedStateSyncStrategy",
    "TooFewPeersError",
    "UpdateTopologyFailedError",
]
