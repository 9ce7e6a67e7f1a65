"""P2P listener and handshake: acceptance, every refusal, timeouts, containment of bad connections."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from pccl import PROTOCOL_VERSION, PCCLError, PeerConfig, RankConnectionFailedError, Result
from pccl.peer.p2p import open_p2p, serve_p2p
from pccl.transport import Address, StreamBroken, TcpTransport, Transport
from pccl.wire.hello import answer
from pccl.wire.messages import Challenge, Heartbeat, Hello, HelloOk, Refused
from pccl.wire.stream import MessageStream

CONFIG = PeerConfig(connect_timeout=2.0)


@asynccontextmanager
async def serving(
    transport: Transport,
    handlers: dict[str, Any],
    *,
    secret: str = "",
    config: PeerConfig = CONFIG,
    host: str = "127.0.0.1",
) -> AsyncIterator[Address]:
    async with trio.open_nursery() as nursery:
        serve = functools.partial(serve_p2p, config=config, secret=secret)
        addr: Address = await nursery.start(serve, transport, host, 0, handlers)
        yield addr
        nursery.cancel_scope.cancel()


def echo_handlers(seen: list[Hello]) -> dict[str, Any]:
    async def echo(ms: MessageStream, hello: Hello) -> None:
        seen.append(hello)
        msg = await ms.receive()
        await ms.send(msg)

    return {"ring": echo, "state": echo}


async def raw_hello(addr: Address, hello: Hello, secret: str = "") -> tuple[MessageStream, Any]:
    """Send ``hello``; answer a Challenge with the proof made with ``secret`` (without checking the
    listener's proof); return the listener's last answer."""
    stream = await TcpTransport().connect(*addr)
    ms = MessageStream(stream, max_frame_size=CONFIG.max_frame_size)
    await ms.send(hello)
    reply = await ms.receive()
    if isinstance(reply, Challenge) and isinstance(hello, Hello):
        await ms.send(answer(reply, hello, secret=secret))
        reply = await ms.receive()
    return ms, reply


async def assert_closed(ms: MessageStream) -> None:
    with pytest.raises(StreamBroken):
        await ms.receive()
    await ms.aclose()


async def test_handshake_reaches_the_channel_handler() -> None:
    seen: list[Hello] = []
    async with serving(TcpTransport(), echo_handlers(seen), secret="s3") as addr:
        ms = await open_p2p(TcpTransport(), *addr, my_peer_id=42, channel="state", index=3, config=CONFIG,
                            secret="s3")
        await ms.send(Heartbeat())
        assert isinstance(await ms.receive(), Heartbeat)
        await assert_closed(ms)  # the stream is closed once the handler returns
        assert [(h.peer_id, h.channel, h.index, h.purpose) for h in seen] == [(42, "state", 3, "p2p")]


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"protocol_version": PROTOCOL_VERSION + 1}, f"version {PROTOCOL_VERSION + 1}"),
        ({"purpose": "master"}, "purpose"),
        ({"secret": "wrong"}, "bad secret"),
        ({"secret": ""}, "bad secret"),
        ({"channel": "nope"}, "unknown P2P channel"),
    ],
)
async def test_refusals_say_why_and_close(change: dict[str, Any], expect: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Hello] = []
    async with serving(TcpTransport(), echo_handlers(seen), secret="right") as addr:
        fields: dict[str, Any] = dict(protocol_version=PROTOCOL_VERSION, purpose="p2p", nonce=b"n" * 16,
                                      peer_id=1, channel="ring")
        # The secret is no Hello field any more: it makes the Proof that answers the Challenge.
        change = dict(change)
        presented = change.pop("secret", "right")
        with caplog.at_level(logging.WARNING, logger="pccl.p2p"):
            ms, reply = await raw_hello(addr, Hello(**{**fields, **change}), presented)
            assert isinstance(reply, Refused)
            assert expect in reply.reason
            if "protocol_version" in change:
                assert f"version {PROTOCOL_VERSION}" in reply.reason  # both versions named
            await assert_closed(ms)
        assert [r for r in caplog.records if r.name == "pccl.p2p" and "refused" in r.getMessage()]
        # the listener keeps serving good connections
        good, reply = await raw_hello(addr, Hello(**fields), "right")
        assert isinstance(reply, HelloOk)
        await good.aclose()
    assert len(seen) == 1


async def test_open_p2p_raises_on_refusal_with_the_reason() -> None:
    async with serving(TcpTransport(), echo_handlers([]), secret="x") as addr:
        with pytest.raises(RankConnectionFailedError, match="bad secret"):
            await open_p2p(TcpTransport(), *addr, my_peer_id=1, channel="ring", config=CONFIG, secret="y")
        with pytest.raises(RankConnectionFailedError, match="unknown P2P channel"):
            await open_p2p(TcpTransport(), *addr, my_peer_id=1, channel="bench", config=CONFIG, secret="x")


async def test_open_p2p_connect_failure() -> None:
    listener = await TcpTransport().listen("127.0.0.1", 0)
    port = listener.address[1]
    await listener.aclose()
    with pytest.raises(RankConnectionFailedError, match="failed"):
        await open_p2p(TcpTransport(), "127.0.0.1", port, my_peer_id=1, channel="ring", config=CONFIG)


async def test_non_hello_first_message_and_garbage_are_refused() -> None:
    async with serving(TcpTransport(), echo_handlers([])) as addr:
        ms, reply = await raw_hello(addr, Heartbeat())  # type: ignore[arg-type]
        assert isinstance(reply, Refused) and "expected Hello" in reply.reason
        await assert_closed(ms)
        stream = await TcpTransport().connect(*addr)
        await stream.send_all(b"\xff\xff\xff\xff" + b"garbage")  # length prefix over the limit
        assert await stream.receive_some() == b""  # closed without a reply
        await stream.aclose()
        good = Hello(protocol_version=PROTOCOL_VERSION, purpose="p2p", channel="ring", nonce=b"n" * 16)
        ms, reply = await raw_hello(addr, good)
        assert isinstance(reply, HelloOk)
        await ms.aclose()


async def test_failing_handler_does_not_kill_the_listener() -> None:
    calls = 0

    async def boom(ms: MessageStream, hello: Hello) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("handler bug")

    async with serving(TcpTransport(), {"ring": boom}) as addr:
        for _ in range(3):
            ms = await open_p2p(TcpTransport(), *addr, my_peer_id=1, channel="ring", config=CONFIG)
            await assert_closed(ms)
    assert calls == 3


async def test_silent_client_is_dropped_after_the_connect_timeout(autojump_clock: trio.abc.Clock) -> None:
    from pccl.testing.network import VirtualNetwork

    net = VirtualNetwork()
    server, client = net.host("server"), net.host("client")
    async with serving(server, echo_handlers([]), config=PeerConfig(connect_timeout=3.0),
                       host="0.0.0.0") as (_, port):
        stream = await client.connect(server.address, port)
        t0 = trio.current_time()
        assert await stream.receive_some() == b""  # nothing sent: the server gives up and closes
        assert 3.0 <= trio.current_time() - t0 < 4.0
        await stream.aclose()


async def test_open_p2p_times_out_waiting_for_hello_ok(autojump_clock: trio.abc.Clock) -> None:
    from pccl.testing.network import VirtualNetwork

    net = VirtualNetwork()
    server, client = net.host("server"), net.host("client")
    listener = await server.listen("0.0.0.0", 7000)
    async with trio.open_nursery() as nursery:
        accepted: list[Any] = []

        async def accept_and_ignore() -> None:
            accepted.append(await listener.accept())  # never answers the Hello
            await trio.sleep_forever()

        nursery.start_soon(accept_and_ignore)
        t0 = trio.current_time()
        with pytest.raises(RankConnectionFailedError, match="timed out"):
            await open_p2p(client, server.address, 7000, my_peer_id=1, channel="ring",
                           config=PeerConfig(connect_timeout=2.0))
        assert 2.0 <= trio.current_time() - t0 < 3.0
        nursery.cancel_scope.cancel()


async def test_listen_failure_is_a_pccl_error() -> None:
    listener = await TcpTransport().listen("127.0.0.1", 0)
    try:
        with pytest.raises(PCCLError, match="cannot listen"):
            # SO_REUSEADDR does not allow two listeners on one port
            await serve_p2p(TcpTransport(), "127.0.0.1", listener.address[1], {}, config=CONFIG)
    finally:
        await listener.aclose()


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"protocol_version": PROTOCOL_VERSION + 1}, Result.REMOTE_ERROR),
        ({"channel": "version2"}, Result.INVALID_USAGE),  # "version" in the reason must not matter
        ({"secret": "wrong"}, Result.INVALID_USAGE),
    ],
)
async def test_refusal_codes_come_from_the_problem_not_the_reason_text(
    change: dict[str, Any], code: Result
) -> None:
    """Regression: the listener chose REMOTE_ERROR whenever the reason text contained "version"."""
    async with serving(TcpTransport(), echo_handlers([]), secret="right") as addr:
        fields: dict[str, Any] = dict(protocol_version=PROTOCOL_VERSION, purpose="p2p", nonce=b"n" * 16,
                                      peer_id=1, channel="ring")
        change = dict(change)
        presented = change.pop("secret", "right")  # the secret makes the Proof, it is no Hello field
        ms, reply = await raw_hello(addr, Hello(**{**fields, **change}), presented)
        assert isinstance(reply, Refused) and reply.code == int(code), reply
        await assert_closed(ms)
