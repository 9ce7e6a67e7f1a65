"""The link probes of ``optimize_topology`` (pccl.peer.bandwidth) on the virtual network, in virtual
time (MockClock): the latency ping measures the configured one-way latency, a slow sample does not
move it, and an unreachable target reports zeros."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pccl.peer import bandwidth
from pccl.testing import VirtualHost, VirtualNetwork, delay_after
from pccl.testing.network import VirtualListener
from pccl.transport import StreamBroken
from pccl.wire import messages as m
from pccl.wire.stream import MessageStream

FRAME = 1 << 20


class _Dialer:
    """Plain virtual-network connections (no P2P hello: the probes do not depend on it)."""

    connect_timeout = 5.0

    def __init__(self, host: VirtualHost) -> None:
        self.host = host

    async def dial(
        self, host: str, port: int, *, channel: str, index: int = 0, peer_id: int = -1
    ) -> MessageStream:
        assert channel == "bench"
        return MessageStream(await self.host.connect(host, port), max_frame_size=FRAME)


async def _serve(listener: VirtualListener) -> None:
    stream = await listener.accept()
    await bandwidth.serve_probe(MessageStream(stream, max_frame_size=FRAME))


@pytest.mark.parametrize("latency", [0.0005, 0.025])
@pytest.mark.parametrize("bw", [125e6, 1.25e9])
async def test_measured_latency_is_the_configured_one(
    autojump_clock: trio.testing.MockClock, latency: float, bw: float
) -> None:
    net = VirtualNetwork(latency=latency, bandwidth=bw)
    a, b = net.host("a"), net.host("b")
    listener = await b.listen("0.0.0.0", 0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve, listener)
        rows = await bandwidth.measure_targets(_Dialer(a), [[7, b.address, listener.address[1]]], 0.05)
        nursery.cancel_scope.cancel()
    [(pid, rate, measured)] = rows
    assert pid == 7 and rate > 0
    # an empty probe's round trip is two latencies plus two small frames' serialization
    assert latency <= measured <= latency * 1.02 + 1e-6, measured


async def test_one_slow_round_trip_does_not_move_the_latency(autojump_clock: trio.testing.MockClock) -> None:
    """The first ping's request is held 40 ms on the way: the median of the three samples ignores it."""
    net = VirtualNetwork(latency=0.005, bandwidth=1.25e9)
    a, b = net.host("a"), net.host("b")
    listener = await b.listen("0.0.0.0", 0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve, listener)
        ms = await _Dialer(a).dial(b.address, listener.address[1], channel="bench")
        net.add_hook(delay_after(0, 0.040, src="a", dst="b"))
        measured = await bandwidth.ping(ms)
        nursery.cancel_scope.cancel()
    assert 0.005 <= measured <= 0.0051, measured


async def test_ping_refuses_a_wrong_answer(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.001, bandwidth=None)
    a, b = net.host("a"), net.host("b")
    listener = await b.listen("0.0.0.0", 0)

    async def wrong() -> None:
        ms = MessageStream(await listener.accept(), max_frame_size=FRAME)
        await ms.receive()
        await ms.send(m.BenchResult(nbytes=5, seconds=0.0))  # not the empty probe's answer
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wrong)
        ms = await _Dialer(a).dial(b.address, listener.address[1], channel="bench")
        with pytest.raises(StreamBroken, match="ping reply"):
            await bandwidth.ping(ms)
        with pytest.raises(ValueError, match="samples"):
            await bandwidth.ping(ms, samples=0)
        nursery.cancel_scope.cancel()


async def test_an_unreachable_target_reports_zeros(autojump_clock: trio.testing.MockClock) -> None:
    net = VirtualNetwork(latency=0.001, bandwidth=None)
    a, b = net.host("a"), net.host("b")
    listener = await b.listen("0.0.0.0", 0)
    port = listener.address[1]
    await listener.aclose()  # nothing listens there: the connect is refused
    rows = await bandwidth.measure_targets(_Dialer(a), [[3, b.address, port]], 0.05)
    assert rows == [[3, 0.0, 0.0]]


@pytest.mark.parametrize("latency", [0.0005, 0.025])
@pytest.mark.parametrize("bw", [125e6, 1.25e9])
async def test_measured_bandwidth_leaves_the_round_trip_out(
    autojump_clock: trio.testing.MockClock, latency: float, bw: float
) -> None:
    """The probe's bytes are timed without the link's round trip: the measured rate is the link's,
    or what one connection's window carries per round trip where that is less (25 ms links). With
    the round trip counted, a 25 ms link measured ~5 MB/s at 1 and at 10 Gbit/s."""
    net = VirtualNetwork(latency=latency, bandwidth=bw)
    a, b = net.host("a"), net.host("b")
    listener = await b.listen("0.0.0.0", 0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve, listener)
        [(_pid, rate, _lat)] = await bandwidth.measure_targets(
            _Dialer(a), [[1, b.address, listener.address[1]]], 0.05
        )
        nursery.cancel_scope.cancel()
    sustained = min(bw, net.buffer_size / (2 * latency))
    assert 0.97 * sustained <= rate <= 1.001 * sustained, (rate, sustained)
