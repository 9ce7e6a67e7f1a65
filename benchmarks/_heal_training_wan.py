"""``python benchmarks/heal.py --wan --wan-cases train``: the members' training while a newcomer heals, on
the WAN emulator (issue 35, "Must show": steps per second during the heal at least 90% of the same without
a newcomer).

``--members`` (3) processes loop {all-reduce of ``--grad-mb`` MiB (AVG, float32); every ``--sync-every``
steps admit pending peers (``are_peers_pending``, ``update_topology``), push the revision and sync the
shared state} (the state unchanged between syncs, as in DiLoCo's
inner steps). Each member's **uplink** is one shared link of ``--donor-mbit`` (all its directions, to the
other members and to the newcomer: one rate, one queue), RTT ``--rtt-ms``; the newcomer's directions to
the members ``--newcomer-mbit``. One run on one emulator:

* **alone**: the members' steps from their second sync period on until ``--train-steps`` steps, when
  the driver starts the newcomer (holding zeros);
* **heal**: the members admit it before their next sync, which its sync joins and heals live (the
  default: the members return at once and serve a pinned copy, each capped by ``--serve-mbit``:
  ``PeerConfig.state_serve_rate``; with ``--serve-idle-mbit``, serving yields to each member's own
  collectives: ``--serve-mbit`` while one's data plane runs, ``--serve-idle-mbit`` between them,
  ``PeerConfig.state_serve_idle_rate``); it joins at the members' next sync after its fetch; the window
  is its whole ``sync_shared_state`` call. Everyone stops one sync period after the first all-reduce with
  the newcomer in it.

Printed: member 0's steps per second over each window (the members step in lockstep), the ratio, the heal
(the newcomer's whole call; fetch: its transfer) and whether every state ended bit-identical; where the
window went: member 0's time in syncs, their count and median, the median of its votes' hashing passes
and their count (one per sync), its all-reduces' median and 90th percentile; and per window the cores
used (sampled from ``/proc``) by the members, the newcomer, the master, the emulator's forwarder and the
whole machine (others' processes too). Times are wall seconds of real processes: the machine's load
shows in them (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio
from _common import end_processes, follow_json_lines, wait_for_results, wait_listening
from _cpu_sampler import CpuSampler

MIB = 1 << 20
MASTER_PORT = 29_452


async def _admit(comm: Any) -> None:
    """Admit pending peers (``are_peers_pending``, then one ``update_topology``; a failed vote is left to
    the next call)."""
    from pccl import UpdateTopologyFailedError

    if await comm.are_peers_pending():
        try:
            await comm.update_topology()
        except UpdateTopologyFailedError:
            pass


async def train_peer(cfg: dict[str, Any], arrays: list[np.ndarray], state: Any) -> None:
    """One member or the newcomer of the ``train`` run; prints JSON lines (joined, ready, result)."""
    from pccl import PeerConfig, ReduceOp
    from pccl.kernels import hashing
    from pccl.peer.communicator import open_communicator

    newcomer = cfg["role"] == "newcomer"
    h = cfg["sync_every"]
    hashed = _time_vote_hashing()
    yielding = {"state_serve_idle_rate": cfg["serve_idle_rate"]} if cfg.get("serve_idle_rate") else {}
    conf = PeerConfig(p2p_listen_host=cfg["addr"], state_serve_rate=cfg.get("serve_rate"), **yielding)
    async with open_communicator(cfg["master"], config=conf) as comm:
        print(json.dumps({"event": "joined", "pid": os.getpid()}), flush=True)
        while not newcomer and comm.world_size < cfg["members"]:
            await _admit(comm)
            await trio.sleep(0.01)  # polling the world size until the members are in, before the clock starts
        grad = np.ones(cfg["grad_mb"] * MIB // 4, np.float32)
        t_sync = time.time()
        await comm.sync_shared_state(state)  # members: the group's first sync; the newcomer: its heal
        healed_at = time.time()
        step = (state.revision - 1) * h if newcomer else 0
        start = time.time()
        times: list[float] = []
        phases: list[tuple[float, float, float]] = []  # (vote, data plane, confirm) s of each all-reduce
        syncs: list[tuple[float, float]] = []  # (start, end) of the loop's syncs
        full_at: int | None = None  # the first step with the newcomer in the all-reduce
        while True:
            info = await comm.all_reduce(grad, op=ReduceOp.AVG)
            times.append(time.time())
            last = comm._last_phases  # (the benchmark's diagnosis: where an all-reduce's time went)
            phases.append((last.get("vote", 0.0), last.get("ring", 0.0), last.get("confirm", 0.0)))
            if full_at is None and info.local_world_size == cfg["members"] + 1:
                full_at = step
            step += 1
            if step == cfg["steps"] and not newcomer:
                print(json.dumps({"event": "ready"}), flush=True)  # the driver starts the newcomer
            if step % h == 0:
                await _admit(comm)  # as a training loop does before its sync (a newcomer's first call is one)
                state.push_revision()
                t = time.time()
                await comm.sync_shared_state(state)
                syncs.append((t, time.time()))
                if full_at is not None and step >= full_at + h:
                    break
        last = comm.statistics().get("heal_last") or {}
        print(json.dumps({"event": "result", "role": cfg["role"], "t_sync": t_sync, "healed_at": healed_at,
                          "start": start, "times": times, "phases": phases, "syncs": syncs, "hashed": hashed,
                          "revision": state.revision,
                          "hashes": [hashing.content_hash(a) for a in arrays],
                          "fetch_s": last.get("elapsed", 0.0) if newcomer else 0.0,
                          "rx": last.get("rx_bytes", 0) if newcomer else 0,
                          "served": comm.statistics().get("heal_served_bytes", 0)}), flush=True)


def _time_vote_hashing() -> list[tuple[float, float]]:
    """(start, end) of every vote's hashing pass of this process's syncs, from now on (a wrapper around
    ``pccl.peer.shared_state._entries``: the benchmark's diagnosis of where a sync's time goes)."""
    from pccl.peer import shared_state

    spans: list[tuple[float, float]] = []
    entries = shared_state._entries

    def timed(state: Any) -> Any:
        t = time.time()
        try:
            return entries(state)
        finally:
            spans.append((t, time.time()))

    shared_state._entries = timed
    return spans


def wan_training(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ``train`` case: the members alone, then with a newcomer healing (one run, one emulator)."""
    from pccl.testing.wan import LinkSpec, WanEmulator

    members = args.members
    hosts = members + 1
    script = str(Path(__file__).resolve().parent / "heal.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    uplink = LinkSpec(delay_ms=args.rtt_ms / 2, rate_mbit=args.donor_mbit, rtt_ms=args.rtt_ms)
    cpu = CpuSampler()
    with WanEmulator(hosts, prefix="healtrain") as wan:
        for a in range(hosts):
            for b in range(a + 1, hosts):
                wan.set_pair(a, b, rtt_ms=args.rtt_ms, rate_mbit=args.newcomer_mbit)
        for d in range(members):  # a member's uplink: one link for everything it sends
            wan.share_link([(d, x) for x in range(hosts) if x != d], uplink)
        log = tempfile.NamedTemporaryFile("w+", prefix="pccl-heal-master-", suffix=".log", delete=False)
        master = wan.popen(0, [sys.executable, "-m", "pccl", "master", "--host", wan.addresses[0],
                               "--port", str(MASTER_PORT)], stdout=subprocess.DEVNULL, stderr=log, env=env)
        cpu.watch("master", master.pid)
        if wan._proc is not None:
            cpu.watch("forwarder", wan._proc.pid)
        cpu.start()
        procs: dict[int, subprocess.Popen[str]] = {}
        errs: dict[int, Any] = {}
        lines: dict[int, list[dict[str, Any]]] = {h: [] for h in range(hosts)}
        try:
            if not wait_listening(master, Path(log.name)):
                raise RuntimeError("the master did not start")
            serve = args.serve_mbit * 1e6 / 8 if args.serve_mbit else None
            serve_idle = args.serve_idle_mbit * 1e6 / 8 if args.serve_idle_mbit else None

            def start(h: int) -> None:
                cfg = {"train": True, "master": f"{wan.addresses[0]}:{MASTER_PORT}", "members": members,
                       "state_mb": args.state_mb, "addr": wan.addresses[h],
                       "role": "newcomer" if h == members else "member",
                       "grad_mb": args.grad_mb, "sync_every": args.sync_every, "serve_rate": serve,
                       "serve_idle_rate": serve_idle,
                       "steps": args.train_steps}
                errs[h] = tempfile.TemporaryFile("w+")
                procs[h] = wan.popen(h, [sys.executable, script, "--child", json.dumps(cfg)],
                                     stdout=subprocess.PIPE, stderr=errs[h], text=True, env=env)
                follow_json_lines(procs[h], lines[h])
                cpu.watch("newcomer" if h == members else "members", procs[h].pid)

            for h in range(members):
                start(h)
            deadline = time.monotonic() + 120 + 6 * args.state_mb * 8 / (args.serve_mbit or args.donor_mbit)
            while not any(x["event"] == "ready" for x in lines[0]):  # the members ran ``--train-steps``
                if any(p.poll() is not None for p in procs.values()) or time.monotonic() > deadline:
                    raise RuntimeError(f"train run: the members did not get ready: {_tails(errs)}")
                time.sleep(0.1)  # the readers fill ``lines``
            ready_at = time.time()
            start(members)
            results = wait_for_results(
                procs, lines, list(procs), deadline,
                lambda dead: f"train run: no result from {dead or 'some (timeout)'}: {_tails(errs)}")
        finally:
            cpu.stop()
            end_processes(procs.values(), master)
            log.close()
            os.unlink(log.name)
            for f in errs.values():
                f.close()
    m0, new = results[0], results[members]
    # alone: member 0's steps after its first sync period (warm) until the newcomer was started
    a0 = m0["times"][args.sync_every - 1]
    alone = _window(m0, a0, ready_at)
    alone["cpu"] = cpu.cores(a0, ready_at)
    # heal: from the newcomer's call until it returned (healed and joined)
    heal = _window(m0, new["t_sync"], new["healed_at"])
    heal["cpu"] = cpu.cores(new["t_sync"], new["healed_at"])
    heal.update({"heal_s": new["healed_at"] - new["t_sync"], "fetch_s": new["fetch_s"],
                 "rx_mib": new["rx"] / MIB})
    ref = m0["hashes"]
    exact = all(r["hashes"] == ref for r in results.values())
    served = [round(results[d]["served"] / MIB, 1) for d in range(members)]
    for row, name in ((alone, "alone"), (heal, "heal")):
        row.update({"run": name, "exact": exact, "served_mib": served if name == "heal" else []})
    alone.update({"heal_s": 0.0, "fetch_s": 0.0, "rx_mib": 0.0})
    return [alone, heal]


def _window(m0: dict[str, Any], t0: float, t1: float) -> dict[str, Any]:
    """Member 0's steps completed in ``(t0, t1]``, the time its syncs took in it, its reduces' p50/p90."""
    steps = [t for t in m0["times"] if t0 < t <= t1]
    in_syncs = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in m0["syncs"])
    prev = [m0["start"], *m0["times"]]
    durs = sorted(t - p - sum(b - a for a, b in m0["syncs"] if p <= a < t)
                  for p, t in zip(prev, m0["times"], strict=False) if t0 < t <= t1)
    each = sorted(b - a for a, b in m0["syncs"] if t0 < b <= t1)  # the syncs that ended in the window
    hashing = sorted(b - a for a, b in m0["hashed"] if t0 < b <= t1)
    inside = [ph for t, ph in zip(m0["times"], m0["phases"], strict=True) if t0 < t <= t1]
    vote = sorted(v for v, _, _ in inside)
    ring = sorted(r for _, r, _ in inside)
    confirm = sorted(c for _, _, c in inside)
    return {"window_s": t1 - t0, "steps": len(steps), "steps_per_s": len(steps) / (t1 - t0),
            "sync_s": in_syncs, "syncs": len(each), "sync_median_s": each[len(each) // 2] if each else 0.0,
            "hash_median_s": hashing[len(hashing) // 2] if hashing else 0.0, "hash_passes": len(hashing),
            "reduce_median_s": durs[len(durs) // 2] if durs else 0.0,
            "reduce_p90_s": durs[len(durs) * 9 // 10] if durs else 0.0,
            "vote_median_s": vote[len(vote) // 2] if vote else 0.0,
            "ring_median_s": ring[len(ring) // 2] if ring else 0.0,
            "confirm_median_s": confirm[len(confirm) // 2] if confirm else 0.0}


def _tails(errs: dict[int, Any]) -> list[str]:
    out = []
    for f in errs.values():
        f.seek(0)
        out.append(str(f.read()[-800:]))
    return out


def print_training(args: argparse.Namespace, rows: list[dict[str, Any]], load: tuple[float, float]) -> None:
    alone = rows[0]["steps_per_s"]
    cap = f"{args.serve_mbit:g} Mbit/s" if args.serve_mbit else "none"
    if args.serve_mbit and args.serve_idle_mbit:
        cap += f" while its collectives run, {args.serve_idle_mbit:g} Mbit/s between them"
    print(f"members' training during a heal, WAN emulator (processes, wall seconds): {args.members} members, "
          f"all-reduce of {args.grad_mb} MiB, sync every {args.sync_every} steps, {args.state_mb} MiB state; "
          f"each member's uplink {args.donor_mbit:g} Mbit/s (shared by all it sends), newcomer "
          f"{args.newcomer_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms; serving cap per member {cap}; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    print(f"{'run':>6} {'window s':>8} {'steps':>6} {'steps/s':>8} {'x alone':>7} {'heal s':>7} "
          f"{'fetch s':>7} {'rx MiB':>7} {'served MiB':>18} {'in syncs s':>10} "
          f"{'syncs':>5} {'sync p50 s':>10} {'hash p50 s':>10} {'passes':>6} {'reduce p50/p90 s':>16} "
          f"{'exact':>5}")
    for r in rows:
        print(f"{r['run']:>6} {r['window_s']:>8.2f} {r['steps']:>6} {r['steps_per_s']:>8.2f} "
              f"{r['steps_per_s'] / alone if alone else 0.0:>7.2f} {r['heal_s']:>7.2f} {r['fetch_s']:>7.2f} "
              f"{r['rx_mib']:>7.1f} {r['served_mib']!s:>18} {r['sync_s']:>10.2f} {r['syncs']:>5} "
              f"{r['sync_median_s']:>10.3f} {r['hash_median_s']:>10.3f} {r['hash_passes']:>6} "
              f"{r['reduce_median_s']:>7.3f}/{r['reduce_p90_s']:<8.3f} {r['exact']!s:>5}")
    for r in rows:  # where the CPU went (the machine: every process on it, others' too)
        c = r.get("cpu") or {}
        if c:
            print(f"{r['run']:>6} CPU, cores: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(c.items()))
                  + f" (machine: of {os.cpu_count()}); all-reduce phases p50: vote "
                  f"{r['vote_median_s']:.3f} s, data plane {r['ring_median_s']:.3f} s, "
                  f"confirm {r['confirm_median_s']:.3f} s")
