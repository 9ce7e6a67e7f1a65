"""Swarm heal (issue 35): a newcomer fetches a shared state from 1, 2 and 3 donors (virtual network, --wan).

The state: ``--state-mb`` MiB of float32 (default 256: one tensor of three quarters of it, 192 MiB, plus
four equal smaller ones). Donors hold random content, the newcomer zeros. Every donor -> newcomer link
has ``--donor-mbit`` Mbit/s (default 100, the donor's uplink: it sends to nobody else) and a one-way
delay of half ``--rtt-ms`` (default 50 ms RTT); the newcomer's 1 Gbit/s downlink is not modelled (three
donors at 100 Mbit/s stay below it).

This runs on :class:`pccl.testing.VirtualNetwork` under trio's MockClock: the heal time printed is
**virtual** time of the newcomer's whole ``sync_shared_state()`` call, what the network model takes
(bandwidth, delay, a 4 MiB window per connection); CPU time (hashing, copies) is not in it (hashing
runs inline here, not in worker threads, so that it cannot let virtual time jump). The project's WAN
emulator (``pccl.testing.wan``: network namespaces, root) is not used here. Wall seconds are printed
too (this process simulating every byte).

Cases: 1, 2, 3 donors; 3 donors of which one has a quarter of the others' rate (its share follows its
speed, and it does not hold the tail: compare with 2 donors); 3 donors with one killed at 50% of the
transfer (bytes fetched twice, the heal still completes, no member's call fails); 3 donors with one that
corrupts every chunk it sends (the chunks are re-fetched, the donor excluded). Each case checks the
newcomer's state bit-identical to the donors'.

``--wan``: the same cases on the project's WAN emulator (:mod:`pccl.testing.wan`; root only), in real
time with real processes: a fresh emulator per case (namespaces ``healops-<pid>-<i>``), one host per
donor and one for the newcomer (the last), the master on host 0 beside the first donor. Every donor ->
newcomer direction is capped at ``--donor-mbit`` (the donor's uplink); the newcomer -> donor directions
and those between donors at ``--newcomer-mbit`` (default 1000: the newcomer's downlink is no bottleneck
for three 100 Mbit/s donors, so each donor's direction carries its own cap); RTT ``--rtt-ms``
everywhere, queues of one bandwidth-delay product. The heal time is the newcomer's whole
``sync_shared_state()`` call in wall seconds (the donors vote first; "fetch s": its fetch alone, from the
plan's arrival, without hashing its own state for the vote and the apply). "kill": the newcomer SIGKILLs the
last donor's process when half of its bytes are in; "corrupt": the last donor flips a bit in the first
chunk it serves (one chunk). Each case checks the newcomer's tensors bit-identical to every donor's and
that no surviving member's call failed. ``--wan-cases`` picks cases (1,2,3,kill,corrupt; and train: the
members' training during a heal, with each member's uplink one shared link, benchmarks/_heal_training_wan.py;
``--serve-mbit`` caps each member's serving; diloco and diloco-ordinary: DiLoCo's members while a newcomer
heals a state that every outer step changes entirely, with and without ``replay_heals``,
benchmarks/_heal_diloco_wan.py).

usage: python benchmarks/heal.py [--state-mb 256] [--donor-mbit 100] [--rtt-ms 50] [--json]
       sudo python benchmarks/heal.py --wan [--wan-cases 1,2,3,kill,corrupt] [--state-mb 256]

``--training`` (issue 35 item 4) measures instead the members' training during a heal: ``--members`` (3)
peers loop {all-reduce of ``--grad-mb`` MiB; every ``--sync-every`` steps push the revision and sync}
(the shared state unchanged between syncs, as in DiLoCo's inner steps); after their first step a newcomer
joins (admitted before a sync, which its own sync joins) and heals the state from them; every link
(member <-> member and donor -> newcomer) has ``--donor-mbit`` and half the RTT.
Printed: the members' all-reduces per virtual second while the newcomer heals, against the same loop
with no newcomer, for live heals (``MasterConfig.live_heal_rounds=1``) and without (the members wait in
the sync); with ``--changing`` also the same where each sync follows a change of every byte of the state
(DiLoCo's outer step, data-parallel), where the newcomer's last difference moves in an ordinary sync
(docs/concepts.md "Live heals"). The virtual network models each directed pair of hosts as its own
link: a donor's serving does not take bandwidth from its collectives here (what
``PeerConfig.state_serve_rate`` bounds on a real uplink is not measured by this mode).

usage: python benchmarks/heal.py --training [--state-mb 256] [--grad-mb 4] [--members 3] [--sync-every 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio
import trio.testing
from _common import end_processes, follow_json_lines, wait_for_results, wait_listening

from pccl.peer import heal
from pccl.peer import shared_state as ss
from pccl.peer.shared_state import SharedState, TensorInfo
from pccl.testing import DEFAULT_MASTER_CONFIG, VirtualNetwork, open_test_cluster

MIB = 1 << 20


def _arrays(state_mb: int, fill: str) -> list[np.ndarray]:
    total = state_mb * MIB // 4
    big = total * 3 // 4
    sizes = [big] + [(total - big) // 4] * 4
    rng = np.random.default_rng(7)
    return [rng.random(n, dtype=np.float32) if fill == "random" else np.zeros(n, np.float32) for n in sizes]


def _state(arrays: list[np.ndarray]) -> SharedState:
    return SharedState([TensorInfo.from_numpy(a, f"t{i}") for i, a in enumerate(arrays)], revision=1)


async def _case(args: argparse.Namespace, donors: int, fault: str) -> dict[str, Any]:
    net = VirtualNetwork()
    async with open_test_cluster(donors + 1, network=net) as cluster:
        newcomer = donors
        for d in range(donors):
            mbit = args.donor_mbit / 4 if fault == "slow" and d == donors - 1 else args.donor_mbit
            net.set_link(cluster.host(d), cluster.host(newcomer), bandwidth=mbit * 1e6 / 8,
                         latency=args.rtt_ms / 2000)
        content = _arrays(args.state_mb, "random")
        states = {d: _state([a.copy() for a in content]) for d in range(donors)}
        states[newcomer] = _state(_arrays(args.state_mb, "zeros"))
        total = sum(a.nbytes for a in content)
        killed: list[float] = []
        restore = ss.chunk_bytes
        if fault == "corrupt":
            liar = states[donors - 1]

            def lying(ctx: ss.SyncContext, info: TensorInfo, offset: int, nbytes: int) -> memoryview:
                data = restore(ctx, info, offset, nbytes)
                if ctx.state is not liar or nbytes == 0:
                    return data
                bad = bytearray(data)
                bad[0] ^= 1
                return memoryview(bytes(bad))

            ss.chunk_bytes = lying  # type: ignore[assignment]

        def on_progress(done: int, total_: int) -> None:
            if fault == "kill" and not killed and done >= total_ // 2:
                killed.append(done)
                cluster.kill(donors - 1)

        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            comm = cluster.peer(i)
            try:
                results[i] = await comm.sync_shared_state(
                    states[i], progress=on_progress if i == newcomer else None)
            except Exception as exc:
                results[i] = exc

        t0 = trio.current_time()
        w0 = time.perf_counter()
        try:
            async with trio.open_nursery() as nursery:
                for i in states:
                    nursery.start_soon(one, i)
        finally:
            ss.chunk_bytes = restore  # type: ignore[assignment]
        virtual = trio.current_time() - t0
        wall = time.perf_counter() - w0
        exact = all(a.tensor.tobytes() == b.tobytes()
                    for a, b in zip(states[newcomer].tensor_infos, content, strict=True))
        st = cluster.peer(newcomer).statistics()
        last = st["heal_last"] or {}
        # the killed donor's own call ends with it; every other call must succeed
        failed_calls = [i for i, r in results.items()
                        if isinstance(r, Exception) and not (fault == "kill" and i == donors - 1)]
        return {
            "donors": donors, "fault": fault or "-", "state_mib": total / MIB, "heal_s": virtual,
            "wall_s": wall, "exact": exact, "failed_calls": failed_calls,
            "rx_mib": last.get("rx_bytes", 0) / MIB,
            "twice_mib": (last.get("rx_bytes", 0) - total) / MIB,
            "per_donor_mib": [round(v / MIB, 1) for v in last.get("donors", {}).values()],
            "excluded": len(last.get("donors_excluded", {})),
            "failed_donors": len(last.get("donors_failed", {})),
        }


async def _training_case(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One ``--training`` run: ``mode`` "alone" (no newcomer), "live" or "blocking" (a newcomer heals);
    a "changing" prefix: every sync follows a change of every byte of the state. The members run first
    (their first sync and a step); the newcomer then joins the running group (admitted by the members
    before a sync, which its own sync joins): the case live heals are for."""
    net = VirtualNetwork()
    changing = mode.startswith("changing ")
    mode = mode.removeprefix("changing ")
    members = args.members
    cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, live_heal_rounds=1 if mode == "live" else 0)
    bandwidth, latency = args.donor_mbit * 1e6 / 8, args.rtt_ms / 2000

    def links(cluster: Any, n: int) -> None:
        for a in range(n):
            for b in range(n):
                if a != b:
                    net.set_link(cluster.host(a), cluster.host(b), bandwidth=bandwidth, latency=latency,
                                 oneway=True)

    async with open_test_cluster(members, network=net, master_config=cfg) as cluster:
        links(cluster, members)
        content = _arrays(args.state_mb, "random")
        states = {i: _state([a.copy() for a in content]) for i in range(members)}
        newcomer_state = _state(_arrays(args.state_mb, "zeros"))
        h = args.sync_every
        last = 1 + args.train_steps // h  # the revision the loop ends at (a newcomer may move it on)
        stop = {"rev": last}
        done: dict[int, list[float]] = {i: [] for i in range(members + 1)}
        healed: list[float] = []
        began: list[float] = []  # when the newcomer's sync call began
        stepped = trio.Event()

        async def loop(i: int, first_step: int) -> None:
            comm = cluster.peer(i)
            grad = np.ones(args.grad_mb * MIB // 4, np.float32)
            step = first_step
            while True:
                await comm.all_reduce(grad)
                done[i].append(trio.current_time())
                stepped.set()
                step += 1
                if step % h == 0:
                    if changing:  # an outer step: every parameter moves (DiLoCo, data-parallel)
                        for info in states[i].tensor_infos:
                            info.tensor += np.float32(1.0)
                    if await comm.are_peers_pending():  # admit a newcomer before the sync it joins
                        await comm.update_topology()
                    states[i].push_revision()
                    await comm.sync_shared_state(states[i])
                    if states[i].revision >= stop["rev"] and (mode == "alone" or healed):
                        return

        async def member(i: int) -> None:
            await cluster.peer(i).sync_shared_state(states[i])
            await loop(i, 0)

        async def newcomer() -> None:
            await stepped.wait()  # the group runs
            i = await cluster.add_peer(admit=False)
            links(cluster, members + 1)
            states[i] = newcomer_state
            began.append(trio.current_time())
            await cluster.peer(i).sync_shared_state(states[i])
            healed.append(trio.current_time())
            rev = states[i].revision
            stop["rev"] = max(stop["rev"], rev + 1)  # everyone runs one more sync period with it
            await loop(i, (rev - 1) * h)

        w0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(members):
                nursery.start_soon(member, i)
            if mode != "alone":
                nursery.start_soon(newcomer)
        wall = time.perf_counter() - w0
        t0 = began[0] if began else done[0][0]
        end = healed[0] if healed else max(done[0])
        during = [t for t in done[0] if t0 < t <= end]
        ref = states[0].tensor_infos
        exact = all(a.tensor.tobytes() == b.tensor.tobytes() for s in states.values()
                    for a, b in zip(s.tensor_infos, ref, strict=True))
        fetched = cluster.peer(members).statistics()["heal_last"] if mode != "alone" else None
        return {"mode": ("changing " if changing else "") + mode,
                "heal_s": (healed[0] - t0) if healed else 0.0, "window_s": end - t0,
                "fetch_s": fetched["elapsed"] if fetched else 0.0,
                "steps_in_window": len(during), "steps_per_s": len(during) / (end - t0),
                "steps": len(done[0]), "exact": exact, "wall_s": wall,
                "live_heals": cluster.master.state.statistics()["heals"]["started"]}


async def _training(args: argparse.Namespace) -> list[dict[str, Any]]:
    modes = ["alone", "live", "blocking"]
    if args.changing:
        modes += ["changing alone", "changing live", "changing blocking"]
    return [await _training_case(args, mode) for mode in modes]


def _print_training(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    bases = {r["mode"].startswith("changing"): r["steps_per_s"] for r in rows if r["mode"].endswith("alone")}
    print(f"members' training during a heal, virtual network: {args.members} members, all-reduce of "
          f"{args.grad_mb} MiB, sync every {args.sync_every} steps, {args.state_mb} MiB state, links "
          f"{args.donor_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms (virtual seconds)")
    print("fetch s: the newcomer's transfer; heal s: its whole sync_shared_state call (live: until it "
          "joins at the members' next sync); steps: the members' all-reduces meanwhile")
    print(f"{'mode':>17} {'fetch s':>7} {'heal s':>7} {'window s':>8} {'steps':>6} {'steps/s':>8} "
          f"{'x alone':>7} {'exact':>5} {'wall s':>7}")
    for r in rows:
        print(f"{r['mode']:>17} {r['fetch_s']:>7.2f} {r['heal_s']:>7.2f} {r['window_s']:>8.2f} "
              f"{r['steps_in_window']:>6} {r['steps_per_s']:>8.2f} "
              f"{r['steps_per_s'] / bases[r['mode'].startswith('changing')]:>7.2f} "
              f"{r['exact']!s:>5} {r['wall_s']:>7.1f}")


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for donors, fault in ((1, ""), (2, ""), (3, ""), (3, "slow"), (3, "kill"), (3, "corrupt")):
        rows.append(await _case(args, donors, fault))
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _wan_child(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=int, default=256)
    p.add_argument("--donor-mbit", type=float, default=100.0)
    p.add_argument("--newcomer-mbit", type=float, default=1000.0)
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--training", action="store_true", help="members' steps per second during a heal")
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--grad-mb", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--train-steps", type=int, default=40, help="steps of the loop without a newcomer")
    p.add_argument("--changing", action="store_true",
                   help="also the runs where every sync follows a change of every byte (DiLoCo's outer step)")
    p.add_argument("--wan", action="store_true", help="on the WAN emulator (root), real processes")
    p.add_argument("--wan-cases", default="1,2,3,kill,corrupt",
                   help="cases of --wan: 1,2,3,kill,corrupt, train (the members' training during a heal), "
                        "diloco and diloco-ordinary (DiLoCo's members during a heal, with and without "
                        "replay_heals: benchmarks/_heal_diloco_wan.py), streaming and streaming-ordinary "
                        "(the same with streaming DiLoCo)")
    p.add_argument("--diloco-mb", type=int, default=16, help="--wan diloco: MiB of parameters")
    p.add_argument("--inner", type=int, default=5, help="--wan diloco: inner steps per outer round")
    p.add_argument("--diloco-rounds", type=int, default=16, help="--wan diloco: outer rounds of the run")
    p.add_argument("--diloco-ready", type=int, default=4,
                   help="--wan diloco: outer rounds before the newcomer is started")
    p.add_argument("--serve-mbit", type=float, default=None,
                   help="--wan train: each member's serving cap (PeerConfig.state_serve_rate), Mbit/s")
    p.add_argument("--serve-idle-mbit", type=float, default=None,
                   help="--wan train: each member's serving cap between its collectives' data planes "
                        "(PeerConfig.state_serve_idle_rate; --serve-mbit then holds while one runs), Mbit/s")
    args = p.parse_args()
    if args.wan:
        _wan_main(args)
        return
    # Hash inline, never in a worker thread: under the autojump clock a thread's CPU time would let
    # virtual time jump (to the next timeout), which is not what the network takes.
    ss._HASH_IN_THREAD_BYTES = 1 << 62
    heal.VERIFY_IN_THREAD_BYTES = 1 << 62  # (the fetch's chunk verification too)
    if args.training:
        trows = trio.run(_training, args, clock=trio.testing.MockClock(autojump_threshold=0))
        if args.json:
            print(json.dumps(trows, indent=1))
        else:
            _print_training(args, trows)
        return
    rows = trio.run(_main, args, clock=trio.testing.MockClock(autojump_threshold=0))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    one = rows[0]["heal_s"]
    print(f"swarm heal, virtual network: {args.state_mb} MiB float32, donors' links "
          f"{args.donor_mbit:g} Mbit/s, RTT {args.rtt_ms:g} ms (virtual seconds)")
    print(f"{'donors':>6} {'fault':>8} {'heal s':>8} {'x 1-donor':>9} {'fetched twice MiB':>17} "
          f"{'per donor MiB':>22} {'excl':>4} {'exact':>5} {'failed calls':>12} {'wall s':>7}")
    for r in rows:
        print(f"{r['donors']:>6} {r['fault']:>8} {r['heal_s']:>8.2f} {r['heal_s'] / one:>9.2f} "
              f"{r['twice_mib']:>17.1f} {r['per_donor_mib']!s:>22} {r['excluded']:>4} {r['exact']!s:>5} "
              f"{r['failed_calls']!s:>12} {r['wall_s']:>7.1f}")


# ----------------------------------------------------------------------------------------------
# --wan: real processes on the WAN emulator

MASTER_PORT = 29_450


def _wan_child(cfg: dict[str, Any]) -> None:
    """A donor or the newcomer, in its host's namespace: join, wait for the whole group, sync once,
    print a JSON result line (and, the newcomer, SIGKILL a donor at half of the bytes if asked)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    if cfg.get("diloco"):  # the ``diloco`` cases (benchmarks/_heal_diloco_wan.py)
        from _heal_diloco_wan import diloco_peer

        trio.run(diloco_peer, cfg)
        return
    if cfg.get("train"):  # the ``train`` case (benchmarks/_heal_training_wan.py)
        from _heal_training_wan import train_peer

        arrays = _arrays(cfg["state_mb"], "zeros" if cfg["role"] == "newcomer" else "random")
        trio.run(train_peer, cfg, arrays, _state(arrays))
        return
    trio.run(_wan_peer, cfg)


async def _wan_peer(cfg: dict[str, Any]) -> None:
    from pccl import PeerConfig, UpdateTopologyFailedError
    from pccl.kernels import hashing
    from pccl.peer.communicator import open_communicator

    newcomer = cfg["role"] == "newcomer"
    arrays = _arrays(cfg["state_mb"], "zeros" if newcomer else "random")
    state = _state(arrays)
    if cfg.get("corrupt"):
        honest = ss.chunk_bytes
        spoiled: list[int] = []

        def lying(ctx: ss.SyncContext, info: TensorInfo, offset: int, nbytes: int) -> memoryview:
            data = honest(ctx, info, offset, nbytes)
            if spoiled or nbytes == 0:
                return data
            spoiled.append(offset)
            bad = bytearray(data)
            bad[nbytes // 2] ^= 0x01
            return memoryview(bytes(bad))

        ss.chunk_bytes = lying  # type: ignore[assignment]
    total = sum(a.nbytes for a in arrays)
    killed: list[float] = []

    def on_progress(done: int, total_: int) -> None:
        if cfg.get("kill_pid") and not killed and done >= total_ // 2:
            killed.append(done)
            os.kill(cfg["kill_pid"], signal.SIGKILL)
            print(json.dumps({"event": "killed", "at": done}), flush=True)

    async with open_communicator(cfg["master"], config=PeerConfig(p2p_listen_host=cfg["addr"])) as comm:
        print(json.dumps({"event": "joined", "pid": os.getpid()}), flush=True)
        while comm.world_size < cfg["world"]:
            if await comm.are_peers_pending():
                try:
                    await comm.update_topology()
                except UpdateTopologyFailedError:
                    pass
            await trio.sleep(0.01)
        t0 = time.perf_counter()
        error = ""
        try:
            await comm.sync_shared_state(state, progress=on_progress if newcomer else None)
        except Exception as exc:  # reported, not raised: the driver checks every member's call
            error = f"{type(exc).__name__}: {exc}"
        heal_s = time.perf_counter() - t0
        last = comm.statistics().get("heal_last") or {}
        hashes = [hashing.content_hash(a) for a in arrays]
        print(json.dumps({"event": "result", "role": cfg["role"], "error": error, "heal_s": heal_s,
                          "hashes": hashes, "total": total, "rx": last.get("rx_bytes", 0),
                          "donors": {str(k): v for k, v in last.get("donors", {}).items()},
                          "failed": len(last.get("donors_failed", {})),
                          "excluded": len(last.get("donors_excluded", {})),
                          "bad": last.get("bad_bytes", 0), "stolen": last.get("stolen", 0),
                          "fetch_s": last.get("elapsed", 0.0),
                          "killed_at": killed[0] if killed else None}), flush=True)
        if not newcomer:
            # stay a member until the driver has the newcomer's result (a donor leaving at once would
            # be a lost peer in the newcomer's next steps; the driver ends us)
            await trio.sleep_forever()


def _wan_case(args: argparse.Namespace, donors: int, fault: str) -> dict[str, Any]:
    from pccl.testing.wan import WanEmulator

    hosts = donors + 1
    nc = donors  # the newcomer's host
    script = str(Path(__file__).resolve())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with WanEmulator(hosts, prefix="healops") as wan:
        for a in range(hosts):
            for b in range(a + 1, hosts):
                wan.set_pair(a, b, rtt_ms=args.rtt_ms, rate_mbit=args.newcomer_mbit)
        for d in range(donors):
            wan.set_pair(d, nc, rtt_ms=args.rtt_ms, rate_mbit=args.newcomer_mbit)
            wan.set_link(d, nc, _link(args, args.donor_mbit))  # the donor's uplink
        log = tempfile.NamedTemporaryFile("w+", prefix="pccl-heal-master-", suffix=".log", delete=False)
        master = wan.popen(0, [sys.executable, "-m", "pccl", "master", "--host", wan.addresses[0],
                               "--port", str(MASTER_PORT)], stdout=subprocess.DEVNULL, stderr=log, env=env)
        procs: dict[int, subprocess.Popen[str]] = {}
        errs: dict[int, Any] = {}
        lines: dict[int, list[dict[str, Any]]] = {}
        try:
            if not wait_listening(master, Path(log.name)):
                raise RuntimeError("the master did not start")
            base = {"master": f"{wan.addresses[0]}:{MASTER_PORT}", "world": hosts, "state_mb": args.state_mb}
            pids: dict[int, int] = {}
            for h in range(hosts):
                cfg = {**base, "addr": wan.addresses[h], "role": "newcomer" if h == nc else "donor",
                       "corrupt": fault == "corrupt" and h == donors - 1,
                       "kill_pid": pids.get(donors - 1) if fault == "kill" and h == nc else None}
                errs[h] = tempfile.TemporaryFile("w+")  # (a pipe nobody drains could block the child)
                p = wan.popen(h, [sys.executable, script, "--child", json.dumps(cfg)], stdout=subprocess.PIPE,
                              stderr=errs[h], text=True, env=env)
                procs[h] = p
                assert p.stdout is not None
                first = p.stdout.readline()
                if "joined" not in first:
                    raise RuntimeError(f"host {h} did not join: {_tail(errs[h])}")
                pids[h] = json.loads(first)["pid"]
                lines[h] = []

            for h in procs:
                follow_json_lines(procs[h], lines[h])
            budget = 120 + 4 * args.state_mb * 8 / args.donor_mbit
            deadline = time.monotonic() + budget
            expect = [h for h in range(hosts) if not (fault == "kill" and h == donors - 1)]
            results = wait_for_results(
                procs, lines, expect, deadline,
                lambda dead: f"case {donors}/{fault or '-'}: no result from hosts "
                             f"{dead or 'some (timeout)'}: {[_tail(errs[h]) for h in dead]}")
        finally:
            end_processes(procs.values(), master)
            log.close()
            os.unlink(log.name)
            for f in errs.values():
                f.close()
    new = results[nc]
    exact = all(r["hashes"] == new["hashes"] for h, r in results.items() if h != nc)
    failed = [h for h, r in results.items() if r["error"]]
    return {"donors": donors, "fault": fault or "-", "heal_s": new["heal_s"], "fetch_s": new["fetch_s"],
            "exact": exact,
            "failed_calls": failed, "errors": {h: results[h]["error"] for h in failed},
            "rx_mib": new["rx"] / MIB, "twice_mib": (new["rx"] - new["total"]) / MIB,
            "per_donor_mib": [round(v / MIB, 1) for v in new["donors"].values()],
            "excluded": new["excluded"], "failed_donors": new["failed"], "bad_mib": new["bad"] / MIB,
            "stolen": new["stolen"], "killed_at_mib": (new["killed_at"] or 0) / MIB}


def _tail(f: Any) -> str:
    f.seek(0)
    return str(f.read()[-1500:])


def _link(args: argparse.Namespace, mbit: float) -> Any:
    from pccl.testing.wan import LinkSpec

    return LinkSpec(delay_ms=args.rtt_ms / 2, rate_mbit=mbit, rtt_ms=args.rtt_ms)


def _wan_main(args: argparse.Namespace) -> None:
    from pccl.testing.wan import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return
    load = os.getloadavg()
    names = args.wan_cases.split(",")
    dl = [c for c in names if c in ("diloco", "diloco-ordinary", "streaming", "streaming-ordinary")]
    if dl:
        from _heal_diloco_wan import print_diloco, wan_diloco

        drows = [wan_diloco(args, replay=not c.endswith("-ordinary"), streaming=c.startswith("streaming"))
                 for c in dl]
        if args.json:
            print(json.dumps(drows, indent=1))
        else:
            print_diloco(args, drows)
        names = [c for c in names if c not in dl]
        if not names:
            return
        load = os.getloadavg()
    if "train" in names:
        from _heal_training_wan import print_training, wan_training

        trows = wan_training(args)
        if args.json:
            print(json.dumps(trows, indent=1))
        else:
            print_training(args, trows, (load[0], os.getloadavg()[0]))
        names.remove("train")
        if not names:
            return
        load = os.getloadavg()
    cases = {"1": (1, ""), "2": (2, ""), "3": (3, ""), "kill": (3, "kill"), "corrupt": (3, "corrupt")}
    rows = [_wan_case(args, *cases[c]) for c in names]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    one = next((r["heal_s"] for r in rows if r["donors"] == 1 and r["fault"] == "-"), None)
    print(f"swarm heal, WAN emulator (processes, wall seconds): {args.state_mb} MiB float32, donors' "
          f"uplinks {args.donor_mbit:g} Mbit/s, other directions {args.newcomer_mbit:g} Mbit/s, RTT "
          f"{args.rtt_ms:g} ms; {os.cpu_count()} CPUs, load average {load[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"{'donors':>6} {'fault':>8} {'heal s':>8} {'x 1-donor':>9} {'fetch s':>8} "
          f"{'fetched twice MiB':>17} {'per donor MiB':>22} {'lost':>4} {'excl':>4} {'bad MiB':>7} "
          f"{'exact':>5} {'failed calls':>12}")
    for r in rows:
        ratio = f"{r['heal_s'] / one:.2f}" if one else "-"
        print(f"{r['donors']:>6} {r['fault']:>8} {r['heal_s']:>8.2f} {ratio:>9} {r['fetch_s']:>8.2f} "
              f"{r['twice_mib']:>17.1f} "
              f"{r['per_donor_mib']!s:>22} {r['failed_donors']:>4} {r['excluded']:>4} {r['bad_mib']:>7.1f} "
              f"{r['exact']!s:>5} {r['failed_calls']!s:>12}")
    for r in rows:  # a failed call says why (the table's columns cannot)
        for host, error in r.get("errors", {}).items():
            print(f"  {r['donors']} donor(s), {r['fault']}: host {host}'s call failed: {error}")


if __name__ == "__main__":
    main()
