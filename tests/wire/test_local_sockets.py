"""The same-host shortcut of TcpTransport: a connection to a listener of this host goes over the Unix
socket named after the listener's TCP address, with the same bytes and the addresses TCP would report;
everything else (another host, no such listener, a listener of another user, the shortcut off) is TCP."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import pytest
import trio

from pccl import transport
from pccl._env import ENV_LOCAL_SOCKETS
from pccl._errors import InvalidArgumentError
from pccl.transport import (
    ConnectFailed,
    Listener,
    Stream,
    StreamBroken,
    TcpListener,
    TcpStream,
    TcpTransport,
    local_socket_name,
)

pytestmark = pytest.mark.skipif(not transport._LOCAL_SOCKETS, reason="the shortcut is Linux's")


async def _echo_once(listener: Listener, accepted: list[Stream]) -> None:
    stream = await listener.accept()
    accepted.append(stream)
    data = await stream.receive_some(1 << 16)
    await stream.send_all(data[::-1])


async def _round_trip(client: Stream) -> bytes:
    await client.send_all(b"abcdef")
    return await client.receive_some(1 << 16)


def _local_address() -> str | None:
    """A non-loopback IPv4 address of this host, if it has one (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        ip = str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


@pytest.mark.parametrize("bind, dial", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"),
                                        ("0.0.0.0", "localhost"), ("127.0.0.1", "localhost")])
async def test_a_connection_on_this_host_takes_the_unix_socket(bind: str, dial: str) -> None:
    listener = await TcpTransport().listen(bind, 0)
    assert isinstance(listener, TcpListener) and listener.same_host
    port = listener.address[1]
    accepted: list[Stream] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_echo_once, listener, accepted)
        client = await TcpTransport().connect(dial, port)
        assert await _round_trip(client) == b"fedcba"
    server = accepted[0]
    assert isinstance(client, TcpStream) and isinstance(server, TcpStream)
    assert client.same_host and server.same_host
    assert client.socket.family == socket.AF_UNIX
    # the addresses a TCP connection to 127.0.0.1 would report (the master records the source host)
    assert client.peer_address == ("127.0.0.1", port)
    assert server.peer_address[0] == "127.0.0.1"
    assert server.local_address == client.peer_address  # the address dialled, as TCP's getsockname()
    await client.aclose()
    assert await server.receive_some(10) == b""  # a clean close reads as EOF, as over TCP
    await server.aclose()
    await listener.aclose()


async def test_the_listener_takes_tcp_and_unix_connections_alike() -> None:
    listener = await TcpTransport().listen("127.0.0.1", 0)
    port = listener.address[1]
    accepted: list[Stream] = []
    async with trio.open_nursery() as nursery:
        for same_host in (False, True, False):
            nursery.start_soon(_echo_once, listener, accepted)
            client = await TcpTransport(same_host=same_host).connect("127.0.0.1", port)
            assert await _round_trip(client) == b"fedcba"
            assert isinstance(client, TcpStream) and client.same_host is same_host
            await client.aclose()
    assert [isinstance(s, TcpStream) and s.same_host for s in accepted] == [False, True, False]
    for s in accepted:
        await s.aclose()
    await listener.aclose()


async def test_the_shortcut_off_on_either_side_means_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    off = TcpTransport(same_host=False)
    listener = await off.listen("127.0.0.1", 0)
    assert isinstance(listener, TcpListener) and not listener.same_host
    client = await TcpTransport().connect("127.0.0.1", listener.address[1])
    assert isinstance(client, TcpStream) and not client.same_host
    assert client.socket.family == socket.AF_INET
    await client.aclose()
    await listener.aclose()
    monkeypatch.setenv(ENV_LOCAL_SOCKETS, "0")
    assert not TcpTransport().same_host
    assert TcpTransport(same_host=True).same_host  # an explicit argument wins over the environment
    monkeypatch.setenv(ENV_LOCAL_SOCKETS, "maybe")
    with pytest.raises(InvalidArgumentError, match="PCCL_LOCAL_SOCKETS must be 1 or 0, not 'maybe'"):
        TcpTransport()


async def test_a_closed_listener_is_refused_over_tcp_too() -> None:
    listener = await TcpTransport().listen("127.0.0.1", 0)
    port = listener.address[1]
    await listener.aclose()
    with pytest.raises(ConnectFailed, match="refused"):
        await TcpTransport().connect("127.0.0.1", port)


async def test_an_address_of_another_host_or_a_name_is_not_taken_for_this_host() -> None:
    assert transport._local_ip("203.0.113.77") is None  # TEST-NET-3: no interface of a test machine has it
    assert transport._local_ip("example.invalid") is None
    assert transport._local_ip("::1") is None  # IPv6: TCP
    assert transport._local_ip("127.0.0.5") == "127.0.0.5"
    listener = await TcpTransport().listen("::1", 0) if socket.has_ipv6 else None
    if listener is not None:
        assert isinstance(listener, TcpListener) and not listener.same_host
        await listener.aclose()


@pytest.mark.parametrize("bind", ["address", "0.0.0.0"])
async def test_a_non_loopback_address_of_this_host_takes_the_shortcut(bind: str) -> None:
    """Dialled at the host's own address (how peers on one machine reach each other when the master saw
    them there): the listener bound to that address, or to every address, takes it over its Unix socket,
    and reports the address dialled as the source, as TCP would."""
    ip = _local_address()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address")
    assert transport._local_ip(ip) == ip
    listener = await TcpTransport().listen(ip if bind == "address" else bind, 0)
    assert isinstance(listener, TcpListener)
    assert ip in listener.same_host_addresses
    accepted: list[Stream] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_echo_once, listener, accepted)
        client = await TcpTransport().connect(ip, listener.address[1])
        assert await _round_trip(client) == b"fedcba"
    assert isinstance(client, TcpStream) and client.same_host
    assert accepted[0].peer_address[0] == ip  # where a TCP connection to ip comes from
    assert accepted[0].local_address == (ip, listener.address[1])
    await client.aclose()
    await accepted[0].aclose()
    await listener.aclose()


def test_the_host_addresses_are_this_hosts() -> None:
    addresses = transport.host_addresses()
    assert "127.0.0.1" in addresses
    ip = _local_address()
    if ip is not None:
        assert ip in addresses
    # each one is an address a socket can bind to here (the check a connecting side makes)
    assert all(transport._local_ip(a) == a for a in addresses)


async def test_a_wildcard_listener_has_a_name_for_every_address_of_the_host() -> None:
    listener = await TcpTransport().listen("0.0.0.0", 0)
    assert isinstance(listener, TcpListener)
    assert listener.same_host_addresses == transport.host_addresses()
    await listener.aclose()


async def test_a_taken_name_leaves_the_listener_on_tcp_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    name = b"\0pccl-test-taken/%d" % os.getpid()
    monkeypatch.setattr(transport, "local_socket_name", lambda ip, port: name)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(name)
    squatter.listen()
    try:
        with caplog.at_level(logging.WARNING, logger="pccl.transport"):
            listener = await TcpTransport().listen("127.0.0.1", 0)
        assert isinstance(listener, TcpListener) and not listener.same_host
        assert "no same-host shortcut for the listener on 127.0.0.1" in caplog.text
        await listener.aclose()
    finally:
        squatter.close()


async def test_a_socket_of_another_user_is_not_trusted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    listener = await TcpTransport().listen("127.0.0.1", 0)
    monkeypatch.setattr(transport, "_same_user", lambda sock: False)
    with caplog.at_level(logging.WARNING, logger="pccl.transport"):
        client = await TcpTransport().connect("127.0.0.1", listener.address[1])
    assert isinstance(client, TcpStream) and not client.same_host  # TCP reached the real listener
    assert "belongs to another user" in caplog.text
    await client.aclose()
    await listener.aclose()


_SQUAT = """
import os, socket, sys
os.setuid(65534)  # another user (the kernel records the listener's credentials at listen())
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(bytes.fromhex(sys.argv[1]))
s.listen()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
async def test_a_name_held_by_another_user_is_refused_by_its_credentials() -> None:
    """SO_PEERCRED, for real: a process that took the name and runs as another user is not connected to
    (the connection goes over TCP, to the real listener), so a name squatter cannot pose as a listener."""
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    name = local_socket_name("127.0.0.1", port)
    child = subprocess.Popen([sys.executable, "-c", _SQUAT, name.hex()], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        client = await TcpTransport().connect("127.0.0.1", port)
        assert isinstance(client, TcpStream) and not client.same_host
        assert client.socket.family == socket.AF_INET
        await client.aclose()
    finally:
        child.kill()
        child.wait()
        tcp.close()


@pytest.mark.parametrize("how", ["send_all", "try_send"])
async def test_the_last_words_of_a_closed_side_are_read_as_over_tcp(how: str) -> None:
    """A Unix socket fails a send at once when the other side has closed; TCP takes it and the receive
    that follows reads what the other side said last (a Refused and its reason, a TLS alert). The first
    send that meets the close is taken as sent while there is something left to read; later ones fail."""
    listener = await TcpTransport().listen("127.0.0.1", 0)
    accepted: list[Stream] = []
    async with trio.open_nursery() as nursery:

        async def say_no_and_close() -> None:
            server = await listener.accept()
            accepted.append(server)
            await server.send_all(b"refused: go away")
            await server.aclose()

        nursery.start_soon(say_no_and_close)
        client = await TcpTransport().connect("127.0.0.1", listener.address[1])
    assert isinstance(client, TcpStream) and client.same_host
    if how == "send_all":
        await client.send_all(b"hello")
    else:
        assert client.try_send(b"hello") == 5
    got = b""
    while len(got) < 16:
        chunk = await client.receive_some(100)
        assert chunk
        got += chunk
    assert got == b"refused: go away"
    assert await client.receive_some(100) == b""
    with pytest.raises(StreamBroken, match="Broken pipe"):
        await client.send_all(b"again")
    await client.aclose()
    await listener.aclose()


async def test_a_send_to_a_closed_side_with_nothing_left_to_read_fails() -> None:
    listener = await TcpTransport().listen("127.0.0.1", 0)
    async with trio.open_nursery() as nursery:

        async def close_at_once() -> None:
            await (await listener.accept()).aclose()

        nursery.start_soon(close_at_once)
        client = await TcpTransport().connect("127.0.0.1", listener.address[1])
    assert isinstance(client, TcpStream) and client.same_host
    with pytest.raises(StreamBroken, match="Broken pipe"):
        await client.send_all(b"hello")
    await client.aclose()
    await listener.aclose()


async def test_no_unix_socket_to_be_had_means_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unix sockets that cannot be created (no descriptor left, or forbidden by a sandbox) leave both
    sides on TCP instead of raising a raw OSError."""
    real = transport._unix_socket

    def none_left() -> socket.socket:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(transport, "_unix_socket", none_left)
    listener = await TcpTransport().listen("127.0.0.1", 0)
    assert isinstance(listener, TcpListener) and not listener.same_host
    monkeypatch.setattr(transport, "_unix_socket", real)
    other = await TcpTransport().listen("127.0.0.1", 0)  # this one has its Unix socket
    assert isinstance(other, TcpListener) and other.same_host
    monkeypatch.setattr(transport, "_unix_socket", none_left)
    client = await TcpTransport().connect("127.0.0.1", other.address[1])
    assert isinstance(client, TcpStream) and not client.same_host
    await client.aclose()
    await other.aclose()
    await listener.aclose()
