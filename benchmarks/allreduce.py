"""All-reduce latency, ours and torch.distributed Gloo side by side, in one run.

Both sides use real OS processes on loopback, float32 SUM, in place, with the same sizes, world sizes,
warm-up and iteration counts.

* ours: a master process (``python -m pccl master``) and N peer processes using ``open_communicator`` +
  ``all_reduce``. Like the Gloo script, each timed call is preceded by a barrier (a 1-element all-reduce on
  another tag) and the figure is the median over the iterations on rank 0 (the first peer of the ring).
* Gloo: ``gloo_bench.py`` (``--gloo-bench``, default ``../shared/bench/gloo_bench.py`` from the repository
  root) run with ``--json``; it times ``dist.all_reduce`` after ``dist.barrier()`` on rank 0.

For each world size the two sides run back to back, so the ratio compares numbers taken moments apart.

``--device cuda`` (a machine with a GPU): both sides all-reduce torch CUDA tensors. Ours stages them
through host memory (the wire is TCP); Gloo runs in this script's own worker (``gloo_bench.py`` is CPU
only), written like ``gloo_bench.py`` (barrier, then ``dist.all_reduce``) plus a
``torch.cuda.synchronize()`` inside the timed region, since Gloo's CUDA all-reduce returns before its
copy back to the device has finished. Our call returns with the result in device memory.

``--spin-seconds`` sets our peers' ``PeerConfig.spin_seconds`` (how long a collective polls instead of
sleeping; 0 turns polling off, for A/B runs). ``--schedule`` sets our peers' ``PeerConfig.schedule``
(default: the PeerConfig default, "auto": the cost model picks the ring, halving-doubling or the tree
per operation, docs/topology.md).

``--tls``: the cost of security instead of the Gloo comparison. At each world size (default 2) our side
runs in three settings, interleaved over ``--rounds`` rounds (the order rotates each round, so a busy
host's drift hits every setting alike): ``plain`` (no secret, no TLS), ``secret`` (the challenge-response
handshake, no TLS: it runs only at connection set-up, so once connected it should cost nothing) and
``tls`` (mutual TLS on master and P2P connections, throw-away certificates from
``pccl.testing.tls``, which needs ``trustme``). The table gives the median over the rounds and the ratios.

``--master-in-rank0``: our master runs inside the first peer's process, in its event loop, instead of as
a process of its own. That is the shape of the Gloo side, whose rendezvous store (torch.distributed's
TCPStore) is a thread of rank 0's process: on a host with fewer cores than processes it shows what the
master's own process costs each operation (docs/history/benchmarks-allreduce.md "Where a small operation's
time goes").

usage: python benchmarks/allreduce.py [--worlds 2,3,4] [--sizes 64K,1M,16M,64M] [--iters 20] [--device cpu]
                                      [--schedule auto|ring|hd|tree] [--master-arg ARG ...]
                                      [--spin-seconds S] [--master-in-rank0]
       python benchmarks/allreduce.py --tls [--rounds 3] [--sizes 64K,1M,16M,64M] [--iters 20]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

# ----------------------------------------------------------------------------------------------
# child: one of our peers


async def _peer(cfg: dict[str, Any]) -> None:
    if cfg.get("device", "cpu") == "cuda":
        import torch

        # Create the CUDA context before joining: it takes seconds, and a peer whose event loop is
        # blocked that long misses the master's heartbeats (and the master misses its own).
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()

    overrides: dict[str, Any] = dict(cfg.get("peer", {}))
    if cfg.get("stash_limit") is not None:
        overrides["recv_stash_limit"] = cfg["stash_limit"]
    if cfg.get("schedule"):
        overrides["schedule"] = cfg["schedule"]
    if cfg.get("spin") is not None:
        overrides["spin_seconds"] = cfg["spin"]
    async with contextlib.AsyncExitStack() as stack:
        address = cfg.get("master")
        if address is None:
            # --master-in-rank0: this peer hosts the master in its own event loop (as torch.distributed
            # keeps its TCPStore in rank 0's process); the others learn its address from the parent.
            from pccl.master.server import open_master

            master = await stack.enter_async_context(open_master("127.0.0.1:0"))
            address = master.connect_address
            c.emit("master", address=address)
        await _time_peer(cfg, address, overrides)


async def _time_peer(cfg: dict[str, Any], address: str, overrides: dict[str, Any]) -> None:
    from pccl import ReduceOp
    from pccl.peer.communicator import open_communicator

    cuda = cfg.get("device", "cpu") == "cuda"
    async with open_communicator(address, config=c.peer_config(**overrides),
                                 p2p_connection_pool_size=cfg["pool_size"]) as comm:
        while comm.world_size < cfg["world"]:
            await c.admit_pending(comm)
            await trio.sleep(0.005)
        c.emit("ready", peer=comm.peer_id, rank=comm.rank, world=comm.world_size)
        barrier = np.zeros(1, np.float32)
        medians: dict[str, float] = {}
        samples: dict[str, list[float]] = {}
        cpu_medians: dict[str, float] = {}
        phase_medians: dict[str, dict[str, float]] = {}
        rng = np.random.default_rng(comm.rank)
        if cuda:
            import torch
        for nbytes in cfg["sizes"]:
            x: Any = rng.random(nbytes // 4, dtype=np.float32)
            if cuda:
                x = torch.from_numpy(x).cuda()
                torch.cuda.synchronize()
            times: list[float] = []
            cpus: list[float] = []
            phases: dict[str, list[float]] = {}
            for i in range(cfg["warmup"] + cfg["iters"]):
                await comm.all_reduce(barrier, op=ReduceOp.SUM, tag=1)
                cpu = time.process_time()
                t = time.perf_counter()
                info = await comm.all_reduce(x, op=ReduceOp.SUM, tag=0)
                if cuda:
                    torch.cuda.synchronize()  # nothing should be pending: the call copies synchronously
                dt = time.perf_counter() - t
                dcpu = time.process_time() - cpu
                if info.local_world_size != cfg["world"]:
                    raise RuntimeError(f"world changed to {info.local_world_size}")
                if i >= cfg["warmup"]:
                    times.append(dt)
                    cpus.append(dcpu)
                    if cfg["samples"]:
                        for name, v in comm.statistics()["last_op_phases"].items():
                            phases.setdefault(name, []).append(v)
            medians[str(nbytes)] = statistics.median(times)
            samples[str(nbytes)] = times
            cpu_medians[str(nbytes)] = statistics.median(cpus)
            phase_medians[str(nbytes)] = {k: statistics.median(v) for k, v in phases.items()}
        ps = comm.pool.statistics()
        c.emit("result", peer=comm.peer_id, rank=comm.rank, median_s=medians, samples_s=samples,
               cpu_median_s=cpu_medians, phase_median_s=phase_medians,
               stash={k: ps[k] for k in ("frames_stashed_total", "stash_peak_bytes", "reader_blocks_total")})
        # Leave together: a peer that closes early would look like a failure to a peer still timing.
        await comm.all_reduce(barrier, op=ReduceOp.SUM, tag=1)


def child_main(cfg: dict[str, Any]) -> int:
    c.child_setup()
    try:
        trio.run(_peer, cfg)
    except Exception as exc:
        c.emit("error", message=f"{type(exc).__name__}: {exc}")
        raise
    return 0


# ----------------------------------------------------------------------------------------------
# driver


async def run_ours(world: int, sizes: list[int], args: argparse.Namespace,
                   setting: Setting | None = None) -> dict[int, float]:
    script = Path(__file__).resolve()
    setting = setting or Setting("plain", master_argv=list(args.master_arg or []))
    async with c.open_cluster(keep_logs=args.keep_logs) as cluster:
        address: str | None = None
        if not args.master_in_rank0:
            address = (await cluster.start_master(extra=setting.master_argv)).address
        cfg = {"master": address, "world": world, "sizes": sizes, "iters": args.iters,
               "warmup": args.warmup, "pool_size": args.pool_size, "device": args.device,
               "samples": args.samples, "stash_limit": args.recv_stash_limit, "schedule": args.schedule,
               "spin": args.spin_seconds, "peer": setting.peer}
        for i in range(world):
            await cluster.spawn(f"peer{i}", c.script_argv(script, cfg))
            if cfg["master"] is None:  # --master-in-rank0: the first peer hosts it
                _, msg = await cluster.wait_for(lambda ch, m: m.get("event") in ("master", "exit"), 60,
                                                "the master address of peer0")
                if msg["event"] == "exit":
                    raise RuntimeError(f"peer0 exited before hosting the master (code {msg.get('code')})")
                cfg = dict(cfg, master=msg["address"])
        results: dict[int, dict[str, Any]] = {}
        reported: set[str] = set()
        budget = 60 + world * sum(sizes) * (args.iters + args.warmup) / 5e7
        while len(results) < world:
            ch, msg = await cluster.wait_for(lambda ch, m: m.get("event") in ("result", "exit"), budget,
                                             f"results of {world} peers")
            if msg["event"] == "exit" and ch.name not in reported:
                raise RuntimeError(f"{ch.name} exited early (code {msg.get('code')}):\n{ch.log_tail()}")
            if msg["event"] == "result":
                results[int(msg["rank"])] = msg
                reported.add(ch.name)
    if args.samples:
        for n in sizes:
            for r in sorted(results):
                xs = sorted(1e3 * v for v in results[r]["samples_s"][str(n)])
                q = [xs[int(f * (len(xs) - 1))] for f in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)]
                cpu = 1e3 * results[r]["cpu_median_s"][str(n)]
                print(f"    {c.human_bytes(n):>6} world {world} rank {r}: ms min/p10/p25/p50/p75/p90/max "
                      + " ".join(f"{v:.2f}" for v in q) + f"; CPU per call (process time) {cpu:.2f} ms",
                      flush=True)
                ph = results[r]["phase_median_s"][str(n)]
                print(f"    {'':>6} phase medians (ms): "
                      + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in ph.items()), flush=True)
    if args.recv_stash_limit is not None:
        st = [results[r].get("stash", {}) for r in sorted(results)]
        stashed = [s.get("frames_stashed_total") for s in st]
        peaks = [s.get("stash_peak_bytes") for s in st]
        blocks = [s.get("reader_blocks_total") for s in st]
        print(f"    world {world}, recv_stash_limit {args.recv_stash_limit}: frames stashed {stashed}, "
              f"stash peak bytes {peaks}, reader blocks {blocks} (per rank, whole run)", flush=True)
    rank0 = results[0]["median_s"]
    return {n: float(rank0[str(n)]) for n in sizes}


def _gloo_cuda_worker(rank: int, world: int, sizes: list[int], iters: int, port: int, q: Any) -> None:
    """``gloo_bench.py``'s worker with CUDA tensors (and a synchronize inside the timed region)."""
    import os

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for nbytes in sizes:
        x = torch.rand(nbytes // 4, device="cuda")
        times = []
        for _ in range(iters + 3):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[nbytes] = statistics.median(times[3:])
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def _run_gloo_cuda(world: int, sizes: list[int], iters: int) -> dict[int, float]:
    import os

    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    port = 20000 + os.getpid() % 20000
    procs = [ctx.Process(target=_gloo_cuda_worker, args=(r, world, sizes, iters, port, q))
             for r in range(world)]
    for pr in procs:
        pr.start()
    res: dict[int, float] = q.get(timeout=600)
    for pr in procs:
        pr.join()
    return res


async def run_gloo(world: int, sizes: list[int], args: argparse.Namespace) -> dict[int, float] | None:
    if args.device == "cuda":
        return await trio.to_thread.run_sync(_run_gloo_cuda, world, sizes, args.iters)
    bench = Path(args.gloo_bench)
    if not bench.is_absolute():
        bench = (c.REPO_ROOT / bench).resolve()
    if not bench.exists():
        print(f"  (gloo bench not found at {bench}; skipping the Gloo side)", flush=True)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gloo.json"
        argv = [sys.executable, str(bench), "--world", str(world), "--sizes", ",".join(map(str, sizes)),
                "--iters", str(args.iters), "--json", str(out)]
        with trio.fail_after(600):
            proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False,
                                          env=c.child_env())
        if proc.returncode != 0 or not out.exists():
            print(f"  gloo bench failed ({proc.returncode}):\n{proc.stderr.decode(errors='replace')[-2000:]}")
            return None
        data = json.loads(out.read_text())
    return {n: float(data["median_s"][str(n)]) for n in sizes}


@dataclasses.dataclass
class Setting:
    """How the master and the peers of one run are secured (``--tls`` mode)."""

    name: str
    master_argv: list[str] = dataclasses.field(default_factory=list)
    peer: dict[str, Any] = dataclasses.field(default_factory=dict)  # PeerConfig fields


def security_settings(root: Path) -> list[Setting]:
    """plain, secret (a secret file, no TLS) and tls (mutual TLS, certificates under ``root``)."""
    from pccl.testing.tls import Certs  # needs trustme: imported only in --tls mode

    secret = "benchmark-" + "0123456789abcdef" * 4
    secret_file = root / "secret"
    secret_file.write_text(secret)
    certs = Certs(root)
    master_pem, peer_pem = certs.issue("master", "127.0.0.1"), certs.issue("peer", "pccl-peer")
    return [
        Setting("plain"),
        Setting("secret", ["--secret-file", str(secret_file)], {"secret": secret}),
        Setting("tls", ["--tls-cert", master_pem, "--tls-ca", certs.ca_file],
                {"tls_cert": peer_pem, "tls_key": peer_pem, "tls_ca": certs.ca_file}),
    ]


async def run_security(args: argparse.Namespace) -> list[list[Any]]:
    """``--tls``: plain / secret / tls interleaved over ``args.rounds`` rounds at each world size."""
    sizes = [c.parse_size(x) for x in args.sizes.split(",")]
    worlds = [int(x) for x in (args.worlds or "2").split(",")]
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = security_settings(Path(tmp))
        for world in worlds:
            got: dict[str, list[dict[int, float]]] = {s.name: [] for s in settings}
            for r in range(args.rounds):
                order = settings[r % len(settings):] + settings[: r % len(settings)]
                for st in order:
                    print(f"  world {world} round {r + 1}/{args.rounds}: {st.name}...", flush=True)
                    res = await run_ours(world, sizes, args, st)
                    got[st.name].append(res)
                    print("    " + ", ".join(f"{c.human_bytes(n)} {res[n] * 1e3:.2f} ms" for n in sizes),
                          flush=True)
            for n in sizes:
                med = {k: statistics.median(v[n] for v in runs) for k, runs in got.items()}

                def per_round(name: str, n: int = n) -> str:
                    pairs = zip((r[n] for r in got[name]), (r[n] for r in got["plain"]), strict=True)
                    return " ".join(f"{x:.2f}" for x in sorted(a / b for a, b in pairs))

                rows.append([c.human_bytes(n), world, med["plain"] * 1e3, med["secret"] * 1e3,
                             med["tls"] * 1e3, med["secret"] / med["plain"], per_round("secret"),
                             med["tls"] / med["plain"], per_round("tls"), n / med["plain"] / 1e9,
                             n / med["tls"] / 1e9])
    return rows


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0f}"


async def run(args: argparse.Namespace) -> list[list[Any]]:
    sizes = [c.parse_size(x) for x in args.sizes.split(",")]
    worlds = [int(x) for x in args.worlds.split(",")]
    rows: list[list[Any]] = []
    for world in worlds:
        print(f"  world {world}: ours...", flush=True)
        with c.HostSteal() as steal_ours:
            ours = await run_ours(world, sizes, args)
        gloo = None
        steal_gloo = c.HostSteal()
        if not args.no_gloo:
            print(f"  world {world}: gloo...", flush=True)
            with steal_gloo:
                gloo = await run_gloo(world, sizes, args)
        for n in sizes:
            o = ours[n] * 1e3
            g = gloo[n] * 1e3 if gloo else float("nan")
            rows.append([c.human_bytes(n), world, o, g, o / g if gloo else float("nan"),
                         n / ours[n] / 1e9, f"{_pct(steal_ours.percent)} / {_pct(steal_gloo.percent)}"])
            print(f"    {c.human_bytes(n):>6}  ours {o:8.2f} ms   gloo {g:8.2f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--worlds", default=None, help="world sizes (default 2,3,4; with --tls 2)")
    p.add_argument("--sizes", default="64K,1M,16M,64M", help="bytes of float32 data (K/M suffixes)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool-size", type=int, default=1, help="p2p_connection_pool_size of our peers")
    p.add_argument("--recv-stash-limit", type=int, default=None,
                   help="PeerConfig.recv_stash_limit of our peers (default: PeerConfig's); also prints "
                        "their stash counters")
    p.add_argument("--gloo-bench", default="../shared/bench/gloo_bench.py",
                   help="path to gloo_bench.py (relative paths are from the repository root)")
    p.add_argument("--no-gloo", action="store_true", help="only our side")
    p.add_argument("--schedule", default=None, choices=("auto", "ring", "hd", "tree"),
                   help="PeerConfig.schedule of our peers (default: the PeerConfig default, auto)")
    p.add_argument("--spin-seconds", type=float, default=None,
                   help="PeerConfig.spin_seconds of our peers (default: PeerConfig's; 0: block in every "
                        "wait, as before polling existed)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: all-reduce torch CUDA tensors on both sides (needs a GPU)")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--master-arg", action="append", metavar="ARG",
                   help="an extra pccl-master argument for our side, repeated per word "
                        "(--master-arg=--speculative-go-delay --master-arg=0)")
    p.add_argument("--samples", action="store_true",
                   help="also print every rank's distribution of our per-call times, its CPU time per "
                        "call and the median of each phase (statistics()[\"last_op_phases\"])")
    p.add_argument("--master-in-rank0", action="store_true",
                   help="run our master inside the first peer's process and event loop (the shape "
                        "torch.distributed's TCPStore has in Gloo's run) instead of as its own process")
    p.add_argument("--tls", action="store_true",
                   help="instead of Gloo: plain vs secret vs mutual TLS, interleaved (see the module doc)")
    p.add_argument("--rounds", type=int, default=3, help="with --tls: interleaved rounds (default 3)")
    args = p.parse_args(argv)
    if args.master_in_rank0 and (args.tls or args.master_arg):
        p.error("--master-in-rank0 runs the master with its defaults: not with --tls or --master-arg")
    t0 = time.monotonic()
    if args.tls:
        print("all-reduce float32 SUM, in place, cpu tensors, plain / secret / mutual TLS; "
              f"{c.machine_line()}; "
              f"{args.iters} iterations after {args.warmup} warm-up, median on rank 0, median of "
              f"{args.rounds} interleaved rounds", flush=True)
        rows = trio.run(run_security, args)
        print()
        print(c.format_table(["size", "world", "plain ms", "secret ms", "tls ms", "secret/plain",
                              "secret/plain per round", "tls/plain", "tls/plain per round",
                              "plain algbw GB/s", "tls algbw GB/s"], rows))
        print("\nratios: of the medians over the rounds; per round: each round's ratio, sorted")
        print(f"\n({time.monotonic() - t0:.0f}s)")
        return 0
    args.worlds = args.worlds or "2,3,4"
    print(f"all-reduce float32 SUM, in place, {args.device} tensors; {c.machine_line()}; "
          f"{args.iters} iterations after {args.warmup} warm-up, median on rank 0", flush=True)
    rows = trio.run(run, args)
    print()
    print(c.format_table(["size", "world", "ours median ms", "gloo median ms", "ours/gloo",
                          "ours algbw GB/s", "host steal % ours / gloo"], rows))
    print("\nhost steal: CPU time the hypervisor took from this VM during each side's run (processes "
          "included); runs with more than a few percent are not comparable with quiet ones.")
    print(f"\n({time.monotonic() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
