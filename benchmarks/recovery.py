"""Recovery from a failed peer: SIGKILL (crash) and SIGSTOP (hang) in the middle of an all-reduce loop.

A master and 3 peers, all OS processes on loopback. The peers loop 1 MB float32 all-reduces as fast as they
can. The driver then faults one peer:

* SIGKILL: its sockets close; the survivors' current all-reduce fails with RankConnectionLostError;
* SIGSTOP: its sockets stay open and silent; only the master's heartbeat timeout (default 3.0 s) evicts it,
  or, with ``--straggler-timeout S``, the master's straggler rule (silent for S while the others wait on it).

Survivors follow the recipe: on RankConnectionLostError they call ``update_topology()`` and retry
(``--retry direct`` retries without it). Each trial uses a fresh master and peers; the stopped peer is
SIGKILLed afterwards to clean up.

Reported per trial (worst survivor): time from the fault to the survivors' next successful all-reduce with
the smaller world (recovery), the number of calls that failed in between, and the time from the fault to
the first failed call (when a call failed at all: a fault that lands between two calls can also show up as
a vote that simply waits until the master drops the peer, with no failed call). Times are CLOCK_MONOTONIC,
comparable across processes on one machine.

Targets: SIGKILL recovered within 50 ms with at most one failed call; SIGSTOP within heartbeat timeout
+ 100 ms.

``--faults master``: the master is SIGKILLed and a fresh ``pccl-master`` started on the same port after
``--restart-delay`` s (default 1); the peers run with ``reconnect_window`` (``--reconnect-window``, default
30 s). Reported: how long after the kill the new master listened ("1st failure" column) and the time from
it listening to every peer's next successful all-reduce over the whole world (target 0.5 s), failed calls
per peer (target at most 1).

usage: python benchmarks/recovery.py [--trials 3] [--size BYTES] [--retry update_topology|direct]
       [--faults SIGKILL,SIGSTOP,master]
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
# child


async def _peer(cfg: dict[str, Any]) -> None:
    from pccl import (
        MasterConnectionError,
        RankConnectionLostError,
        ReduceOp,
        TooFewPeersError,
        UpdateTopologyFailedError,
    )
    from pccl.peer.communicator import open_communicator

    config = c.peer_config(reconnect_window=cfg.get("reconnect_window", 0.0))
    async with open_communicator(cfg["master"], config=config) as comm:
        while comm.world_size < cfg["world"]:
            await c.admit_pending(comm)
            await trio.sleep(0.005)
        c.emit("ready", peer=comm.peer_id, world=comm.world_size)
        send = np.ones(cfg["size"] // 4, np.float32)
        recv = np.empty_like(send)
        while True:
            t0 = time.monotonic()
            try:
                info = await comm.all_reduce(send, recv, op=ReduceOp.SUM)
            except RankConnectionLostError as exc:
                c.emit("fail", peer=comm.peer_id, t0=t0, error=str(exc)[:200])
                if cfg["retry"] == "update_topology":
                    while True:
                        try:
                            await comm.update_topology()
                            break
                        except UpdateTopologyFailedError:
                            continue
                continue
            except MasterConnectionError as exc:
                c.emit("fail", peer=comm.peer_id, t0=t0, error=str(exc)[:200])
                raise
            except TooFewPeersError:
                c.emit("alone", peer=comm.peer_id)
                await trio.sleep_forever()
            c.emit("ok", peer=comm.peer_id, t0=t0, world=info.local_world_size)


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


async def _peers_ready(cluster: Any, world: int) -> dict[str, int]:
    """Wait until ``world`` peers said "ready"; their peer ids by process name."""
    ids: dict[str, int] = {}
    while len(ids) < world:
        ch, msg = await cluster.wait_for(lambda ch, m: m.get("event") == "ready", 60, "peers ready")
        ids[ch.name] = int(msg["peer"])
    return ids


async def _count_ok(cluster: Any, seconds: float) -> int:
    """Successful calls the peers report within ``seconds``."""
    ok = 0
    with trio.move_on_after(seconds):
        while True:
            _, msg = await cluster.next_event()
            ok += msg.get("event") == "ok"
    return ok


async def master_trial(args: argparse.Namespace) -> dict[str, float]:
    """SIGKILL the master while 3 peers loop all-reduces, start a fresh one on the same port after
    ``--restart-delay`` s; time from the new master listening to every peer's next success."""
    script = Path(__file__).resolve()
    world = 3
    async with c.open_cluster(keep_logs=args.keep_logs) as cluster:
        master = await cluster.start_master(heartbeat_timeout=args.heartbeat_timeout)
        port = int(master.address.rsplit(":", 1)[1])
        cfg = {"master": master.address, "world": world, "size": args.size, "retry": args.retry,
               "reconnect_window": args.reconnect_window}
        for i in range(world):
            await cluster.spawn(f"peer{i}", c.script_argv(script, cfg))
        ids = await _peers_ready(cluster, world)
        steady = await _count_ok(cluster, args.steady)
        assert master.proc.returncode is None
        t_fault = time.monotonic()
        master.proc.kill()
        fails: dict[int, int] = dict.fromkeys(ids.values(), 0)
        with trio.move_on_after(args.restart_delay):
            while True:
                _, msg = await cluster.next_event()
                if msg.get("event") == "fail":
                    fails[int(msg["peer"])] += 1
        new = await cluster.start_master(heartbeat_timeout=args.heartbeat_timeout, port=port)
        recovered: dict[int, float] = {}
        while len(recovered) < world:
            ch, msg = await cluster.wait_for(
                lambda ch, m: m.get("event") in ("ok", "fail", "exit", "error"),
                args.reconnect_window + 10, "recovery after the master's restart")
            ev = msg["event"]
            if ev in ("exit", "error"):
                raise RuntimeError(f"{ch.name} {ev}:\n{ch.log_tail()}")
            pid = int(msg["peer"])
            if ev == "fail" and pid not in recovered:
                fails[pid] += 1
            after_kill = float(msg["t0"]) > t_fault
            if ev == "ok" and pid not in recovered and int(msg["world"]) == world and after_kill:
                recovered[pid] = float(msg["t"])
    return {"steady_calls_per_s": steady / args.steady, "detect_s": new.listening_at - t_fault,
            "recover_s": max(recovered.values()) - new.listening_at,
            "failed_calls": float(max(fails.values()))}


async def trial(kind: str, args: argparse.Namespace) -> dict[str, float]:
    script = Path(__file__).resolve()
    world = 3
    async with c.open_cluster(keep_logs=args.keep_logs) as cluster:
        extra = ["--straggler-timeout", str(args.straggler_timeout)] if args.straggler_timeout > 0 else []
        master = await cluster.start_master(heartbeat_timeout=args.heartbeat_timeout, extra=extra)
        cfg = {"master": master.address, "world": world, "size": args.size, "retry": args.retry}
        peers = [await cluster.spawn(f"peer{i}", c.script_argv(script, cfg)) for i in range(world)]
        ids = await _peers_ready(cluster, world)
        steady = await _count_ok(cluster, args.steady)  # steady state first
        victim = peers[-1]
        t_fault = victim.kill() if kind == "SIGKILL" else victim.stop()
        survivors = {ids[p.name] for p in peers if p is not victim}
        first_fail: dict[int, float] = {}
        fails: dict[int, int] = dict.fromkeys(survivors, 0)
        recovered: dict[int, float] = {}
        deadline = args.heartbeat_timeout + 10
        while len(recovered) < len(survivors):
            ch, msg = await cluster.wait_for(lambda ch, m: m.get("event") in ("ok", "fail", "alone", "exit"),
                                             deadline, f"recovery after {kind}")
            ev = msg["event"]
            pid = int(msg.get("peer", -1))
            if pid not in survivors and ev != "exit":
                continue
            if ev == "exit" and ch is not victim:
                raise RuntimeError(f"{ch.name} exited:\n{ch.log_tail()}")
            if ev == "alone":
                raise RuntimeError(f"peer {pid} ended up alone")
            if ev == "fail" and pid not in recovered:
                fails[pid] += 1
                first_fail.setdefault(pid, float(msg["t"]))
            if ev == "ok" and pid not in recovered and int(msg["world"]) == world - 1:
                recovered[pid] = float(msg["t"])
        if kind == "SIGSTOP":
            victim.kill()
    detect = max(first_fail.values()) - t_fault if len(first_fail) == len(survivors) else float("nan")
    return {"steady_calls_per_s": steady / args.steady, "detect_s": detect,
            "recover_s": max(recovered.values()) - t_fault, "failed_calls": float(max(fails.values()))}


async def run(args: argparse.Namespace) -> list[list[Any]]:
    rows: list[list[Any]] = []
    kinds = [k.strip().upper() for k in args.faults.split(",")]
    for kind in kinds:
        results = []
        for i in range(args.trials):
            if kind == "MASTER":
                r = await master_trial(args)
                results.append(r)
                print(f"  master trial {i + 1}: new master listening {r['detect_s'] * 1e3:.0f} ms after the "
                      f"kill, every peer's next success {r['recover_s'] * 1e3:.1f} ms after that, "
                      f"{int(r['failed_calls'])} failed call(s) per peer at most", flush=True)
                continue
            r = await trial(kind, args)
            results.append(r)
            print(f"  {kind} trial {i + 1}: first failed call after {r['detect_s'] * 1e3:.1f} ms, "
                  f"recovered after {r['recover_s'] * 1e3:.1f} ms, {int(r['failed_calls'])} failed call(s) "
                  f"(steady state: {r['steady_calls_per_s']:.0f} all-reduces/s)", flush=True)
        target = {"SIGKILL": 0.050, "MASTER": 0.500}.get(kind, args.heartbeat_timeout + 0.100)
        rec = [r["recover_s"] for r in results]
        failed = int(max(r["failed_calls"] for r in results))
        met = max(rec) <= target and (kind not in ("SIGKILL", "MASTER") or failed <= 1)
        detects = [r["detect_s"] for r in results if r["detect_s"] == r["detect_s"]]  # trials with a failure
        rows.append([kind, len(results), statistics.median(detects) * 1e3 if detects else float("nan"),
                     statistics.median(rec) * 1e3, max(rec) * 1e3, failed, f"{target * 1e3:.0f}",
                     "yes" if met else "no"])
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--faults", default="SIGKILL,SIGSTOP")
    p.add_argument("--size", type=int, default=1 << 20, help="all-reduce bytes (float32)")
    p.add_argument("--retry", choices=["update_topology", "direct"], default="update_topology")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="master's heartbeat timeout")
    p.add_argument("--straggler-timeout", type=float, default=0.0,
                   help="master's straggler timeout (default 0: off)")
    p.add_argument("--steady", type=float, default=1.0, help="seconds of fault-free looping before the fault")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--restart-delay", type=float, default=1.0,
                   help="--faults master: seconds from the master's SIGKILL to its restart on the same port")
    p.add_argument("--reconnect-window", type=float, default=30.0,
                   help="--faults master: the peers' PeerConfig.reconnect_window")
    args = p.parse_args(argv)
    straggler = f"{args.straggler_timeout:g}s" if args.straggler_timeout > 0 else "off"
    print(f"recovery; {c.machine_line()}; 3 peers looping {c.human_bytes(args.size)} all-reduces; "
          f"retry after {args.retry}; master heartbeat timeout {args.heartbeat_timeout:g}s, "
          f"straggler timeout {straggler}", flush=True)
    rows = trio.run(run, args)
    print()
    print(c.format_table(["fault", "trials", "1st failure median ms", "recover median ms", "recover max ms",
                          "max failed calls", "target ms", "met"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
