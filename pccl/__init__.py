"""pccl: fault-tolerant collective communications over plain TCP/IP, built on trio."""

from __future__ import annotations

from . import _pccl as _pccl
from . import cuda
from ._config import DEFAULT_MASTER_PORT, PROTOCOL_VERSION, MasterConfig, PeerConfig
from ._env import apply_log_level as _apply_log_level
from ._errors import (
    InvalidArgumentError,
    InvalidBufferError,
    InvalidUsageError,
    KickedError,
    MasterConnectionError,
    NoSharedStateAvailableError,
    PCCLError,
    PendingAsyncOpsError,
    RankConnectionFailedError,
    RankConnectionLostError,
    Result,
    SharedStateSyncError,
    TooFewPeersError,
    TopologyOptimizationFailedError,
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
from .blocking import (
    AsyncReduceHandle,
    Communicator,
    MasterNode,
    ReduceDescriptor,
    ReduceOpDescriptor,
    ReduceOperandDescriptor,
)
from .master.server import MasterHandle, open_master, serve_master
from .peer.communicator import Communicator as AsyncCommunicator
from .peer.communicator import open_communicator
from .peer.shared_state import SharedState, TensorInfo

__version__ = "0.1.0"

_apply_log_level()  # PCCL_LOG_LEVEL, when set

__all__ = [
    "DEFAULT_MASTER_PORT",
    "PROTOCOL_VERSION",
    "AsyncCommunicator",
    "AsyncReduceHandle",
    "Attribute",
    "Communicator",
    "DataType",
    "DeviceType",
    "DistributionHint",
    "InvalidArgumentError",
    "InvalidBufferError",
    "InvalidUsageError",
    "KickedError",
    "MasterConfig",
    "MasterConnectionError",
    "MasterHandle",
    "MasterNode",
    "NoSharedStateAvailableError",
    "PCCLError",
    "PeerConfig",
    "PendingAsyncOpsError",
    "QuantizationAlgorithm",
    "QuantizationOptions",
    "RankConnectionFailedError",
    "RankConnectionLostError",
    "ReduceDescriptor",
    "ReduceInfo",
    "ReduceOp",
    "ReduceOpDescriptor",
    "ReduceOperandDescriptor",
    "Result",
    "SharedState",
    "SharedStateSyncError",
    "SharedStateSyncInfo",
    "SharedStateSyncStrategy",
    "TensorInfo",
    "TooFewPeersError",
    "TopologyOptimizationFailedError",
    "UpdateTopologyFailedError",
    "cuda",
    "open_communicator",
    "open_master",
    "serve_master",
]
