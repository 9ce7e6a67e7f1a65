"""``python benchmarks/heal.py --wan --wan-cases diloco,diloco-ordinary``: DiLoCo's members while a newcomer
heals a state that changes entirely at every sync (issue 35 item 4, replay; docs/concepts.md "Replaying
the rounds missed"), on the WAN emulator.

``--members`` (3) processes run ``pccl.torch.AsyncDiLoCo`` (plain, SGD inner and outer) on one flat
parameter of ``--diloco-mb`` MiB (the shared state: it and its outer momentum, twice that), ``--inner``
inner steps per outer round (each a real backward and optimizer step of the parameter), for
``--diloco-rounds`` outer rounds; every outer step changes every byte of the state. After
``--diloco-ready`` rounds the driver starts a newcomer (other initial parameters), admitted before the
members' next sync, where it heals. ``diloco``: every peer sets ``replay_heals`` (the heal runs live: the
newcomer takes part in the members' outer all-reduces while it fetches, then replays them); ``diloco-
ordinary``: none does (the master keeps that sync ordinary: the members wait for the transfer). Each
member's uplink is one shared link of ``--donor-mbit`` (all it sends), RTT ``--rtt-ms``; the newcomer's
directions ``--newcomer-mbit``; each member serves at most ``--serve-mbit`` (``state_serve_rate``).

``streaming`` and ``streaming-ordinary``: the same with ``pccl.torch.AsyncStreamingDiLoCo`` (the parameter
cut into 4 fragments, one per parameter, sent at inner steps 0..3 of each cycle of ``--inner`` steps,
``overlap=1``, ``codec="int8"`` with error feedback, ``sync_every=1``), with and without ``replay_heals``
(an outer round is a cycle); the master evicts a peer after 10 s of silence instead of 3 (the members'
first cycle stalled their heartbeats on a loaded 2-core machine).

Printed per case: member 0's outer rounds per second before the newcomer started (alone, from its second
round), while it healed (the rounds that ended between the newcomer's first step call and its first
trained step, the heal window, each counted from the previous round's end) and after (the newcomer
contributing: the same ring of four as during the heal, where the newcomer takes part without
contributing), the ratios, the longest round that overlapped the heal window (a member held for the
transfer has one as long as the heal), the heal time (that window) and the fetch alone, the rounds the
newcomer replayed, whether every peer's shared state ended bit-identical, and the machine's load. Wall
seconds of real processes: the machine's load shows in them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _common import end_processes, follow_json_lines, wait_for_results, wait_listening

MIB = 1 << 20
MASTER_PORT = 29_454


async def diloco_peer(cfg: dict[str, Any]) -> None:
    """One member or the newcomer of a ``diloco`` run; prints JSON lines (joined, ready, result)."""
    import torch
    from torch import nn

    from pccl import PeerConfig, UpdateTopologyFailedError
    from pccl.kernels import hashing
    from pccl.peer.communicator import open_communicator
    from pccl.torch import AsyncDiLoCo, AsyncStreamingDiLoCo

    newcomer = cfg["role"] == "newcomer"
    streaming = cfg.get("streaming", False)
    parts = 4 if streaming else 1  # streaming: one fragment per parameter
    n = cfg["diloco_mb"] * MIB // 4 // parts
    gen = torch.Generator().manual_seed(1 if newcomer else 0)
    ws = [nn.Parameter(torch.randn(n, generator=gen)) for _ in range(parts)]
    model = nn.ParameterList(ws)
    target = torch.randn(n, generator=torch.Generator().manual_seed(7))
    conf = PeerConfig(p2p_listen_host=cfg["addr"], state_serve_rate=cfg.get("serve_rate"))
    async with open_communicator(cfg["master"], config=conf) as comm:
        print(json.dumps({"event": "joined", "pid": os.getpid()}), flush=True)
        while not newcomer and comm.world_size < cfg["members"]:
            if await comm.are_peers_pending():
                try:
                    await comm.update_topology()
                except UpdateTopologyFailedError:
                    pass
            await trio.sleep(0.01)  # polling the world size until the members are in, before the clock starts
        inner = torch.optim.SGD(model.parameters(), lr=0.01)

        def backward(step: Any) -> float:
            loss = torch.stack([((w - target) ** 2).mean() for w in ws]).sum()  # every element moves
            loss.backward()
            return float(loss.detach())

        rounds: list[float] = []  # end of each outer round (its last inner step applied)
        first_step: float | None = None
        async with trio.open_nursery() as nursery:
            diloco: Any
            if streaming:
                diloco = AsyncStreamingDiLoCo(comm, model, inner, nursery=nursery, inner_steps=cfg["inner"],
                                              fragments=parts, overlap=1, codec="int8",
                                              total_outer_steps=cfg["rounds"], replay_heals=cfg["replay"],
                                              just_joined=newcomer)
            else:
                diloco = AsyncDiLoCo(comm, model, inner, inner_steps=cfg["inner"],
                                     total_outer_steps=cfg["rounds"], nursery=nursery,
                                     replay_heals=cfg["replay"], just_joined=newcomer)
            t_start = time.time()
            while (r := await diloco.step(backward)) is not None:
                if first_step is None:
                    first_step = time.time()
                if r.index % cfg["inner"] == cfg["inner"] - 1:
                    rounds.append(time.time())
                    if not newcomer and len(rounds) == cfg["ready"]:
                        print(json.dumps({"event": "ready"}), flush=True)  # the driver starts the newcomer
            t_end = time.time()
            nursery.cancel_scope.cancel()
        state = diloco.shared.state
        last = comm.statistics().get("heal_last") or {}
        print(json.dumps({"event": "result", "role": cfg["role"], "t_start": t_start,
                          "first_step": first_step, "t_end": t_end, "rounds": rounds,
                          "revision": diloco.revision,
                          "replayed": diloco.core.rounds_replayed,
                          "hashes": [hashing.content_hash(i.tensor.detach().numpy())
                                     for i in state.tensor_infos],
                          "fetch_s": last.get("elapsed", 0.0) if newcomer else 0.0,
                          "rx": last.get("rx_bytes", 0) if newcomer else 0}), flush=True)


def wan_diloco(args: argparse.Namespace, replay: bool, streaming: bool = False) -> dict[str, Any]:
    """One ``diloco`` (``replay``) or ``diloco-ordinary`` run on a fresh emulator (``streaming``: the
    ``streaming`` cases)."""
    from pccl.testing.wan import LinkSpec, WanEmulator

    members = args.members
    hosts = members + 1
    script = str(Path(__file__).resolve().parent / "heal.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    uplink = LinkSpec(delay_ms=args.rtt_ms / 2, rate_mbit=args.donor_mbit, rtt_ms=args.rtt_ms)
    load0 = os.getloadavg()[0]
    with WanEmulator(hosts, prefix="healst" if streaming else "healdl") as wan:
        for a in range(hosts):
            for b in range(a + 1, hosts):
                wan.set_pair(a, b, rtt_ms=args.rtt_ms, rate_mbit=args.newcomer_mbit)
        for d in range(members):  # a member's uplink: one link for everything it sends
            wan.share_link([(d, x) for x in range(hosts) if x != d], uplink)
        log = tempfile.NamedTemporaryFile("w+", prefix="pccl-heal-master-", suffix=".log", delete=False)
        # streaming: the members' first cycle (hashing, deep copies, int8 encodings in the trio thread) went
        # silent for more than the default 3 s on the loaded 2-core machine in 2 of 4 runs: evicted at start
        patience = ["--heartbeat-timeout", "10"] if streaming else []
        master = wan.popen(0, [sys.executable, "-m", "pccl", "master", "--host", wan.addresses[0],
                               "--port", str(MASTER_PORT), *patience], stdout=subprocess.DEVNULL, stderr=log,
                           env=env)
        procs: dict[int, subprocess.Popen[str]] = {}
        errs: dict[int, Any] = {}
        lines: dict[int, list[dict[str, Any]]] = {h: [] for h in range(hosts)}
        try:
            if not wait_listening(master, Path(log.name)):
                raise RuntimeError("the master did not start")
            serve = args.serve_mbit * 1e6 / 8 if args.serve_mbit else None

            def start(h: int) -> None:
                cfg = {"diloco": True, "master": f"{wan.addresses[0]}:{MASTER_PORT}", "members": members,
                       "addr": wan.addresses[h], "role": "newcomer" if h == members else "member",
                       "diloco_mb": args.diloco_mb, "inner": args.inner, "rounds": args.diloco_rounds,
                       "ready": args.diloco_ready, "replay": replay, "serve_rate": serve,
                       "streaming": streaming}
                errs[h] = tempfile.TemporaryFile("w+")
                procs[h] = wan.popen(h, [sys.executable, script, "--child", json.dumps(cfg)],
                                     stdout=subprocess.PIPE, stderr=errs[h], text=True, env=env)
                follow_json_lines(procs[h], lines[h])

            for h in range(members):
                start(h)
            deadline = time.monotonic() + 420
            while not any(x["event"] == "ready" for x in lines[0]):
                if any(p.poll() is not None for p in procs.values()) or time.monotonic() > deadline:
                    raise RuntimeError(f"diloco run: the members did not get ready: {_tails(errs)}")
                time.sleep(0.1)  # the readers fill ``lines``
            start(members)
            results = wait_for_results(
                procs, lines, list(procs), deadline,
                lambda dead: f"diloco run: no result from {dead or 'some (timeout)'}: {_tails(errs)}; the "
                             f"master's log ends: {Path(log.name).read_text()[-1500:]}")
        finally:
            end_processes(procs.values(), master)
            log.close()
            os.unlink(log.name)
            for f in errs.values():
                f.close()
    m0, new = results[0], results[members]
    ends = m0["rounds"]
    if new["first_step"] is None:
        raise RuntimeError(f"the newcomer never trained (the run ended first: more --diloco-rounds): {new}")
    t0, t1 = new["t_start"], new["first_step"]
    alone = [b - a for a, b in itertools.pairwise(ends) if b <= t0]
    # the rounds that ended in the heal window, each from the previous round's end (its whole length)
    during = [b - a for a, b in itertools.pairwise(ends) if t0 < b <= t1]
    after = [b - a for a, b in itertools.pairwise(ends) if a >= t1]  # the same ring, all contributing
    alone_rate = len(alone) / sum(alone) if alone else 0.0
    after_rate = len(after) / sum(after) if after else 0.0
    heal_rate = len(during) / sum(during) if during else 0.0
    longest = max((b - a for a, b in itertools.pairwise(ends) if b > t0 and a < t1), default=0.0)
    exact = all(r["hashes"] == m0["hashes"] for r in results.values())
    case = ("streaming" if streaming else "diloco") + ("" if replay else "-ordinary")
    return {"case": case, "alone_rounds_per_s": alone_rate,
            "heal_rounds_per_s": heal_rate, "ratio": heal_rate / alone_rate if alone_rate else 0.0,
            "after_rounds_per_s": after_rate, "longest_round_s": longest,
            "rounds_s": [round(b - a, 2) for a, b in itertools.pairwise(ends)],
            "window": (round(t0 - ends[0], 2), round(t1 - ends[0], 2)),
            "rounds_during": len(during), "heal_s": t1 - t0, "fetch_s": new["fetch_s"],
            "rx_mib": new["rx"] / MIB,
            "replayed": new["replayed"], "exact": exact, "revision": m0["revision"],
            "load": (load0, os.getloadavg()[0])}


def _tails(errs: dict[int, Any]) -> list[str]:
    out = []
    for f in errs.values():
        f.seek(0)
        out.append(str(f.read()[-800:]))
    return out


def print_diloco(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    cap = f"{args.serve_mbit:g} Mbit/s" if args.serve_mbit else "none"
    print(f"DiLoCo members while a newcomer heals, WAN emulator (processes, wall seconds): {args.members} "
          f"members, {args.diloco_mb} MiB parameters ({2 * args.diloco_mb} MiB shared state, every byte "
          f"changed by every outer step), {args.inner} inner steps per outer round; each member's uplink "
          f"{args.donor_mbit:g} Mbit/s (shared by all it sends), newcomer {args.newcomer_mbit:g} Mbit/s, "
          f"RTT {args.rtt_ms:g} ms; serving cap per member {cap}; {os.cpu_count()} CPUs")
    print(f"{'case':>18} {'alone rnd/s':>11} {'heal rnd/s':>10} {'x alone':>7} {'after rnd/s':>11} "
          f"{'heal x after':>12} {'longest rnd s':>13} {'rounds in heal':>14} "
          f"{'heal s':>7} {'fetch s':>7} {'rx MiB':>7} {'replayed':>8} {'exact':>5} {'load start/end':>14}")
    for r in rows:
        print(f"{r['case']:>18} {r['alone_rounds_per_s']:>11.3f} {r['heal_rounds_per_s']:>10.3f} "
              f"{r['ratio']:>7.2f} {r['after_rounds_per_s']:>11.3f} "
              f"{r['heal_rounds_per_s'] / (r['after_rounds_per_s'] or float('inf')):>12.2f} "
              f"{r['longest_round_s']:>13.2f} {r['rounds_during']:>14} {r['heal_s']:>7.2f} "
              f"{r['fetch_s']:>7.2f} "
              f"{r['rx_mib']:>7.1f} {r['replayed']:>8} {r['exact']!s:>5} "
              f"{r['load'][0]:>6.1f}/{r['load'][1]:<6.1f}")
    for r in rows:
        print(f"  {r['case']}: member 0's rounds, s: {r['rounds_s']}; the heal window from its first round's "
              f"end: {r['window'][0]:.2f}-{r['window'][1]:.2f} s")
