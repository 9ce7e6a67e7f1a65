"""Small network probes the WAN self-test runs inside the emulator's hosts.

``python -m pccl.testing.wan.probe echo PORT`` answers UDP datagrams;
``... ping ADDR COUNT`` (ICMP echo) prints the median and minimum round trip in ms as JSON;
``... sink PORT STREAMS SECONDS`` accepts ``STREAMS`` TCP connections and prints the goodput of the
second half of ``SECONDS`` (after slow start) in Mbit/s as JSON;
``... source ADDR PORT STREAMS SECONDS`` sends on ``STREAMS`` connections for ``SECONDS``.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import statistics
import struct
import sys
import threading
import time


def _echo(port: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    while True:
        data, addr = s.recvfrom(2048)
        if data == b"quit":
            return
        s.sendto(data, addr)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _ping(addr: str, count: int) -> None:
    """ICMP echo (a raw socket: root), answered by the far host's kernel like ``ping``."""
    try:  # the measuring process should not add its own scheduling delay to the round trip
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(40))
    except OSError:
        pass
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(2.0)
    ident = os.getpid() & 0xFFFF
    rtts = []
    for k in range(count):
        body = b"pccl-wan" * 7
        head = struct.pack("!BBHHH", 8, 0, 0, ident, k)
        packet = struct.pack("!BBHHH", 8, 0, _checksum(head + body), ident, k) + body
        t0 = time.perf_counter()
        s.sendto(packet, (addr, 0))
        got = False
        while True:
            try:
                data = s.recv(2048)
            except TimeoutError:
                break
            ihl = (data[0] & 0x0F) * 4
            typ, _code, _ck, rid, rseq = struct.unpack_from("!BBHHH", data, ihl)
            if typ == 0 and rid == ident and rseq == k:
                got = True
                break
        if got:
            rtts.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.05)
    print(json.dumps({"median_ms": statistics.median(rtts) if rtts else None,
                      "min_ms": min(rtts) if rtts else None, "replies": len(rtts)}))


def _sink(port: int, streams: int, seconds: float) -> None:
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(streams)
    sel = selectors.DefaultSelector()
    for _ in range(streams):
        c, _ = ls.accept()
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)
    buf = bytearray(1 << 20)
    total = 0
    t0 = time.perf_counter()
    half = t0 + seconds / 2
    at_half: int | None = None
    open_ = streams
    while open_:
        for key, _ in sel.select(1.0):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                n = sock.recv_into(buf)
            except BlockingIOError:
                continue
            if n == 0:
                sel.unregister(sock)
                sock.close()
                open_ -= 1
                if open_ == streams - 1:
                    t_end = time.perf_counter()
                    end_total = total
            total += n
        if at_half is None and time.perf_counter() >= half:
            at_half, t_half = total, time.perf_counter()
    if at_half is None:
        at_half, t_half = 0, t0
    mbit = (end_total - at_half) * 8 / max(1e-9, t_end - t_half) / 1e6
    print(json.dumps({"mbit": mbit, "bytes": total}))


def _source(addr: str, port: int, streams: int, seconds: float) -> None:
    chunk = b"\0" * (1 << 20)
    stop = time.perf_counter() + seconds

    def one() -> None:
        s = socket.create_connection((addr, port))
        while time.perf_counter() < stop:
            s.sendall(chunk)
        s.close()

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main(argv: list[str] | None = None) -> int:
    """Dispatch one probe (see the module doc)."""
    a = sys.argv[1:] if argv is None else argv
    if a[0] == "echo":
        _echo(int(a[1]))
    elif a[0] == "ping":
        _ping(a[1], int(a[2]))
    elif a[0] == "sink":
        _sink(int(a[1]), int(a[2]), float(a[3]))
    elif a[0] == "source":
        _source(a[1], int(a[2]), int(a[3]), float(a[4]))
    else:
        print(f"unknown probe {a[0]!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
