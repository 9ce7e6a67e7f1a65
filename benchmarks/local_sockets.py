#!/usr/bin/env python3
"""Loopback TCP against a Unix socket between two processes: what the same-host shortcut saves the kernel.

usage: python benchmarks/local_sockets.py [--sizes 64,64K,1M] [--rounds 2]

A forked child echoes every message back (blocking ``recv_into`` / ``sendall``, TCP_NODELAY on TCP);
the parent times round trips and its own CPU time per round trip. Kinds alternate within each round so
that both see the same host. No pccl code runs here: it measures the two kernel paths that
``pccl.transport.TcpTransport`` chooses between (docs/transport.md "Same-host connections").
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c


def _listener(kind: str) -> tuple[socket.socket, object]:
    if kind == "tcp":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        return sock, sock.getsockname()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = b"\0pccl-bench-local-sockets/%d" % os.getpid()
    sock.bind(name)
    sock.listen()
    return sock, name


def _tune(sock: socket.socket) -> None:
    if sock.family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _fill(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("closed")
        got += n


def round_trips(kind: str, size: int, count: int) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) per round trip of ``size`` bytes, ``count`` times."""
    listener, address = _listener(kind)
    pid = os.fork()
    if pid == 0:  # the echo side
        try:
            conn, _ = listener.accept()
            _tune(conn)
            view = memoryview(bytearray(size))
            for _ in range(count):
                _fill(conn, view)
                conn.sendall(view)
        finally:
            os._exit(0)
    listener.close()
    sock = socket.socket(socket.AF_INET if kind == "tcp" else socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)  # type: ignore[arg-type]
    _tune(sock)
    view = memoryview(bytearray(size))
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(count):
        sock.sendall(view)
        _fill(sock, view)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    sock.close()
    os.waitpid(pid, 0)
    return wall / count, cpu / count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,64K,1M", help="message sizes (K/M suffixes)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.5, help="about how long each measurement runs")
    a = ap.parse_args()
    try:
        sizes = [c.parse_size(s) for s in a.sizes.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if a.rounds < 1 or a.seconds <= 0:
        ap.error("--rounds must be >= 1 and --seconds > 0")
    print(f"round trips between two processes; {c.machine_line()}", flush=True)
    rows = []
    for size in sizes:
        # calibrate the count on TCP so that each measurement takes about --seconds
        probe, _ = round_trips("tcp", size, 50)
        count = max(50, int(a.seconds / probe))
        got: dict[str, list[tuple[float, float]]] = {"tcp": [], "unix": []}
        for _ in range(a.rounds):
            for kind in ("tcp", "unix"):
                got[kind].append(round_trips(kind, size, count))
        rows.append([c.human_bytes(size), count,
                     " / ".join(f"{w * 1e6:.1f}" for w, _ in got["tcp"]),
                     " / ".join(f"{w * 1e6:.1f}" for w, _ in got["unix"]),
                     " / ".join(f"{u * 1e6:.1f}" for _, u in got["tcp"]),
                     " / ".join(f"{u * 1e6:.1f}" for _, u in got["unix"])])
    print(c.format_table(["size", "round trips", "TCP us", "Unix us", "TCP CPU us", "Unix CPU us"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
