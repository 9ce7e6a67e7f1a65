"""Swarm heal (issue 35): a newcomer fetches a shared state from 1, 2 and 3 donors, on the virtual network.

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

usage: python benchmarks/heal.py [--state-mb 256] [--donor-mbit 100] [--rtt-ms 50] [--json]

``--training`` (issue 35 item 4) measures instead the members' training during a heal: ``--members`` (3)
peers loop {all-reduce of ``--grad-mb`` MiB; every ``--sync-every`` steps push the revision and sync}
(the shared state unchanged between syncs, as in DiLoCo's inner steps) while a newcomer heals the state
from them; every link (member <-> member and donor -> newcomer) has ``--donor-mbit`` and half the RTT.
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
import time
from typing import Any

import numpy as np
import trio
import trio.testing

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
    a "changing" prefix: every sync follows a change of every byte of the state."""
    net = VirtualNetwork()
    changing = mode.startswith("changing ")
    mode = mode.removeprefix("changing ")
    members = args.members
    n = members + (mode != "alone")
    cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, live_heal_rounds=1 if mode == "live" else 0)
    async with open_test_cluster(n, network=net, master_config=cfg) as cluster:
        for a in range(n):
            for b in range(n):
                if a != b:
                    net.set_link(cluster.host(a), cluster.host(b), bandwidth=args.donor_mbit * 1e6 / 8,
                                 latency=args.rtt_ms / 2000, oneway=True)
        content = _arrays(args.state_mb, "random")
        states = {i: _state([a.copy() for a in content]) for i in range(members)}
        if mode != "alone":
            states[members] = _state(_arrays(args.state_mb, "zeros"))
        h = args.sync_every
        last = 1 + args.train_steps // h  # the revision the loop ends at (a newcomer may move it on)
        stop = {"rev": last}
        done: dict[int, list[float]] = {i: [] for i in states}
        healed: list[float] = []

        async def loop(i: int, first_step: int) -> None:
            comm = cluster.peer(i)
            grad = np.ones(args.grad_mb * MIB // 4, np.float32)
            step = first_step
            while True:
                await comm.all_reduce(grad)
                done[i].append(trio.current_time())
                step += 1
                if step % h == 0:
                    if changing:  # an outer step: every parameter moves (DiLoCo, data-parallel)
                        for info in states[i].tensor_infos:
                            info.tensor += np.float32(1.0)
                    states[i].push_revision()
                    await comm.sync_shared_state(states[i])
                    if states[i].revision >= stop["rev"]:
                        return

        async def member(i: int) -> None:
            await cluster.peer(i).sync_shared_state(states[i])
            await loop(i, 0)

        async def newcomer(i: int) -> None:
            await cluster.peer(i).sync_shared_state(states[i])
            healed.append(trio.current_time())
            rev = states[i].revision
            stop["rev"] = max(stop["rev"], rev + 1)  # everyone runs one more sync period with it
            await loop(i, (rev - 1) * h)

        t0 = trio.current_time()
        w0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(members):
                nursery.start_soon(member, i)
            if mode != "alone":
                nursery.start_soon(newcomer, members)
        wall = time.perf_counter() - w0
        end = healed[0] if healed else max(done[0])
        during = [t for t in done[0] if t0 <= t <= end]
        ref = states[0].tensor_infos
        exact = all(a.tensor.tobytes() == b.tensor.tobytes() for s in states.values()
                    for a, b in zip(s.tensor_infos, ref, strict=True))
        fetched = cluster.peer(members).statistics()["heal_last"] if mode != "alone" else None
        return {"mode": ("changing " if changing else "") + mode,
                "heal_s": (healed[0] - t0) if healed else 0.0, "window_s": end - t0,
                "fetch_s": fetched["elapsed"] if fetched else 0.0,
                "steps_in_window": len(during), "steps_per_s": len(during) / (end - t0),
                "steps": len(done[0]), "exact": exact, "wall_s": wall}


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=int, default=256)
    p.add_argument("--donor-mbit", type=float, default=100.0)
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--training", action="store_true", help="members' steps per second during a heal")
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--grad-mb", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--train-steps", type=int, default=40, help="steps of the loop without a newcomer")
    p.add_argument("--changing", action="store_true",
                   help="also the runs where every sync follows a change of every byte (DiLoCo's outer step)")
    args = p.parse_args()
    # Hash inline, never in a worker thread: under the autojump clock a thread's CPU time would let
    # virtual time jump (to the next timeout), which is not what the network takes.
    ss._HASH_IN_THREAD_BYTES = 1 << 62
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


if __name__ == "__main__":
    main()
