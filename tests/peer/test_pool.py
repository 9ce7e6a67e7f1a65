"""The ring connection pool: data-frame headers, routing, stashing, dropping, failures, safety of
destinations after an operation is forgotten."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from pccl import (
    InvalidUsageError,
    PeerConfig,
    RankConnectionFailedError,
    RankConnectionLostError,
)
from pccl import transport as transport_module
from pccl._errors import LocalProtocolError, RemoteProtocolError
from pccl.peer.p2p import open_p2p, serve_p2p
from pccl.peer.pool import P2PPool
from pccl.peer.ring_conn import SocketConn
from pccl.testing import BareTransport, wait_until
from pccl.transport import Address, StreamBroken, TcpStream, TcpTransport, Transport
from pccl.wire.data import (
    DATA_HEADER_SIZE,
    MAX_DATA_FRAME_LENGTH,
    pack_data_header,
    pack_data_header_into,
    unpack_data_header,
    unpack_data_header_fields,
)

CONFIG = PeerConfig(connect_timeout=5.0)

# ---------------------------------------------------------------------------------------------
# data-frame header (pccl/wire/data.py)


def test_header_round_trip_and_layout() -> None:
    raw = pack_data_header(2**64 - 1, 2**32 - 1, 7, 123456)
    assert len(raw) == DATA_HEADER_SIZE == 32
    h = unpack_data_header(raw)
    assert (h.tag, h.op_seq, h.seq, h.length, h.flags) == (2**64 - 1, 2**32 - 1, 7, 123456, 0)
    assert unpack_data_header_fields(raw) == (2**64 - 1, 2**32 - 1, 7, 123456)
    assert raw[:4] == b"PCD1"
    buf = bytearray(32)
    pack_data_header_into(buf, 1, 2, 3, 4)
    assert bytes(buf) == pack_data_header(1, 2, 3, 4)


def test_header_validation() -> None:
    good = pack_data_header(1, 2, 3, 100)
    with pytest.raises(RemoteProtocolError, match="magic"):
        unpack_data_header(b"XXXX" + good[4:])
    with pytest.raises(RemoteProtocolError, match="flags"):
        unpack_data_header(good[:4] + b"\x01\x00\x00\x00" + good[8:])
    with pytest.raises(RemoteProtocolError, match="limit"):
        unpack_data_header(good, max_length=99)
    with pytest.raises(RemoteProtocolError):
        unpack_data_header(good[:31])
    with pytest.raises(RemoteProtocolError):
        unpack_data_header_fields(b"XXXX" + good[4:])
    for bad in [(-1, 0, 0, 0), (0, 2**32, 0, 0), (0, 0, 2**32, 0), (0, 0, 0, MAX_DATA_FRAME_LENGTH + 1)]:
        with pytest.raises(LocalProtocolError):
            pack_data_header(*bad)
        with pytest.raises(LocalProtocolError):
            pack_data_header_into(bytearray(32), *bad)


# ---------------------------------------------------------------------------------------------
# pools over loopback TCP


# BareTransport hides the TCP socket, so the pool uses its generic stream path.
def tcp_only() -> TcpTransport:
    """Loopback TCP: the TcpTransport without its same-host shortcut (the default now takes it)."""
    return TcpTransport(same_host=False)


# Both fast paths (TCP, and the same-host shortcut's Unix socket) and the generic stream path.
TRANSPORTS: list[Callable[[], Transport]] = [tcp_only, TcpTransport, BareTransport]


@asynccontextmanager
async def pools(
    ids: list[int], *, pool_size: int = 1, transport: Callable[[], Transport] = TcpTransport,
    config: PeerConfig = CONFIG,
) -> AsyncIterator[tuple[list[P2PPool], list[Address]]]:
    async with trio.open_nursery() as nursery:
        ps = [P2PPool(transport=transport(), my_peer_id=i, pool_size=pool_size, config=config) for i in ids]
        addrs: list[Address] = []
        for p in ps:
            serve = functools.partial(serve_p2p, config=config)
            addrs.append(await nursery.start(serve, p.transport, "127.0.0.1", 0, {"ring": p.handle_incoming}))
        try:
            yield ps, addrs
        finally:
            for p in ps:
                await p.aclose()
            nursery.cancel_scope.cancel()


def incoming(pool: P2PPool, peer: int) -> int:
    return int(pool.statistics()["incoming"].get(peer, 0))


async def connected_pair(a: P2PPool, b: P2PPool, b_addr: Address) -> None:
    await a.connect(b.my_peer_id, *b_addr)
    await wait_until(lambda: incoming(b, a.my_peer_id) == a.pool_size)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_send_expect_and_stash(transport: Callable[[], Transport]) -> None:
    async with pools([1, 2], pool_size=2, transport=transport) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        # registered first: lands straight in dest
        dest = bytearray(100_000)
        slot = b.expect(1, 5, 9, 0, memoryview(dest))
        payload = bytes(range(256)) * 390 + b"x" * 160
        await a.send(2, 5, 9, 0, memoryview(payload), conn_index=1)
        await slot.wait()
        assert dest == payload
        # sent first: stashed, then copied on registration
        await a.send(2, 5, 9, 1, memoryview(b"abc"), conn_index=0)
        await wait_until(lambda: b.statistics()["stashed_frames"] == 1)
        dest2 = bytearray(3)
        slot2 = b.expect(1, 5, 9, 1, memoryview(dest2))
        assert slot2.done and dest2 == b"abc"
        await slot2.wait()
        # zero-length frames work too
        slot3 = b.expect(1, 5, 9, 2, memoryview(bytearray(0)))
        await a.send(2, 5, 9, 2, memoryview(b""), conn_index=0)
        await slot3.wait()
        s = b.statistics()
        assert s["stashed_bytes"] == 0 and s["pending_receives"] == 0 and s["frames_received"] == 3
        assert a.statistics()["tx_bytes"] == len(payload) + 3
        assert "P2PPool peer=2" in repr(b) and "ReceiveSlot" in repr(slot)


async def test_reader_lets_a_runnable_op_register_before_stashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame whose operation task is already runnable (it got the master's go-ahead) but has not
    registered its receives yet lands straight in the destination instead of being stashed: the
    reader yields a few scheduler passes first (a stashed frame costs a fresh buffer and a second
    copy, and filling the stash kept the operation's task from running)."""
    import pccl.peer.ring_reader as reader_module

    header_seen = trio.Event()
    real_unpack = unpack_data_header_fields  # the function reader_module imported (not re-exported)

    def unpack(buf: Any) -> Any:
        fields = real_unpack(buf)
        if fields[2] == 1:  # seq 1: the frame under test
            header_seen.set()
        return fields

    monkeypatch.setattr(reader_module, "unpack_data_header_fields", unpack)
    async with pools([1, 2]) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        dest = bytearray(3 << 20)
        payload = bytes(range(256)) * (3 << 12)

        async def operation() -> None:
            await header_seen.wait()  # "the go-ahead arrived": runnable while the reader holds the header
            for _ in range(3):  # a few steps to its receives, as in the communicator
                await trio.lowlevel.checkpoint()
            await b.expect(1, 5, 9, 1, memoryview(dest)).wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(operation)
            await a.send(2, 5, 9, 1, memoryview(payload), conn_index=0)
        assert dest == payload
        s = b.statistics()
        assert s["frames_stashed_total"] == 0 and s["frames_received"] == 1


async def test_connect_is_idempotent_and_disconnect_rebuilds() -> None:
    async with pools([1, 2], pool_size=3) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        assert a.is_connected(2)
        await a.connect(2, *b_addr)
        assert a.statistics()["outgoing"] == {2: 3}
        assert incoming(b, 1) == 3  # no extra connections were opened
        pending = b.expect(1, 0, 1, 0, memoryview(bytearray(8)))
        await a.disconnect(2)
        assert not a.is_connected(2)
        with pytest.raises(RankConnectionLostError):
            await a.send(2, 0, 1, 0, memoryview(b"12345678"), conn_index=0)
        await wait_until(lambda: incoming(b, 1) == 0)
        with pytest.raises(RankConnectionLostError):  # its connections from 1 broke
            await pending.wait()
        await connected_pair(a, b, b_addr)
        slot = b.expect(1, 0, 2, 0, memoryview(bytearray(8)))
        await a.send(2, 0, 2, 0, memoryview(b"12345678"), conn_index=2)
        await slot.wait()


async def test_connect_failure_and_remote_close_detection() -> None:
    async with pools([1, 2]) as ((a, b), (_, b_addr)):
        listener = await TcpTransport().listen("127.0.0.1", 0)
        dead_port = listener.address[1]
        await listener.aclose()
        with pytest.raises(RankConnectionFailedError):
            await a.connect(9, "127.0.0.1", dead_port)
        assert not a.is_connected(9)
        await connected_pair(a, b, b_addr)
        await b.aclose()  # the other side goes away: its end of every connection closes
        await wait_until(lambda: not a.is_connected(2))


async def test_frames_of_forgotten_ops_are_dropped_and_the_stream_stays_in_sync() -> None:
    async with pools([1, 2]) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        b.forget_op(7)
        await a.send(2, 1, 7, 0, memoryview(b"z" * 3_000_000), conn_index=0)
        dest = bytearray(4)
        slot = b.expect(1, 1, 8, 0, memoryview(dest))
        await a.send(2, 1, 8, 0, memoryview(b"next"), conn_index=0)
        await slot.wait()
        assert dest == b"next"
        assert b.statistics()["bytes_discarded"] == 3_000_000
        with pytest.raises(InvalidUsageError):
            b.expect(1, 1, 7, 1, memoryview(bytearray(1)))
        b.expect(1, 1, 8, 1, memoryview(bytearray(1)))
        with pytest.raises(LocalProtocolError):
            b.expect(1, 1, 8, 1, memoryview(bytearray(1)))


async def test_forget_op_drops_pending_receives_and_stashes() -> None:
    async with pools([1, 2]) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        await a.send(2, 1, 3, 0, memoryview(b"early"), conn_index=0)
        await wait_until(lambda: b.statistics()["stashed_frames"] == 1)
        slot = b.expect(1, 1, 3, 1, memoryview(bytearray(5)))
        b.forget_op(3)
        assert b.statistics()["stashed_frames"] == 0 and b.statistics()["pending_receives"] == 0
        with pytest.raises(RankConnectionLostError, match="aborted"):
            await slot.wait()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_no_write_into_dest_after_forget_op_even_mid_frame(transport: Callable[[], Transport]) -> None:
    """A reader in the middle of a frame must stop writing into a forgotten destination."""
    async with pools([2], transport=transport) as ((b,), (b_addr,)):
        ms = await open_p2p(transport(), *b_addr, my_peer_id=1, channel="ring", config=CONFIG)
        await wait_until(lambda: incoming(b, 1) == 1)
        size = 4 << 20
        dest = bytearray(size)
        slot = b.expect(1, 1, 5, 0, memoryview(dest))
        await ms.stream.send_all(pack_data_header(1, 5, 0, size) + b"\x01" * (1 << 20))
        await wait_until(lambda: dest[(1 << 20) - 1] == 1)  # the first MiB has landed in dest
        b.forget_op(5)
        snapshot = bytes(dest)
        after = bytearray(3)
        slot2 = b.expect(1, 1, 6, 0, memoryview(after))
        await ms.stream.send_all(b"\x02" * (size - (1 << 20)) + pack_data_header(1, 6, 0, 3) + b"abc")
        await slot2.wait()
        assert after == b"abc"  # the stream stayed in sync through the dropped remainder
        assert bytes(dest) == snapshot  # and nothing was written into the forgotten destination
        with pytest.raises(RankConnectionLostError):
            await slot.wait()
        await ms.aclose()


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"NOPE" + pack_data_header(1, 1, 0, 8)[4:] + b"12345678", "magic"),
        (pack_data_header(1, 1, 0, 5) + b"short", "expected"),  # the registered receive wants 8 bytes
    ],
)
async def test_protocol_violations_close_the_connection(frame: bytes, reason: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    async with pools([2]) as ((b,), (b_addr,)):
        ms = await open_p2p(TcpTransport(), *b_addr, my_peer_id=1, channel="ring", config=CONFIG)
        await wait_until(lambda: incoming(b, 1) == 1)
        slot = b.expect(1, 1, 1, 0, memoryview(bytearray(8)))
        with caplog.at_level(logging.WARNING, logger="pccl.p2p"):
            await ms.stream.send_all(frame)
            with pytest.raises((RankConnectionLostError, RemoteProtocolError)):
                await slot.wait()
            await wait_until(lambda: incoming(b, 1) == 0)
        assert any(reason in r.getMessage() for r in caplog.records)
        try:
            assert await ms.stream.receive_some() == b""
        except StreamBroken:
            # A reset: the pool closed with the rest of the bad frame unread, which a Unix socket (the
            # same-host shortcut) reports to the other side as a reset; TCP here as an end of stream.
            assert isinstance(ms.stream, TcpStream) and ms.stream.same_host
        await ms.aclose()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_full_stash_stops_the_connection_until_the_receive_is_registered(
    transport: Callable[[], Transport],
) -> None:
    """Backpressure on both read paths (TCP fast path and generic stream): a frame with no receive and
    no room holds its connection, frames behind it wait, and registering its receive lets it land in
    place (not stashed) and the rest follow."""
    cfg = PeerConfig(connect_timeout=5.0, recv_stash_limit=1000)
    async with pools([1, 2], transport=transport, config=cfg) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        behind = bytearray(300)
        op2 = b.expect(1, 0, 2, 0, memoryview(behind))
        await a.send(2, 0, 1, 0, memoryview(b"\x01" * 600), conn_index=0)
        await a.send(2, 0, 1, 1, memoryview(b"\x02" * 700), conn_index=0)  # no room: blocks
        await a.send(2, 0, 2, 0, memoryview(b"\x03" * 300), conn_index=0)
        await wait_until(lambda: b.statistics()["readers_blocked"] == 1)
        assert not op2.done and b.statistics()["stashed_bytes"] == 600
        second = bytearray(700)
        await b.expect(1, 0, 1, 1, memoryview(second)).wait()
        await op2.wait()
        first = bytearray(600)
        await b.expect(1, 0, 1, 0, memoryview(first)).wait()
        assert (bytes(first), bytes(second), bytes(behind)) == (b"\x01" * 600, b"\x02" * 700, b"\x03" * 300)
        s = b.statistics()
        assert s["frames_stashed_total"] == 1 and s["stash_peak_bytes"] == 600 and s["stashed_bytes"] == 0


# A full stash no longer closes the connection at once: the reader waits (backpressure) and closes it only
# after p2p_stall_timeout. That test (same assertions: the pending receive fails with "stash is full", the
# sender's side is gone) moved to test_pool_backpressure.py, which runs it in virtual time.


async def test_reconnected_slot_supersedes_the_old_connection_quietly() -> None:
    async with pools([2]) as ((b,), (b_addr,)):
        first = await open_p2p(TcpTransport(), *b_addr, my_peer_id=1, channel="ring", config=CONFIG)
        await wait_until(lambda: incoming(b, 1) == 1)
        slot = b.expect(1, 1, 1, 0, memoryview(bytearray(2)))
        second = await open_p2p(TcpTransport(), *b_addr, my_peer_id=1, channel="ring", config=CONFIG)
        assert await first.stream.receive_some() == b""  # the old one was closed
        assert not slot.done  # ... without failing receives that the new one will carry
        await second.stream.send_all(pack_data_header(1, 1, 0, 2) + b"ok")
        await slot.wait()
        await first.aclose()
        await second.aclose()


async def test_concurrent_frames_on_one_connection_do_not_interleave() -> None:
    async with pools([1, 2]) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        n = 6
        dests = [bytearray(2_000_000) for _ in range(n)]
        slots = [b.expect(1, 0, 1, i, memoryview(dests[i])) for i in range(n)]
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(functools.partial(a.send, 2, 0, 1, i, memoryview(bytes([i]) * 2_000_000),
                                                     conn_index=0))
        for i in range(n):
            await slots[i].wait()
            assert dests[i] == bytes([i]) * 2_000_000


async def test_aclose_fails_pending_and_refuses_new_work() -> None:
    async with pools([1, 2]) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        slot = b.expect(1, 0, 1, 0, memoryview(bytearray(1)))
        await b.aclose()
        with pytest.raises(RankConnectionLostError, match="closed"):
            await slot.wait()
        with pytest.raises(InvalidUsageError):
            b.expect(1, 0, 1, 1, memoryview(bytearray(1)))
        with pytest.raises(RankConnectionFailedError):
            await b.connect(1, "127.0.0.1", 1)
        assert b.statistics()["closed"] and "closed" in repr(b)


async def test_tcp_ring_sockets_are_tuned_for_bulk_frames() -> None:
    """trio's TCP_NOTSENT_LOWAT (16 KiB) would cap every send at a few segments; the pool lifts it."""
    import socket

    async with pools([1, 2], transport=tcp_only) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        (conn,) = a.links.conns[2]
        assert isinstance(conn, SocketConn) and conn.sock is not None
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) >= 1 << 30
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.skipif(not transport_module._LOCAL_SOCKETS, reason="the same-host shortcut is Linux's")
async def test_same_host_ring_sockets_take_the_fast_path_with_a_large_send_buffer() -> None:
    """Over the shortcut's Unix socket the fast path runs too; epoll ignores SO_RCVLOWAT there, so the
    reader does not set it, and the send buffer is 1 MiB (the kernel reports twice what was set)."""
    import socket

    async with pools([1, 2]) as ((a, b), (_, b_addr)):
        await connected_pair(a, b, b_addr)
        (conn,) = a.links.conns[2]
        assert isinstance(conn, SocketConn) and conn.sock.family == socket.AF_UNIX
        assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(
            1 << 20, int(open("/proc/sys/net/core/wmem_max").read()))
        await wait_until(lambda: incoming(b, 1) == 1)
        (inc,) = [c for (peer, _), c in b.readers.conns.items() if peer == 1]
        assert isinstance(inc, SocketConn) and inc.lowat_cap == 1
        dest = bytearray(3 << 20)
        payload = bytes(range(256)) * (3 << 12)
        slot = b.expect(1, 4, 1, 0, memoryview(dest))
        await a.send(2, 4, 1, 0, memoryview(payload), conn_index=0)
        await slot.wait()
        assert dest == payload
        assert inc.lowat == 1  # never raised: no setsockopt per frame


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_retire_closes_the_outgoing_connections_to_peers_not_kept(
        transport: Callable[[], Transport]) -> None:
    async with pools([1, 2, 3], pool_size=2, transport=transport) as ((a, b, c), (a_addr, b_addr, c_addr)):
        await connected_pair(a, b, b_addr)
        await connected_pair(a, c, c_addr)
        await connected_pair(b, a, a_addr)  # b sends to a
        # A frame to 3 on connection 1; connection 0 never carries one (closed before its first header).
        slot = c.expect(1, 5, 1, 0, memoryview(bytearray(3)))
        await a.send(3, 5, 1, 0, memoryview(b"abc"), conn_index=1)
        await slot.wait()
        pending = c.expect(1, 5, 2, 0, memoryview(bytearray(3)))  # a receive that can never complete now
        assert await a.retire({2}) == [3]
        s = a.statistics()
        assert s["outgoing"] == {2: 2} and s["connections_retired"] == 1
        assert incoming(a, 2) == 2  # its incoming side is not touched
        await wait_until(lambda: incoming(c, 1) == 0)
        s = c.statistics()
        # A clean close between frames: not a lost connection, but what was expected from 1 fails.
        assert s["connections_lost"] == 0 and s["connections_closed_by_peer"] == 2
        with pytest.raises(RankConnectionLostError, match="closed its connection"):
            await pending.wait()
        # The kept peer is unaffected, and a retired one is reconnected on demand.
        slot = b.expect(1, 5, 3, 0, memoryview(bytearray(3)))
        await a.send(2, 5, 3, 0, memoryview(b"def"), conn_index=0)
        await slot.wait()
        await connected_pair(a, c, c_addr)
        slot = c.expect(1, 5, 4, 0, memoryview(bytearray(3)))
        await a.send(3, 5, 4, 0, memoryview(b"xyz"), conn_index=0)
        await slot.wait()
        assert c.statistics()["connections_lost"] == 0


async def test_a_close_within_a_frame_header_is_a_lost_connection() -> None:
    async with pools([2]) as ((b,), (b_addr,)):
        ms = await open_p2p(TcpTransport(), *b_addr, my_peer_id=1, channel="ring", config=CONFIG)
        await wait_until(lambda: incoming(b, 1) == 1)
        await ms.stream.send_all(pack_data_header(1, 1, 0, 8)[:10])  # a header cut off
        await ms.aclose()
        await wait_until(lambda: incoming(b, 1) == 0)
        s = b.statistics()
        assert s["connections_lost"] == 1 and s["connections_closed_by_peer"] == 0
