"""All-reduce over an emulated WAN, ours and torch.distributed Gloo side by side, in one run.

Each case starts a fresh :class:`pccl.testing.wan.WanEmulator` (hosts in network namespaces joined
by links with a one-way delay, a rate, a drop-tail queue of one bandwidth-delay product and random
loss; root only), runs our peers (one process per host, the master on host 0) and then Gloo's ranks
(one per host, ``GLOO_SOCKET_IFNAME=wan0``) on the same links, and prints one table row. Both sides
time a float32 SUM all-reduce after a barrier; the figure is the median over the iterations on the
slower peer (the largest per-rank median).

Cases (the issue's "Must show"; ``--cases`` picks some by name):

* ``2p-50ms``, ``2p-100ms``: 64 MiB, 2 peers, 1000 Mbit/s, RTT 50 / 100 ms;
* ``2p-50ms-idle``, ``2p-100ms-idle``: the same with a 1 s idle gap before each operation;
* ``4p-50ms``: 64 MiB, 4 peers, every link 50 ms;
* ``2p-50ms-loss1``: 64 MiB, 2 peers, 50 ms, 1% random loss each way;
* ``2p-100ms-200mbit``: 64 MiB, 2 peers, 100 ms, 200 Mbit/s;
* ``4KB-50ms``: 4 KB, 2 peers, 50 ms (ours should take about one round trip);
* ``2p-25ms``, ``2p-25ms-loss1`` (not run by default, no target): 64 MiB, 2 peers, 25 ms, without
  and with 1% loss;
* ``4p-asym``: 64 MiB, 4 hosts in two sites (2 ms RTT and no rate limit inside a site; between
  the sites one shared 1000 Mbit/s link per direction with 100 ms RTT, as a site's uplink), joined
  in the order 0, 2, 1, 3 so the join-order ring crosses the WAN four times (two flows share each
  direction); ours with the join order and after ``optimize_topology()`` (which should find the
  ring that crosses twice).

"Wire limit" is the time each peer's bytes take at the link rate (a ring all-reduce sends
``2 (n-1)/n`` of the buffer per peer). Our default configuration is what a user gets without a pool
size and without ``optimize_topology()``; ``--pool N`` adds a column with ``p2p_connection_pool_size=N``.

Each row states the issue's target for ours and whether it was met; ``--ab TREE`` adds a column
with ours from another checkout run right after, on the same emulator (an interleaved A/B). The
emulator's namespaces are named ``<prefix>-<pid>-<i>`` with ``--prefix`` (default ``$PCCL_WAN_PREFIX`` or
``wan``): people sharing a machine each use their own.

Diagnostics (environment): ``PCCL_WAN_VERBOSE=1`` prints each peer's times, phases and connection
count after each operation, and the emulator's queue drops and worst delivery lateness;
``PCCL_WAN_TRACE=1`` the last operation's frame timeline per connection; ``PCCL_WAN_EVENTS=PATH``
writes every master message and data frame each peer sent or received, with its
``time.perf_counter()``, to ``PATH.<peer id>`` (JSON; the namespaces share one monotonic clock, so the
peers' records line up: how the 4 KB case's pacing delay was found, docs/topology.md);
``PCCL_WAN_LOG=DEBUG`` writes each peer's ``pccl.p2p`` log (the stripe sizer's observations and
decisions) to ``/tmp/pccl-wan-ours-<pid>.log``; ``PCCL_WAN_CPU=1`` the cores the forwarder, our
peers (together), our master and the whole machine used during each timed operation
(``_cpu_sampler.py``, median over the operations).

``--cc NAME`` makes ``NAME`` every host's default congestion control (``cubic``: what most
distributions ship; the machine's otherwise), for ours and Gloo alike; ``--ours-cc NAME`` sets ours'
``PeerConfig.p2p_congestion_control`` (``default``: None, the host's).

usage: sudo python benchmarks/wan.py [--quick] [--cases a,b,...] [--iters 5] [--pool N] [--no-gloo]
                                     [--ab TREE] [--prefix NAME] [--cc NAME] [--ours-cc NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import end_processes, wait_listening

REPO = Path(__file__).resolve().parent.parent
MASTER_PORT = 29_400
GLOO_PORT = 29_500
MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    """One row: hosts, links and what is all-reduced."""

    name: str
    hosts: int
    rtt_ms: float
    rate_mbit: float
    nbytes: int = 64 * MIB
    loss: float = 0.0
    idle_s: float = 0.0
    sites: tuple[int, ...] = ()  # site of each host (empty: one link setting for every pair)
    site_rtt_ms: float = 2.0
    join_order: tuple[int, ...] = ()
    optimize: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # the target for ours (one of): a median at most ``max_s``; at least ``min_fill`` of the
    # wire limit; at most the ping plus ``ping_plus_ms``; ``optimized_faster``: the optimized ring
    # beats the join order
    max_s: float | None = None
    min_fill: float | None = None
    ping_plus_ms: float | None = None
    optimized_faster: bool = False

    def wire_limit_s(self) -> float:
        per_peer = self.nbytes * 2 * (self.hosts - 1) / self.hosts
        return per_peer * 8 / (self.rate_mbit * 1e6)

    def target(self) -> str:
        """The target, in words."""
        if self.max_s is not None:
            return f"<= {self.max_s:.3f} s"
        if self.min_fill is not None:
            return f">= {100 * self.min_fill:.0f}% of wire"
        if self.ping_plus_ms is not None:
            return f"<= ping + {self.ping_plus_ms:g} ms"
        return "optimized < join order" if self.optimized_faster else "-"

    def met(self, ours_s: float, ping_ms: float, join_order_s: float | None = None) -> bool:
        """Whether ``ours_s`` (the optimized ring's time for ``optimized_faster``) meets the target."""
        if self.max_s is not None:
            return ours_s <= self.max_s
        if self.min_fill is not None:
            return self.wire_limit_s() / ours_s >= self.min_fill
        if self.ping_plus_ms is not None:
            return ours_s * 1e3 <= ping_ms + self.ping_plus_ms
        return join_order_s is not None and ours_s < join_order_s


CASES = [
    Case("2p-50ms", 2, 50, 1000, max_s=0.62),
    Case("2p-100ms", 2, 100, 1000, max_s=0.70),
    Case("2p-50ms-idle", 2, 50, 1000, idle_s=1.0, max_s=0.62),
    Case("2p-100ms-idle", 2, 100, 1000, idle_s=1.0, max_s=0.70),
    Case("4p-50ms", 4, 50, 1000, max_s=1.2 * (0.805 + 0.050)),
    Case("2p-50ms-loss1", 2, 50, 1000, loss=0.01, min_fill=0.60),
    Case("2p-100ms-200mbit", 2, 100, 200, min_fill=0.90),
    Case("4KB-50ms", 2, 50, 1000, nbytes=4096, ping_plus_ms=2.0),
    Case("4p-asym", 4, 100, 1000, sites=(0, 0, 1, 1), join_order=(0, 2, 1, 3), optimized_faster=True),
]
#: Cases outside the issue's list (no target): only by name, ``--cases 2p-25ms,2p-25ms-loss1``.
EXTRA_CASES = [
    Case("2p-25ms", 2, 25, 1000),
    Case("2p-25ms-loss1", 2, 25, 1000, loss=0.01),
]


# ----------------------------------------------------------------------------------------------
# children (run inside a host's namespace)


async def _ours_child(cfg: dict[str, Any]) -> None:
    import numpy as np
    import trio

    from pccl import PeerConfig, ReduceOp, UpdateTopologyFailedError
    from pccl.peer.communicator import open_communicator

    trace: list[tuple[str, int, float, float, int]] | None = [] if cfg.get("trace") else None
    if trace is not None:
        _install_trace(trace)
    events: list[tuple[float, str, str]] | None = [] if cfg.get("events") else None
    if events is not None:
        _install_events(events)
    kwargs: dict[str, Any] = {}
    if cfg.get("pool"):
        kwargs["p2p_connection_pool_size"] = cfg["pool"]
    config = PeerConfig(p2p_listen_host=cfg["addr"])
    if "cc" in cfg:  # --ours-cc: PeerConfig.p2p_congestion_control ("default": None, the kernel's)
        cc = None if cfg["cc"] == "default" else cfg["cc"]
        config = dataclasses.replace(config, p2p_congestion_control=cc)
    async with open_communicator(cfg["master"], config=config, **kwargs) as comm:
        print(json.dumps({"event": "joined"}), flush=True)
        while comm.world_size < cfg["world"]:
            if await comm.are_peers_pending():
                try:
                    await comm.update_topology()
                except UpdateTopologyFailedError:
                    pass
            await trio.sleep(0.01)
        barrier = np.zeros(1, np.float32)
        await comm.all_reduce(barrier, op=ReduceOp.SUM, tag=1)
        if cfg.get("optimize"):
            t = time.perf_counter()
            await comm.optimize_topology()
            opt_s = time.perf_counter() - t
        else:
            opt_s = 0.0
        x = np.random.default_rng(comm.rank).random(cfg["nbytes"] // 4, dtype=np.float32)
        times = []
        phases: list[dict[str, float]] = []
        counts: list[int] = []
        lost: list[float] = []
        walls: list[tuple[float, float]] = []  # each timed operation's wall-clock window (PCCL_WAN_CPU)
        for i in range(cfg["warmup"] + cfg["iters"]):
            if cfg["idle"]:
                await trio.sleep(cfg["idle"])  # a training step's compute
            await comm.all_reduce(barrier, op=ReduceOp.SUM, tag=1)
            if trace is not None:
                trace.clear()
            t = time.perf_counter()
            wall = time.time()
            if events is not None:
                events.append((t, "op", f"start {i}"))
            await comm.all_reduce(x, op=ReduceOp.SUM, tag=0)
            if events is not None:
                events.append((time.perf_counter(), "op", f"end {i}"))
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t)
                walls.append((wall, time.time()))
                phases.append(comm.statistics()["last_op_phases"])
            # the connections each operation striped over, as sized after it (PCCL_WAN_VERBOSE)
            counts.append(max(comm.pool.statistics().get("stripes", {}).values(), default=0))
            again = comm.pool.statistics().get("retransmitted", {}).values()
            lost.append(round(100 * max(again, default=0), 2))
        stripes = comm.pool.statistics().get("outgoing")
        in_use = comm.pool.statistics().get("stripes")  # connections operations stripe over (sized)
        stats = comm.statistics()
        spec = {k: stats.get(k, 0) for k in ("speculative_starts", "speculative_gate_waits")}
        ring = comm.group_ring
        await comm.all_reduce(barrier, op=ReduceOp.SUM, tag=1)
    if events is not None:
        with open(f"{cfg['events']}.{comm.peer_id}", "w") as f:
            json.dump(events, f)
    if trace is not None:
        print(json.dumps({"event": "trace", "t0": t, "frames": [
            (k, c, round(1e3 * (a - t), 1), round(1e3 * (b - t), 1), n >> 10) for k, c, a, b, n in trace]}),
            flush=True)
    print(json.dumps({"event": "result", "median_s": statistics.median(times), "times": times,
                      "optimize_s": opt_s, "ring": ring, "outgoing": stripes, "stripes": in_use,
                      "stripes_after_each": counts, "retransmitted_pct": lost, "walls": walls,
                      **spec,
                      "phases_ms": {k: round(1e3 * statistics.median(p[k] for p in phases), 1)
                                    for k in (phases[0] if phases else {})}}), flush=True)


def _install_trace(trace: list[tuple[str, int, float, float, int]]) -> None:
    """Record every data frame's send (start, end) and receive (header read, end) per connection
    (``--trace``: where the time of the last iteration went)."""
    from pccl.peer.ring_links import RingLinks
    from pccl.peer.ring_reader import RingReaders
    from pccl.wire.data import unpack_data_header_fields

    send0 = RingLinks.send
    read0 = RingReaders.read_frame

    async def send(self: Any, peer_id: int, tag: int, op_seq: int, seq: int, data: Any, *,
                   conn_index: int) -> None:
        a = time.perf_counter()
        await send0(self, peer_id, tag, op_seq, seq, data, conn_index=conn_index)
        if len(data) > 65536:
            trace.append(("send", conn_index % len(self.conns[peer_id]), a, time.perf_counter(), len(data)))

    async def read_frame(self: Any, conn: Any) -> bool:
        a = time.perf_counter()
        length = unpack_data_header_fields(conn.hdr)[3]
        ok: bool = await read0(self, conn)
        if length > 65536:
            trace.append(("recv", conn.index, a, time.perf_counter(), length))
        return ok

    RingLinks.send = send  # type: ignore[method-assign]
    RingReaders.read_frame = read_frame  # type: ignore[method-assign]


def _gloo_child(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = cfg["master_addr"], str(GLOO_PORT)
    os.environ["GLOO_SOCKET_IFNAME"] = "wan0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=cfg["rank"], world_size=cfg["world"])
    x = torch.rand(cfg["nbytes"] // 4)
    times = []
    for i in range(cfg["warmup"] + cfg["iters"]):
        if cfg["idle"]:
            time.sleep(cfg["idle"])
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"event": "result", "median_s": statistics.median(times), "times": times}), flush=True)


def child_main(kind: str, cfg: dict[str, Any]) -> int:
    """Entry of a child process: ``--child ours|gloo JSON``."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    if os.environ.get("PCCL_WAN_LOG"):  # e.g. DEBUG: the stripe sizer's decisions (logger pccl.p2p)
        p2p = logging.getLogger("pccl.p2p")
        p2p.setLevel(os.environ["PCCL_WAN_LOG"])
        handler = logging.FileHandler(f"/tmp/pccl-wan-{kind}-{os.getpid()}.log")
        handler.setFormatter(logging.Formatter("%(relativeCreated)d ms %(name)s: %(message)s"))
        p2p.addHandler(handler)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    if kind == "ours":
        import trio

        trio.run(_ours_child, cfg)
    else:
        _gloo_child(cfg)
    return 0


# ----------------------------------------------------------------------------------------------
# driver


def _setup_links(wan: Any, case: Case) -> None:
    if case.sites:
        wan.set_sites(list(case.sites), rtt_ms=case.rtt_ms, rate_mbit=case.rate_mbit,
                      site_rtt_ms=case.site_rtt_ms, loss=case.loss)
    else:
        wan.set_all(rtt_ms=case.rtt_ms, rate_mbit=case.rate_mbit, loss=case.loss)


def _collect(procs: list[subprocess.Popen[str]], timeout: float, what: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{what}: timed out after {timeout:.0f} s") from None
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        for x in lines:
            if x.get("event") == "trace":
                _print_trace(x["frames"])
        res = [x for x in lines if x.get("event") == "result"]
        if p.returncode != 0 or not res:
            raise RuntimeError(f"{what}: a process failed ({p.returncode}):\n{err[-3000:]}")
        results.append(res[-1])
    return results


def _print_trace(frames: list[list[Any]]) -> None:
    by: dict[tuple[str, int], list[str]] = {}
    for kind, conn, a, b, kib in frames:
        by.setdefault((kind, conn), []).append(f"{a:.0f}-{b:.0f}({kib >> 10}M)")
    print("  trace (ms from the call, per connection):", flush=True)
    for (kind, conn), items in sorted(by.items()):
        print(f"    {kind} {conn}: " + " ".join(items), flush=True)


def _install_events(events: list[tuple[float, str, str]]) -> None:
    """Record (``time.perf_counter()``, what, detail) of every message to and from the master and every
    data frame sent and received (``PCCL_WAN_EVENTS=path``: one JSON file per peer, ``path.<peer id>``).
    The namespaces share the host's monotonic clock, so the peers' records line up."""
    from pccl.peer.communicator import Communicator
    from pccl.peer.ring_links import RingLinks
    from pccl.peer.ring_reader import RingReaders
    from pccl.wire.data import unpack_data_header_fields

    handle0, send_now0, send0 = Communicator.handle_master_message, Communicator._send_now, RingLinks.send
    send_plain0, read0 = Communicator._send, RingReaders.read_frame

    def handle(self: Any, msg: Any) -> Any:
        events.append((time.perf_counter(), "master->", type(msg).__name__))
        r = handle0(self, msg)
        events.append((time.perf_counter(), "handled", type(msg).__name__))
        return r

    async def send_now(self: Any, msg: Any) -> None:
        events.append((time.perf_counter(), "->master", type(msg).__name__))
        await send_now0(self, msg)
        events.append((time.perf_counter(), "sent", type(msg).__name__))

    async def send_plain(self: Any, msg: Any) -> None:
        events.append((time.perf_counter(), "->master(q)", type(msg).__name__))
        await send_plain0(self, msg)

    async def send(self: Any, peer_id: int, tag: int, op_seq: int, seq: int, data: Any, *,
                   conn_index: int) -> None:
        events.append((time.perf_counter(), "frame->", f"{peer_id} tag {tag} seq {seq} {len(data)} B"))
        await send0(self, peer_id, tag, op_seq, seq, data, conn_index=conn_index)
        events.append((time.perf_counter(), "frame sent", f"{peer_id} tag {tag} seq {seq}"))

    async def read_frame(self: Any, conn: Any) -> bool:
        tag, _op_seq, seq, length = unpack_data_header_fields(conn.hdr)
        events.append((time.perf_counter(), "->frame", f"{conn.peer_id} tag {tag} seq {seq} {length} B"))
        ok: bool = await read0(self, conn)
        events.append((time.perf_counter(), "frame read", f"{conn.peer_id} tag {tag} seq {seq}"))
        return ok

    Communicator.handle_master_message = handle  # type: ignore[method-assign]
    Communicator._send_now = send_now  # type: ignore[method-assign]
    Communicator._send = send_plain  # type: ignore[method-assign]
    RingLinks.send = send  # type: ignore[method-assign]
    RingReaders.read_frame = read_frame  # type: ignore[method-assign]


def _child_argv(kind: str, cfg: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(cfg)]


def run_ours(wan: Any, case: Case, args: argparse.Namespace, pool: int | None,
             optimize: bool = False, tree: str | None = None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if tree is not None:  # --ab: the peers and the master import pccl from that tree
        env["PYTHONPATH"] = tree
    # The master logs to a file (a pipe nobody drains would block it once full).
    log = tempfile.NamedTemporaryFile("w+", prefix="pccl-wan-master-", suffix=".log", delete=False)
    master = wan.popen(0, [sys.executable, "-m", "pccl", "master", "--host", wan.addresses[0],
                           "--port", str(MASTER_PORT)], stdout=subprocess.DEVNULL, stderr=log, env=env,
                       cwd=tree or str(REPO))
    procs: list[subprocess.Popen[str]] = []
    sampler = None
    if os.environ.get("PCCL_WAN_CPU"):
        from _cpu_sampler import CpuSampler

        sampler = CpuSampler(0.05)
        sampler.watch("forwarder", wan._proc.pid)
        sampler.watch("master", master.pid)
        sampler.start()
    ok = False
    try:
        if not wait_listening(master, Path(log.name)):
            raise RuntimeError("our master did not start")
        order = case.join_order or tuple(range(case.hosts))
        for host in order:
            cfg = {"master": f"{wan.addresses[0]}:{MASTER_PORT}", "addr": wan.addresses[host],
                   "world": case.hosts, "nbytes": case.nbytes, "iters": args.iters,
                   "warmup": args.warmup, "idle": case.idle_s, "pool": pool, "optimize": optimize,
                   **({"cc": args.ours_cc} if args.ours_cc else {}),
                   "trace": bool(os.environ.get("PCCL_WAN_TRACE")),
                   "events": os.environ.get("PCCL_WAN_EVENTS")}
            p = wan.popen(host, _child_argv("ours", cfg), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
            procs.append(p)
            if sampler is not None:
                sampler.watch("peers", p.pid)
            assert p.stdout is not None
            line = p.stdout.readline()  # "joined": the next one joins after it (the join order)
            if "joined" not in line:
                err = p.stderr.read()[-2000:] if p.stderr else ""
                raise RuntimeError(f"our peer on host {host} did not join: {err}")
        budget = 120 + (args.iters + args.warmup) * (case.wire_limit_s() * 8 + case.idle_s + 2)
        res = _collect(procs, budget, f"ours ({case.name})")
        ok = True
    finally:
        if sampler is not None:
            sampler.stop()
        end_processes(procs, master)
        log.close()
        if not ok:
            tail = Path(log.name).read_text().splitlines()[-30:]
            print("  our master's log (last lines):\n    " + "\n    ".join(tail), file=sys.stderr)
        os.unlink(log.name)
    if sampler is not None:
        # cores used during each timed operation (the first peer's windows), median over the operations
        per_op = [sampler.cores(a, b) for a, b in res[0].get("walls", [])]
        per_op = [c for c in per_op if c]
        if per_op:
            med = {k: statistics.median(c.get(k, 0.0) for c in per_op) for k in per_op[0]}
            used = ", ".join(f"{k} {v:.2f}" for k, v in med.items())
            print(f"  cpu ({case.name}, {tree or 'this tree'}), cores during an operation (median of "
                  f"{len(per_op)}; {os.cpu_count()} CPUs): {used}", flush=True)
    if os.environ.get("PCCL_WAN_VERBOSE"):
        st = wan.stats()
        drops = sum(x["queue_dropped_segments"] for x in st["links"])
        print(f"  emulator: {drops} segments dropped at the queue, worst lateness "
              f"{st['max_lateness_ms']:.1f} ms; load {os.getloadavg()[0]:.1f}")
        print(f"  ours ({case.name}, {tree or 'this tree'}): " + "; ".join(
            json.dumps({k: [round(t, 3) for t in v] if k == "times" else v
                        for k, v in r.items() if k != "event"}) for r in res), flush=True)
    return {"median_s": max(r["median_s"] for r in res), "ring": res[0]["ring"],
            "optimize_s": max(r["optimize_s"] for r in res), "outgoing": [r["outgoing"] for r in res]}


def run_gloo(wan: Any, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    order = case.join_order or tuple(range(case.hosts))
    procs = []
    for rank, host in enumerate(order):
        cfg = {"master_addr": wan.addresses[order[0]], "rank": rank, "world": case.hosts,
               "nbytes": case.nbytes, "iters": args.iters, "warmup": args.warmup, "idle": case.idle_s}
        procs.append(wan.popen(host, _child_argv("gloo", cfg), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env))
    budget = 180 + (args.iters + args.warmup) * (case.wire_limit_s() * 20 + case.idle_s + 5)
    res = _collect(procs, budget, f"gloo ({case.name})")
    return {"median_s": max(r["median_s"] for r in res)}


def _ping_ms(wan: Any, a: int, b: int) -> float:
    out = subprocess.run(wan.command(a, [sys.executable, "-m", "pccl.testing.wan.probe", "ping",
                                         wan.addresses[b], "10"]),
                         capture_output=True, text=True, timeout=60, check=True)
    return float(json.loads(out.stdout)["median_ms"])


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _run_cases(args: argparse.Namespace, names: list[str], by_name: dict[str, Case],
               rows: list[list[str]]) -> None:
    """Each case of ``names`` on a fresh emulator: ours (and the other columns ``args`` ask for); a
    row per case appended to ``rows`` and printed as it comes."""
    from pccl.testing.wan import WanEmulator

    for name in names:
        case = by_name[name]
        with WanEmulator(case.hosts, prefix=args.prefix) as wan:
            _setup_links(wan, case)
            if args.cc:
                for host in range(case.hosts):
                    sysctl = ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={args.cc}"]
                    subprocess.run(wan.command(host, sysctl), check=True)
            far = case.hosts - 1
            ping = _ping_ms(wan, 0, far)
            notes = ""
            ours = run_ours(wan, case, args, None)
            opt = None
            if case.join_order:
                opt = run_ours(wan, case, args, None, optimize=True)
                notes = (f"join-order ring {ours['ring']}: {ours['median_s']:.3f} s; optimized ring "
                         f"{opt['ring']}: {opt['median_s']:.3f} s "
                         f"(optimize_topology {opt['optimize_s']:.1f} s)")
            ab = run_ours(wan, case, args, None, tree=args.ab)["median_s"] if args.ab else None
            extra = run_ours(wan, case, args, args.pool)["median_s"] if args.pool else None
            gloo = None if args.no_gloo else run_gloo(wan, case, args)["median_s"]
            lost = sum(x["lost_segments"] for x in wan.stats()["links"])
            if case.loss:
                notes += f"{lost} segments lost in the run"
        o = ours["median_s"]
        wire = case.wire_limit_s()
        met = case.met(opt["median_s"], ping, o) if opt is not None else case.met(o, ping)
        row = [name, f"{ping:.2f}", f"{wire:.3f}", _fmt_s(o), f"{100 * wire / o:.0f}%", case.target(),
               "-" if case.target() == "-" else "met" if met else "MISSED"]
        if args.ab:
            row.append(_fmt_s(ab))
        if args.pool:
            row.append(_fmt_s(extra))
        row += [_fmt_s(gloo), "-" if gloo is None else f"{o / gloo:.2f}", notes]
        rows.append(row)
        print("  " + " | ".join(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--pool", type=int, default=None, help="also run ours with this pool size")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--ab", metavar="TREE", default=None,
                    help="also run ours (default configuration) from another checkout (e.g. /work/main), "
                         "right after ours from this one, on the same emulator: an interleaved A/B column")
    ap.add_argument("--quick", action="store_true",
                    help="3 iterations, and only 2p-50ms, 4KB-50ms and 4p-asym")
    ap.add_argument("--prefix", default=os.environ.get("PCCL_WAN_PREFIX") or "wan",
                    help="namespace prefix (<prefix>-<pid>-<i>; default $PCCL_WAN_PREFIX or wan)")
    ap.add_argument("--cc", default=None,
                    help="the hosts' default congestion control (net.ipv4.tcp_congestion_control in each "
                         "namespace; e.g. cubic, most distributions' default), for ours and Gloo alike")
    ap.add_argument("--ours-cc", default=None,
                    help="ours' PeerConfig.p2p_congestion_control (default: the library's, bbr; "
                         "'default': None, the host's)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child[0], json.loads(args.child[1]))
    sys.path.insert(0, str(REPO))
    from pccl.testing.wan import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    names = args.cases.split(",")
    if args.quick:
        args.iters = 3
        if args.cases == ap.get_default("cases"):
            names = ["2p-50ms", "4KB-50ms", "4p-asym"]
    if args.cc:
        available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
        if args.cc not in available.read_text().split() and shutil.which("modprobe"):
            subprocess.run(["modprobe", f"tcp_{args.cc}"], stderr=subprocess.DEVNULL, check=False)
        if args.cc not in available.read_text().split():
            ap.error(f"--cc {args.cc}: not a congestion control this kernel has (it offers "
                     f"{available.read_text().strip()}; no module tcp_{args.cc} could be loaded)")
    if args.ours_cc and args.ours_cc != "default":
        from pccl import PeerConfig

        try:
            PeerConfig(p2p_congestion_control=args.ours_cc)
        except ValueError as exc:
            ap.error(f"--ours-cc: {exc}")
    by_name = {c.name: c for c in CASES + EXTRA_CASES}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {sorted(by_name)}")
    print(f"WAN all-reduce, float32 SUM; median of {args.iters} (+{args.warmup} warm-up) on the slower "
          f"peer; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; queue 1 BDP; "
          f"tcp_wmem max {Path('/proc/sys/net/ipv4/tcp_wmem').read_text().split()[2]}, "
          f"cc {args.cc or Path('/proc/sys/net/ipv4/tcp_congestion_control').read_text().strip()}"
          f"{'' if not args.ours_cc else f', ours asking for {args.ours_cc}'}", flush=True)
    headers = ["case", "ping ms", "wire limit s", "ours default s", "% of wire", "target", "met"]
    if args.ab:
        headers.append("ours --ab tree s")
    if args.pool:
        headers.append(f"ours pool {args.pool} s")
    headers += ["gloo s", "ours/gloo", "notes"]
    rows: list[list[str]] = []
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    was_allowed = allowed.read_text().strip()
    if args.cc and args.cc not in was_allowed.split():
        # a namespace's default must be one any process may pick (global; restored below)
        allowed.write_text(f"{was_allowed} {args.cc}")
    try:
        _run_cases(args, names, by_name, rows)
    finally:
        if allowed.read_text().strip() != was_allowed:
            allowed.write_text(was_allowed)
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
