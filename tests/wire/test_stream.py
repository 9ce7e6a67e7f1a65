"""The immediate-send and one-pass receive paths: ``TcpStream.try_send`` / ``receive_*``,
``MessageStream.send_nowait`` / ``flush``, and the master writing messages without its writer task.

Real loopback sockets where the OS behaviour is the point; the virtual network (virtual time) for the
window, ordering and eviction cases.
"""

from __future__ import annotations

import logging
import socket
import struct

import pytest
import trio
import trio.testing

from pccl import MasterConfig
from pccl._errors import RemoteProtocolError
from pccl.master.server import open_master
from pccl.testing import BareStream, VirtualNetwork, VirtualStream, open_stream_pair
from pccl.transport import Stream, StreamBroken, TcpStream, TcpTransport, receive_exactly_into
from pccl.wire import messages as m
from pccl.wire.framing import encode_frame
from pccl.wire.handshake import offer_hello
from pccl.wire.stream import MessageStream


async def tcp_pair(same_host: bool = False) -> tuple[TcpStream, TcpStream]:
    """A connected pair over loopback TCP, or over the same-host shortcut's Unix socket."""
    tcp = TcpTransport(same_host=same_host)
    a, b = await open_stream_pair(tcp, tcp, connect_host="127.0.0.1", listen_host="127.0.0.1")
    assert isinstance(a, TcpStream) and isinstance(b, TcpStream)
    assert a.same_host is same_host and b.same_host is same_host
    return a, b


# The stream behaviours that hold over both ways a TcpTransport connects.
either_way = pytest.mark.parametrize("same_host", [False, True], ids=["tcp", "unix"])


async def message_pair(net: VirtualNetwork) -> tuple[VirtualStream, MessageStream, MessageStream]:
    """A virtual connection from host a to host b: (a's stream, a's MessageStream, b's MessageStream)."""
    a, b = await open_stream_pair(net.host("a"), net.host("b"), connect_host=net.host("b").address)
    assert isinstance(a, VirtualStream)
    return a, MessageStream(a, max_frame_size=1 << 20), MessageStream(b, max_frame_size=1 << 20)


async def read_exactly(stream: Stream, n: int) -> bytes:
    buf = bytearray(n)
    await receive_exactly_into(stream, memoryview(buf))
    return bytes(buf)


HEARTBEAT_FRAME = 7  # bytes of one framed Heartbeat (checked below); 256 is not a multiple of it

# ----------------------------------------------------------------------------------------------
# TcpStream


@either_way
async def test_tcp_try_send_sends_at_once_until_the_buffer_is_full(same_host: bool) -> None:
    a, b = await tcp_pair(same_host)
    assert a.try_send(b"hello") == 5
    assert await read_exactly(b, 5) == b"hello"
    # Nobody reads: the socket buffers fill and try_send reports a short count, then 0 - never waits.
    chunk = bytes(1 << 20)
    total, last = 0, -1
    for _ in range(256):
        last = a.try_send(chunk)
        total += last
        if last == 0:
            break
    assert last == 0 and total > 0
    got = 0
    while got < total:
        got += len(await b.receive_some(1 << 20))
    assert got == total
    await a.aclose()
    with pytest.raises(StreamBroken, match="closed"):
        a.try_send(b"x")
    await b.aclose()


async def test_tcp_try_send_to_a_reset_peer_raises_stream_broken() -> None:
    a, b = await tcp_pair()
    # SO_LINGER 0: closing b resets the connection at once (no FIN), so a can wait for the reset itself.
    b.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await b.aclose()
    with pytest.raises(StreamBroken):
        await a.receive_some(10)  # the reset has arrived
    with pytest.raises(StreamBroken):
        a.try_send(b"ping")
    await a.aclose()


@either_way
async def test_tcp_receive_is_a_checkpoint_and_returns_data_that_arrives_later(same_host: bool) -> None:
    a, b = await tcp_pair(same_host)
    await a.send_all(b"ready")
    with trio.testing.assert_checkpoints():  # data already there: still a schedule point
        assert await b.receive_some(5) == b"ready"
    async with trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def reader() -> None:
            got.append(await b.receive_some(100))

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # waiting in epoll, not spinning
        await a.send_all(b"later")
    assert got == [b"later"]
    buf = bytearray(8)
    await a.send_all(b"into")
    assert await b.receive_into(memoryview(buf)) == 4 and buf[:4] == b"into"
    await a.aclose()
    assert await b.receive_some(10) == b""  # EOF
    await b.aclose()


@either_way
async def test_tcp_receive_cancelled_or_closed_underneath(same_host: bool) -> None:
    a, b = await tcp_pair(same_host)
    async with trio.open_nursery() as nursery:
        waiting = trio.CancelScope()

        async def cancelled_reader() -> None:
            with waiting:
                await b.receive_some(10)
            assert waiting.cancelled_caught

        nursery.start_soon(cancelled_reader)
        await trio.testing.wait_all_tasks_blocked()  # the reader waits for data: cancel that wait
        waiting.cancel()
    await a.send_all(b"still usable")
    assert await read_exactly(b, 12) == b"still usable"
    with trio.testing.assert_checkpoints():
        with trio.CancelScope() as cs:
            cs.cancel()
            await b.receive_some(10)  # a cancelled call raises Cancelled, reading nothing
    await a.send_all(b"!")
    assert await b.receive_some(10) == b"!"

    async with trio.open_nursery() as nursery:
        errors: list[BaseException] = []

        async def reader() -> None:
            try:
                await b.receive_some(10)
            except StreamBroken as exc:
                errors.append(exc)

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        await b.aclose()  # from another task: the waiting receive fails, it does not hang
    assert len(errors) == 1
    with pytest.raises(StreamBroken):
        await b.receive_some(10)
    await a.aclose()


# ----------------------------------------------------------------------------------------------
# MessageStream.send_nowait


async def test_send_nowait_sends_whole_frames_and_defers_to_a_running_send(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(buffer_size=1024)
    _, ms_a, ms_b = await message_pair(net)
    assert ms_a.send_nowait(m.Heartbeat()) and not ms_a.owes
    assert await ms_b.receive() == m.Heartbeat()
    async with trio.open_nursery() as nursery:
        # A send() holding the lock (blocked mid-frame on the window): send_nowait must not cut in.
        big = m.CollectiveAbort(tag=1, op_seq=2, reason="x" * (net.buffer_size * 2), code=1)
        nursery.start_soon(ms_a.send, big)
        await trio.testing.wait_all_tasks_blocked()
        assert ms_a.send_nowait(m.Heartbeat()) is False
        assert await ms_b.receive() == big
    await ms_a.aclose()
    await ms_b.aclose()


async def test_send_nowait_partial_frame_is_owed_and_flushed_before_anything_else(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(buffer_size=64)
    a, ms_a, ms_b = await message_pair(net)
    first = m.CollectiveAbort(tag=3, op_seq=4, reason="r" * 200, code=1)  # larger than the window
    assert ms_a.send_nowait(first) is True
    assert ms_a.owes
    assert ms_a.send_nowait(m.Heartbeat()) is False  # nothing may go out before the owed tail
    second = m.CollectiveAbort(tag=5, op_seq=6, reason="second", code=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ms_a.send, second)  # pays the debt first
        assert await ms_b.receive() == first
        assert await ms_b.receive() == second
    assert not ms_a.owes
    # A full window: nothing taken, nothing owed, the caller must use send().
    for _ in range(2):
        a.try_send(b"\x00" * 64)
    assert ms_a.send_nowait(m.Heartbeat()) is False and not ms_a.owes
    await ms_a.flush()  # nothing owed: a no-op
    await ms_a.aclose()
    await ms_b.aclose()


async def test_send_nowait_without_try_send_falls_back(autojump_clock: trio.testing.MockClock) -> None:
    a, _, ms_b = await message_pair(VirtualNetwork())
    plain = BareStream(a)  # a custom transport's stream: no try_send
    assert isinstance(plain, Stream)
    ms_a = MessageStream(plain, max_frame_size=1 << 20)
    assert ms_a.send_nowait(m.Heartbeat()) is False
    await ms_a.send(m.Heartbeat())
    assert await ms_b.receive() == m.Heartbeat()
    await ms_a.aclose()
    await ms_b.aclose()


async def test_receive_without_read_ahead_leaves_the_raw_bytes_in_the_transport(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The swarm fetch reads a chunk's header this way and the chunk itself in place: no byte of it may
    # sit in the frame buffer (a copy, and fresh memory per chunk, which cost it half its speed).
    _, ms_a, ms_b = await message_pair(VirtualNetwork())
    raw = bytes(range(256)) * 64
    hdr = m.StateChunk(key="k", offset=0, nbytes=len(raw))
    await ms_a.send_with_raw(hdr, raw)
    await ms_a.send_with_raw(hdr, raw)
    await trio.testing.wait_all_tasks_blocked()  # both frames and their bytes have arrived
    for _ in range(2):
        assert await ms_b.receive(read_ahead=False) == hdr
        assert ms_b.take_buffered(len(raw)) == b""
        assert await read_exactly(ms_b.stream, len(raw)) == raw
    # The default reads ahead: the raw bytes after the frame come out of its buffer first.
    await ms_a.send_with_raw(hdr, raw)
    await trio.testing.wait_all_tasks_blocked()
    assert await ms_b.receive() == hdr
    got = bytearray(len(raw))
    pre = ms_b.take_buffered(len(raw))
    assert pre
    got[: len(pre)] = pre
    await ms_b.receive_raw_into(memoryview(got)[len(pre) :])
    assert bytes(got) == raw
    await ms_a.aclose()
    await ms_b.aclose()


# ----------------------------------------------------------------------------------------------
# The master's immediate sends


# Seven window sizes: every remainder modulo the heartbeat's frame size, so in one of them the window
# fills part-way through a frame (send_nowait owes the tail and the writer task must send it).
@pytest.mark.parametrize("window", range(256, 256 + HEARTBEAT_FRAME))
async def test_master_evicts_a_peer_that_stops_reading_and_keeps_serving(
    window: int, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that sends heartbeats but never reads: the socket takes the master's first messages
    at once, then (for some window size) a frame only in part - the writer task owes the rest - then
    the queue fills and the peer is evicted with the reason; the master stays up for the others."""
    assert len(encode_frame(m.encode(m.Heartbeat()), max_frame_size=1 << 20)) == HEARTBEAT_FRAME
    net = VirtualNetwork(buffer_size=window)
    cfg = MasterConfig(heartbeat_interval=0.1, heartbeat_timeout=5.0, send_queue_size=4)
    caplog.set_level(logging.INFO, logger="pccl.master")
    async with open_master("0.0.0.0:0", config=cfg, transport=net.host("m")) as master:
        port = master.address[1]
        stream = await net.host("p").connect(net.host("m").address, port)
        ms = MessageStream(stream, max_frame_size=1 << 20)
        assert isinstance(await offer_hello(ms, purpose="master", secret=None), m.HelloOk)
        await ms.send(m.Register(p2p_port=5555, peer_group=0))
        with trio.fail_after(60):
            while master.statistics()["connections"]:
                try:
                    await ms.send(m.Heartbeat())  # alive, but never reads again
                except StreamBroken:
                    break  # the master closed the connection
                await trio.sleep(0.1)
        assert master.statistics()["connections"] == 0
        assert "send queue overflowed" in caplog.text
        # What the peer can still read is whole heartbeats, in order, then the end of the stream (after
        # the head of a frame when the window filled part-way through one): nothing was sent after a
        # frame's head but its tail.
        beats = 0
        credentials = 0  # bytes of the P2P credentials among the answers (issued since protocol 4)
        with trio.fail_after(5):
            while True:
                try:
                    msg = await ms.receive()
                except StreamBroken:
                    break
                except RemoteProtocolError as exc:
                    assert "inside a frame" in str(exc)
                    break
                if beats == 0 and isinstance(msg, (m.Registered, m.P2PCredentials, m.Accepted)):
                    if isinstance(msg, (m.P2PCredentials, m.Registered)):  # (Registered: its member token)
                        credentials += len(encode_frame(m.encode(msg), max_frame_size=1 << 20))
                    continue  # the answers to Register come first
                assert isinstance(msg, m.Heartbeat)
                beats += 1
        # the 256-byte window held ~30 of them, less the room the credentials and the token take
        assert beats >= (200 - credentials) // HEARTBEAT_FRAME
        # The master still serves a newcomer.
        s2 = await net.host("q").connect(net.host("m").address, port)
        ms2 = MessageStream(s2, max_frame_size=1 << 20)
        assert isinstance(await offer_hello(ms2, purpose="master", secret=None), m.HelloOk)
        await ms2.aclose()
        await ms.aclose()
