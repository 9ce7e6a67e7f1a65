"""Collectives on GPU tensors (torch CUDA tensors, cupy arrays) through host staging.

A GPU ``send`` is copied to a host buffer through the staging pipeline (pccl/collectives/staging.py, here
with SynchronousDevice: the existing synchronous copies), the ring runs on host memory exactly as for CPU
tensors, and the host result goes into the GPU ``recv``: range by range during the data plane when it is
in place (rolled back if the operation fails), else at the commit. So every GPU result must be
bit-identical to the result of the same operation run on host copies of the same data, on every peer,
whatever device each peer uses, and a failed operation must leave every GPU buffer as it was.

The GPU tests skip cleanly without a CUDA device (torch tests) or without cupy and a device (cupy tests).
The first tests check the device-compatibility rule and the staging helpers' argument checks; they run on
any machine.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch
import trio
import trio.testing

import pccl
from pccl import DataType, QuantizationAlgorithm, QuantizationOptions, ReduceOp
from pccl.kernels import backend
from pccl.peer.communicator import Communicator
from pccl.testing import VirtualNetwork, open_test_cluster
from pccl.testing import tensor_bytes as _bits
from pccl.testing.pytest_plugin import require_cupy

from ._cluster import cancel_peer0_mid_ring, gather, kill_peer2_mid_ring, loopback_cluster

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")


_cupy = require_cupy


def _cupy_or_none() -> Any:
    """cupy when it is installed and sees a device, else None (for tests that only add cupy peers)."""
    try:
        return _cupy()
    except pytest.skip.Exception:
        return None


# ----------------------------------------------------------------------------------------------------
# helpers


def _data(dtype: torch.dtype, count: int, seed: int) -> torch.Tensor:
    """Deterministic CPU test data: floats ~ N(0, 100) rounded to ``dtype``, ints in [-1000, 1000)
    (uint8: [0, 256))."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(count, generator=g) * 100).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (count,), generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, (count,), generator=g, dtype=dtype)


def _to_cupy(t: torch.Tensor) -> Any:
    return sys.modules["cupy"].asarray(t.numpy())


async def _host_all_reduce(
    comms: list[Communicator], data: list[torch.Tensor], op: ReduceOp, q: QuantizationOptions | None = None
) -> list[torch.Tensor]:
    """The reference: the same all-reduce on CPU copies of ``data`` (one result per peer)."""
    outs = [torch.empty_like(d) for d in data]
    await gather(comms, lambda i, c: c.all_reduce(data[i], outs[i], op=op, quantization=q))
    assert all(_bits(o) == _bits(outs[0]) for o in outs)
    return outs


# ----------------------------------------------------------------------------------------------------
# device rule and helper checks (CPU-runnable)


def test_same_device_rule() -> None:
    backend.check_same_device(-1, -1)
    backend.check_same_device(0, 0)
    backend.check_same_device(3, 3)
    for si, ri, words in [
        (-1, 0, "send is on the CPU but recv is on CUDA device 0"),
        (0, -1, "send is on CUDA device 0 but recv is on the CPU"),
        (0, 1, "send is on CUDA device 0 but recv is on CUDA device 1"),
    ]:
        with pytest.raises(pccl.InvalidArgumentError, match=words) as info:
            backend.check_same_device(si, ri)
        assert info.value.result == pccl.Result.INVALID_ARGUMENT


def test_staging_helpers_refuse_cpu_tensors() -> None:
    a = np.arange(8, dtype=np.float32)
    t = torch.arange(8, dtype=torch.float32)
    assert backend.device_index(a) == -1
    assert backend.device_index(t) == -1
    backend.sync_current_stream(a)  # nothing to wait for on the CPU
    backend.sync_current_stream(t)
    for x in (a, t):
        with pytest.raises(pccl.InvalidArgumentError, match="GPU tensor"):
            backend.copy_to_host(x, np.empty(8, np.float32))
        with pytest.raises(pccl.InvalidArgumentError, match="GPU tensor"):
            backend.copy_from_host(x, np.zeros(8, np.float32))
    assert a.tobytes() == np.arange(8, dtype=np.float32).tobytes()


@cuda
def test_staging_helpers_round_trip_torch() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        src = _data(dtype, 1001, 1).reshape(7, 143)
        dev = src.cuda()
        host = np.empty(1001, backend.dtype_to_numpy(backend.torch_to_dtype(dtype)))
        backend.copy_to_host(dev, host)
        assert host.tobytes() == _bits(src)
        # write back only [100, 200): the rest of the device tensor keeps its bits
        target = torch.zeros_like(dev)
        backend.copy_from_host(target, host, 100, 200)
        expect = torch.zeros_like(src).reshape(-1)
        expect[100:200] = src.reshape(-1)[100:200]
        assert _bits(target) == _bits(expect)
        with pytest.raises(pccl.InvalidArgumentError):
            backend.copy_to_host(dev, np.empty(1000, host.dtype))
        with pytest.raises(pccl.InvalidArgumentError):
            backend.copy_from_host(dev, host, 10, 2000)
    assert backend.device_index(torch.zeros(1, device="cuda")) == torch.cuda.current_device()


def test_staging_helpers_round_trip_cupy(cp: Any) -> None:
    cupy = cp
    src = np.random.default_rng(3).standard_normal(1001).astype(np.float32)
    dev = cupy.asarray(src.reshape(7, 143))
    host = np.empty(1001, np.float32)
    backend.copy_to_host(dev, host)
    assert host.tobytes() == src.tobytes()
    target = cupy.zeros(1001, cupy.float32)
    backend.copy_from_host(target, host, 0, 500)
    expect = np.zeros(1001, np.float32)
    expect[:500] = src[:500]
    assert _bits(target) == expect.tobytes()
    assert backend.device_index(dev) == dev.device.id


# ----------------------------------------------------------------------------------------------------
# all_reduce


@cuda
@pytest.mark.parametrize("n", [2, 3])
async def test_all_reduce_cuda_bit_identical_to_host_run(n: int) -> None:
    count = 1001  # not a multiple of the world size: uneven chunks
    async with loopback_cluster(n) as cl:
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.float16):
            for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
                for in_place in (True, False):
                    data = [_data(dtype, count, seed=10 * i + int(op)) for i in range(n)]
                    ref = await _host_all_reduce(cl.comms, data, op)
                    sends = [d.cuda().reshape(11, 91) for d in data]  # 2-D: collectives see the flat view
                    recvs = [s if in_place else torch.full_like(s, 7) for s in sends]
                    infos = await gather(
                        cl.comms, lambda i, c: c.all_reduce(sends[i], None if in_place else recvs[i], op=op)
                    )
                    case = (dtype, op, in_place)
                    for i in range(n):
                        assert recvs[i].is_cuda and recvs[i].shape == (11, 91), case
                        assert _bits(recvs[i]) == _bits(ref[0]), case
                        if not in_place:
                            assert _bits(sends[i]) == _bits(data[i]), case  # send is an input only
                        assert infos[i].local_world_size == n and infos[i].rx_bytes > 0
                    # the host run itself is right (so "equal to it" means something)
                    stacked = torch.stack([d.double() for d in data])
                    if op == ReduceOp.MAX:
                        assert torch.equal(ref[0], stacked.amax(0).to(dtype)), case
                    elif op == ReduceOp.SUM and dtype == torch.int64:
                        assert torch.equal(ref[0], stacked.sum(0).to(dtype)), case
                    elif op == ReduceOp.SUM and dtype == torch.float32:
                        torch.testing.assert_close(ref[0], stacked.sum(0).float(), rtol=1e-5, atol=1e-3)


@cuda
async def test_all_reduce_cuda_large_uses_the_pipelined_path() -> None:
    count = 3 * (1 << 20) + 5  # 12 MB of float32: above the inline-send limit, several blocks per chunk
    async with loopback_cluster(3) as cl:
        data = [_data(torch.float32, count, seed=i) for i in range(3)]
        ref = await _host_all_reduce(cl.comms, data, ReduceOp.AVG)
        xs = [d.cuda() for d in data]
        await gather(cl.comms, lambda i, c: c.all_reduce(xs[i], op=ReduceOp.AVG, tag=3))
        assert all(_bits(x) == _bits(ref[0]) for x in xs)
        # the buffers are reused across ops: a second op on new data is not polluted by the first
        data2 = [_data(torch.float32, count, seed=100 + i) for i in range(3)]
        ref2 = await _host_all_reduce(cl.comms, data2, ReduceOp.SUM)
        for x, d in zip(xs, data2, strict=True):
            x.copy_(d)
        await gather(cl.comms, lambda i, c: c.all_reduce(xs[i], tag=3))
        assert all(_bits(x) == _bits(ref2[0]) for x in xs)


@pytest.mark.parametrize("n", [2, 3])
async def test_all_reduce_cupy_bit_identical_to_host_run(cp: Any, n: int) -> None:
    cupy = cp
    count = 1001
    async with loopback_cluster(n) as cl:
        for dtype in (torch.float32, torch.int64, torch.float16):
            for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
                for in_place in (True, False):
                    data = [_data(dtype, count, seed=7 * i + int(op)) for i in range(n)]
                    ref = await _host_all_reduce(cl.comms, data, op)
                    sends = [_to_cupy(d) for d in data]
                    recvs = [s if in_place else cupy.full_like(s, 3) for s in sends]
                    await gather(
                        cl.comms, lambda i, c: c.all_reduce(sends[i], None if in_place else recvs[i], op=op)
                    )
                    for i in range(n):
                        assert isinstance(recvs[i], cupy.ndarray)
                        assert _bits(recvs[i]) == _bits(ref[0]), (dtype, op, in_place)
                        if not in_place:
                            assert _bits(sends[i]) == _bits(data[i])


@cuda
@pytest.mark.parametrize("n", [2, 3])
async def test_cpu_and_gpu_peers_in_one_op(n: int) -> None:
    """Each peer picks its own device: the wire format is the same."""
    cupy = _cupy_or_none()
    count = 5003
    async with loopback_cluster(n) as cl:
        for dtype in (torch.float32, torch.bfloat16):
            data = [_data(dtype, count, seed=i) for i in range(n)]
            ref = await _host_all_reduce(cl.comms, data, ReduceOp.SUM)
            # peer 0 on the CPU (numpy when numpy has the dtype, else torch), peer 1 a torch CUDA tensor,
            # peer 2 a cupy array (or a CPU torch tensor when cupy is missing or has no bfloat16)
            xs: list[Any] = [data[0].numpy() if dtype == torch.float32 else data[0].clone(), data[1].cuda()]
            if n == 3:
                use_cupy = cupy is not None and dtype == torch.float32
                xs.append(_to_cupy(data[2]) if use_cupy else data[2].clone())
            await gather(cl.comms, lambda i, c: c.all_reduce(xs[i]))
            assert all(_bits(x) == _bits(ref[0]) for x in xs), dtype


@cuda
async def test_torch_send_with_cupy_recv_on_the_same_gpu(cp: Any) -> None:
    cupy = cp
    async with loopback_cluster(2) as cl:
        data = [_data(torch.float32, 999, seed=i) for i in range(2)]
        ref = await _host_all_reduce(cl.comms, data, ReduceOp.MAX)
        sends = [d.cuda() for d in data]
        recvs = [cupy.zeros(999, cupy.float32) for _ in range(2)]
        await gather(cl.comms, lambda i, c: c.all_reduce(sends[i], recvs[i], op=ReduceOp.MAX))
        assert all(_bits(r) == _bits(ref[0]) for r in recvs)


@cuda
async def test_pending_work_on_the_current_stream_is_ordered_before_the_copy() -> None:
    """``send`` written on a busy side stream (the caller's current stream) is copied only after that
    write; the result is complete on return (readable from any other stream)."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("this torch has no torch.cuda._sleep")
    async with loopback_cluster(2) as cl:
        # torch.cuda.Stream's constructor and torch.cuda._sleep carry no annotations
        side, other = torch.cuda.Stream(), torch.cuda.Stream()
        xs = [torch.zeros(1 << 16, device="cuda"), torch.full((1 << 16,), 2.0, device="cuda")]
        torch.cuda.synchronize()

        async def run(i: int, c: Communicator) -> pccl.ReduceInfo:
            if i == 0:
                with torch.cuda.stream(side):
                    # ~0.1 s of GPU time before the write below runs
                    torch.cuda._sleep(200_000_000)
                    xs[0].fill_(1.0)
                    return await c.all_reduce(xs[0])
            return await c.all_reduce(xs[1])

        await gather(cl.comms, run)
        with torch.cuda.stream(other):
            seen = [x.clone() for x in xs]
        other.synchronize()
        for s in seen:
            assert torch.equal(s, torch.full_like(s, 3.0))


# ----------------------------------------------------------------------------------------------------
# reduce_scatter, all_gather, broadcast


def _make(lib: str, t: torch.Tensor) -> Any:
    if lib == "cupy":
        return _to_cupy(t)
    return t.cuda()


@pytest.mark.parametrize("n", [2, 3])
async def test_reduce_scatter_all_gather_broadcast_on_gpu(lib: str, n: int) -> None:
    count = 1003
    async with loopback_cluster(n) as cl:
        comms = cl.comms
        # reduce_scatter: recv[chunk] gets the host run's chunk; the rest of recv keeps its bits
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            data = [_data(torch.float32, count, seed=i + 20) for i in range(n)]
            host_out = [torch.full((count,), -5.0) for _ in range(n)]
            host_chunks = await gather(comms, lambda i, c: c.reduce_scatter(data[i], host_out[i], op=op))
            sends = [_make(lib, d) for d in data]
            recvs = [_make(lib, torch.full((count,), -5.0)) for _ in range(n)]
            got = await gather(comms, lambda i, c: c.reduce_scatter(sends[i], recvs[i], op=op))
            for i in range(n):
                _, chunk = got[i]
                assert chunk == host_chunks[i][1]
                assert chunk.stop > chunk.start
                assert _bits(recvs[i]) == _bits(host_out[i]), (lib, op, i)  # chunk and untouched rest

        # all_gather: every peer's send, in ring order
        data = [_data(torch.int64, 17, seed=i + 30) for i in range(n)]
        host_out = [torch.zeros(n * 17, dtype=torch.int64) for _ in range(n)]
        await gather(comms, lambda i, c: c.all_gather(data[i], host_out[i]))
        sends = [_make(lib, d) for d in data]
        recvs = [_make(lib, torch.zeros(n * 17, dtype=torch.int64)) for _ in range(n)]
        await gather(comms, lambda i, c: c.all_gather(sends[i], recvs[i]))
        ring = comms[0].group_ring
        by_id = {c.peer_id: data[i] for i, c in enumerate(comms)}
        expect = torch.cat([by_id[p] for p in ring])
        assert _bits(host_out[0]) == _bits(expect)
        assert all(_bits(r) == _bits(expect) for r in recvs)

        # broadcast from ring rank 1: in place on every peer
        data = [_data(torch.float32, count, seed=i + 40) for i in range(n)]
        bufs = [_make(lib, d) for d in data]
        await gather(comms, lambda i, c: c.broadcast(bufs[i], root=1))
        root_data = {c.peer_id: data[i] for i, c in enumerate(comms)}[ring[1]]
        assert all(_bits(b) == _bits(root_data) for b in bufs)


# ----------------------------------------------------------------------------------------------------
# failures leave the GPU recv buffer bit-identical


COUNT = 1 << 20  # 4 MB of float32: ~0.1 s per ring step at 10 MB/s (virtual time)


@cuda
@pytest.mark.parametrize("in_place", [True, False])
async def test_cancelled_mid_ring_leaves_cuda_buffers_untouched(
    autojump_clock: trio.testing.MockClock, in_place: bool
) -> None:
    net = VirtualNetwork(latency=0.0005, bandwidth=10e6)
    async with open_test_cluster(3, network=net) as cl:
        data = [_data(torch.float32, COUNT, seed=i) for i in range(3)]
        sends = [d.cuda() for d in data]
        recvs = [s if in_place else torch.full_like(s, -7.0) for s in sends]
        before = [_bits(r) for r in recvs]
        # cancel in the middle of the ring: once peer 0 has received a first chunk
        results = await cancel_peer0_mid_ring(
            cl, lambda i: cl.peer(i).all_reduce(sends[i], None if in_place else recvs[i], tag=5), COUNT
        )
        for i in (1, 2):
            assert isinstance(results[i], pccl.RankConnectionLostError), results[i]
        for i in range(3):
            assert _bits(recvs[i]) == before[i], f"peer {i}: CUDA buffer changed"
        # the group carries on: a retry equals the host run
        host = [torch.empty_like(d) for d in data]
        await gather(cl.peers, lambda i, c: c.all_reduce(data[i], host[i], tag=7))
        out = [torch.empty_like(s) for s in sends]
        await gather(cl.peers, lambda i, c: c.all_reduce(sends[i], out[i], tag=8))
        assert all(_bits(o) == _bits(host[0]) for o in out)


@cuda
async def test_peer_killed_mid_ring_leaves_survivor_cuda_buffers_untouched(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.0005, bandwidth=10e6)
    async with open_test_cluster(3, network=net) as cl:
        xs = [_data(torch.float32, COUNT, seed=i).cuda() for i in range(3)]
        before = [_bits(x) for x in xs]
        # mid-ring: both survivors have received at least a first chunk
        results = await kill_peer2_mid_ring(
            cl, lambda i: cl.peer(i).all_reduce(xs[i], op=ReduceOp.AVG, tag=5), COUNT
        )
        for i in (0, 1):
            assert isinstance(results[i], pccl.RankConnectionLostError), results[i]
            assert _bits(xs[i]) == before[i], f"peer {i}: CUDA buffer changed"


@cuda
async def test_mixed_send_recv_devices_refused_before_voting() -> None:
    cupy = _cupy_or_none()
    async with loopback_cluster(2) as cl:
        comm = cl.comms[0]
        cases: list[tuple[Any, Any]] = [
            (torch.ones(4), torch.zeros(4, device="cuda")),
            (torch.ones(4, device="cuda"), torch.zeros(4)),
            (np.ones(4, np.float32), torch.zeros(4, device="cuda")),
        ]
        if cupy is not None:
            cases += [
                (cupy.ones(4, cupy.float32), np.zeros(4, np.float32)),
                (np.ones(4, np.float32), cupy.zeros(4, cupy.float32)),
            ]
        if torch.cuda.device_count() >= 2:
            cases.append((torch.ones(4, device="cuda:0"), torch.zeros(4, device="cuda:1")))
        for send, recv in cases:
            before = _bits(recv)
            with pytest.raises(pccl.InvalidArgumentError, match="must live on the same device"):
                await comm.all_reduce(send, recv)
            with pytest.raises(pccl.InvalidArgumentError, match="must live on the same device"):
                await comm.reduce_scatter(send, recv)
            assert _bits(recv) == before
            assert cl.master.statistics()["collectives_voting"] == 0
            assert comm.statistics()["ops_in_flight"] == 0
        # nobody was dragged in: the group's next op runs normally
        xs = [torch.ones(4, device="cuda") for _ in range(2)]
        await gather(cl.comms, lambda i, c: c.all_reduce(xs[i]))
        assert all(torch.equal(x, torch.full_like(x, 2.0)) for x in xs)


# ----------------------------------------------------------------------------------------------------
# quantization


@cuda
@pytest.mark.parametrize("algo", [QuantizationAlgorithm.MIN_MAX, QuantizationAlgorithm.ZERO_POINT_SCALE])
async def test_quantized_all_reduce_cuda_float32(algo: QuantizationAlgorithm) -> None:
    n, count = 3, 100_003
    q = QuantizationOptions(quantized_datatype=DataType.UINT8, algorithm=algo)
    async with loopback_cluster(n) as cl:
        g = torch.Generator().manual_seed(5)
        data = [torch.rand(count, generator=g) for _ in range(n)]
        ref = await _host_all_reduce(cl.comms, data, ReduceOp.SUM, q)
        xs = [d.cuda() for d in data]
        infos = await gather(cl.comms, lambda i, c: c.all_reduce(xs[i], op=ReduceOp.SUM, quantization=q))
        assert all(_bits(x) == _bits(ref[0]) for x in xs)
        exact = torch.stack([d.double() for d in data]).sum(0)
        err = (xs[0].cpu().double() - exact).abs().max().item()
        assert 0 < err < 0.1 * n  # quantized (not exact), yet close
        # full precision sends 2 (n-1)/n x 4 bytes per element; uint8 about a quarter of that
        assert all(inf.tx_bytes < count * 4 // 2 for inf in infos)
