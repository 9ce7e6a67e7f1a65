"""The WAN emulator's pure parts: the link model (rate, drop-tail queue, delay, jitter, loss) and the
cutting of GSO bursts into the runs of segments that survive."""

from __future__ import annotations

import random
import struct

import pytest

from pccl.testing.wan.link import LinkModel, LinkSpec
from pccl.testing.wan.packet import VNET_HDR_LEN, cut_burst, parse_burst


def test_delay_only_delivers_after_the_one_way_delay() -> None:
    link = LinkModel(LinkSpec(delay_ms=25))
    adm = link.offer(10.0, 1, 100)
    assert adm.deliver_at == pytest.approx(10.025)
    assert adm.kept == ((0, 1),)


def test_rate_serializes_back_to_back_bursts() -> None:
    # 80 Mbit/s = 10 MB/s: 10_000 bytes take 1 ms on the wire
    link = LinkModel(LinkSpec(delay_ms=10, rate_mbit=80))
    a = link.offer(0.0, 7, 10_000)
    b = link.offer(0.0, 7, 10_000)
    assert a.deliver_at == pytest.approx(0.011)
    assert b.deliver_at == pytest.approx(0.012)
    # an idle link starts fresh
    c = link.offer(1.0, 1, 10_000)
    assert c.deliver_at == pytest.approx(1.011)


def test_default_queue_is_one_bdp_and_drops_the_tail_of_a_burst() -> None:
    spec = LinkSpec(delay_ms=50, rate_mbit=8, rtt_ms=100)  # 1 MB/s * 0.1 s = 100 kB -> floor 128 KiB
    assert spec.queue_limit() == 128 * 1024
    spec2 = LinkSpec(delay_ms=50, rate_mbit=80, rtt_ms=100)
    assert spec2.queue_limit() == pytest.approx(1_000_000)
    link = LinkModel(LinkSpec(delay_ms=0, rate_mbit=8, queue_bytes=10_000))
    first = link.offer(0.0, 5, 5_000)  # fits (5 000 of 10 000)
    assert first.kept == ((0, 5),)
    second = link.offer(0.0, 10, 10_000)  # 5 000 bytes of room: the first 5 segments fit
    assert second.kept == ((0, 5),)
    assert link.stats.queue_dropped_segments == 5
    third = link.offer(0.0, 1, 1_000)  # full
    assert third.deliver_at is None


def test_loss_rate_and_runs_of_survivors() -> None:
    link = LinkModel(LinkSpec(loss=0.01), rng=random.Random(7))
    kept = 0
    for _ in range(20_000):
        adm = link.offer(0.0, 44, 44 * 1500)
        kept += sum(b - a for a, b in adm.kept)
        for (a1, b1), (a2, _b2) in zip(adm.kept, adm.kept[1:], strict=False):
            assert a1 < b1 < a2  # disjoint, ascending, a lost segment between them
    lost = 1 - kept / (20_000 * 44)
    assert 0.009 < lost < 0.011
    assert link.stats.lost_segments == 20_000 * 44 - kept


def test_jitter_never_reorders() -> None:
    link = LinkModel(LinkSpec(delay_ms=10, jitter_ms=5), rng=random.Random(1))
    times = [link.offer(i * 0.0001, 1, 100).deliver_at or 0.0 for i in range(1000)]
    assert times == sorted(times)
    assert min(times) < 0.0101 and max(t - i * 0.0001 for i, t in enumerate(times)) > 0.0145


def test_bad_specs_are_refused() -> None:
    for kwargs in ({"delay_ms": -1}, {"rate_mbit": 0}, {"loss": 1.0}, {"queue_bytes": 10}):
        with pytest.raises(ValueError):
            LinkSpec(**kwargs)  # type: ignore[arg-type]


def _gso_frame(payload: bytes, mss: int, seq: int = 1000, flags: int = 0x18) -> bytes:
    ip = bytearray(20)
    ip[0] = 0x45
    struct.pack_into("!HHHBB", ip, 2, 40 + len(payload), 77, 0x4000, 64, 6)
    ip[12:16] = bytes([10, 99, 0, 1])
    ip[16:20] = bytes([10, 99, 0, 2])
    tcp = bytearray(20)
    struct.pack_into("!HHII", tcp, 0, 5000, 6000, seq, 1)
    tcp[12] = 5 << 4
    tcp[13] = flags
    vnet = struct.pack("<BBHHHH", 1, 1, 40, mss, 20, 16)
    return vnet + bytes(ip) + bytes(tcp) + payload


def test_parse_burst_counts_segment_headers() -> None:
    frame = _gso_frame(bytes(range(256)) * 20, mss=1448)  # 5120 bytes: 4 segments
    burst = parse_burst(frame)
    assert burst.dst == bytes([10, 99, 0, 2])
    assert burst.segments == 4
    assert burst.wire_bytes == 40 + 5120 + 3 * 40


def test_cut_burst_rebuilds_valid_runs() -> None:
    payload = bytes(range(256)) * 20
    frame = _gso_frame(payload, mss=1448, flags=0x19)  # PSH|FIN|ACK
    burst = parse_burst(frame)
    pieces = cut_burst(frame, burst, ((0, 1), (2, 4)))
    assert len(pieces) == 2
    single, tail = pieces
    # the single segment is a plain packet carrying bytes 0..1448
    assert single[1] == 0 and single[VNET_HDR_LEN + 40 :] == payload[:1448]
    ip = single[VNET_HDR_LEN : VNET_HDR_LEN + 20]
    assert struct.unpack_from("!H", ip, 2)[0] == 40 + 1448
    assert sum(struct.unpack("!10H", ip)) % 0xFFFF == 0  # IP checksum valid
    assert single[VNET_HDR_LEN + 33] & 0x09 == 0  # no FIN/PSH before the end
    # the tail run is a GSO burst from segment 2: seq advanced, FIN/PSH kept
    assert tail[1] == 1
    assert struct.unpack_from("!I", tail, VNET_HDR_LEN + 24)[0] == 1000 + 2 * 1448
    assert tail[VNET_HDR_LEN + 40 :] == payload[2 * 1448 :]
    assert tail[VNET_HDR_LEN + 33] & 0x09 == 0x09
    assert parse_burst(tail).segments == 2
    assert cut_burst(frame, burst, ((0, 4),)) == [frame]
    assert cut_burst(frame, burst, ()) == []
