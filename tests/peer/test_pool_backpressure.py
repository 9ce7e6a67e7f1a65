"""Backpressure of the ring pool's early-frame stash (pccl/peer/pool.py): a frame that has no receive and
does not fit in the stash stops its connection until the receive is registered (then it lands in place),
its operation is forgotten (dropped), room frees (stashed), or ``p2p_stall_timeout`` passes (the
connection is closed with a logged reason). Two pools on the virtual network, virtual time."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from pccl import PeerConfig, RankConnectionLostError
from pccl.peer.p2p import serve_p2p
from pccl.peer.pool import P2PPool
from pccl.testing import VirtualNetwork

SENDER, RECEIVER = 1, 2
STALL = 5.0


def config(limit: int, stall: float = STALL) -> PeerConfig:
    return PeerConfig(connect_timeout=5.0, recv_stash_limit=limit, p2p_stall_timeout=stall)


@asynccontextmanager
async def pair(cfg: PeerConfig, pool_size: int = 1) -> AsyncIterator[tuple[P2PPool, P2PPool]]:
    """A sender pool connected to a receiver pool over the virtual network."""
    net = VirtualNetwork(loopback=True)
    async with trio.open_nursery() as nursery:
        a = P2PPool(transport=net.host("a"), my_peer_id=SENDER, pool_size=pool_size, config=cfg)
        b = P2PPool(transport=net.host("b"), my_peer_id=RECEIVER, pool_size=pool_size, config=cfg)
        serve = functools.partial(serve_p2p, config=cfg)
        host, port = await nursery.start(serve, b.transport, "127.0.0.1", 0, {"ring": b.handle_incoming})
        await a.connect(RECEIVER, host, port)
        await until(lambda: b.statistics()["incoming"].get(SENDER, 0) == pool_size)
        try:
            yield a, b
        finally:
            await a.aclose()
            await b.aclose()
            nursery.cancel_scope.cancel()


async def until(predicate: Callable[[], bool]) -> None:
    """Wait for a state of the pools (checked on every scheduling pass, never a delay)."""
    with trio.fail_after(1):
        while not predicate():
            await trio.sleep(0)


def payload(n: int, fill: int) -> memoryview:
    return memoryview(bytes([fill]) * n)


async def test_frame_that_does_not_fit_waits_for_its_receive_and_lands_in_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Frame (op 1, seq 1) has no receive and no room: the connection stops, so op 2's frame behind it
    waits too (its receive is registered). Registering op 1's receive lets both through; nothing is
    dropped, the blocked frame is never stashed, and the stash never holds more than its limit."""
    async with pair(config(1000)) as (a, b):
        later = bytearray(100)
        op2 = b.expect(SENDER, 0, 2, 0, memoryview(later))
        await a.send(RECEIVER, 0, 1, 0, payload(600, 1), conn_index=0)  # stashed
        await a.send(RECEIVER, 0, 1, 1, payload(600, 2), conn_index=0)  # does not fit: blocks
        await a.send(RECEIVER, 0, 2, 0, payload(100, 3), conn_index=0)  # queued behind it
        await until(lambda: b.statistics()["readers_blocked"] == 1)
        await trio.sleep(STALL / 2)  # well inside the bound: still waiting, nothing closed
        s = b.statistics()
        assert s["readers_blocked"] == 1 and s["stashed_bytes"] == 600 and s["incoming"] == {SENDER: 1}
        assert not op2.done
        second, first = bytearray(600), bytearray(600)
        slot = b.expect(SENDER, 0, 1, 1, memoryview(second))
        await slot.wait()
        await op2.wait()
        done = b.expect(SENDER, 0, 1, 0, memoryview(first))  # from the stash
        await done.wait()
        assert (bytes(first), bytes(second), bytes(later)) == (b"\x01" * 600, b"\x02" * 600, b"\x03" * 100)
        s = b.statistics()
        assert s["frames_stashed_total"] == 1 and s["stash_peak_bytes"] <= 1000
        assert s["reader_blocks_total"] == 1 and s["readers_blocked"] == 0 and s["stashed_bytes"] == 0


async def test_zero_limit_never_stashes_and_a_forgotten_op_unblocks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With ``recv_stash_limit=0`` every early frame waits for its receive; a waiting frame of an
    operation that is then forgotten is read and dropped, and the stream stays in sync."""
    async with pair(config(0)) as (a, b):
        await a.send(RECEIVER, 7, 5, 0, payload(300, 9), conn_index=0)
        await a.send(RECEIVER, 7, 6, 0, payload(300, 4), conn_index=0)
        await until(lambda: b.statistics()["readers_blocked"] == 1)
        dest = bytearray(300)
        slot = b.expect(SENDER, 7, 6, 0, memoryview(dest))
        assert not slot.done
        b.forget_op(5)
        await slot.wait()
        assert bytes(dest) == b"\x04" * 300
        s = b.statistics()
        assert s["bytes_discarded"] == 300 and s["frames_stashed_total"] == 0 and s["stash_peak_bytes"] == 0


async def test_blocked_frame_is_stashed_once_room_frees(autojump_clock: trio.testing.MockClock) -> None:
    async with pair(config(1000)) as (a, b):
        await a.send(RECEIVER, 0, 1, 0, payload(600, 1), conn_index=0)
        await a.send(RECEIVER, 0, 1, 1, payload(600, 2), conn_index=0)
        await until(lambda: b.statistics()["readers_blocked"] == 1)
        first = bytearray(600)
        b.expect(SENDER, 0, 1, 0, memoryview(first))  # claims the stashed frame: room for the other
        assert bytes(first) == b"\x01" * 600
        await until(lambda: b.statistics()["frames_stashed_total"] == 2)
        s = b.statistics()
        assert s["readers_blocked"] == 0 and s["stashed_bytes"] == 600
        second = bytearray(600)
        b.expect(SENDER, 0, 1, 1, memoryview(second))
        assert bytes(second) == b"\x02" * 600


async def test_a_frame_larger_than_the_whole_stash_waits_instead_of_failing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with pair(config(1000)) as (a, b):
        await a.send(RECEIVER, 0, 1, 0, payload(5000, 6), conn_index=0)
        await until(lambda: b.statistics()["readers_blocked"] == 1)
        dest = bytearray(5000)
        slot = b.expect(SENDER, 0, 1, 0, memoryview(dest))
        await slot.wait()
        assert bytes(dest) == b"\x06" * 5000 and b.statistics()["stash_peak_bytes"] == 0


async def test_connection_blocked_past_the_bound_is_closed_with_a_logged_reason(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing ever claims the frame: after ``p2p_stall_timeout`` the connection is closed with the
    reason logged, pending receives from that peer fail, and what it stashed is released."""
    async with pair(config(1000)) as (a, b):
        pending = b.expect(SENDER, 0, 1, 5, memoryview(bytearray(1)))
        await a.send(RECEIVER, 0, 1, 0, payload(600, 1), conn_index=0)
        await a.send(RECEIVER, 0, 1, 1, payload(600, 2), conn_index=0)  # over the limit
        await until(lambda: b.statistics()["readers_blocked"] == 1)
        assert b.statistics()["stashed_frames"] == 1
        t0 = trio.current_time()
        with caplog.at_level(logging.WARNING, logger="pccl.p2p"):
            with pytest.raises(RankConnectionLostError, match="stash is full"):
                await pending.wait()
        assert STALL <= trio.current_time() - t0 <= STALL + 0.01
        assert "waited 5s (p2p_stall_timeout) for its receive while the stash is full" in caplog.text
        s = b.statistics()
        assert s["incoming"] == {} and s["stashed_bytes"] == 0 and s["blocked_connections_dropped"] == 1
        with pytest.raises(RankConnectionLostError):  # the sender's side is gone too
            for seq in range(2, 100):
                await a.send(RECEIVER, 0, 1, seq, payload(600, 0), conn_index=0)


async def test_disconnect_ends_a_blocked_reader(autojump_clock: trio.testing.MockClock) -> None:
    async with pair(config(0)) as (a, b):
        await a.send(RECEIVER, 0, 1, 0, payload(600, 1), conn_index=0)
        await until(lambda: b.statistics()["readers_blocked"] == 1)
        await b.disconnect(SENDER)
        await until(lambda: b.statistics()["readers_blocked"] == 0)
        assert b.statistics()["blocked_connections_dropped"] == 0 and b.statistics()["incoming"] == {}


async def test_a_blocked_connection_does_not_hold_up_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two connections: one waits on a frame nobody claims, the other keeps delivering (early frames
    included, as long as there is room)."""
    async with pair(config(1000), pool_size=2) as (a, b):
        await a.send(RECEIVER, 0, 9, 0, payload(1000, 1), conn_index=0)  # fills the stash
        await a.send(RECEIVER, 0, 9, 1, payload(10, 1), conn_index=0)  # blocks connection 0
        await until(lambda: b.statistics()["readers_blocked"] == 1)
        for op_seq in range(20, 30):
            dest = bytearray(200)
            slot = b.expect(SENDER, 1, op_seq, 0, memoryview(dest))
            await a.send(RECEIVER, 1, op_seq, 0, payload(200, op_seq), conn_index=1)
            await slot.wait()
            assert bytes(dest) == bytes([op_seq]) * 200
        assert b.statistics()["readers_blocked"] == 1


def test_config_rejects_a_negative_limit_and_a_zero_bound() -> None:
    with pytest.raises(ValueError, match="recv_stash_limit"):
        PeerConfig(recv_stash_limit=-1)
    with pytest.raises(ValueError, match="p2p_stall_timeout"):
        PeerConfig(p2p_stall_timeout=0)
