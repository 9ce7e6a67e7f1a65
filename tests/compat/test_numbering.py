"""Every enum member numbered as in the established library's C header (``include/pccl.h`` of pypccl 1.0);
our own members come after upstream's."""

from __future__ import annotations

import pccl
from pccl import (
    Attribute,
    DataType,
    DeviceType,
    DistributionHint,
    QuantizationAlgorithm,
    ReduceOp,
    Result,
    SharedStateSyncStrategy,
)

# pcclResult_t
UPSTREAM_RESULT = {
    "SUCCESS": 0,
    "NOT_INITIALIZED": 1,
    "INTERNAL_ERROR": 2,
    "INVALID_ARGUMENT": 3,
    "INVALID_USAGE": 4,
    "TOO_FEW_PEERS": 5,
    "MASTER_CONNECTION_FAILED": 6,
    "RANK_CONNECTION_FAILED": 7,
    "RANK_CONNECTION_LOST": 8,
    "NO_SHARED_STATE_AVAILABLE": 9,
    "PENDING_ASYNC_OPS": 10,
    "UPDATE_TOPOLOGY_FAILED": 11,
    "TOPOLOGY_OPTIMIZATION_FAILED": 12,
}
OUR_RESULT = ["SYSTEM_ERROR", "REMOTE_ERROR", "IN_PROGRESS", "SHARED_STATE_SYNC_FAILED", "KICKED"]

# pcclAttribute_t (the Python names of the established bindings, plus ours)
UPSTREAM_ATTRIBUTE = {
    "GLOBAL_WORLD_SIZE": 1,
    "LOCAL_WORLD_SIZE": 2,
    "NUM_DISTINCT_PEER_GROUPS": 3,
    "LARGEST_PEER_GROUP_WORLD_SIZE": 4,
}

# pcclDataType_t (INT16 is in the header; the established Python enum leaves it out)
UPSTREAM_DATATYPE = {
    "UINT8": 0,
    "INT8": 1,
    "INT16": 2,
    "UINT16": 3,
    "UINT32": 4,
    "INT32": 5,
    "UINT64": 6,
    "INT64": 7,
    "FLOAT16": 8,
    "BFLOAT16": 9,
    "FLOAT": 10,
    "DOUBLE": 11,
}

UPSTREAM_REDUCE_OP = {"SUM": 0, "AVG": 1, "PROD": 2, "MAX": 3, "MIN": 4}
UPSTREAM_DEVICE = {"CPU": 0, "CUDA": 1}
UPSTREAM_STRATEGY = {"ENFORCE_POPULAR": 0, "RECEIVE_ONLY": 1, "SEND_ONLY": 2}
UPSTREAM_HINT = {"NONE": 0, "NORMAL": 1, "UNIFORM": 2}
UPSTREAM_QUANT = {"NONE": 0, "MIN_MAX": 1, "ZERO_POINT_SCALE": 2}


def _assert_table(enum_cls: type, table: dict[str, int]) -> None:
    for name, value in table.items():
        member = getattr(enum_cls, name)
        assert int(member) == value, f"{enum_cls.__name__}.{name} is {int(member)}, upstream {value}"


def test_result_codes_are_upstreams_then_ours() -> None:
    _assert_table(Result, UPSTREAM_RESULT)
    ours = [int(getattr(Result, n)) for n in OUR_RESULT]
    assert min(ours) > max(UPSTREAM_RESULT.values())
    assert sorted(ours) == ours and len(set(ours)) == len(ours)
    assert {m.name for m in Result} == set(UPSTREAM_RESULT) | set(OUR_RESULT)


def test_attribute_numbering_and_aliases() -> None:
    _assert_table(Attribute, UPSTREAM_ATTRIBUTE)
    # (the aliases annotated as the enum: mypy types each name as a literal of its own, aliases too)
    local: Attribute = Attribute.LOCAL_WORLD_SIZE
    current: Attribute = Attribute.CURRENT_WORLD_SIZE
    assert Attribute.PEER_GROUP_WORLD_SIZE == local == 2
    assert Attribute.GLOBAL_WORLD_SIZE == current == 1


def test_datatype_numbering_matches_the_header() -> None:
    _assert_table(DataType, UPSTREAM_DATATYPE)
    float_alias: DataType = DataType.FLOAT  # (annotated: see test_attribute_numbering_and_aliases)
    double_alias: DataType = DataType.DOUBLE
    assert float_alias is DataType.FLOAT32 and double_alias is DataType.FLOAT64


def test_other_enums() -> None:
    _assert_table(ReduceOp, UPSTREAM_REDUCE_OP)
    _assert_table(DeviceType, UPSTREAM_DEVICE)
    _assert_table(SharedStateSyncStrategy, UPSTREAM_STRATEGY)
    _assert_table(DistributionHint, UPSTREAM_HINT)
    _assert_table(QuantizationAlgorithm, UPSTREAM_QUANT)


def test_codes_round_trip_through_the_error_table() -> None:
    # the master sends codes as integers; each side maps them back with the same enum
    for name, value in UPSTREAM_RESULT.items():
        if value == 0:
            continue
        try:
            pccl.PCCLError.check(value, "f")
        except pccl.PCCLError as exc:
            assert exc.result.name == name
        else:
            raise AssertionError(f"check({value}) did not raise")
