"""Shared-state sync of GPU tensors (torch CUDA tensors, cupy arrays) alongside CPU peers.

Content hashes are identical on CPU and GPU, so a CPU peer and a GPU peer holding the same bytes move
nothing; a GPU peer whose content differs receives the elected bytes into its own tensors, in place (the
objects and their device memory stay the same), and a CPU peer can receive from GPU holders.
Skipped without a CUDA device (torch) or without cupy and a device (cupy).
"""

from __future__ import annotations

import sys
from typing import Any, cast

import numpy as np
import torch

import pccl
from pccl.peer.shared_state import SharedState, TensorInfo
from pccl.testing import tensor_bytes as _bits

from ._cluster import loopback_cluster, sync_all, sync_killing_the_holder


def _to_gpu(lib: str, t: torch.Tensor) -> Any:
    if lib == "cupy":
        return sys.modules["cupy"].asarray(t.numpy())
    return t.cuda()


def _ptr(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.data_ptr())
    if isinstance(x, np.ndarray):
        return int(x.ctypes.data)
    return int(x.data.ptr)


def _tensors(lib: str, seed: int) -> dict[str, torch.Tensor]:
    """CPU content of one state: a float32 matrix, an int64 vector and (torch only) a bfloat16 vector."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "w": torch.randn(64, 33, generator=g),
        "step": torch.randint(0, 1 << 40, (5,), generator=g, dtype=torch.int64),
    }
    if lib == "torch":
        out["emb"] = torch.randn(1001, generator=g).to(torch.bfloat16)
    return out


def _state(tensors: dict[str, Any], revision: int = 1) -> SharedState:
    return SharedState([TensorInfo(k, t) for k, t in tensors.items()], revision=revision)


async def test_cpu_peer_and_gpu_peer_with_equal_content_move_nothing(lib: str) -> None:
    async with loopback_cluster(2) as cl:
        content = _tensors(lib, seed=1)
        cpu: dict[str, torch.Tensor | np.ndarray] = {k: v.clone() for k, v in content.items()}
        gpu = {k: _to_gpu(lib, v) for k, v in content.items()}
        cpu["w"] = cast(torch.Tensor, cpu["w"]).numpy()  # the CPU peer mixes numpy and torch tensors
        states = [_state(cpu), _state(gpu)]
        infos = await sync_all(cl.comms, states)
        assert all(i.tx_bytes == 0 and i.rx_bytes == 0 for i in infos), infos
        for k, v in content.items():
            assert _bits(gpu[k]) == _bits(v)


async def test_gpu_peer_receives_into_its_tensors_in_place(lib: str) -> None:
    async with loopback_cluster(3) as cl:
        good = _tensors(lib, seed=2)
        stale = _tensors(lib, seed=3)
        stale["step"] = good["step"].clone()  # equal key: must not move
        gpu = {k: _to_gpu(lib, v) for k, v in stale.items()}
        ids = {k: id(v) for k, v in gpu.items()}
        ptrs = {k: _ptr(v) for k, v in gpu.items()}
        as_numpy = {k: v.clone().numpy() if v.dtype != torch.bfloat16 else v.clone() for k, v in good.items()}
        states = [_state({k: v.clone() for k, v in good.items()}), _state(as_numpy), _state(gpu)]
        infos = await sync_all(cl.comms, states)
        moved = sum(v.numel() * v.element_size() for k, v in good.items() if k != "step")
        assert infos[2].rx_bytes == moved
        assert infos[0].rx_bytes == infos[1].rx_bytes == 0
        assert sum(i.tx_bytes for i in infos) == moved
        for info in states[2].tensor_infos:
            k = info.name
            assert info.tensor is gpu[k] and id(gpu[k]) == ids[k]  # the caller's objects, updated in place
            assert _ptr(gpu[k]) == ptrs[k]
            assert _bits(gpu[k]) == _bits(good[k]), k
        # next round: everyone equal, nothing moves
        for s in states:
            s.revision += 1
        infos = await sync_all(cl.comms, states)
        assert all(i.tx_bytes == 0 and i.rx_bytes == 0 for i in infos)


async def test_cpu_peer_receives_from_gpu_holders(lib: str) -> None:
    async with loopback_cluster(3) as cl:
        good = _tensors(lib, seed=4)
        cpu = {k: v.clone() for k, v in _tensors(lib, seed=5).items()}
        states = [
            _state({k: _to_gpu(lib, v) for k, v in good.items()}),
            _state({k: _to_gpu(lib, v) for k, v in good.items()}),
            _state(cpu),
        ]
        before = {k: _ptr(v) for k, v in cpu.items()}
        infos = await sync_all(cl.comms, states)
        total = sum(v.numel() * v.element_size() for v in good.values())
        assert infos[2].rx_bytes == total
        assert infos[0].tx_bytes + infos[1].tx_bytes == total
        for k, v in good.items():
            assert _bits(cpu[k]) == _bits(v), k
            assert _ptr(cpu[k]) == before[k]


async def test_holder_killed_mid_transfer_leaves_gpu_tensor_untouched(lib: str) -> None:
    """Fetched bytes are staged on the host and applied only after the master confirms: a GPU receiver
    whose holder dies mid-transfer keeps its old bits, and a retry fills it."""
    size = 32 * 1024 * 1024
    async with loopback_cluster(3) as cl:
        c = cl.comms[2]
        sa = SharedState([TensorInfo("w", np.full(size, 1, np.uint8))], revision=1)
        sb = SharedState([TensorInfo("w", np.full(size, 1, np.uint8))], revision=1)
        target = _to_gpu(lib, torch.zeros(size, dtype=torch.uint8))
        sc = SharedState([TensorInfo("w", target)], revision=1)
        assert isinstance(await sync_killing_the_holder(cl, [sa, sb, sc], both=True), pccl.PCCLError)
        assert _bits(target) == bytes(size)  # atomic: old bits kept
        # a new holder arrives: the retry fills the same tensor
        d = await cl.add_peer()
        sd = SharedState([TensorInfo("w", np.full(size, 1, np.uint8))], revision=1)
        res = await sync_all([c, d], [sc, sd], [pccl.SharedStateSyncStrategy.RECEIVE_ONLY,
                                                pccl.SharedStateSyncStrategy.SEND_ONLY])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res), res
        assert sc.tensor_infos[0].tensor is target
        assert _bits(target) == b"\x01" * size
