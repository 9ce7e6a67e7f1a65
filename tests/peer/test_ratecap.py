"""The serving rate cap (PeerConfig.state_serve_rate): a token bucket released in pieces, time passed in
(pure), and the serving side that paces every chunk with it (MockClock: virtual seconds)."""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest
import trio
import trio.testing

from pccl import PeerConfig
from pccl.peer.ratecap import PIECE_MAX, PIECE_MIN, RateCap, piece_bytes
from pccl.peer.shared_state import SharedState, StateServer, SyncContext, TensorInfo, serve_state_requests
from pccl.testing import RecordingStream, VirtualNetwork, open_stream_pair
from pccl.transport import TcpStream, TcpTransport, limit_send_rate, receive_exactly_into
from pccl.wire import messages as m
from pccl.wire.stream import MessageStream

MIB = 1 << 20
KIB = 1 << 10


def test_a_burst_goes_at_once_then_the_rate_holds() -> None:
    cap = RateCap(MIB, burst=2 * MIB)
    assert cap.take(MIB, 0.0) == 0.0 and cap.take(MIB, 0.0) == 0.0  # the burst
    assert cap.take(MIB, 0.0) == pytest.approx(1.0)  # one second's worth behind
    assert cap.take(MIB, 0.0) == pytest.approx(2.0)  # concurrent senders queue behind each other
    assert cap.take(MIB, 10.0) == 0.0  # refilled (up to the burst) after a quiet time
    assert cap.take(2 * MIB, 10.0) == pytest.approx(1.0)
    assert cap.waited == pytest.approx(4.0)


def test_over_a_long_run_the_average_is_the_rate() -> None:
    cap = RateCap(3 * MIB)
    now = 0.0
    for _ in range(300):
        now += cap.take(MIB, now)
    assert now == pytest.approx(300 / 3 - cap.burst / (3 * MIB), rel=1e-9)


def test_pieces_are_about_ten_milliseconds_of_the_rate_within_bounds() -> None:
    assert piece_bytes(1.25e6) == PIECE_MIN  # 10 Mbit/s: 12.5 kB, raised to 16 KiB
    assert piece_bytes(4e6) == 40_000
    assert piece_bytes(1e9) == PIECE_MAX
    cap = RateCap(1.25e6)
    assert cap.piece == PIECE_MIN and cap.burst == 2 * PIECE_MIN  # the default burst: two pieces
    assert RateCap(1e6, piece=4 * KIB).burst == 8 * KIB


def _granted_windows(grants: list[tuple[float, int]], span: float) -> int:
    """The most bytes granted within any ``span`` seconds (windows starting at a grant)."""
    return max(sum(n for t, n in grants if t0 <= t < t0 + span) for t0, _ in grants)


def test_paced_pieces_never_exceed_burst_plus_rate_in_any_window() -> None:
    # Three senders (three fetchers' connections) take pieces concurrently from one bucket, each
    # sending a piece when told and asking for its next one right after.
    rate = 1.25e6
    cap = RateCap(rate)
    next_at = [0.0, 0.0, 0.0]
    grants: list[tuple[float, int]] = []
    for _ in range(600):
        i = min(range(3), key=lambda k: next_at[k])
        now = next_at[i]
        at = now + cap.take(cap.piece, now)
        grants.append((at, cap.piece))
        next_at[i] = at
    total = sum(n for _, n in grants)
    end = max(t for t, _ in grants)
    assert total / end == pytest.approx(rate, rel=0.01)  # the rate, over all senders
    for span in (0.001, 0.01, 0.05, 0.5):
        assert _granted_windows(grants, span) <= cap.burst + rate * span + 1e-6


def test_a_late_clock_reading_never_adds_tokens() -> None:
    cap = RateCap(MIB, burst=MIB)
    assert cap.take(MIB, 5.0) == 0.0
    assert cap.take(MIB, 4.0) == pytest.approx(1.0)  # an earlier reading (another task's) earns nothing


def test_bad_rates_are_refused() -> None:
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            RateCap(bad)
    with pytest.raises(ValueError):
        RateCap(MIB, piece=0)
    with pytest.raises(ValueError):
        RateCap(MIB, burst=0)


async def test_a_capped_holder_sends_each_chunk_in_paced_pieces(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 1 MiB chunk is not released at once: it leaves in pieces, each when the bucket grants it, so no
    window of the sending holds more than the burst plus the rate's share; the bytes arrive exact."""
    rate = float(MIB)  # 1 MiB/s: pieces of 16 KiB
    data = np.random.default_rng(3).integers(0, 256, 2 * MIB, dtype=np.uint8)
    ctx = SyncContext(state=SharedState([TensorInfo("w", data)]), hashes={"w": 0}, seq=7)
    ctx.plan_ready.set()
    server = StateServer(plan_timeout=1.0, serve_rate=rate)
    server.pin(ctx)
    net = VirtualNetwork()
    a, b = await open_stream_pair(net.host("a"), net.host("b"), connect_host=net.host("b").address)
    rec = RecordingStream(b)
    fetcher = MessageStream(a, max_frame_size=MIB)
    holder = MessageStream(rec, max_frame_size=MIB)
    got = bytearray(2 * MIB)
    async with trio.open_nursery() as nursery:
        hello = m.Hello(protocol_version=1, purpose="p2p", peer_id=1, channel="state")
        nursery.start_soon(serve_state_requests, server, holder, hello)
        start = trio.current_time()
        await fetcher.send(m.StateChunkRequest(sync_seq=7, pieces=[["w", 0, MIB], ["w", MIB, MIB]]))
        for offset in (0, MIB):
            hdr = await fetcher.receive(read_ahead=False)
            assert hdr == m.StateChunk(key="w", offset=offset, nbytes=MIB)
            await receive_exactly_into(a, memoryview(got)[offset : offset + MIB])
        elapsed = trio.current_time() - start
        await fetcher.aclose()
    assert bytes(got) == data.tobytes()
    assert server.totals["heal_served_bytes"] == 2 * MIB
    cap = server.cap
    assert cap is not None and cap.piece == 16 * KIB
    payload = [(t, n) for t, n in rec.writes if n > 64]  # the chunks' bytes (the headers are a few bytes)
    assert sum(n for _, n in payload) == 2 * MIB
    assert max(n for _, n in payload) == cap.piece
    assert elapsed == pytest.approx((2 * MIB - cap.burst) / rate, rel=0.01)
    for span in (0.005, 0.05, 0.25):
        assert _granted_windows(payload, span) <= cap.burst + rate * span + 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_MAX_PACING_RATE is Linux's")
async def test_the_kernel_paces_a_capped_tcp_connection() -> None:
    tcp = TcpTransport(same_host=False)
    a, b = await open_stream_pair(tcp, tcp, connect_host="127.0.0.1", listen_host="127.0.0.1")
    assert isinstance(a, TcpStream)
    assert limit_send_rate(a, 1.25e6)
    assert a.socket.getsockopt(socket.SOL_SOCKET, 47) == 1_250_000  # SO_MAX_PACING_RATE
    await a.send_all(b"x" * 1000)  # still a working connection
    got = bytearray(1000)
    await receive_exactly_into(b, memoryview(got))
    assert bytes(got) == b"x" * 1000
    await a.aclose()
    await b.aclose()


async def test_no_kernel_pacing_where_there_is_no_tcp_socket() -> None:
    net = VirtualNetwork()
    a, b = await open_stream_pair(net.host("a"), net.host("b"), connect_host=net.host("b").address)
    assert not limit_send_rate(a, 1e6)
    local = TcpTransport(same_host=True)  # the same-host shortcut: a Unix socket, nothing to pace
    c, d = await open_stream_pair(local, local, connect_host="127.0.0.1", listen_host="127.0.0.1")
    assert isinstance(c, TcpStream) and c.same_host
    assert not limit_send_rate(c, 1e6)
    for s in (a, b, c, d):
        await s.aclose()


def test_the_config_refuses_a_serving_rate_no_cap_can_hold() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="state_serve_rate"):
            PeerConfig(state_serve_rate=bad)
    assert PeerConfig(state_serve_rate=1.25e6).state_serve_rate == 1.25e6
