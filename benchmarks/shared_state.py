"""Shared-state throughput: content hashing, and a 256 MB state delivered to a newcomer over loopback.

1. Hash: ``pccl.kernels.hashing.content_hash`` on float32 arrays (in this process), MB/s, with the default
   thread count and with one thread.
2. Transfer: a master, ``--holders`` peers holding the state (``--tensors`` float32 tensors totalling
   ``--state-mb``) and a newcomer, all OS processes. The newcomer's tensors differ (zeros, revision 0), so
   its ``sync_shared_state()`` fetches everything from the holders. Each round the newcomer resets its
   tensors and syncs again. Reported: the newcomer's whole ``sync_shared_state()`` call (its own hashing,
   the vote, the fetch, re-hashing what it received, the atomic apply) and the wire phase alone (bytes
   between the first and the last progress callback over the time between them; the library re-hashes each
   tensor as it completes, so that time is inside this phase too), and the newcomer process's CPU time
   during its call (all its threads: less sensitive than wall time to other load on a shared machine).
3. Baseline: the same bytes between two processes over plain trio sockets (``send`` / ``recv_into`` in 4 MB
   slices), measured in the same run: what the machine allows at that moment.

Target: transfer >= 1 GB/s.

usage: python benchmarks/shared_state.py [--state-mb 256] [--tensors 4] [--holders 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

# ----------------------------------------------------------------------------------------------
# children


def _make_state(cfg: dict[str, Any], fill: str) -> tuple[Any, list[np.ndarray]]:
    from pccl.peer.shared_state import SharedState, TensorInfo

    per = cfg["state_bytes"] // cfg["tensors"] // 4
    rng = np.random.default_rng(1)  # every holder holds the same content
    arrays = [rng.random(per, dtype=np.float32) if fill == "random" else np.zeros(per, np.float32)
              for _ in range(cfg["tensors"])]
    state = SharedState([TensorInfo(f"t{i}", a) for i, a in enumerate(arrays)], revision=cfg["revision"])
    return state, arrays


async def _holder(cfg: dict[str, Any]) -> None:
    from pccl.peer.communicator import open_communicator

    state, _ = _make_state(cfg, "random")
    async with open_communicator(cfg["master"], config=c.peer_config()) as comm:
        c.emit("accepted", peer=comm.peer_id)
        while True:
            await c.admit_pending(comm)
            if comm.world_size < cfg["holders"] + 1:
                await trio.sleep(0.005)
                continue
            info = await comm.sync_shared_state(state)
            c.emit("sync", peer=comm.peer_id, tx=info.tx_bytes, rx=info.rx_bytes)


async def _newcomer(cfg: dict[str, Any]) -> None:
    from pccl.peer.communicator import open_communicator

    state, arrays = _make_state(cfg, "zeros")
    async with open_communicator(cfg["master"], config=c.peer_config()) as comm:
        for r in range(cfg["rounds"]):
            if r > 0:
                await c.admit_pending(comm)  # the holders' loop runs this before each sync
            for a in arrays:
                a.fill(0.0)
            state.revision = 0
            marks: list[tuple[float, int]] = []

            def progress(done: int, total: int, marks: list[tuple[float, int]] = marks) -> None:
                marks.append((time.perf_counter(), done))

            t0, cpu0 = time.perf_counter(), time.process_time()
            info = await comm.sync_shared_state(state, progress=progress)
            dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            ok = all(float(a[-1]) != 0.0 for a in arrays)
            wire = (marks[-1][1] - marks[0][1]) / (marks[-1][0] - marks[0][0]) if len(marks) > 1 else 0.0
            c.emit("round", round=r, rx=info.rx_bytes, sync_s=dt, cpu_s=cpu, wire_bps=wire, content_ok=ok,
                   world=comm.world_size)
        c.emit("done")


async def _raw_recv(cfg: dict[str, Any]) -> None:
    """Baseline: plain trio sockets, recv_into a preallocated buffer (what the machine allows right now)."""
    import socket

    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    await sock.bind((c.PEER_HOST, 0))
    sock.listen(1)
    c.emit("listening", port=sock.getsockname()[1])
    conn, _ = await sock.accept()
    buf = np.empty(cfg["state_bytes"], np.uint8)
    view = buf.data
    step = 4 << 20
    for r in range(cfg["rounds"]):
        got = await conn.recv_into(view, step)
        t0 = time.perf_counter()
        while got < len(view):
            got += await conn.recv_into(view[got:], min(step, len(view) - got))
        dt = time.perf_counter() - t0
        c.emit("raw", round=r, bps=(len(view) - step) / dt if dt > 0 else 0.0)
        await conn.send(b"k")


async def _raw_send(cfg: dict[str, Any]) -> None:
    import socket

    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    await sock.connect((c.PEER_HOST, cfg["port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = np.ones(cfg["state_bytes"], np.uint8).data
    step = 4 << 20
    for _ in range(cfg["rounds"]):
        sent = 0
        while sent < len(data):
            sent += await sock.send(data[sent:sent + step])
        await sock.recv(1)


def child_main(cfg: dict[str, Any]) -> int:
    c.child_setup()
    fn = {"holder": _holder, "newcomer": _newcomer, "raw_recv": _raw_recv, "raw_send": _raw_send}[cfg["role"]]
    try:
        trio.run(fn, cfg)
    except Exception as exc:
        c.emit("error", message=f"{type(exc).__name__}: {exc}")
        raise
    return 0


# ----------------------------------------------------------------------------------------------
# driver


def bench_hash(sizes_mb: list[int], repeats: int) -> list[list[Any]]:
    from pccl.kernels.hashing import content_hash

    rows: list[list[Any]] = []
    for mb in sizes_mb:
        a = np.random.default_rng(0).random(mb * (1 << 20) // 4, dtype=np.float32)
        for threads in (None, 1):
            content_hash(a, threads=threads)  # warm-up (thread pool, key tables)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                content_hash(a, threads=threads)
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            rows.append([f"{mb} MB", "default" if threads is None else str(threads), med * 1e3,
                         a.nbytes / med / 1e6])
        del a
    return rows


async def bench_transfer(args: argparse.Namespace) -> list[list[Any]]:
    script = Path(__file__).resolve()
    cfg = {"state_bytes": args.state_mb << 20, "tensors": args.tensors, "holders": args.holders,
           "rounds": args.rounds, "revision": 7}
    rows: list[list[Any]] = []
    async with c.open_cluster(keep_logs=args.keep_logs) as cluster:
        master = await cluster.start_master()
        cfg["master"] = master.address
        for i in range(args.holders):
            await cluster.spawn(f"holder{i}", c.script_argv(script, {**cfg, "role": "holder"}))
            await cluster.wait_for(lambda ch, m: m.get("event") == "accepted", 120, "a holder")
        await cluster.spawn("newcomer", c.script_argv(script, {**cfg, "role": "newcomer"}))
        rounds: list[dict[str, Any]] = []
        while len(rounds) < args.rounds:
            _, msg = await cluster.wait_for(lambda ch, m: m.get("event") == "round", 300, "a sync round")
            rounds.append(msg)
            print(f"  round {msg['round']}: {msg['rx'] / 2**20:.0f} MB in {msg['sync_s'] * 1e3:.0f} ms "
                  f"(whole sync {msg['rx'] / msg['sync_s'] / 1e9:.2f} GB/s, wire phase "
                  f"{msg['wire_bps'] / 1e9:.2f} GB/s, newcomer CPU {msg['cpu_s'] * 1e3:.0f} ms)"
                  f"{'' if msg['content_ok'] else '  CONTENT WRONG'}",
                  flush=True)
    for msg in rounds:
        if msg["rx"] != cfg["state_bytes"] or not msg["content_ok"]:
            raise RuntimeError(f"round {msg['round']} received {msg['rx']} bytes, "
                               f"content_ok={msg['content_ok']}")
    raw: list[float] = []
    if not args.skip_raw:
        async with c.open_cluster(keep_logs=args.keep_logs) as cluster:
            base = {"state_bytes": cfg["state_bytes"], "rounds": args.rounds}
            await cluster.spawn("raw_recv", c.script_argv(script, {**base, "role": "raw_recv"}))
            _, msg = await cluster.wait_for(lambda ch, m: m.get("event") == "listening", 60,
                                            "the raw receiver")
            await cluster.spawn("raw_send", c.script_argv(script, {**base, "role": "raw_send",
                                                                    "port": msg["port"]}))
            while len(raw) < args.rounds:
                _, msg = await cluster.wait_for(lambda ch, m: m.get("event") == "raw", 120, "a raw round")
                raw.append(float(msg["bps"]))
        print(f"  raw trio socket baseline: {statistics.median(raw) / 1e9:.2f} GB/s (median of {len(raw)})",
              flush=True)
    sync_s = statistics.median(float(m["sync_s"]) for m in rounds)
    cpu_s = statistics.median(float(m["cpu_s"]) for m in rounds)
    wire = statistics.median(float(m["wire_bps"]) for m in rounds)
    rows.append([f"{args.state_mb} MB", args.tensors, args.holders, sync_s * 1e3, cpu_s * 1e3,
                 cfg["state_bytes"] / sync_s / 1e9, wire / 1e9,
                 statistics.median(raw) / 1e9 if raw else float("nan")])
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--state-mb", type=int, default=256)
    p.add_argument("--tensors", type=int, default=4)
    p.add_argument("--holders", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hash-sizes", default="1,16,256", help="MB, comma separated")
    p.add_argument("--hash-repeats", type=int, default=5)
    p.add_argument("--skip-hash", action="store_true")
    p.add_argument("--skip-raw", action="store_true", help="skip the plain-socket baseline")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    print(f"shared state; {c.machine_line()}", flush=True)
    if not args.skip_hash:
        rows = bench_hash([int(x) for x in args.hash_sizes.split(",")], args.hash_repeats)
        print()
        print(c.format_table(["content_hash input", "threads", "median ms", "MB/s"], rows))
        print(flush=True)
    rows = trio.run(bench_transfer, args)
    print()
    print(c.format_table(["state", "tensors", "holders", "newcomer sync median ms", "newcomer CPU ms",
                          "whole sync GB/s",
                          "wire phase GB/s", "raw socket GB/s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
