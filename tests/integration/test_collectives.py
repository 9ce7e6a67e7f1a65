"""Collectives through the full stack (master consensus + P2P ring) on loopback TCP."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import trio

import pccl
from pccl import ReduceOp
from pccl.peer.communicator import Communicator
from pccl.testing import BareTransport

from ._cluster import gather, loopback_cluster


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_all_reduce_sum_and_avg_numpy(n: int) -> None:
    async with loopback_cluster(n) as cl:
        rng = np.random.default_rng(n)
        data = [rng.standard_normal(1001).astype(np.float32) for _ in range(n)]
        outs = [np.zeros(1001, np.float32) for _ in range(n)]

        async def run(i: int, c: Communicator) -> pccl.ReduceInfo:
            return await c.all_reduce(data[i], outs[i], op=ReduceOp.SUM, tag=1)

        infos = await gather(cl.comms, run)
        assert all(inf.local_world_size == n for inf in infos)
        assert all(o.tobytes() == outs[0].tobytes() for o in outs)
        np.testing.assert_allclose(outs[0], np.sum(data, axis=0), rtol=1e-5, atol=1e-5)
        assert all(inf.tx_bytes > 0 and inf.rx_bytes > 0 for inf in infos)

        ints = [np.arange(10, dtype=np.int32) * (i + 1) for i in range(n)]

        async def avg(i: int, c: Communicator) -> None:
            await c.all_reduce(ints[i], op=ReduceOp.AVG, tag=2)  # in place

        await gather(cl.comms, avg)
        expect = (np.arange(10, dtype=np.int64) * sum(range(1, n + 1))) // n
        for x in ints:
            np.testing.assert_array_equal(x, expect.astype(np.int32))


async def test_statistics_report_where_collectives_spent_their_time() -> None:
    """statistics() splits each successful collective into vote, ring, confirm and commit: the
    latest one's phases, and running totals over the successful ones."""
    async with loopback_cluster(3) as cl:
        for c in cl.comms:
            s = c.statistics()
            assert s["last_op_phases"] == {}
            assert s["phase_seconds"] == {"vote": 0.0, "ring": 0.0, "confirm": 0.0, "commit": 0.0}
        xs = [np.full(3000, i, np.float32) for i in range(3)]

        async def run(i: int, c: Communicator) -> dict[str, float]:
            t0 = trio.current_time()
            await c.all_reduce(xs[i], op=ReduceOp.SUM, tag=1)
            elapsed = trio.current_time() - t0
            first: dict[str, float] = c.statistics()["last_op_phases"]
            assert set(first) == {"vote", "ring", "confirm", "commit"}
            assert all(v >= 0 for v in first.values())
            # the phases are consecutive slices of the call
            assert sum(first.values()) <= elapsed + 0.05
            await c.all_reduce(xs[i], op=ReduceOp.SUM, tag=2)
            s = c.statistics()
            second = s["last_op_phases"]
            for name, total in s["phase_seconds"].items():
                assert total == pytest.approx(first[name] + second[name])
            return first

        await gather(cl.comms, run)
        np.testing.assert_array_equal(xs[0], np.full(3000, 9, np.float32))


@pytest.mark.parametrize("n", [2, 3])  # 2: the exchange plan; 3: the ring
async def test_collectives_over_a_transport_without_extras(n: int) -> None:
    """Over streams with only the protocol's required methods (no TCP socket, no try_send), the
    master queues every message for its writer task and the pool takes its generic path; the
    results are the same."""
    async with loopback_cluster(n, transport=BareTransport()) as cl:
        rng = np.random.default_rng(n)
        data = [rng.standard_normal(5000).astype(np.float32) for _ in range(n)]
        outs = [np.zeros(5000, np.float32) for _ in range(n)]

        async def run(i: int, c: Communicator) -> None:
            for tag in range(3):  # a few in a row: votes and completes through the writer tasks
                await c.all_reduce(data[i], outs[i], op=ReduceOp.MAX, tag=tag)

        await gather(cl.comms, run)
        assert all(o.tobytes() == np.maximum.reduce(data).tobytes() for o in outs)


async def test_all_reduce_torch_tensors_and_small_counts() -> None:
    async with loopback_cluster(3) as cl:
        ts = [torch.full((2,), float(i + 1)) for i in range(3)]

        async def run(i: int, c: Communicator) -> None:
            await c.all_reduce(ts[i], op=ReduceOp.MAX)

        await gather(cl.comms, run)
        assert all(torch.equal(t, torch.full((2,), 3.0)) for t in ts)


async def test_concurrent_tags_and_duplicate_refused() -> None:
    async with loopback_cluster(2) as cl:
        a = [np.full(50_000, i + 1, np.float64) for i in range(2)]
        b = [np.full(70_001, 10 * (i + 1), np.float64) for i in range(2)]

        async def run(i: int, c: Communicator) -> None:
            async with trio.open_nursery() as n:
                n.start_soon(lambda: c.all_reduce(a[i], tag=1))
                n.start_soon(lambda: c.all_reduce(b[i], tag=2))

        await gather(cl.comms, run)
        assert all((x == 3).all() for x in a) and all((x == 30).all() for x in b)

        # a duplicate running tag is refused; the running one is unaffected
        c0, c1 = cl.comms
        x0, x1 = np.ones(1000, np.float32), np.ones(1000, np.float32)
        async with trio.open_nursery() as n:
            n.start_soon(lambda: c0.all_reduce(x0, tag=5))
            # c0's call has registered its tag (it now waits for c1's vote)
            while 5 not in c0.statistics()["op_tags"]:
                await trio.sleep(0)
            with pytest.raises(pccl.InvalidUsageError):
                await c0.all_reduce(np.ones(3, np.float32), tag=5)
            n.start_soon(lambda: c1.all_reduce(x1, tag=5))
        assert (x0 == 2).all() and (x1 == 2).all()


async def test_too_few_peers() -> None:
    async with loopback_cluster(1) as cl:
        with pytest.raises(pccl.TooFewPeersError) as ei:
            await cl.comms[0].all_reduce(np.ones(4, np.float32))
        assert ei.value.result == pccl.Result.TOO_FEW_PEERS


async def test_broadcast_all_gather_reduce_scatter() -> None:
    async with loopback_cluster(3) as cl:
        comms = cl.comms
        bufs = [np.full(10, i, np.int64) for i in range(3)]

        async def bc(i: int, c: Communicator) -> None:
            await c.broadcast(bufs[i], root=1)

        await gather(comms, bc)
        root_val = comms[0].group_ring.index(comms[0].group_ring[1])
        vals = {int(b[0]) for b in bufs}
        assert len(vals) == 1 and all((b == b[0]).all() for b in bufs)
        assert root_val == 1

        outs = [np.zeros(3 * 4, np.float32) for _ in range(3)]

        async def ag(i: int, c: Communicator) -> None:
            await c.all_gather(np.full(4, float(c.peer_id), np.float32), outs[i])

        await gather(comms, ag)
        ring = comms[0].group_ring
        expect = np.concatenate([np.full(4, float(p), np.float32) for p in ring])
        assert all((o == expect).all() for o in outs)

        rs_out = [np.zeros(10, np.float32) for _ in range(3)]

        async def rs(i: int, c: Communicator) -> slice:
            _, chunk = await c.reduce_scatter(np.arange(10, dtype=np.float32), rs_out[i])
            return chunk

        chunks = await gather(comms, rs)
        covered = np.zeros(10, bool)
        for o, ch in zip(rs_out, chunks, strict=True):
            np.testing.assert_array_equal(o[ch], 3 * np.arange(10, dtype=np.float32)[ch])
            covered[ch] = True
        assert covered.all()


async def test_peer_killed_mid_op_survivors_restore_and_retry() -> None:
    async with loopback_cluster(3) as cl:
        victim = cl.comms[2]
        survivors = cl.comms[:2]
        count = 4_000_000
        bufs = [np.full(count, float(i + 1), np.float32) for i in range(2)]
        before = [b.copy() for b in bufs]
        errors: list[BaseException] = []

        async def survivor(i: int, c: Communicator) -> None:
            try:
                await c.all_reduce(bufs[i], tag=9)
            except pccl.PCCLError as exc:
                errors.append(exc)

        async with trio.open_nursery() as n:
            for i, c in enumerate(survivors):
                n.start_soon(survivor, i, c)

            async def victim_call() -> None:
                # the victim's own call ends with an error when it is killed (closed communicator)
                with pytest.raises(pccl.PCCLError):
                    await victim.all_reduce(np.ones(count, np.float32), tag=9)

            n.start_soon(victim_call)
            # kill the victim once the master said "commence": the op cannot complete without it
            while victim.statistics()["ops"].get(9, -1) == -1:
                await trio.sleep(0.0005)
            cl.kill(victim)
        assert len(errors) == 2, errors
        assert all(isinstance(e, pccl.RankConnectionLostError) for e in errors)
        for b, b0 in zip(bufs, before, strict=True):
            assert b.tobytes() == b0.tobytes()
        # retry with the smaller group
        await gather(survivors, lambda i, c: c.all_reduce(bufs[i], tag=9))
        assert all((b == 3.0).all() for b in bufs)


async def test_mixed_devices_refused_before_voting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A send the backend reports as CUDA with a CPU recv is refused locally, before voting; the other
    peer's op is not disturbed. (The GPU paths themselves run in test_gpu_collectives.py, on a GPU.)"""
    from pccl.kernels import backend

    real = backend.device_index
    fake_gpu = np.ones(4, np.float32)

    def device_index(t: Any) -> int:
        return 0 if t is fake_gpu else real(t)

    monkeypatch.setattr(backend, "device_index", device_index)
    async with loopback_cluster(2) as cl:
        out = np.zeros(4, np.float32)
        with pytest.raises(pccl.InvalidArgumentError, match="but recv is on the CPU"):
            await cl.comms[0].all_reduce(fake_gpu, out)
        assert out.tobytes() == np.zeros(4, np.float32).tobytes()
        assert cl.master.statistics()["collectives_voting"] == 0
        xs = [np.ones(4, np.float32) for _ in range(2)]
        await gather(cl.comms, lambda i, c: c.all_reduce(xs[i]))
        assert all((x == 2).all() for x in xs)
