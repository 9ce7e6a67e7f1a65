"""Signatures and values of the established bindings (pypccl 1.0), without a network."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pccl
import pccl._pccl
from pccl import (
    DataType,
    DeviceType,
    DistributionHint,
    InvalidArgumentError,
    PCCLError,
    QuantizationAlgorithm,
    QuantizationOptions,
    ReduceDescriptor,
    ReduceInfo,
    ReduceOp,
    ReduceOpDescriptor,
    ReduceOperandDescriptor,
    Result,
    SharedState,
    SharedStateSyncError,
    SharedStateSyncInfo,
    TensorInfo,
    TooFewPeersError,
)

UPSTREAM_ALL = ["cuda", "Communicator", "MasterNode", "ReduceOp", "Attribute", "SharedStateSyncStrategy",
                "DataType", "DistributionHint", "QuantizationAlgorithm", "ReduceOperandDescriptor",
                "QuantizationOptions", "ReduceDescriptor", "TensorInfo", "SharedState", "SharedStateSyncInfo",
                "ReduceInfo", "ReduceOpDescriptor", "AsyncReduceHandle", "PCCLError"]


def test_star_import_and_modules() -> None:
    namespace: dict[str, object] = {}
    exec("from pccl import *", namespace)
    missing = [n for n in UPSTREAM_ALL if n not in namespace]
    assert not missing
    assert pccl.cuda.is_available() == torch.cuda.is_available()
    for name in [*UPSTREAM_ALL[1:], "Result", "DeviceType"]:
        assert getattr(pccl._pccl, name) is getattr(pccl, name), name


# --- PCCLError --------------------------------------------------------------------------------------


def test_pcclerror_upstream_call_order_and_message() -> None:
    err = PCCLError(Result.TOO_FEW_PEERS, "pcclAllReduce")
    assert err.result is Result.TOO_FEW_PEERS
    assert err.func_name == "pcclAllReduce"
    assert str(err) == "pcclAllReduce failed with error: TOO_FEW_PEERS: TOO_FEW_PEERS"
    assert err.args == ("pcclAllReduce failed with error: TOO_FEW_PEERS",)


def test_pcclerror_our_call_order_still_works() -> None:
    err = PCCLError("it broke", Result.RANK_CONNECTION_LOST)
    assert err.result is Result.RANK_CONNECTION_LOST and err.message == "it broke"
    assert str(err) == "RANK_CONNECTION_LOST: it broke"
    assert str(TooFewPeersError("alone")) == "TOO_FEW_PEERS: alone"
    assert SharedStateSyncError("x").result is Result.SHARED_STATE_SYNC_FAILED
    with pytest.raises(TypeError):
        PCCLError("message", "not a result")  # type: ignore[arg-type]


def test_pcclerror_check() -> None:
    PCCLError.check(0, "pcclInit")
    PCCLError.check(Result.SUCCESS, "pcclInit")
    with pytest.raises(PCCLError) as info:
        PCCLError.check(5, "pcclAllReduce")
    assert info.value.result is Result.TOO_FEW_PEERS
    assert isinstance(info.value, TooFewPeersError)  # ours are subclasses
    assert str(info.value) == "pcclAllReduce failed with error: TOO_FEW_PEERS: TOO_FEW_PEERS"
    with pytest.raises(PCCLError) as generic:
        PCCLError.check(Result.NOT_INITIALIZED, "pcclFoo")
    assert type(generic.value) is PCCLError


# --- DataType / DeviceType conversions -----------------------------------------------------------------


def test_datatype_torch_conversions() -> None:
    pairs = {DataType.UINT8: torch.uint8, DataType.INT8: torch.int8, DataType.INT16: torch.int16,
             DataType.UINT16: torch.uint16, DataType.UINT32: torch.uint32, DataType.INT32: torch.int32,
             DataType.UINT64: torch.uint64, DataType.INT64: torch.int64, DataType.FLOAT16: torch.float16,
             DataType.BFLOAT16: torch.bfloat16, DataType.FLOAT: torch.float32, DataType.DOUBLE: torch.float64}
    for dt, tdt in pairs.items():
        assert dt.to_torch_dtype() == tdt
        assert DataType.from_torch_dtype(tdt) is dt
    with pytest.raises(ValueError):  # upstream raises ValueError for an unsupported torch dtype
        DataType.from_torch_dtype(torch.complex64)


def test_datatype_numpy_conversions() -> None:
    for dt in DataType:
        np_dtype = dt.to_numpy_dtype()
        assert DataType.from_numpy_dtype(np_dtype) is dt
        assert np.dtype(np_dtype).itemsize == dt.itemsize
    assert DataType.from_numpy_dtype(np.float32) is DataType.FLOAT
    assert DataType.from_numpy_dtype(np.zeros(1, np.int64).dtype) is DataType.INT64
    with pytest.raises(AssertionError):  # upstream asserts
        DataType.from_numpy_dtype(np.complex128)


def test_device_type_from_torch() -> None:
    assert DeviceType.from_torch_device_type("cpu") is DeviceType.CPU
    assert DeviceType.from_torch_device_type("cuda") is DeviceType.CUDA
    assert DeviceType.from_torch_device_type("mps") is None


# --- TensorInfo / SharedState --------------------------------------------------------------------------


def test_tensorinfo_from_raw_pointer_views_the_callers_memory() -> None:
    arr = np.arange(6, dtype=np.float32)
    info = TensorInfo("w", arr.ctypes.data, numel=6, dtype=DataType.FLOAT, device_type=DeviceType.CPU,
                      allow_content_inequality=False)
    assert (info.name, info.data_ptr, info.numel, info.dtype, info.device_type) == \
        ("w", arr.ctypes.data, 6, DataType.FLOAT, DeviceType.CPU)
    assert info.allow_content_inequality is False
    info.tensor[2] = 42.0  # what a sync writes lands in the caller's array
    assert arr[2] == 42.0


def test_tensorinfo_raw_pointer_errors() -> None:
    with pytest.raises(ValueError, match="nullptr"):
        TensorInfo("w", 0, numel=1, dtype=DataType.FLOAT, device_type=DeviceType.CPU,
                   allow_content_inequality=False)
    arr = np.zeros(4, np.float32)
    with pytest.raises(PCCLError) as cuda:
        TensorInfo("w", arr.ctypes.data, numel=4, dtype=DataType.FLOAT, device_type=DeviceType.CUDA,
                   allow_content_inequality=False)
    assert cuda.value.result is Result.INVALID_ARGUMENT
    with pytest.raises(AssertionError):
        TensorInfo("w", arr.ctypes.data)  # a raw address without numel/dtype


def test_tensorinfo_constructors_and_attributes() -> None:
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    a = np.zeros(5, np.int16)
    from_torch = TensorInfo.from_torch(t, "t", allow_content_inequality=True)
    from_numpy = TensorInfo.from_numpy(tensor=a, name="a")
    ours = TensorInfo("o", a)
    assert (from_torch.data_ptr, from_torch.numel, from_torch.dtype, from_torch.device_type) == \
        (t.data_ptr(), 12, DataType.BFLOAT16, DeviceType.CPU)
    assert from_torch.allow_content_inequality is True and from_torch.tensor is t
    assert (from_numpy.data_ptr, from_numpy.numel, from_numpy.dtype) == (a.ctypes.data, 5, DataType.INT16)
    assert ours.tensor is a and ours.dtype is DataType.INT16
    with pytest.raises(AssertionError):
        TensorInfo("m", a, numel=4)  # a tensor that contradicts numel
    with pytest.raises(AssertionError):
        TensorInfo.from_torch(torch.zeros(4, 4).t(), "non_contiguous")


def test_tensorinfo_rejects_dtensor() -> None:
    dist = pytest.importorskip("torch.distributed")
    tensor_mod = pytest.importorskip("torch.distributed.tensor")
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = tensor_mod.DeviceMesh("cpu", [0])
        dtensor = tensor_mod.DTensor.from_local(torch.zeros(4), mesh, [tensor_mod.Replicate()])
        with pytest.raises(AssertionError, match="distributed tensor"):
            TensorInfo.from_torch(dtensor, "d")
    finally:
        dist.destroy_process_group()


def test_shared_state_push_revision_and_empty_list() -> None:
    state = SharedState([TensorInfo.from_numpy(np.zeros(2, np.float32), "x")])
    assert state.revision == 0
    state.push_revision()
    state.push_revision()
    assert state.revision == 2
    state.revision = 7
    assert state.revision == 7
    with pytest.raises(AssertionError):
        SharedState([])


# --- info and descriptor classes -----------------------------------------------------------------------


def test_info_classes_are_positional() -> None:
    info = ReduceInfo(2, 0, 0)
    assert (info.local_world_size, info.world_size, info.tx_bytes, info.rx_bytes) == (2, 2, 0, 0)
    sync = SharedStateSyncInfo(10, 20)
    assert (sync.tx_bytes, sync.rx_bytes) == (10, 20)
    q = QuantizationOptions(DataType.UINT8, QuantizationAlgorithm.MIN_MAX)
    assert (q.quantized_datatype, q.algorithm) == (DataType.UINT8, QuantizationAlgorithm.MIN_MAX)
    assert QuantizationOptions() == q  # upstream's defaults


def test_reduce_descriptor_always_has_quantization_options() -> None:
    operand = ReduceOperandDescriptor(DataType.FLOAT, DistributionHint.NORMAL)
    d = ReduceDescriptor(8, ReduceOp.SUM, 3, operand)
    assert d.quantization_options is not None
    assert d.quantization_options.algorithm is QuantizationAlgorithm.NONE
    assert d.quantization_options.quantized_datatype is DataType.FLOAT
    given = QuantizationOptions(DataType.UINT8, QuantizationAlgorithm.MIN_MAX)
    assert ReduceDescriptor(8, ReduceOp.SUM, 3, operand, given).quantization_options is given


def test_reduce_op_descriptor_from_raw_pointers() -> None:
    send = np.arange(4, dtype=np.float32)
    recv = np.zeros(4, dtype=np.float32)
    rd = ReduceDescriptor(4, ReduceOp.SUM, 0, ReduceOperandDescriptor(DataType.FLOAT),
                          QuantizationOptions(DataType.FLOAT, QuantizationAlgorithm.NONE))
    d = ReduceOpDescriptor(send.ctypes.data, recv.ctypes.data, rd)
    assert (d.sendbuf_ptr, d.recvbuf_ptr, d.reduce_descriptor) == (send.ctypes.data, recv.ctypes.data, rd)
    np.testing.assert_array_equal(d.send, send)
    d.recv[:] = 5.0
    assert (recv == 5.0).all()
    t = torch.ones(4)
    assert ReduceOpDescriptor.from_torch(t, t, rd).sendbuf_ptr == t.data_ptr()
    with pytest.raises(ValueError, match="nullptr"):
        ReduceOpDescriptor(0, recv.ctypes.data, rd)


def test_bad_buffers_raise_assertion_compatible_errors() -> None:
    rd = ReduceDescriptor(4, ReduceOp.SUM, 0, ReduceOperandDescriptor(DataType.FLOAT))
    with pytest.raises(AssertionError) as info:
        ReduceOpDescriptor.from_torch(torch.zeros(4), torch.zeros(4, dtype=torch.float64), rd)
    assert isinstance(info.value, InvalidArgumentError)
    assert info.value.result is Result.INVALID_ARGUMENT
    with pytest.raises(AssertionError):
        ReduceOpDescriptor.from_numpy(np.zeros(4, np.float32), np.zeros(3, np.float32), rd)
