"""``pccl._pccl``: where the established bindings define their API; here it re-exports the blocking API.

Code that imports from ``pccl._pccl`` (``from pccl._pccl import ReduceOpDescriptor``) gets the same classes
as ``from pccl import ...``.
"""

from __future__ import annotations

from ._errors import PCCLError, Result
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
from .peer.shared_state import SharedState, TensorInfo

__all__ = [
    "AsyncReduceHandle",
    "Attribute",
    "Communicator",
    "DataType",
    "DeviceType",
    "DistributionHint",
    "MasterNode",
    "PCCLError",
    "QuantizationAlgorithm",
    "QuantizationOptions",
    "ReduceDescriptor",
    "ReduceInfo",
    "ReduceOp",
    "ReduceOpDescriptor",
    "ReduceOperandDescriptor",
    "Result",
    "SharedState",
    "SharedStateSyncInfo",
    "SharedStateSyncStrategy",
    "TensorInfo",
]
