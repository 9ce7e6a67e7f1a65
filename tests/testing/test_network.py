"""Tests of the virtual network (pccl.testing.network), all in virtual time.

Every test requests ``autojump_clock`` (pytest-trio's ``MockClock(autojump_threshold=0)``), so
latencies, bandwidth and timeouts are exact virtual durations and nothing really waits.
"""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from pccl.testing import (
    Delay,
    VirtualNetwork,
    VirtualStream,
    close_after,
    delay_after,
    open_stream_pair,
    reset_after,
    stall_after,
    trickle,
)
from pccl.transport import (
    ConnectFailed,
    Listener,
    Stream,
    StreamBroken,
    Transport,
    receive_exactly_into,
)

MB = 1_000_000


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-9)


async def open_pair(
    net: VirtualNetwork, client: str, server: str, port: int = 0
) -> tuple[VirtualStream, VirtualStream]:
    """Connect ``client`` to a fresh listener on ``server``; return (client end, server end)."""
    c, s = await open_stream_pair(net.host(client), net.host(server), connect_host=net.host(server).address,
                                  port=port)
    assert isinstance(c, VirtualStream) and isinstance(s, VirtualStream)
    return c, s


async def recv_exactly(stream: VirtualStream, n: int) -> bytes:
    buf = bytearray(n)
    await receive_exactly_into(stream, memoryview(buf))
    return bytes(buf)


async def test_protocols_are_implemented(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    host = net.host("a")
    transport: Transport = host  # checked statically by mypy as well
    assert isinstance(transport, Transport)
    lst = await host.listen("0.0.0.0", 0)
    assert isinstance(lst, Listener)
    c, s = await open_pair(net, "b", "a")
    assert isinstance(c, Stream) and isinstance(s, Stream)
    await lst.aclose()


async def test_echo_and_addresses(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    a, b = net.host("a"), net.host("b")
    assert a.address != b.address
    lst = await b.listen("0.0.0.0", 7000)
    assert lst.address == ("0.0.0.0", 7000)

    async def echo_server() -> None:
        s = await lst.accept()
        assert s.local_address == (b.address, 7000)
        while data := await s.receive_some(100):
            await s.send_all(data)
        await s.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo_server)
        c = await a.connect("b", 7000)  # by name; resolves to b's address
        assert c.peer_address == (b.address, 7000)
        assert c.local_address[0] == a.address
        payload = os.urandom(5000)
        await c.send_all(payload)
        assert await recv_exactly(c, len(payload)) == payload
        await c.aclose()
    assert c.statistics().bytes_sent == 5000
    assert c.statistics().bytes_received == 5000
    assert not c.statistics().open


async def test_latency_in_virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    net.host("a"), net.host("b")
    net.set_link("a", "b", latency=0.05, oneway=True)
    net.set_link("b", "a", latency=0.02, oneway=True)
    assert net.link("a", "b").latency == 0.05
    assert net.link("b", "a").latency == 0.02
    lst = await net.host("b").listen("0.0.0.0", 0)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        server: list[VirtualStream] = []

        async def accept() -> None:
            server.append(await lst.accept())
            # The server's accept completes when the client's final ACK arrives.
            assert trio.current_time() - t0 == approx(0.05 + 0.02 + 0.05)

        nursery.start_soon(accept)
        c = await net.host("a").connect(net.host("b").address, lst.address[1])
        assert trio.current_time() - t0 == approx(0.07)  # one round trip
    s = server[0]
    t1 = trio.current_time()
    await c.send_all(b"ping")
    assert await s.receive_some() == b"ping"
    assert trio.current_time() - t1 == approx(0.05)
    t2 = trio.current_time()
    await s.send_all(b"pong")
    assert await c.receive_some() == b"pong"
    assert trio.current_time() - t2 == approx(0.02)


async def test_bandwidth_10mb_over_1mb_per_s(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.01)
    net.host("a"), net.host("b")
    net.set_link("a", "b", bandwidth=1 * MB)
    c, s = await open_pair(net, "a", "b")
    data = os.urandom(10 * MB)
    got = bytearray(len(data))
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.send_all, data)
        await receive_exactly_into(s, memoryview(got))
    elapsed = trio.current_time() - t0
    assert got == data
    assert elapsed == pytest.approx(10.0 + 0.01, rel=1e-6)


async def test_bandwidth_is_shared_between_connections(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(bandwidth=1 * MB)
    pairs = [await open_pair(net, "a", "b") for _ in range(2)]
    done: list[float] = []
    t0 = trio.current_time()

    async def transfer(c: VirtualStream, s: VirtualStream) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.send_all, bytes(4 * MB))
            await recv_exactly(s, 4 * MB)
        done.append(trio.current_time() - t0)

    async with trio.open_nursery() as nursery:
        for c, s in pairs:
            nursery.start_soon(transfer, c, s)
    # 8 MB through one 1 MB/s link: both finish near 8 s; neither got the link to itself (4 s).
    assert min(done) > 7.5
    assert max(done) == pytest.approx(8.0, rel=1e-6)


async def test_window_limits_throughput_per_round_trip(autojump_clock: trio.testing.MockClock) -> None:
    # 10 windows of 64 KiB, 0.1 s each way: window k is sent at 0.2 k and arrives 0.1 later.
    net = VirtualNetwork(latency=0.1, buffer_size=64 << 10)
    c, s = await open_pair(net, "a", "b")
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.send_all, bytes(640 << 10))
        await recv_exactly(s, 640 << 10)
    assert trio.current_time() - t0 == approx(1.9)


async def test_receive_into_delivers_partial_data_as_it_arrives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(bandwidth=1 * MB, segment_size=1000)
    c, s = await open_pair(net, "a", "b")
    payload = os.urandom(5000)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.send_all, payload)
        buf = bytearray(10_000)
        n = await s.receive_into(memoryview(buf))
        # The first 1000-byte segment, after its 1 ms serialization; not the whole payload.
        assert n == 1000
        assert trio.current_time() - t0 == approx(0.001)
        assert buf[:n] == payload[:n]
        await trio.sleep(0.0105)  # by now segments 2..5 have all arrived
        m = await s.receive_into(memoryview(buf)[n:])
        assert m == 4000
        assert buf[: n + m] == payload


async def test_connection_refused_is_prompt(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.03, connect_timeout=5.0)
    net.host("b")
    t0 = trio.current_time()
    with pytest.raises(ConnectFailed, match="refused"):
        await net.host("a").connect(net.host("b").address, 1234)
    assert trio.current_time() - t0 == approx(0.06)
    assert net.statistics().connections_refused == 1
    with pytest.raises(ConnectFailed, match="no route"):
        await net.host("a").connect("10.99.99.99", 1234)


async def test_partition_blackholes_then_heal_delivers(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.01, buffer_size=100_000)
    c, s = await open_pair(net, "a", "b")
    net.partition("a", "b")
    assert net.is_partitioned("a", "b") and net.is_partitioned("b", "a")
    await c.send_all(b"hello")
    with trio.move_on_after(100) as scope:
        await s.receive_some()
    assert scope.cancelled_caught  # nothing delivered, no EOF, no error
    # Once the window is full the sender blocks too.
    with trio.move_on_after(100) as scope:
        await c.send_all(bytes(200_000))
    assert scope.cancelled_caught
    # New connections time out (no RST crosses a black hole).
    t0 = trio.current_time()
    lst = await net.host("b").listen("0.0.0.0", 0)
    with pytest.raises(ConnectFailed, match="timed out"):
        await net.host("a").connect(net.host("b").address, lst.address[1])
    assert trio.current_time() - t0 == approx(5.0)
    t1 = trio.current_time()
    net.heal()
    with trio.fail_after(1):
        assert await recv_exactly(s, 5) == b"hello"
    assert trio.current_time() - t1 == approx(0.01)  # retransmitted after the heal
    assert net.statistics().partitions == ()


async def test_connect_waiting_on_partition_succeeds_after_heal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(connect_timeout=10.0)
    net.host("a")
    lst = await net.host("b").listen("0.0.0.0", 9000)
    net.partition("a", "b")

    async def heal_later() -> None:
        await trio.sleep(3)
        net.heal("a", "b")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heal_later)
        c = await net.host("a").connect("b", 9000)
        assert trio.current_time() == approx(3.0)
        s = await lst.accept()
    await c.send_all(b"x")
    assert await s.receive_some() == b"x"


async def test_one_way_partition(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.01)
    c, s = await open_pair(net, "a", "b")
    net.partition("a", "b", oneway=True)
    assert net.is_partitioned("a", "b") and not net.is_partitioned("b", "a")
    await s.send_all(b"b->a works")
    assert await recv_exactly(c, 10) == b"b->a works"
    await c.send_all(b"a->b lost")
    with trio.move_on_after(10) as scope:
        await s.receive_some()
    assert scope.cancelled_caught
    net.heal("a")
    with trio.fail_after(1):
        assert await recv_exactly(s, 9) == b"a->b lost"


async def test_partition_catches_data_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=1.0)
    c, s = await open_pair(net, "a", "b")
    await c.send_all(b"in flight")
    await trio.sleep(0.5)
    net.partition("a", "b")
    with trio.move_on_after(100) as scope:
        await s.receive_some()
    assert scope.cancelled_caught
    t0 = trio.current_time()
    net.heal()
    with trio.fail_after(5):
        assert await recv_exactly(s, 9) == b"in flight"
    assert trio.current_time() - t0 == approx(1.0)


async def test_accept_order_follows_connect_order(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.01)
    lst = await net.host("srv").listen("0.0.0.0", 0)
    clients = [await net.host(f"c{i}").connect("srv", lst.address[1]) for i in range(3)]
    with trio.fail_after(1):
        accepted = [await lst.accept() for _ in range(3)]
    assert [s.peer_address for s in accepted] == [c.local_address for c in clients]


async def test_partition_from_everyone(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    for name in ("a", "b", "c"):
        net.host(name)
    net.partition("a")
    assert net.is_partitioned("a", "c") and net.is_partitioned("b", "a")
    assert not net.is_partitioned("b", "c")
    net.heal("a", "b")
    assert not net.is_partitioned("a", "b") and net.is_partitioned("a", "c")


async def test_hang_blocks_io_without_eof_and_unhang_resumes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.01, buffer_size=100_000)
    c, s = await open_pair(net, "a", "b")
    net.hang("b")
    assert net.host("b").hung
    await c.send_all(b"data for a hung host")
    # The hung host's calls block even though the data has arrived.
    with trio.move_on_after(50) as scope:
        await s.receive_some()
    assert scope.cancelled_caught
    with trio.move_on_after(50) as scope:
        await s.send_all(b"x")
    assert scope.cancelled_caught
    # Its peer sees neither data nor EOF, and stalls once the window is full.
    with trio.move_on_after(50) as scope:
        await c.receive_some()
    assert scope.cancelled_caught
    with trio.move_on_after(50) as scope:
        await c.send_all(bytes(200_000))
    assert scope.cancelled_caught
    assert net.statistics().hung == ("b",)
    net.unhang("b")
    with trio.fail_after(1):
        assert await recv_exactly(s, 20) == b"data for a hung host"
    await s.send_all(b"back")
    assert await recv_exactly(c, 4) == b"back"


async def test_unhang_wakes_a_blocked_receive(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    c, s = await open_pair(net, "a", "b")
    net.hang("b")
    got: list[bytes] = []
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:

            async def reader() -> None:
                got.append(await s.receive_some())

            nursery.start_soon(reader)
            await c.send_all(b"q")
            await trio.sleep(5)
            assert got == []
            net.unhang("b")
    assert got == [b"q"]


async def test_crash_breaks_both_ends(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.02, connect_timeout=2.0)
    c, s = await open_pair(net, "a", "b")
    lst = await net.host("b").listen("0.0.0.0", 5555)
    await s.send_all(b"last words")
    errors: dict[str, BaseException] = {}

    async def expect_broken(name: str, fn: object) -> None:
        try:
            await fn()  # type: ignore[operator]
        except StreamBroken as exc:
            errors[name] = exc
            errors[name + "@"] = trio.current_time()  # type: ignore[assignment]

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(expect_broken, "own receive", s.receive_some)
        nursery.start_soon(expect_broken, "accept", lst.accept)
        await trio.sleep(1)
        t0 = trio.current_time()
        net.crash("b")
    assert set(errors) >= {"own receive", "accept"}
    assert errors["own receive@"] == approx(t0)  # the crashed host's own pending ops fail at once
    # The remote end reads what was sent before the crash, then gets a reset, not EOF.
    assert await recv_exactly(c, 10) == b"last words"
    with pytest.raises(StreamBroken):
        await c.receive_some()
    with pytest.raises(StreamBroken):
        await c.send_all(b"x")
    old = net.host("b")
    assert not old.alive
    with pytest.raises(ConnectFailed):
        await old.connect(net.host("a").address, 1)
    with pytest.raises(ConnectFailed):
        await old.listen("0.0.0.0", 0)
    t1 = trio.current_time()
    with pytest.raises(ConnectFailed, match="timed out"):
        await net.host("a").connect("b", 5555)
    assert trio.current_time() - t1 == approx(2.0)
    assert net.statistics().crashed == ("b",)
    new = net.restart("b")
    assert new is net.host("b") and new.alive and new.address == old.address
    with pytest.raises(ConnectFailed, match="refused"):  # nobody listens on the new incarnation
        await net.host("a").connect("b", 5555)
    c2, s2 = await open_pair(net, "a", "b", port=5555)
    await c2.send_all(b"ok")
    assert await recv_exactly(s2, 2) == b"ok"


async def test_reset_breaks_the_connections_between_two_hosts_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.02)
    c, s = await open_pair(net, "a", "b")
    c2, s2 = await open_pair(net, "a", "c", port=6000)
    await c.send_all(b"lost in flight")
    async with trio.open_nursery() as nursery:

        async def expect_broken(fn: object) -> None:
            with pytest.raises(StreamBroken):
                await fn()  # type: ignore[operator]

        nursery.start_soon(expect_broken, s.receive_some)  # a pending receive fails at once
        await trio.sleep(0)
        assert net.reset("a", "b") == 1
    for end in (c, s):
        with pytest.raises(StreamBroken):
            await end.send_all(b"x")
    # Both hosts stay up: the other connection works, and so does a new one between them.
    await c2.send_all(b"still here")
    assert await recv_exactly(s2, 10) == b"still here"
    c3, s3 = await open_pair(net, "a", "b", port=7000)
    await c3.send_all(b"again")
    assert await recv_exactly(s3, 5) == b"again"
    assert net.reset("b", "c") == 0


async def test_crash_reset_reaches_a_pending_remote_receive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.25)
    c, _s = await open_pair(net, "a", "b")
    async with trio.open_nursery() as nursery:

        async def crash_later() -> None:
            await trio.sleep(1)
            net.crash("b")

        nursery.start_soon(crash_later)
        t0 = trio.current_time()
        with pytest.raises(StreamBroken):
            await c.receive_some()
        assert trio.current_time() - t0 == approx(1.25)  # the RST takes one latency


async def test_aclose_wakes_pending_ops_in_other_tasks(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(buffer_size=1000)
    c, s = await open_pair(net, "a", "b")
    outcomes: list[str] = []

    async def pending(fn: object, *args: object) -> None:
        try:
            await fn(*args)  # type: ignore[operator]
        except StreamBroken:
            outcomes.append("broken")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pending, c.receive_some)
        nursery.start_soon(pending, c.send_all, bytes(5000))  # blocks: window full, nobody reads
        await trio.sleep(1)
        assert outcomes == []
        await c.aclose()
    assert outcomes == ["broken", "broken"]
    with pytest.raises(StreamBroken):
        await c.receive_some()
    await c.aclose()  # idempotent
    # The peer reads what was sent before the close, then EOF.
    assert await recv_exactly(s, 1000) == bytes(1000)
    assert await s.receive_some() == b""
    assert await s.receive_into(memoryview(bytearray(10))) == 0


async def test_clean_close_eof_after_data_and_send_to_closed_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(latency=0.1)
    c, s = await open_pair(net, "a", "b")
    await c.send_all(b"bye")
    await c.aclose()
    await s.send_all(b"too late")  # the FIN has not arrived yet: accepted, then discarded
    assert await s.receive_some() == b"bye"
    assert await s.receive_some() == b""
    with pytest.raises(StreamBroken, match="broken pipe"):
        await s.send_all(b"x")
    assert net.statistics().bytes_discarded == 8


async def test_listener_port_zero_and_address_in_use(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    h = net.host("10.1.2.3")
    assert h.address == "10.1.2.3"
    l1 = await h.listen("0.0.0.0", 0)
    l2 = await h.listen("10.1.2.3", 0)
    assert l1.address[1] > 0 and l2.address[1] > 0 and l1.address[1] != l2.address[1]
    assert l2.address == ("10.1.2.3", l2.address[1])
    with pytest.raises(ConnectFailed, match="in use"):
        await h.listen("0.0.0.0", l1.address[1])
    with pytest.raises(ConnectFailed, match="assign"):
        await h.listen("10.9.9.9", 0)
    # The reported port is the one that works.
    c = await net.host("x").connect("10.1.2.3", l1.address[1])
    s = await l1.accept()
    assert s.peer_address == c.local_address
    # A host also reaches its own listeners over its private 127.0.0.1.
    lo = await h.listen("127.0.0.1", 0)
    c2 = await h.connect("localhost", lo.address[1])
    assert c2.peer_address == ("127.0.0.1", lo.address[1])
    with pytest.raises(ConnectFailed, match="refused"):
        await net.host("x").connect("10.1.2.3", lo.address[1])  # bound to loopback only
    await l1.aclose()
    with pytest.raises(StreamBroken):
        await l1.accept()
    await h.listen("0.0.0.0", l1.address[1])  # the port is free again


async def test_loopback_mode(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(loopback=True, latency=0.01)
    a, b, m = net.host("a"), net.host("b"), net.host("master")
    assert a.address == b.address == m.address == "127.0.0.1"
    lm = await m.listen("0.0.0.0", 48148)
    lb = await b.listen("0.0.0.0", 0)
    la = await a.listen("0.0.0.0", 0)
    assert len({lm.address[1], lb.address[1], la.address[1]}) == 3
    with pytest.raises(ConnectFailed, match="in use"):  # one machine: one port space
        await a.listen("127.0.0.1", 48148)
    t0 = trio.current_time()
    c = await a.connect("127.0.0.1", lb.address[1])
    assert trio.current_time() - t0 == approx(0.02)  # the a<->b link latency still applies
    s = await lb.accept()
    assert s.host is b
    assert c.peer_address == ("127.0.0.1", lb.address[1])
    assert s.peer_address == c.local_address and c.local_address[0] == "127.0.0.1"
    assert c.local_address[1] not in (lm.address[1], lb.address[1], la.address[1])
    await c.send_all(b"hi")
    assert await s.receive_some() == b"hi"
    with pytest.raises(ConnectFailed, match="no route"):
        await a.connect("10.0.0.1", lb.address[1])
    await lb.aclose()
    with pytest.raises(ConnectFailed, match="refused"):
        await a.connect("127.0.0.1", lb.address[1])


async def test_hook_reset_after_n_bytes(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    c, s = await open_pair(net, "a", "b")
    net.add_hook(reset_after(100, src="a"))
    payload = os.urandom(300)
    with pytest.raises(StreamBroken):
        await c.send_all(payload)
    assert await recv_exactly(s, 100) == payload[:100]
    with pytest.raises(StreamBroken):
        await s.receive_some()
    with pytest.raises(StreamBroken):
        await c.receive_some()


async def test_hook_close_after_n_bytes_gives_a_frame_with_eof(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork()
    c, s = await open_pair(net, "a", "b")
    hook = net.add_hook(close_after(7, connection=c.connection_id))
    with pytest.raises(StreamBroken):
        await c.send_all(b"\x00\x00\x00\x10partial-frame")
    assert await recv_exactly(s, 7) == b"\x00\x00\x00\x10par"
    assert await s.receive_some() == b""  # clean EOF in the middle of a frame
    net.remove_hook(hook)
    c2, s2 = await open_pair(net, "a", "b")
    await c2.send_all(b"unaffected")
    assert await recv_exactly(s2, 10) == b"unaffected"


async def test_hook_stall_after_n_bytes(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(buffer_size=10_000)
    c, s = await open_pair(net, "a", "b")
    net.add_hook(stall_after(50, src="a"))
    await c.send_all(bytes(range(100)))
    assert await recv_exactly(s, 50) == bytes(range(50))
    with trio.move_on_after(1000) as scope:
        await s.receive_some()
    assert scope.cancelled_caught  # no more data, no EOF, no error
    with trio.move_on_after(1000) as scope:
        await c.send_all(bytes(20_000))  # the stalled bytes hold the window
    assert scope.cancelled_caught
    await s.send_all(b"other direction fine")
    assert await recv_exactly(c, 20) == b"other direction fine"
    net.heal()  # a stall is not a partition
    with trio.move_on_after(1000) as scope:
        await s.receive_some()
    assert scope.cancelled_caught


async def test_hook_delay_and_trickle(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    c, s = await open_pair(net, "a", "b")
    hook = net.add_hook(delay_after(4, 3.0, src="a"))
    t0 = trio.current_time()
    await c.send_all(b"fasts")
    assert await recv_exactly(s, 4) == b"fast"
    assert trio.current_time() == approx(t0)
    assert await s.receive_some() == b"s"
    assert trio.current_time() - t0 == approx(3.0)
    net.remove_hook(hook)

    c2, s2 = await open_pair(net, "a", "b")
    net.add_hook(trickle(10.0, piece=2, connection=c2.connection_id))
    t1 = trio.current_time()
    await c2.send_all(b"abcdef")
    arrivals = []
    for _ in range(3):
        arrivals.append((await s2.receive_some(), trio.current_time() - t1))
    assert [d for d, _ in arrivals] == [b"ab", b"cd", b"ef"]
    assert [t for _, t in arrivals] == [approx(0.2), approx(0.4), approx(0.6)]


async def test_custom_hook_sees_offsets_and_can_delay(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(segment_size=4)
    c, s = await open_pair(net, "a", "b")
    seen: list[tuple[str, str, int, bytes]] = []

    def hook(ev: object) -> Delay | None:
        from pccl.testing import TrafficEvent

        assert isinstance(ev, TrafficEvent)
        seen.append((ev.src, ev.dst, ev.offset, ev.data))
        return Delay(1.0) if ev.offset == 4 else None

    net.add_hook(hook)
    t0 = trio.current_time()
    await c.send_all(b"0123456789")
    assert seen == [("a", "b", 0, b"0123"), ("a", "b", 4, b"4567"), ("a", "b", 8, b"89")]
    assert await s.receive_some() == b"0123"
    # FIFO: the chunk after the delayed one does not overtake it.
    assert await s.receive_some() == b"456789"
    assert trio.current_time() - t0 == approx(1.0)


async def test_cancelled_receive_leaves_stream_usable(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    c, s = await open_pair(net, "a", "b")
    with trio.move_on_after(1):
        await s.receive_some()
    await c.send_all(b"after")
    assert await s.receive_some() == b"after"


async def test_concurrent_receivers_are_rejected(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    c, s = await open_pair(net, "a", "b")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.receive_some)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await s.receive_some()
        await c.send_all(b"z")


async def test_statistics_and_repr(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    net.host("a"), net.host("b")
    c, s = await open_pair(net, "a", "b")
    await c.send_all(b"12345")
    await recv_exactly(s, 5)
    st = net.statistics()
    assert st.hosts == ("a", "b")
    assert st.open_connections == 1 and st.connections_opened == 1
    assert st.bytes_sent == 5 and st.bytes_delivered == 5
    assert st.listeners == 0
    assert "hosts=2" in repr(net) and "connections=1 open/1 total" in repr(net)
    assert "#1" in repr(c) and "sent=5" in repr(c)
    await c.aclose()
    await s.aclose()
    assert net.statistics().open_connections == 0
    net.hang("a")
    net.partition("a", "b")
    assert "hung=['a']" in repr(net) and "partitions=2" in repr(net)
    assert "hung" in repr(net.host("a"))


async def test_large_transfer_roundtrip_integrity(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.001, bandwidth=100 * MB)
    c, s = await open_pair(net, "a", "b")
    data = os.urandom(3 * MB + 17)
    got = bytearray(len(data))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.send_all, memoryview(data))
        pos = 0
        while pos < len(got):
            n = await s.receive_into(memoryview(got)[pos : pos + 100_003])
            assert n > 0
            pos += n
    assert got == data


def test_faults_can_be_configured_before_trio_run() -> None:
    net = VirtualNetwork()
    net.host("a"), net.host("b")
    net.partition("a", "b")
    net.set_link("a", "b", latency=0.5, bandwidth=None)
    assert net.is_partitioned("b", "a") and net.link("b", "a").latency == 0.5
    net.heal()
    assert not net.is_partitioned("a", "b")


def test_invalid_configuration() -> None:
    with pytest.raises(ValueError):
        VirtualNetwork(latency=-1)
    with pytest.raises(ValueError):
        VirtualNetwork(bandwidth=0)
    net = VirtualNetwork()
    with pytest.raises(ValueError):
        net.set_link("nobody", "nobody-else", latency=1)
    with pytest.raises(ValueError):
        Delay(-1.0)
    with pytest.raises(ValueError):
        net.host("0.0.0.0")


async def test_try_send_takes_what_the_window_allows_without_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = VirtualNetwork(buffer_size=1000, latency=0.1)
    c, s = await open_pair(net, "a", "b")
    t0 = trio.current_time()
    assert c.try_send(b"x" * 600) == 600
    assert c.try_send(b"y" * 600) == 400  # the window is full after 1000 unread bytes
    assert c.try_send(b"z") == 0
    assert trio.current_time() == t0  # no schedule point, no virtual time
    assert await recv_exactly(s, 1000) == b"x" * 600 + b"y" * 400
    # Once the reads are acknowledged (one latency back), the window opens again.
    await trio.sleep(0.1)
    assert c.try_send(b"z") == 1
    assert await recv_exactly(s, 1) == b"z"
    assert c.statistics().bytes_sent == 1001


async def test_try_send_respects_hooks_hangs_and_closes(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork()
    c, s = await open_pair(net, "a", "b")
    net.add_hook(reset_after(5, src="a"))
    with pytest.raises(StreamBroken):
        c.try_send(b"0123456789")
    assert await recv_exactly(s, 5) == b"01234"
    with pytest.raises(StreamBroken):
        c.try_send(b"more")

    c2, s2 = await open_pair(net, "b", "a")  # the hook only resets data from "a"
    net.hang("b")
    assert c2.try_send(b"held") == 0  # a hung host sends nothing (and does not block)
    net.unhang("b")
    assert c2.try_send(b"free") == 4
    assert await recv_exactly(s2, 4) == b"free"
    await s2.aclose()
    assert await c2.receive_some(10) == b""  # the FIN has reached c2
    with pytest.raises(StreamBroken):
        c2.try_send(b"after close")
