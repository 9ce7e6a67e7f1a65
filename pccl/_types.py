"""Enums and small value types shared by every layer (no trio, no sockets)."""

from __future__ import annotations

import enum
import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import InvalidBufferError

if TYPE_CHECKING:
    import numpy as np


def _np() -> Any:
    """numpy, imported on first use: the master (``pccl-master``) uses these types without numpy."""
    return importlib.import_module("numpy")


class ReduceOp(enum.IntEnum):
    """Reduction applied by all-reduce / reduce-scatter."""

    SUM = 0
    AVG = 1
    PROD = 2
    MAX = 3
    MIN = 4


class Attribute(enum.IntEnum):
    """Attributes readable with ``get_attribute`` (numbered 1..4 as ``pcclAttribute_t`` in the C header)."""

    GLOBAL_WORLD_SIZE = 1
    PEER_GROUP_WORLD_SIZE = 2
    NUM_DISTINCT_PEER_GROUPS = 3
    LARGEST_PEER_GROUP_WORLD_SIZE = 4
    # aliases used by the established Python bindings
    LOCAL_WORLD_SIZE = 2
    CURRENT_WORLD_SIZE = 1


class DataType(enum.IntEnum):
    """Element types, numbered as ``pcclDataType_t`` in the established C header (also on our wire)."""

    UINT8 = 0
    INT8 = 1
    INT16 = 2
    UINT16 = 3
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

    def to_torch_dtype(self) -> Any:
        """The ``torch.dtype`` of this type (imports torch).

        Raises:
            InvalidBufferError: torch is not installed or has no such dtype (also an AssertionError, as the
                established method asserts).
        """
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            raise InvalidBufferError("torch is not installed") from None
        found = getattr(torch, _LIB_NAME[self], None)
        if found is None:
            raise InvalidBufferError(f"this torch has no dtype for {self.name}")
        return found

    def to_numpy_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of this type (BFLOAT16 needs ``ml_dtypes``).

        Raises:
            InvalidBufferError: BFLOAT16 without ``ml_dtypes``.
        """
        if self is DataType.BFLOAT16:
            bf = _numpy_bfloat16()
            if bf is None:
                raise InvalidBufferError("numpy has no bfloat16; install ml_dtypes")
            return bf
        dtype: np.dtype[Any] = _np().dtype(_LIB_NAME[self])
        return dtype

    @classmethod
    def from_torch_dtype(cls, dtype: Any) -> DataType:
        """The DataType of a ``torch.dtype``.

        Raises:
            InvalidBufferError: not a supported torch dtype (also a ValueError, as there).
        """
        torch = sys.modules.get("torch")
        if torch is not None:
            for dt, name in _LIB_NAME.items():
                if getattr(torch, name, None) == dtype:
                    return dt
        raise InvalidBufferError(f"unsupported dtype: {dtype}")

    @classmethod
    def from_numpy_dtype(cls, dtype: Any) -> DataType:
        """The DataType of a numpy dtype (anything ``numpy.dtype()`` accepts; ``ml_dtypes.bfloat16`` too).

        Raises:
            InvalidBufferError: unsupported dtype or non-native byte order.
        """
        numpy = _np()
        try:
            dt = numpy.dtype(dtype)
        except TypeError:
            raise InvalidBufferError(f"unsupported dtype: {dtype!r}") from None
        if not dt.isnative:
            raise InvalidBufferError(f"unsupported dtype: {dt.str!r} (non-native byte order)")
        bf = _numpy_bfloat16()
        if bf is not None and dt == bf:
            return DataType.BFLOAT16
        for member, name in _LIB_NAME.items():
            if member is not DataType.BFLOAT16 and dt == numpy.dtype(name):
                return member
        raise InvalidBufferError(f"unsupported dtype: {dt}")


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

# the attribute names of each type in torch and numpy (numpy's bfloat16 comes from ml_dtypes)
_LIB_NAME = {dt: dt.name.lower() for dt in DataType}


def _numpy_bfloat16() -> np.dtype[Any] | None:
    try:
        ml_dtypes = importlib.import_module("ml_dtypes")
    except ImportError:
        return None
    bf: np.dtype[Any] = _np().dtype(ml_dtypes.bfloat16)
    return bf


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
    """Where a tensor lives (numbered as ``pcclDeviceType_t``)."""

    CPU = 0
    CUDA = 1

    @classmethod
    def from_torch_device_type(cls, device_type: str) -> DeviceType | None:
        """The DeviceType of a torch device type string (``"cpu"``, ``"cuda"``); ``None`` for any other."""
        return {"cpu": cls.CPU, "cuda": cls.CUDA}.get(device_type)


@dataclass(frozen=True)
class QuantizationOptions:
    """Quantization requested for one all-reduce (positional, like the established bindings).

    Args:
        quantized_datatype: the integer type sent on the wire (UINT8 or UINT16).
        algorithm: MIN_MAX (default) or ZERO_POINT_SCALE; NONE disables quantization.
    """

    quantized_datatype: DataType = DataType.UINT8
    algorithm: QuantizationAlgorithm = QuantizationAlgorithm.MIN_MAX


@dataclass(frozen=True)
class ReduceInfo:
    """What one collective did: the world size it ran with and the bytes it moved.

    Positional ``ReduceInfo(local_world_size, tx_bytes, rx_bytes)`` as in the established bindings.
    """

    local_world_size: int
    tx_bytes: int
    rx_bytes: int

    @property
    def world_size(self) -> int:
        """Alias of :attr:`local_world_size` (the name older established releases used)."""
        return self.local_world_size


@dataclass(frozen=True)
class SharedStateSyncInfo:
    """What one shared-state sync moved: ``SharedStateSyncInfo(tx_bytes, rx_bytes)``."""

    tx_bytes: int
    rx_bytes: int
