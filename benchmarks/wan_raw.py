"""The ceiling of the WAN emulator for a 2-peer ring: raw TCP, both peers sending to each other at once.

What a 2-peer ring all-reduce of ``--mib`` MiB does on the wire, without any of our data plane: each
peer opens ``--stripes`` send-only connections to the other (as our pool does), and after a
one-byte barrier both send ``--mib`` MiB at once while receiving as much, with C-speed senders
(``socket.sendall`` of large memoryviews, one thread per connection, the GIL released) and
receivers (``recv_into``). The figure is the time from the barrier to the last byte in and out, on
the slower peer (median of ``--iters`` on warm connections), next to the wire limit. The
forwarder's and each peer's CPU seconds per iteration say whether anything is CPU-bound.

Modes (``--mode``):

* ``split``: the buffer in ``stripes`` contiguous pieces, one per connection, all sent at once;
* ``ring``: what the ring's plan does: the first half (reduce-scatter) in 4 MiB blocks taking
  connections in turn (dealt out by lane, fixed), then the second half (all-gather), block ``k`` of
  it sent only once the partner's block ``k`` has fully arrived (the reduction's dependency);
* ``pull``: the same blocks and dependency, but each connection takes the next ready block when
  it has handed its last one to the kernel (a 4-byte block number precedes each block).

``--cc NAME`` sets the sending connections' congestion control (``TCP_CONGESTION``; what the kernel
offers: ``sysctl net.ipv4.tcp_available_congestion_control``), ``--sndbuf BYTES`` their ``SO_SNDBUF``,
``--pace-mbit R`` their ``SO_MAX_PACING_RATE`` (``R`` in all, split evenly). ``--drop-to K`` (pull mode)
sends over only the first ``K`` connections after the warm-up, as the library's stripe sizer does when
it lowers a count, and ``--restart-cc`` then restarts their congestion control as the library does
(docs/topology.md "Connections per partner").

usage: sudo python benchmarks/wan_raw.py [--rtt-ms 50] [--rate-mbit 1000] [--stripes 3] [--mib 64]
                                         [--iters 5] [--mode ring] [--loss 0] [--prefix wanraw]
                                         [--cc bbr] [--sndbuf 0] [--pace-mbit 0]
                                         [--drop-to K [--restart-cc]]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PORT = 29_600


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("closed")
        got += k


def _block_orders(nb: int, rank: int) -> tuple[list[int], list[int]]:
    """The order this peer sends its ``nb`` blocks in and the order the partner sends its own: the
    reduce-scatter half first, then the all-gather half (peer 0 sends its second half first, as the
    ring)."""
    first, second = list(range(nb // 2)), list(range(nb // 2, nb))
    return (second + first, first + second) if rank == 0 else (first + second, second + first)


def _child(cfg: dict[str, Any]) -> None:
    me, other, n = cfg["addr"], cfg["other"], cfg["stripes"]
    size = cfg["mib"] << 20
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((me, PORT))
    ls.listen(n)
    print(json.dumps({"event": "listening"}), flush=True)
    out: list[socket.socket] = []
    deadline = time.monotonic() + 30
    while len(out) < n:
        try:
            out.append(socket.create_connection((other, PORT), timeout=5))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the other host's listener is not up yet
    for i, s in enumerate(out):
        s.settimeout(None)
        if cfg.get("cc"):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cfg["cc"].encode())
        if cfg.get("sndbuf"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg["sndbuf"])
        if cfg.get("pace"):  # the whole rate, shared by the n connections
            s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_MAX_PACING_RATE", 47),
                         int(cfg["pace"] * 1e6 / 8 / n))
        s.sendall(bytes([i]))
    inc: list[socket.socket] = [socket.socket()] * n
    for _ in range(n):
        c, _a = ls.accept()
        idx = c.recv(1)[0]
        inc[idx] = c
    block = cfg["block"]  # bytes (--block-kib)
    send_buf = memoryview(bytearray(os.urandom(1 << 16)) * (size >> 16))
    recv_buf = memoryview(bytearray(size))
    times = []
    cpu = []
    for it in range(cfg["warmup"] + cfg["iters"]):
        if cfg["idle"]:
            time.sleep(cfg["idle"])
        # barrier: one byte each way on connection 0
        out[0].sendall(b"b")
        _recv_exact(inc[0], memoryview(bytearray(1)))
        c0 = time.process_time()
        t0 = time.perf_counter()
        arrived = [threading.Event() for _ in range(size // block)]
        first_byte: list[float] = []

        if cfg["mode"] == "pull":
            nb = size // block
            order, other_order = _block_orders(nb, cfg["rank"])
            lock = threading.Lock()
            next_pos = [0]

            def puller(i: int) -> None:
                while True:
                    with lock:
                        pos = next_pos[0]
                        next_pos[0] += 1
                    if pos >= nb:
                        return
                    if pos >= nb // 2:
                        arrived[other_order[pos - nb // 2]].wait()
                    b = order[pos]
                    hdr = b.to_bytes(4, "little")
                    out[i].sendall(hdr)
                    out[i].sendall(send_buf[b * block:(b + 1) * block])

            def pull_recv(i: int) -> None:
                hdr = memoryview(bytearray(4))
                while True:
                    _recv_exact(inc[i], hdr)
                    b = int.from_bytes(hdr, "little")
                    if b == 0xFFFFFFFF:
                        return
                    _recv_exact(inc[i], recv_buf[b * block:(b + 1) * block])
                    if not first_byte:
                        first_byte.append(time.perf_counter() - t0)
                    arrived[b].set()

            # --drop-to K: after the warm-up, only the first K connections send (as the library's
            # stripe sizer lowering the count), their congestion control restarted with --restart-cc
            active = n if it < cfg["warmup"] or not cfg.get("drop_to") else cfg["drop_to"]
            if active < n and it == cfg["warmup"] and cfg.get("restart_cc"):
                for s in out[:active]:
                    cc = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0]
                    other = b"reno" if cc != b"reno" else b"cubic"
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, other)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc)
            threads = [threading.Thread(target=puller, args=(i,)) for i in range(active)]
            rthreads = [threading.Thread(target=pull_recv, args=(i,)) for i in range(n)]
            for t in threads + rthreads:
                t.start()
            for t in threads:
                t.join()
            # every block sent: tell idle receivers of the partner to stop
            for s in out:
                s.sendall((0xFFFFFFFF).to_bytes(4, "little"))
            for t in rthreads:
                t.join()
        else:  # split or ring: each connection has its blocks (jobs) from the start
            if cfg["mode"] == "split":
                piece = -(-size // n)
                send_jobs = [[(i * piece, min(size, (i + 1) * piece))] for i in range(n)]
                recv_jobs = send_jobs
            else:
                # blocks of the first half (sent by this peer: the partner reduces them) and of the
                # second half, on connections in turn; peer 0 sends its second half first (as the ring)
                nb = size // block
                order, other_order = _block_orders(nb, cfg["rank"])
                send_jobs = [[] for _ in range(n)]
                for k, b in enumerate(order):
                    send_jobs[k % n].append((b * block, (b + 1) * block))
                recv_jobs = [[] for _ in range(n)]
                for k, b in enumerate(other_order):
                    recv_jobs[k % n].append((b * block, (b + 1) * block))
                # what the partner sends first (its reduce-scatter part) is what we reduce and then
                # send back: our k-th all-gather block waits for the partner's k-th block

            def sender(i: int) -> None:
                for lo, hi in send_jobs[i]:
                    if cfg["mode"] == "ring":
                        b = lo // block
                        pos = order.index(b)
                        if pos >= nb // 2:  # an all-gather block: its reduction needs the partner's block
                            arrived[other_order[pos - nb // 2]].wait()
                    out[i].sendall(send_buf[lo:hi])

            def receiver(i: int) -> None:
                for lo, hi in recv_jobs[i]:
                    _recv_exact(inc[i], recv_buf[lo:hi])
                    if not first_byte:
                        first_byte.append(time.perf_counter() - t0)
                    if cfg["mode"] == "ring":
                        arrived[lo // block].set()

            threads = [threading.Thread(target=sender, args=(i,)) for i in range(n)]
            threads += [threading.Thread(target=receiver, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        dt = time.perf_counter() - t0
        if it >= cfg["warmup"]:
            times.append(dt)
            cpu.append(time.process_time() - c0)
    out[0].sendall(b"e")
    _recv_exact(inc[0], memoryview(bytearray(1)))
    print(json.dumps({"event": "result", "times": times, "median_s": statistics.median(times),
                      "cpu_s": statistics.median(cpu)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt-ms", type=float, default=50)
    ap.add_argument("--rate-mbit", type=float, default=1000)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--stripes", default="3", help="comma-separated: one run each")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--idle", type=float, default=0.0)
    ap.add_argument("--mode", default="ring", choices=["ring", "split", "pull"])
    ap.add_argument("--prefix", default="wanraw")
    ap.add_argument("--block-kib", type=int, default=4096)
    ap.add_argument("--cc", default="",
                    help="TCP_CONGESTION of the sending connections (default: the kernel's)")
    ap.add_argument("--drop-to", type=int, default=0,
                    help="pull mode: after the warm-up only the first K connections send")
    ap.add_argument("--restart-cc", action="store_true",
                    help="with --drop-to: restart the kept connections' congestion control at the drop")
    ap.add_argument("--pace-mbit", type=float, default=0.0,
                    help="SO_MAX_PACING_RATE: this rate in all, split evenly over the sending connections")
    ap.add_argument("--sndbuf", type=int, default=0,
                    help="SO_SNDBUF of the sending connections (0: autotuning)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    sys.path.insert(0, str(REPO))
    from pccl.testing.wan import WanEmulator, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    wire = args.mib * (1 << 20) * 8 / (args.rate_mbit * 1e6)
    print(f"raw TCP, 2 peers both sending {args.mib} MiB, {args.mode}, RTT {args.rtt_ms} ms, "
          f"{args.rate_mbit} Mbit/s, loss {args.loss}, cc {args.cc or 'default'}, "
          f"sndbuf {args.sndbuf or 'auto'}; wire limit {wire:.3f} s; load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    for stripes in [int(x) for x in args.stripes.split(",")]:
        with WanEmulator(2, prefix=args.prefix) as wan:
            wan.set_all(rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit, loss=args.loss)
            assert wan._proc is not None
            fpid = wan._proc.pid
            procs = []
            for h in range(2):
                cfg = {"addr": wan.addresses[h], "other": wan.addresses[1 - h], "rank": h,
                       "stripes": stripes, "mib": args.mib, "iters": args.iters,
                       "warmup": args.warmup, "mode": args.mode, "idle": args.idle,
                       "block": args.block_kib << 10, "cc": args.cc, "sndbuf": args.sndbuf,
                       "pace": args.pace_mbit, "drop_to": args.drop_to, "restart_cc": args.restart_cc}
                p = wan.popen(h, [sys.executable, __file__, "--child", json.dumps(cfg)],
                              stdout=subprocess.PIPE, text=True)
                assert p.stdout is not None
                p.stdout.readline()
                procs.append(p)
            f0 = _cpu_s(fpid)
            t0 = time.perf_counter()
            res = []
            for p in procs:
                out, _ = p.communicate(timeout=300)
                res.append([json.loads(x) for x in out.splitlines() if '"result"' in x][-1])
            wall = time.perf_counter() - t0
            fcpu = _cpu_s(fpid) - f0
            st = wan.stats()
        drops = sum(x["queue_dropped_segments"] for x in st["links"])
        lost = sum(x["lost_segments"] for x in st["links"])
        med = max(r["median_s"] for r in res)
        print(f"  stripes {stripes}: median {med:.3f} s on the slower peer ({100 * wire / med:.0f}% of "
              f"wire); per peer {[round(r['median_s'], 3) for r in res]}, times "
              f"{[[round(t, 3) for t in r['times']] for r in res]}; peer CPU/iter "
              f"{[round(r['cpu_s'], 3) for r in res]} s; forwarder CPU {fcpu:.2f} s over {wall:.1f} s "
              f"wall ({100 * fcpu / wall:.0f}%); queue drops {drops}, lost {lost}; "
              f"max lateness {st['max_lateness_ms']:.2f} ms; load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
