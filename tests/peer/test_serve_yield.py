"""Serving that yields to the member's own collectives (PeerConfig.state_serve_idle_rate): the bucket's two
rates, time passed in (pure), and the trio side that wakes a waiting sender when a collective starts or
ends and keeps the serving connections' kernel pacing at the rate in force (MockClock: virtual seconds)."""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest
import trio
import trio.testing

from pccl import PeerConfig
from pccl.peer.ratecap import RateCap
from pccl.peer.serve_pace import ServePace
from pccl.peer.shared_state import SharedState, StateServer, SyncContext, TensorInfo, serve_state_requests
from pccl.testing import RecordingStream, VirtualNetwork, open_stream_pair
from pccl.transport import TcpStream, TcpTransport, receive_exactly_into
from pccl.wire import messages as m
from pccl.wire.stream import MessageStream

MIB = 1 << 20
KIB = 1 << 10
SO_MAX_PACING_RATE = 47
TCP_NOTSENT_LOWAT = 25


def test_the_rate_in_force_follows_the_collectives() -> None:
    cap = RateCap(MIB, idle_rate=8 * MIB, piece=16 * KIB)
    assert cap.yields and cap.rate_now == 8 * MIB
    assert cap.collective_started(1.0)  # idle -> busy: a change
    assert cap.rate_now == MIB
    assert not cap.collective_started(1.5)  # a second one (all_reduce_multiple): no change
    assert not cap.collective_ended(2.0)  # one still runs
    assert cap.rate_now == MIB
    assert cap.collective_ended(3.0)  # the last one ended: back to the idle rate
    assert cap.rate_now == 8 * MIB and cap.running == 0
    assert cap.busy_seconds == pytest.approx(2.0)
    with pytest.raises(ValueError, match="without a collective"):
        cap.collective_ended(4.0)


def test_without_an_idle_rate_nothing_changes() -> None:
    cap = RateCap(MIB)
    assert not cap.yields
    assert not cap.collective_started(0.0) and cap.rate_now == MIB
    assert not cap.collective_ended(1.0) and cap.rate_now == MIB


def test_a_debt_taken_while_idle_is_repaid_at_the_floor_once_a_collective_starts() -> None:
    cap = RateCap(MIB, idle_rate=4 * MIB, burst=1.0)
    assert cap.take(4 * MIB, 0.0) == pytest.approx(1.0)  # idle: 4 MiB at 4 MiB/s
    cap.collective_started(0.5)  # half repaid (2 MiB) at the idle rate ...
    assert cap.wait(0.5) == pytest.approx(2.0)  # ... the other 2 MiB now at 1 MiB/s
    assert cap.wait(1.5) == pytest.approx(1.0)
    cap.collective_ended(1.5)  # 1 MiB left, at 4 MiB/s again
    assert cap.wait(1.5) == pytest.approx(0.25)
    assert cap.wait(1.75) == 0.0


def test_a_waiting_debt_never_earns_more_than_the_rates_in_force() -> None:
    # Senders take pieces back to back while collectives come and go: in every window the grants stay
    # within the burst plus the integral of the rate in force over it.
    floor, idle = 0.25 * MIB, 2.0 * MIB
    cap = RateCap(floor, idle_rate=idle, piece=16 * KIB)
    busy = [(0.3 + k, 0.3 + k + 0.6) for k in range(10)]  # 60% of every second in a collective

    def integral(t0: float, t1: float) -> float:
        inside = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in busy)
        return inside * floor + (t1 - t0 - inside) * idle

    edges = sorted([(a, 1) for a, _ in busy] + [(b, -1) for _, b in busy])
    grants: list[tuple[float, int]] = []
    now = 0.0
    while now < 9.0:
        while edges and edges[0][0] <= now:
            at, kind = edges.pop(0)
            if kind > 0:
                cap.collective_started(at)
            else:
                cap.collective_ended(at)
        cap.take(cap.piece, now)
        # the trio side: sleep the wait, woken by the next change to ask again
        while (w := cap.wait(now)) > 0:
            nxt = edges[0][0] if edges else float("inf")
            if now + w <= nxt:
                now += w
                break
            now = nxt
            at, kind = edges.pop(0)
            if kind > 0:
                cap.collective_started(at)
            else:
                cap.collective_ended(at)
        grants.append((now, cap.piece))
    for t0, _ in grants:
        for span in (0.05, 0.3, 1.0):
            got = sum(n for t, n in grants if t0 <= t < t0 + span)
            assert got <= cap.burst + integral(t0, t0 + span) + 1e-6
    total = sum(n for _, n in grants)
    assert total == pytest.approx(integral(0.0, now) + cap.burst, rel=0.02)  # the links' whole share


def test_a_donor_whose_collectives_never_end_still_serves_at_the_floor() -> None:
    cap = RateCap(0.5 * MIB, idle_rate=4 * MIB)
    cap.collective_started(0.0)
    now = 0.0
    for _ in range(200):
        now += cap.take(cap.piece, now)
    assert now == pytest.approx((200 * cap.piece - cap.burst) / (0.5 * MIB), rel=1e-9)


def test_bad_idle_rates_are_refused() -> None:
    for bad in (0.5 * MIB, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="idle_rate"):
            RateCap(MIB, idle_rate=bad)
    for bad in (0.5e6, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="state_serve_idle_rate"):
            PeerConfig(state_serve_rate=1e6, state_serve_idle_rate=bad)
    with pytest.raises(ValueError, match="state_serve_idle_rate"):
        PeerConfig(state_serve_idle_rate=1e6)  # without a floor: no cap to yield from
    assert PeerConfig(state_serve_rate=1e6, state_serve_idle_rate=5e6).state_serve_idle_rate == 5e6


async def _serve_two_chunks(server: StateServer, collectives: list[tuple[float, float]]) -> tuple[
        list[tuple[float, int]], float]:
    """A holder under ``server`` serves two 1 MiB chunks while this peer's "collectives" run over the
    given (start, end) virtual times; the payload writes and the time the fetch took."""
    data = np.random.default_rng(4).integers(0, 256, 2 * MIB, dtype=np.uint8)
    ctx = SyncContext(state=SharedState([TensorInfo("w", data)]), hashes={"w": 0}, seq=3)
    ctx.plan_ready.set()
    server.pin(ctx)
    net = VirtualNetwork()
    a, b = await open_stream_pair(net.host("a"), net.host("b"), connect_host=net.host("b").address)
    rec = RecordingStream(b)
    fetcher = MessageStream(a, max_frame_size=MIB)
    holder = MessageStream(rec, max_frame_size=MIB)
    got = bytearray(2 * MIB)

    async def run_collectives(t0: float) -> None:
        for start, end in collectives:
            await trio.sleep_until(t0 + start)
            with server.collective():
                await trio.sleep_until(t0 + end)

    async with trio.open_nursery() as nursery:
        hello = m.Hello(protocol_version=1, purpose="p2p", peer_id=1, channel="state")
        nursery.start_soon(serve_state_requests, server, holder, hello)
        t0 = trio.current_time()
        nursery.start_soon(run_collectives, t0)
        await fetcher.send(m.StateChunkRequest(sync_seq=3, pieces=[["w", 0, MIB], ["w", MIB, MIB]]))
        for offset in (0, MIB):
            hdr = await fetcher.receive(read_ahead=False)
            assert hdr == m.StateChunk(key="w", offset=offset, nbytes=MIB)
            await receive_exactly_into(a, memoryview(got)[offset : offset + MIB])
        elapsed = trio.current_time() - t0
        await fetcher.aclose()
        nursery.cancel_scope.cancel()
    assert bytes(got) == data.tobytes()  # exact, whatever the pace
    assert server.totals["heal_served_bytes"] == 2 * MIB
    return [(t - t0, n) for t, n in rec.writes if n > 64], elapsed


async def test_serving_slows_while_a_collective_runs_and_speeds_up_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Idle rate 4 MiB/s, floor 0.5 MiB/s, one collective over [0.2, 0.7] s: until 0.2 s the idle
    rate, during it the floor (the sender asleep on an idle-rate debt is told to wait longer), after it
    the idle rate again at once (woken by the end, not at its old deadline)."""
    floor, idle = 0.5 * MIB, 4.0 * MIB
    server = StateServer(plan_timeout=1.0, serve_rate=floor, serve_idle_rate=idle)
    writes, elapsed = await _serve_two_chunks(server, [(0.2, 0.7)])
    cap = server.cap
    assert cap is not None and cap.piece == 16 * KIB and cap.running == 0
    assert max(n for _, n in writes) == cap.piece
    during = sum(n for t, n in writes if 0.2 < t <= 0.7)
    assert during <= floor * 0.5 + cap.piece + 1  # the floor (and the piece granted when it started)
    assert during >= floor * 0.5 - cap.piece
    before = sum(n for t, n in writes if t <= 0.2)
    assert before >= idle * 0.2 - cap.piece  # the idle rate before it
    # all bytes: the burst, 0.2 s idle, 0.5 s at the floor, the rest at the idle rate
    rest = 2 * MIB - cap.burst - idle * 0.2 - floor * 0.5
    assert elapsed == pytest.approx(0.7 + rest / idle, abs=0.01)
    assert server.pace is not None and server.pace.changes == 2
    assert cap.busy_seconds == pytest.approx(0.5)


async def test_a_heal_under_collectives_that_never_pause_ends_at_the_floor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A donor whose loop never idles (its collective runs from before the fetch to after it) still
    serves, at the floor: the newcomer never waits forever."""
    floor = 2.0 * MIB
    server = StateServer(plan_timeout=1.0, serve_rate=floor, serve_idle_rate=16 * MIB)
    writes, elapsed = await _serve_two_chunks(server, [(0.0, 100.0)])
    assert server.cap is not None
    assert elapsed == pytest.approx((2 * MIB - server.cap.burst) / floor, rel=0.01)
    assert max(n for _, n in writes) == server.cap.piece


async def test_collectives_between_them_get_the_idle_rate_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A training loop: collectives of 0.1 s every 0.15 s (a third of the time idle); the fetch's pace
    is the time-weighted mix of the two rates, never the floor alone."""
    floor, idle = 0.5 * MIB, 4.0 * MIB
    server = StateServer(plan_timeout=1.0, serve_rate=floor, serve_idle_rate=idle)
    loop = [(0.15 * k, 0.15 * k + 0.1) for k in range(100)]
    writes, elapsed = await _serve_two_chunks(server, loop)
    mix = (0.1 * floor + 0.05 * idle) / 0.15  # 1.67 MiB/s
    assert elapsed == pytest.approx(2 * MIB / mix, rel=0.1)
    for start, end in loop:
        if end > elapsed:
            break
        inside = sum(n for t, n in writes if start + 0.001 < t <= end)
        assert inside <= floor * 0.1 + 2 * 16 * KIB  # the floor holds inside every collective


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_MAX_PACING_RATE is Linux's")
async def test_the_kernel_pacing_of_serving_connections_follows_the_rate_in_force() -> None:
    tcp = TcpTransport(same_host=False)
    a, b = await open_stream_pair(tcp, tcp, connect_host="127.0.0.1", listen_host="127.0.0.1")
    assert isinstance(a, TcpStream)
    pace = ServePace(RateCap(1.25e6, idle_rate=5e6))
    with pace.serving(a):
        assert a.socket.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 5_000_000
        assert a.socket.getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT) == pace.cap.piece
        with pace.collective():
            assert a.socket.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 1_250_000
            await a.send_all(b"x" * 1000)  # still a working connection
        assert a.socket.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 5_000_000
    with pace.collective():  # a connection no longer serving is left alone
        assert a.socket.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 5_000_000
    got = bytearray(1000)
    await receive_exactly_into(b, memoryview(got))
    assert bytes(got) == b"x" * 1000
    await a.aclose()
    await b.aclose()
