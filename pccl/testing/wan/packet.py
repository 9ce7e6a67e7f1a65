"""Packets as the WAN emulator's TUN devices give them (pure: bytes in, bytes out).

Each read from a TUN device opened with ``IFF_VNET_HDR`` is a 10-byte ``virtio_net_hdr`` followed by
an IP packet. With TSO offered to the kernel (``TUNSETOFFLOAD``), a TCP packet may be a *GSO burst*:
up to 64 KB that the wire would carry as ``ceil(payload / gso_size)`` segments of ``gso_size`` bytes,
each with its own copy of the IP and TCP headers. The emulator keeps bursts whole (a low packet rate
is what lets a Python forwarder keep up) and only cuts one where the link model loses or queue-drops
some of its segments: :func:`cut_burst` rebuilds the runs of segments that survive, each a valid
smaller burst (sequence number, IP length, identification and checksum, TCP flags and the partial
checksum the receiver's stack expects).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["VNET_HDR_LEN", "Burst", "cut_burst", "parse_burst"]

VNET_HDR_LEN = 10
_VNET = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
GSO_NONE = 0
GSO_TCPV4 = 1
_GSO_ECN = 0x80
_TCP_FIN = 0x01
_TCP_PSH = 0x08
_TCP_CWR = 0x80


@dataclass(frozen=True)
class Burst:
    """What the forwarder needs to know about one packet read from a TUN device.

    ``dst`` is the IPv4 destination as 4 bytes (``b""`` for anything that is not IPv4); ``segments``
    and ``wire_bytes`` are what the link model charges; ``header_len`` (IP + TCP headers) and
    ``gso_size`` are set for a TCP/IPv4 GSO burst only (``gso_size == 0`` otherwise).
    """

    dst: bytes
    segments: int
    wire_bytes: int
    header_len: int = 0
    gso_size: int = 0


def parse_burst(frame: bytes) -> Burst:
    """Read the destination and wire cost of ``frame`` (virtio header + IP packet).

    Raises:
        ValueError: the frame is shorter than its headers say.
    """
    if len(frame) < VNET_HDR_LEN + 20:
        raise ValueError("frame too short")
    ip_len = len(frame) - VNET_HDR_LEN
    version = frame[VNET_HDR_LEN] >> 4
    if version != 4:
        return Burst(b"", 1, ip_len)
    dst = frame[VNET_HDR_LEN + 16 : VNET_HDR_LEN + 20]
    _flags, gso_type, _hl, gso_size, _cs, _co = _VNET.unpack_from(frame, 0)
    if gso_type & ~_GSO_ECN != GSO_TCPV4 or gso_size == 0:
        return Burst(dst, 1, ip_len)
    ihl = (frame[VNET_HDR_LEN] & 0x0F) * 4
    tcp = VNET_HDR_LEN + ihl
    if len(frame) < tcp + 20:
        raise ValueError("TCP header truncated")
    hlen = ihl + (frame[tcp + 12] >> 4) * 4
    payload = ip_len - hlen
    if payload <= 0:
        return Burst(dst, 1, ip_len)
    segs = -(-payload // gso_size)
    return Burst(dst, segs, ip_len + (segs - 1) * hlen, hlen, gso_size)


def _fold(total: int) -> int:
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _ip_checksum(header: bytes | bytearray) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    return ~_fold(total) & 0xFFFF


def cut_burst(frame: bytes, burst: Burst, runs: tuple[tuple[int, int], ...]) -> list[bytes]:
    """The frames carrying the segment runs ``runs`` (``[(start, stop), ...]``) of ``frame``.

    A run of one segment becomes a plain packet (no GSO); longer runs stay GSO bursts. The TCP
    checksum is left partial (``VIRTIO_NET_HDR_F_NEEDS_CSUM``), as the kernel handed the burst over.
    """
    if burst.gso_size == 0:
        return [frame] if runs else []
    segs, hlen, mss = burst.segments, burst.header_len, burst.gso_size
    if runs == ((0, segs),):
        return [frame]
    flags, gso_type, vhl, _gs, cstart, coff = _VNET.unpack_from(frame, 0)
    ip0 = VNET_HDR_LEN
    ihl = (frame[ip0] & 0x0F) * 4
    tcp0 = ip0 + ihl
    ident = struct.unpack_from("!H", frame, ip0 + 4)[0]
    seq = struct.unpack_from("!I", frame, tcp0 + 4)[0]
    tcp_flags = frame[tcp0 + 13]
    pseudo = sum(struct.unpack_from("!4H", frame, ip0 + 12)) + 6
    body0 = ip0 + hlen
    end = len(frame)
    out: list[bytes] = []
    for start, stop in runs:
        lo = body0 + start * mss
        hi = min(body0 + stop * mss, end)
        head = bytearray(frame[ip0:body0])
        n = stop - start
        struct.pack_into("!H", head, 2, hlen + hi - lo)
        struct.pack_into("!H", head, 4, (ident + start) & 0xFFFF)
        struct.pack_into("!H", head, 10, 0)
        struct.pack_into("!H", head, 10, _ip_checksum(head[:ihl]))
        struct.pack_into("!I", head, ihl + 4, (seq + start * mss) & 0xFFFFFFFF)
        f = tcp_flags
        if start > 0:
            f &= ~_TCP_CWR
        if stop < segs:
            f &= ~(_TCP_FIN | _TCP_PSH)
        head[ihl + 13] = f
        tcp_len = hlen - ihl + hi - lo
        struct.pack_into("!H", head, ihl + 16, _fold(pseudo + tcp_len))
        if n == 1:
            vnet = _VNET.pack(flags, GSO_NONE, vhl, 0, cstart, coff)
        else:
            vnet = _VNET.pack(flags, gso_type, vhl, mss, cstart, coff)
        out.append(vnet + bytes(head) + frame[lo:hi])
    return out
