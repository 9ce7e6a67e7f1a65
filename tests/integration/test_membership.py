"""In-process clusters over real loopback TCP: membership, attributes, failures, heartbeats."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import Attribute, MasterConfig, PeerConfig
from pccl.master.server import open_master
from pccl.peer.communicator import Communicator, open_communicator
from pccl.testing import DEFAULT_MASTER_CONFIG, MASTER, VirtualNetwork, open_test_cluster
from pccl.transport import TcpTransport
from pccl.wire import messages as m
from pccl.wire.framing import encode_frame
from pccl.wire.handshake import offer_hello
from pccl.wire.stream import MessageStream

FAST_MASTER = MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0)
FAST_PEER = PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, p2p_listen_host="127.0.0.1")


async def _update_all(comms: list[Communicator]) -> None:
    async with trio.open_nursery() as n:
        for c in comms:
            n.start_soon(c.update_topology)


async def test_lone_peer_accepted() -> None:
    async with open_master(config=FAST_MASTER) as master:
        async with open_communicator(master.connect_address, config=FAST_PEER) as comm:
            assert comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
            assert comm.get_attribute(Attribute.PEER_GROUP_WORLD_SIZE) == 1
            assert master.statistics()["accepted"] == 1


async def test_second_peer_blocks_until_update_topology() -> None:
    async with open_master(config=FAST_MASTER) as master:
        async with open_communicator(master.connect_address, config=FAST_PEER) as a:
            joined = trio.Event()
            release = trio.Event()
            seen: dict[str, int] = {}

            async def second() -> None:
                async with open_communicator(master.connect_address, config=FAST_PEER) as b:
                    seen["b"] = b.get_attribute(Attribute.GLOBAL_WORLD_SIZE)
                    joined.set()
                    await release.wait()

            async with trio.open_nursery() as n:
                n.start_soon(second)
                # wait until the master has b registered, then prove b is still blocked
                while master.statistics()["registered"] < 1:
                    await trio.sleep(0.01)
                assert not joined.is_set()
                assert await a.are_peers_pending() is True
                await a.update_topology()
                await joined.wait()
                assert seen["b"] == 2
                assert a.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 2
                release.set()


async def test_eight_peers_join_one_by_one() -> None:
    async with open_master(config=FAST_MASTER) as master:
        comms: list[Communicator] = []
        done = trio.Event()

        async def peer(ready: trio.Event) -> None:
            async with open_communicator(master.connect_address, config=FAST_PEER) as c:
                comms.append(c)
                ready.set()
                await done.wait()

        async with trio.open_nursery() as n:
            first = trio.Event()
            n.start_soon(peer, first)
            await first.wait()
            for _ in range(7):
                ready = trio.Event()
                n.start_soon(peer, ready)
                while master.statistics()["registered"] < 1:
                    await trio.sleep(0.005)
                await _update_all(list(comms))
                await ready.wait()
            assert [c.get_attribute(Attribute.GLOBAL_WORLD_SIZE) for c in comms] == [8] * 8
            done.set()


async def test_two_groups_attributes() -> None:
    async with open_master(config=FAST_MASTER) as master:
        done = trio.Event()
        comms: list[Communicator] = []

        async def peer(group: int, ready: trio.Event) -> None:
            async with open_communicator(master.connect_address, peer_group=group, config=FAST_PEER) as c:
                comms.append(c)
                ready.set()
                await done.wait()

        async with trio.open_nursery() as n:
            r0 = trio.Event()
            n.start_soon(peer, 0, r0)
            await r0.wait()
            readies = []
            for g in (1, 1):
                r = trio.Event()
                readies.append(r)
                n.start_soon(peer, g, r)
            while master.statistics()["registered"] < 2:
                await trio.sleep(0.005)
            await comms[0].update_topology()
            for r in readies:
                await r.wait()
            await _update_all(comms)  # everyone sees the same table
            for c in comms:
                assert c.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 3
                assert c.get_attribute(Attribute.NUM_DISTINCT_PEER_GROUPS) == 2
                assert c.get_attribute(Attribute.LARGEST_PEER_GROUP_WORLD_SIZE) == 2
                assert c.get_attribute(Attribute.PEER_GROUP_WORLD_SIZE) == (1 if c.peer_group == 0 else 2)
            done.set()


async def test_closed_peer_drops_out_at_next_update() -> None:
    async with open_master(config=FAST_MASTER) as master:
        async with trio.open_nursery() as n:
            stop = trio.Event()
            leave_c = trio.Event()
            comms: dict[str, Communicator] = {}

            async def peer(name: str, ready: trio.Event, leave: trio.Event) -> None:
                async with open_communicator(master.connect_address, config=FAST_PEER) as c:
                    comms[name] = c
                    ready.set()
                    await leave.wait()

            r = trio.Event()
            n.start_soon(peer, "a", r, stop)
            await r.wait()
            r2, r3 = trio.Event(), trio.Event()
            n.start_soon(peer, "b", r2, stop)
            n.start_soon(peer, "c", r3, leave_c)
            while master.statistics()["registered"] < 2:
                await trio.sleep(0.005)
            await comms["a"].update_topology()
            await r2.wait()
            await r3.wait()
            assert comms["a"].world_size == 3
            leave_c.set()
            while master.statistics()["accepted"] > 2:
                await trio.sleep(0.005)
            rest = [comms["a"], comms["b"]]
            await _update_all(rest)
            assert [c.get_attribute(Attribute.GLOBAL_WORLD_SIZE) for c in rest] == [2, 2]
            stop.set()


async def test_silent_peer_evicted_by_heartbeat(autojump_clock: trio.testing.MockClock) -> None:
    """A peer that keeps its socket open but goes silent is evicted after the timeout (virtual time)."""
    cfg = MasterConfig(heartbeat_interval=0.5, heartbeat_timeout=3.0)
    async with open_master(config=cfg) as master:
        async with open_communicator(master.connect_address, config=FAST_PEER) as a:
            _, port = master.address
            stream = await TcpTransport().connect("127.0.0.1", port)
            ms = MessageStream(stream, max_frame_size=1 << 20)
            await offer_hello(ms, purpose="master", secret=None)
            await ms.send(m.Register(p2p_port=5555, peer_group=0))
            while master.statistics()["registered"] < 1:
                await trio.sleep(0.01)
            t0 = trio.current_time()
            # the silent peer never sends another byte; the master must evict it
            while master.statistics()["connected"] > 1:
                await trio.sleep(0.1)
            waited = trio.current_time() - t0
            assert 3.0 <= waited <= 5.0
            assert await a.are_peers_pending() is False
            await ms.aclose()


async def test_lost_master_fails_calls() -> None:
    async with open_communicator_and_master() as (master_scope, comm):
        master_scope.cancel()
        with trio.fail_after(10):
            while comm.statistics()["master_ok"]:
                await trio.sleep(0.01)
        try:
            await comm.update_topology()
        except pccl.MasterConnectionError as exc:
            assert exc.result == pccl.Result.MASTER_CONNECTION_FAILED
        else:
            raise AssertionError("update_topology after the master died must fail")


class open_communicator_and_master:
    """A master in its own cancel scope plus one communicator, so a test can kill the master."""

    async def __aenter__(self) -> tuple[trio.CancelScope, Communicator]:
        self._stack = trio.open_nursery()
        n = await self._stack.__aenter__()
        self.scope = trio.CancelScope()
        addr_ready: list[str] = []
        got = trio.Event()

        async def run_master() -> None:
            with self.scope:
                async with open_master(config=FAST_MASTER) as master:
                    addr_ready.append(master.connect_address)
                    got.set()
                    await trio.sleep_forever()

        n.start_soon(run_master)
        await got.wait()
        self._comm_cm = open_communicator(addr_ready[0], config=FAST_PEER)
        comm = await self._comm_cm.__aenter__()
        return self.scope, comm

    async def __aexit__(self, *exc: object) -> None:
        await self._comm_cm.__aexit__(None, None, None)
        self.scope.cancel()
        await self._stack.__aexit__(None, None, None)


async def test_illegal_message_kicks_only_that_peer() -> None:
    async with open_master(config=FAST_MASTER) as master:
        async with open_communicator(master.connect_address, config=FAST_PEER) as a:
            _, port = master.address
            stream = await TcpTransport().connect("127.0.0.1", port)
            ms = MessageStream(stream, max_frame_size=1 << 20)
            assert isinstance(await offer_hello(ms, purpose="master", secret=None), m.HelloOk)
            descriptor = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)
            await ms.send(m.CollectiveInitiate(tag=1, descriptor=descriptor))  # before Register: illegal
            reply = await ms.receive()
            assert isinstance(reply, m.Refused) and "before Register" in reply.reason
            await ms.aclose()
            # garbage frame from another connection
            stream2 = await TcpTransport().connect("127.0.0.1", port)
            ms2 = MessageStream(stream2, max_frame_size=1 << 20)
            await offer_hello(ms2, purpose="master", secret=None)
            await stream2.send_all(encode_frame(b"\xc1\xc1garbage"))
            reply = await ms2.receive()
            assert isinstance(reply, m.Refused) and "protocol error" in reply.reason
            await ms2.aclose()
            # oversized length prefix
            stream3 = await TcpTransport().connect("127.0.0.1", port)
            await stream3.send_all(b"\xff\xff\xff\xff")
            await stream3.aclose()
            # the master and peer a are unaffected
            assert await a.are_peers_pending() is False
            assert master.statistics()["accepted"] == 1
            assert master.statistics()["kicked_total"] == 2


async def test_version_mismatch_refused_with_clear_message() -> None:
    async with open_master(config=FAST_MASTER) as master:
        _, port = master.address
        stream = await TcpTransport().connect("127.0.0.1", port)
        ms = MessageStream(stream, max_frame_size=1 << 20)
        await ms.send(m.Hello(protocol_version=999, purpose="master"))
        reply = await ms.receive()
        assert isinstance(reply, m.Refused)
        assert "999" in reply.reason and str(pccl.PROTOCOL_VERSION) in reply.reason
        await ms.aclose()


async def test_secret_required() -> None:
    cfg = MasterConfig(secret="s3cret")
    async with open_master(config=cfg) as master:
        try:
            async with open_communicator(master.connect_address, config=FAST_PEER):
                raise AssertionError("must be refused")
        except pccl.MasterConnectionError as exc:
            assert "secret" in str(exc)
        ok = PeerConfig(secret="s3cret", p2p_listen_host="127.0.0.1")
        async with open_communicator(master.connect_address, config=ok) as c:
            assert c.world_size == 1


async def test_unreachable_master_raises_domain_error() -> None:
    async with open_master() as master:
        port = master.address[1]
    try:
        async with open_communicator(f"127.0.0.1:{port}", config=FAST_PEER):
            raise AssertionError("must fail")
    except pccl.MasterConnectionError as exc:
        assert exc.result == pccl.Result.MASTER_CONNECTION_FAILED


async def test_message_over_max_frame_size_evicts_the_peer_not_the_master(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A master whose max_frame_size is too small for a message it must send (here the first topology
    round's P2PCredentials or EstablishP2P) evicts that peer with the reason in its log and keeps
    serving; it used to crash. (64 bytes: a Register, with its 32-byte P2P key since protocol 5, fits.)"""
    caplog.set_level(logging.ERROR, logger="pccl.master")
    net = VirtualNetwork()
    cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, max_frame_size=64)
    async with open_test_cluster(3, master_config=cfg, network=net) as cl:
        for i in range(3):
            with pytest.raises(pccl.PCCLError):
                await cl.peer(i).all_reduce(np.ones(4, np.float32))
        assert "exceeds the limit of 64 (raise MasterConfig.max_frame_size)" in caplog.text
        # Still serving: a newcomer gets its HelloOk.
        stream = await net.host("probe").connect(cl.host(MASTER).address, cl.master.address[1])
        ms = MessageStream(stream, max_frame_size=1 << 20)
        assert isinstance(await offer_hello(ms, purpose="master", secret=None), m.HelloOk)
        await ms.aclose()
