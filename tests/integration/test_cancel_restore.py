"""A caller-cancelled or aborted all-reduce leaves the caller's buffer exactly as it was.

The ring fills a scratch buffer; the caller's buffer is written only after the master confirms that
every participant finished. These tests cancel or fail the call in the middle of the ring (after data
provably moved), in place and out of place, and check that every peer's buffer holds its pre-call
bits afterwards and that the group recovers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl.testing import VirtualNetwork, open_test_cluster
from pccl.wire import messages as m

from ._cluster import cancel_peer0_mid_ring, gather, kill_peer2_mid_ring

COUNT = 1 << 20  # 4 MB of float32: ~0.1 s per ring step at 10 MB/s


async def _retry(cl: Any, sends: list[np.ndarray]) -> list[np.ndarray]:
    """Every peer all-reduces its ``sends[i]`` again (out of place); the outputs."""
    out = [np.empty_like(s) for s in sends]
    await gather([cl.peer(i) for i in range(len(sends))], lambda i, c: c.all_reduce(sends[i], out[i]))
    return out


def _inputs(n: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).standard_normal(COUNT).astype(np.float32) for i in range(n)]


@pytest.mark.parametrize("in_place", [True, False])
async def test_cancelled_mid_ring_restores_every_buffer(
    autojump_clock: trio.testing.MockClock, in_place: bool
) -> None:
    net = VirtualNetwork(latency=0.0005, bandwidth=10e6)
    async with open_test_cluster(3, network=net) as cl:
        sends = _inputs(3)
        recvs = [s if in_place else np.full(COUNT, -7.0, np.float32) for s in sends]
        before = [r.tobytes() for r in recvs]
        # cancel in the middle of the ring: once peer 0 has received a first chunk
        results = await cancel_peer0_mid_ring(
            cl, lambda i: cl.peer(i).all_reduce(sends[i], None if in_place else recvs[i], tag=5), COUNT
        )
        for i in (1, 2):
            assert isinstance(results[i], pccl.RankConnectionLostError), results[i]
        for i in range(3):
            assert recvs[i].tobytes() == before[i], f"peer {i}: buffer not restored"
        # the group carries on: a retry gives the exact reduction
        out = await _retry(cl, sends)
        assert all(o.tobytes() == out[0].tobytes() for o in out)
        np.testing.assert_allclose(out[0], sends[0] + sends[1] + sends[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_place", [True, False])
async def test_two_peer_exchange_cancelled_mid_transfer_restores_both(
    autojump_clock: trio.testing.MockClock, in_place: bool
) -> None:
    """Two peers and 256 KB take the one-step exchange plan (one frame each way, no dependencies):
    a cancellation half-way through the transfer still leaves both buffers bit-identical."""
    count = 64 << 10
    net = VirtualNetwork(latency=0.0005, bandwidth=1e6)  # 0.26 s per direction
    async with open_test_cluster(2, network=net) as cl:
        sends = [np.random.default_rng(i).standard_normal(count).astype(np.float32) for i in range(2)]
        recvs = [s if in_place else np.full(count, -7.0, np.float32) for s in sends]
        before = [r.tobytes() for r in recvs]
        results: dict[int, object] = {}
        cancel0 = trio.CancelScope()

        async def call(i: int) -> None:
            try:
                with cancel0 if i == 0 else trio.CancelScope():
                    results[i] = await cl.peer(i).all_reduce(sends[i], None if in_place else recvs[i], tag=6)
            except pccl.PCCLError as exc:
                results[i] = exc

        base = net.statistics().bytes_delivered
        async with trio.open_nursery() as n:
            n.start_soon(call, 0)
            n.start_soon(call, 1)
            while (moved := net.statistics().bytes_delivered - base) < count * 4 // 2:
                await trio.sleep(0.001)  # virtual time: wait until half the bytes have moved
            cancel0.cancel()
        assert moved < 2 * count * 4, moved  # in the middle of the transfer
        assert 0 not in results  # cancelled
        assert isinstance(results[1], pccl.RankConnectionLostError), results[1]
        for i in range(2):
            assert recvs[i].tobytes() == before[i], f"peer {i}: buffer not restored"
        out = await _retry(cl, sends)
        assert out[0].tobytes() == out[1].tobytes() == (sends[0] + sends[1]).tobytes()


async def test_peer_killed_mid_ring_restores_survivor_in_place_buffers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.0005, bandwidth=10e6)
    async with open_test_cluster(3, network=net) as cl:
        sends = _inputs(3)
        before = [s.tobytes() for s in sends]
        # mid-ring: both survivors have received at least a first chunk
        results = await kill_peer2_mid_ring(
            cl, lambda i: cl.peer(i).all_reduce(sends[i], op=pccl.ReduceOp.AVG, tag=5), COUNT
        )
        for i in (0, 1):
            assert isinstance(results[i], pccl.RankConnectionLostError), results[i]
            assert sends[i].tobytes() == before[i], f"peer {i}: buffer not restored"


async def test_abort_right_behind_commence_does_not_start_the_ring(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Commence and abort of the same op processed back to back, before the calling task runs again
    (a peer died just after the master commenced): the call must fail at once with the abort's
    error, not enter a ring the others have already left (that hung until a neighbour died)."""
    net = VirtualNetwork(latency=0.0005)
    async with open_test_cluster(3, network=net) as cl:
        comm = cl.peer(0)
        x = np.arange(8, dtype=np.float32)
        before = x.tobytes()
        result: list[object] = []

        async def call() -> None:
            try:
                result.append(await comm.all_reduce(x, tag=11))
            except pccl.PCCLError as exc:
                result.append(exc)

        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(call)
                # wait until the master holds this peer's vote (peers 1 and 2 never vote)
                voting = "collective tag 11 (group 0) vote waits"
                while not any(ln.startswith(voting) for ln in cl.master.state.pending_summary()):
                    await trio.sleep(0.001)
                rows = [r for r in comm.table if r.group == comm.peer_group]
                # What the reader task does for two messages that arrive together: no checkpoint between.
                comm.handle_master_message(m.CollectiveCommence(tag=11, op_seq=777, peers=rows))
                comm.handle_master_message(
                    m.CollectiveAbort(tag=11, op_seq=777, code=int(pccl.Result.RANK_CONNECTION_LOST),
                                      reason="peer 3 was lost during the operation")
                )
        assert len(result) == 1 and isinstance(result[0], pccl.RankConnectionLostError), result
        assert "peer 3 was lost" in str(result[0])
        assert x.tobytes() == before
        assert comm.statistics()["pool"]["tx_bytes"] == 0  # no ring frame left this peer
