"""Issue 33 finding 8: connection budgets that cannot lock honest peers out.

* 64 idle connections from one source (here the same-host Unix socket, which honest same-host peers share)
  made every join from that source fail for as long as they were held: now the newest connection pushes
  the oldest one in its hello out, so a newcomer of that source joins while the flood goes on.
* Connections past their hello that are not members (guests) are capped per source, and admitted only
  while descriptors stay free for the members; one over is refused after its hello with a logged reason.
* Unfinished large frames of guests are bounded in total master memory and in time: one that does not fit
  the budget is kicked with the reason, one that never completes is kicked at the frame deadline.
Honest all-reduces stay exact throughout."""

from __future__ import annotations

import dataclasses
import logging
import socket
import struct

import pytest
import trio
import trio.testing

from pccl import transport
from pccl.master.budget import FD_RESERVE, MIN_HEADROOM
from pccl.testing import DEFAULT_MASTER_CONFIG, VirtualNetwork, open_test_cluster, wait_until
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.transport import StreamBroken, local_socket_name
from pccl.wire import limits
from pccl.wire import messages as m
from pccl.wire.handshake import HandshakeFailed, offer_hello
from pccl.wire.stream import MessageStream

from ._helpers import exact_all_reduces, hostile, master_port


@pytest.mark.skipif(not transport._LOCAL_SOCKETS, reason="the shortcut is Linux's")
async def test_a_flood_from_the_same_host_does_not_lock_a_newcomer_out(
    pccl_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    # A long hello timeout: the flood holds its places for the whole test unless pushed out.
    cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, hello_timeout=60.0)
    cluster = await pccl_cluster(2, network=None, master_config=cfg)
    name = local_socket_name(*master_port(cluster))
    idle: list[trio.socket.SocketType] = []
    try:
        for _ in range(100):
            s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await s.connect(name)
            idle.append(s)
        await wait_until(lambda: cluster.master._server.gate.evicted_total >= 100 - 64, timeout=20)
        with trio.fail_after(20):  # the flood would hold its places for 60 s
            await cluster.add_peer()
        await exact_all_reduces(cluster, rounds=2)
    finally:
        for s in idle:
            s.close()
    assert "64 connections from 127.0.0.1 are in their hello (the cap per host is 64): the oldest is closed" \
        in caplog.text


async def _guest(evil: object, addr: tuple[str, int]) -> MessageStream | str:
    """A connection past its hello (no secret needed): the stream, or the master's refusal."""
    stream = await evil.connect(*addr)  # type: ignore[attr-defined]
    ms = MessageStream(stream, max_frame_size=1 << 20, limits=limits.pre_auth())
    try:
        await offer_hello(ms, purpose="master", secret=None)
    except HandshakeFailed as exc:  # refused in place of HelloOk
        return exc.reason
    with trio.move_on_after(0.003):  # a few round trips; 64 of them stay well within the heartbeat timeout
        try:
            got = await ms.receive()
        except StreamBroken:
            return "closed"
        if isinstance(got, m.Refused):
            return got.reason
    return ms


async def test_guests_are_capped_per_source_and_by_descriptors(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.0005)) as cl:
        evil = hostile(cl)
        addr = master_port(cl)
        cap = cl.master._server.budget.per_host = 16  # the default (256) takes longer to fill
        guests = [await _guest(evil, addr) for _ in range(cap)]
        assert all(isinstance(g, MessageStream) for g in guests)
        over = await _guest(evil, addr)
        assert isinstance(over, str) and f"wait for admission (the cap per host is {cap})" in over
        assert "refused connection from" in caplog.text and "after its hello" in caplog.text
        await exact_all_reduces(cl, rounds=2)

        # Descriptors: with a limit just above what is open, a guest from another source is refused
        # while the members' headroom would be eaten; the members carry on.
        server = cl.master._server
        server.budget.nofile = len(server._conns) + FD_RESERVE + MIN_HEADROOM
        other = hostile(cl, "evil2")
        refused = await _guest(other, addr)
        assert isinstance(refused, str) and "descriptors are kept for members" in refused
        await exact_all_reduces(cl, rounds=2, tag=10)
        for g in guests:
            assert isinstance(g, MessageStream)
            await g.aclose()


async def test_unfinished_large_frames_of_guests_are_bounded(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    # A heartbeat timeout past the frame deadline: the deadline, not the silence, ends the stuck frames.
    cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, heartbeat_timeout=30.0)
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.0005), master_config=cfg) as cl:
        server = cl.master._server
        budget = server.frames
        frame = limits.LIST_MAX_FRAME  # 256 KiB: a P2PConnectionsDone's cap
        fits = budget.limit // frame
        started: list[MessageStream] = []
        for i in range(fits + 1):
            g = await _guest(hostile(cl, f"evil{i}"), master_port(cl))
            assert isinstance(g, MessageStream)
            # the head of a 256 KiB P2PConnectionsDone and a little of it, then nothing more
            head = struct.pack("<I", frame) + bytes([0x92, m.P2PConnectionsDone.TAG])
            await g.stream.send_all(head + b"\0" * 1000)
            started.append(g)
        await wait_until(lambda: budget.refused_total == 1, timeout=1, interval=0.01)
        assert budget.used == fits * frame <= budget.limit
        assert "does not fit the master's budget for unfinished frames" in caplog.text
        await exact_all_reduces(cl, rounds=2)
        # The ones that fit never complete: kicked at the frame deadline, their bytes given back.
        await wait_until(lambda: budget.used == 0, timeout=budget.deadline + 1, interval=0.01)
        assert f"did not arrive whole within {budget.deadline:g}s" in caplog.text
        assert budget.peak <= budget.limit
        await exact_all_reduces(cl, rounds=1, tag=10)
        for g in started:
            await g.aclose()
