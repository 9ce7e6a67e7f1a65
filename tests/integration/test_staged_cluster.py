"""The communicator stages device tensors through the pipeline of pccl.collectives.staging: run here
with the fake device of pccl.testing.fake_device (its tensors stand for GPU memory, its copies complete
whenever every task is blocked), on an in-process cluster over the virtual network."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio

import pccl
from pccl.testing import TestCluster, VirtualNetwork, open_test_cluster
from pccl.testing.fake_device import FakeDevice, FakeTensor, use_fake_device

COUNT = 3 * 4096 + 5


@asynccontextmanager
async def staged_cluster(n: int) -> AsyncIterator[tuple[TestCluster, FakeDevice]]:
    device = FakeDevice()
    with use_fake_device(device):
        async with open_test_cluster(n, network=VirtualNetwork(latency=0.0001)) as cl:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(device.run_automatically)
                yield cl, device
                nursery.cancel_scope.cancel()


async def _all(cl: TestCluster, n: int, call: object) -> list[object]:
    results: list[object] = [None] * n

    async def one(i: int) -> None:
        try:
            results[i] = await call(i, cl.peer(i))  # type: ignore[operator]
        except pccl.PCCLError as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return results


def _inputs(n: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).standard_normal(COUNT).astype(np.float32) for i in range(n)]


@pytest.mark.parametrize("op", [pccl.ReduceOp.SUM, pccl.ReduceOp.AVG])
async def test_staged_all_reduce_gives_the_host_paths_bits(op: pccl.ReduceOp) -> None:
    n = 3
    xs = _inputs(n)
    async with staged_cluster(n) as (cl, device):
        tensors = [FakeTensor.of(x) for x in xs]
        staged = await _all(cl, n, lambda i, c: c.all_reduce(tensors[i], op=op, tag=1))
        host = [x.copy() for x in xs]
        plain = await _all(cl, n, lambda i, c: c.all_reduce(host[i], op=op, tag=2))
    assert all(isinstance(r, pccl.ReduceInfo) for r in staged + plain), (staged, plain)
    for i in range(n):
        assert tensors[i].tobytes() == host[i].tobytes() == host[0].tobytes()
    # the result went to the "device" range by range during the data plane, not at the commit
    assert any(e[:2] == ("queue", "h2d") for e in device.log)
    assert not device.pending


async def test_a_failed_device_copy_fails_the_operation_and_restores_every_tensor() -> None:
    n = 3
    xs = _inputs(n)
    async with staged_cluster(n) as (cl, device):
        tensors = [FakeTensor.of(x) for x in xs]
        device.fail_when(lambda c: c.direction == "h2d")  # the first delivery, whoever's
        results = await _all(cl, n, lambda i, c: c.all_reduce(tensors[i], op=pccl.ReduceOp.AVG, tag=1))
        assert all(isinstance(r, pccl.PCCLError) for r in results), results
        for i in range(n):
            assert tensors[i].tobytes() == xs[i].tobytes(), f"peer {i}: tensor not restored"
        assert not device.pending
        # the group carries on
        results = await _all(cl, n, lambda i, c: c.all_reduce(tensors[i], op=pccl.ReduceOp.AVG, tag=1))
        assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
        assert all(t.tobytes() == tensors[0].tobytes() for t in tensors)


async def test_out_of_place_results_are_written_at_the_commit() -> None:
    n = 2
    xs = _inputs(n)
    async with staged_cluster(n) as (cl, device):
        sends = [FakeTensor.of(x) for x in xs]
        recvs = [FakeTensor.of(np.zeros(COUNT, np.float32)) for _ in range(n)]
        results = await _all(cl, n, lambda i, c: c.all_reduce(sends[i], recvs[i], tag=1))
    assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
    assert recvs[0].tobytes() == recvs[1].tobytes() == (xs[0] + xs[1]).tobytes()
    assert all(s.tobytes() == x.tobytes() for s, x in zip(sends, xs, strict=True))
    assert not any(e[:2] == ("queue", "h2d") for e in device.log)
