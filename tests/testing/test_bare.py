"""pccl.testing.BareTransport: only what the transport protocols require."""

from __future__ import annotations

import trio

from pccl.testing import BareListener, BareStream, BareTransport, VirtualNetwork, open_stream_pair
from pccl.transport import Listener, Stream, TcpStream, Transport


async def test_bare_tcp_streams_hide_the_socket_and_try_send() -> None:
    transport: Transport = BareTransport()
    assert isinstance(transport, Transport)
    client, server = await open_stream_pair(transport, transport, connect_host="127.0.0.1",
                                            listen_host="127.0.0.1")
    for s in (client, server):
        assert isinstance(s, BareStream) and isinstance(s, Stream) and not isinstance(s, TcpStream)
        assert not hasattr(s, "socket") and not hasattr(s, "try_send")
    assert client.peer_address == server.local_address
    await client.send_all(b"ping")
    buf = bytearray(4)
    assert await server.receive_into(memoryview(buf)) == 4 and buf == b"ping"
    await server.send_all(b"pong")
    assert await client.receive_some(10) == b"pong"
    await client.aclose()
    assert await server.receive_some(10) == b""
    await server.aclose()


async def test_bare_wraps_any_transport(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    transport = BareTransport(net.host("a"))
    listener = await BareTransport(net.host("b")).listen("0.0.0.0", 9000)
    assert isinstance(listener, BareListener) and isinstance(listener, Listener)
    async with trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def serve() -> None:
            s = await listener.accept()
            got.append(await s.receive_some(10))
            await s.aclose()

        nursery.start_soon(serve)
        c = await transport.connect("b", 9000)
        assert not hasattr(c, "try_send")  # the virtual stream's try_send is hidden too
        await c.send_all(b"hi")
    assert got == [b"hi"]
    await c.aclose()
    await listener.aclose()
