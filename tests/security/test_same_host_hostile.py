"""A hostile process on the same host, through the same-host shortcut's Unix sockets (real sockets): the
master's and a peer's P2P listener face it with the limits they apply to TCP connections, and the run's
all-reduces stay exact while it throws junk, oversized frames and a flood of idle connections at them."""

from __future__ import annotations

import logging
import socket
import struct

import pytest
import trio

from pccl import transport
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.transport import TcpStream, local_socket_name
from pccl.wire import messages as m

from ._helpers import exact_all_reduces, master_port, p2p_address

pytestmark = pytest.mark.skipif(not transport._LOCAL_SOCKETS, reason="the shortcut is Linux's")


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _attacks() -> list[bytes]:
    return [
        _frame(bytes([0x92, m.Hello.TAG]) + b"\x91" * (64 << 10)),  # over the 4 KiB pre-hello cap
        struct.pack("<I", 0xFFFFFFF0),  # a length prefix of 4 GiB, nothing behind it
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not our protocol at all
        _frame(bytes([0x92, m.Hello.TAG]) + b"\x91" * 4000),  # nested lists inside the cap
    ]


async def _throw(name: bytes, data: bytes) -> bytes:
    """Connect to the Unix socket ``name`` as an outsider, send ``data``, read until the listener closes."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    got = b""
    with sock:
        await sock.connect(name)
        try:
            await sock.send(data)
            while chunk := await sock.recv(65536):
                got += chunk
        except OSError:  # reset by the listener: what a refusal of a half-read frame looks like
            pass
    return got


async def test_junk_and_floods_over_the_unix_sockets_change_nothing(
    pccl_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(3, network=None)
    await exact_all_reduces(cluster, rounds=1)
    host, port = master_port(cluster)
    p2p_host, p2p_port = p2p_address(cluster, 1)
    targets = [local_socket_name(host, port), local_socket_name(p2p_host, p2p_port)]
    idle: list[trio.socket.SocketType] = []
    replies: list[bytes] = []
    closed: list[bytes] = []

    async def attacker() -> None:
        for name in targets:
            for data in _attacks():
                replies.append(await _throw(name, data))
            for _ in range(100):  # then a flood that only connects (the hello slots per source bound it)
                s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    await s.connect(name)
                except OSError:  # the listener's backlog is full: the flood is bounded there too
                    s.close()
                    continue
                idle.append(s)
            # 64 from this source are in their hello: each connection over that closed the oldest. A
            # newcomer from this source still gets its hello answered (issue 33 finding 8): the junk
            # hello below is refused with a reason, not shut out unread.
            closed.append(await _throw(name, b"\x00\x00\x00\x00"))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attacker)
            await exact_all_reduces(cluster, rounds=5, tag=10)
        await exact_all_reduces(cluster, rounds=2, tag=20)
    finally:
        for s in idle:
            s.close()
    assert cluster.alive == [0, 1, 2]
    assert len(replies) == 2 * len(_attacks())
    assert len(closed) == 2
    assert "exceeds the limit of 4096 bytes" in caplog.text  # refused on the length prefix, unbuffered
    assert "64 connections from 127.0.0.1 are in their hello (the cap per host is 64): the oldest is closed" \
        in caplog.text  # the flood, capped per source
    # and the members' own connections took the shortcut: the one to the master, for instance
    stream = cluster.peer(0)._sending_link().stream
    assert isinstance(stream, TcpStream) and stream.same_host
