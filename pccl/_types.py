"""Enums and small value types shared by every layer (no trio, no sockets)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReduceOp(enum.IntEnum):
    """Reduction applied by all-reduce / reduce-scatter."""

    SUM = 0
    AVG = 1
    PROD = 2
    MAX = 3
    MIN = 4


class Attribute(enum.IntEnum):
    """Attributes readable with ``get_attribute``."""

    GLOBAL_WORLD_SIZE = 0
    PEER_GROUP_WORLD_SIZE = 1
    NUM_DISTINCT_PEER_GROUPS = 2
    LARGEST_PEER_GROUP_WORLD_SIZE = 3
    # aliases used by the established Python bindings
    LOCAL_WORLD_SIZE = 1
    CURRENT_WORLD_SIZE = 0


class DataType(enum.IntEnum):
    """Element types understood on the wire (numbering is ours)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    UINT64 = 6
    INT64 = 7
    FLOAT16 = 8
    BFLOAT16 = 9
    FLOAT32 = 10
    FLOAT64 = 11
    # aliases used by the established bindings
    FLOAT = 10
    DOUBLE = 11

    @property
    def itemsize(self) -> int:
        """Size of one element in bytes."""
        return _ITEMSIZE[self]

    @property
    def is_floating(self) -> bool:
        """True for float16/bfloat16/float32/float64."""
        return self in (DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT32, DataType.FLOAT64)


_ITEMSIZE = {
    DataType.UINT8: 1,
    DataType.INT8: 1,
    DataType.UINT16: 2,
    DataType.INT16: 2,
    DataType.UINT32: 4,
    DataType.INT32: 4,
    DataType.UINT64: 8,
    DataType.INT64: 8,
    DataType.FLOAT16: 2,
    DataType.BFLOAT16: 2,
    DataType.FLOAT32: 4,
    DataType.FLOAT64: 8,
}


class QuantizationAlgorithm(enum.IntEnum):
    """How all-reduce payloads are compressed on the wire."""

    NONE = 0
    MIN_MAX = 1
    ZERO_POINT_SCALE = 2


class SharedStateSyncStrategy(enum.IntEnum):
    """How a peer takes part in a shared-state sync (see docs/protocol.md section 5)."""

    ENFORCE_POPULAR = 0
    RECEIVE_ONLY = 1
    SEND_ONLY = 2


class DistributionHint(enum.IntEnum):
    """Hint about the value distribution of a tensor (accepted for API compatibility)."""

    NONE = 0
    NORMAL = 1
    UNIFORM = 2


class DeviceType(enum.IntEnum):
    """Where a tensor lives."""

    CPU = 0
    CUDA = 1


@dataclass(frozen=True)
class QuantizationOptions:
    """Quantization requested for one all-reduce (positional, like the established bindings).

    Args:
        quantized_datatype: the integer type sent on the wire (UINT8 or UINT16).
        algorithm: MIN_MAX (default) or ZERO_POINT_SCALE; NONE disables quantization.
    """

    quantized_datatype: DataType = DataType.UINT8
    algorithm: QuantizationAlgorithm = QuantizationAlgorithm.MIN_MAX


@dataclass(frozen=True, kw_only=True)
class ReduceInfo:
    """What one collective did: the world size it ran with and the bytes it moved."""

    local_world_size: int
    tx_bytes: int
    rx_bytes: int


@dataclass(frozen=True, kw_only=True)
class SharedStateSyncInfo:
    """What one shared-state sync moved."""

    tx_bytes: int
    rx_bytes: int
