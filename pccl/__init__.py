"""pccl: fault-tolerant collective communications over plain TCP/IP, built on trio."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Light modules, imported at once. Everything else (the blocking API, numpy, the peer, the master's
# server) loads on first use through __getattr__ below, so that ``pccl-master`` (pccl.cli) starts
# without importing what only peers need (docs/history/benchmarks-churn-soak.md "With master kills").
from ._config import DEFAULT_MASTER_PORT, PROTOCOL_VERSION, MasterConfig, PeerConfig
from ._env import apply_log_level as _apply_log_level
from ._errors import (
    HelloRefusedError,
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

if TYPE_CHECKING:
    from . import _pccl as _pccl
    from . import cuda
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

#: Public names loaded on first use: name -> (module, attribute; "" for the module itself).
_LAZY: dict[str, tuple[str, str]] = {
    "_pccl": ("._pccl", ""),
    "cuda": (".cuda", ""),
    **{n: ("._types", n) for n in (
        "Attribute", "DataType", "DeviceType", "DistributionHint", "QuantizationAlgorithm",
        "QuantizationOptions", "ReduceInfo", "ReduceOp", "SharedStateSyncInfo", "SharedStateSyncStrategy")},
    **{n: (".blocking", n) for n in (
        "AsyncReduceHandle", "Communicator", "MasterNode", "ReduceDescriptor", "ReduceOpDescriptor",
        "ReduceOperandDescriptor")},
    **{n: (".master.server", n) for n in ("MasterHandle", "open_master", "serve_master")},
    "AsyncCommunicator": (".peer.communicator", "Communicator"),
    "open_communicator": (".peer.communicator", "open_communicator"),
    "SharedState": (".peer.shared_state", "SharedState"),
    "TensorInfo": (".peer.shared_state", "TensorInfo"),
}


def __getattr__(name: str) -> Any:
    """Load a public name of :data:`_LAZY` on first use (PEP 562), then keep it as a global."""
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    mod = importlib.import_module(module, __name__)
    value = getattr(mod, attr) if attr else mod
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
    "HelloRefusedError",
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
