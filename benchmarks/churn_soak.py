"""Churn soak: peers join, crash and hang at random while the others keep training.

Modeled on the established system's stress test. A master and peers run as OS processes on loopback. Every
0.5-2 s the driver either spawns a peer (p = 0.6) or faults a random accepted peer (p = 0.4): SIGKILL or
SIGSTOP (``--stop-fraction`` of the faults; a stopped peer is evicted by the master's heartbeat timeout and
SIGKILLed a little later to clean up). At most ``--max-peers`` processes, and a fault only when more than
``--min-peers`` accepted, running peers would remain.

The peers are the demo's training peers (``pccl.demo.peer_main``): every step syncs the shared state (MLP
parameters + Adam moments), all-reduces the gradients (AVG, retried after a lost peer), applies the same
update and admits pending peers. A newcomer catches up through the shared state.

With ``--master-kill-every S`` the master is SIGKILLed every S seconds on top of the peer churn and a fresh
``pccl-master`` started on the same port ``--restart-delay`` seconds later (default 1); the peers (default
``PeerConfig.reconnect_window``) re-register with it (docs/concepts.md "Surviving the master"). Printed as
well: the longest gap without a completed all-reduce across a master kill (passes when at most
``--max-master-gap``, default restart delay + 2 s). A peer still waiting to be admitted when the master dies
has no place to keep: its join fails and it exits; those are counted apart, not as errors.

At the end (``--duration`` seconds) the driver tells the peers to stop; the stop flag rides in the all-reduce
so every peer stops after the same step and syncs once more. Printed: the churn events, completed steps, the
longest gap without a completed all-reduce, the catch-up transfers, and whether every survivor ended with the
same state hash. All children are SIGKILLed at the end, on errors and on Ctrl-C.

Exit code 0 if the survivors' hashes agree, no peer failed with an error, and the longest gap stayed below
``--max-gap``.

usage: python benchmarks/churn_soak.py [--duration 600] [--seed 0] [--max-peers 10] [--min-peers 2]
       [--master-kill-every 60] [--restart-delay 1] [--rebuild-grace S] [--rebuild-quiet S]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

_EVICTED_RE = re.compile(r"peer (\d+) \([^)]*\) evicted")
_REBUILD_RE = re.compile(r"rebuilding the run from re-registrations: epoch \d+, (\d+) member")


def kill_timeline(t_kill: float, master: c.MasterProcess, next_completion: float) -> str:
    """Where the time from a master kill to the next completed all-reduce went, from the restarted
    master's log: start-up (kill -> listening), the peers' reconnection (-> first re-registration),
    the rebuild quorum (-> "resuming"), then the roll call and operations in doubt (-> next all-reduce;
    "in doubt" lines and members that never came back show what it waited for)."""
    def first(pred: str) -> float | None:
        return next((t for t, line in master.events if pred in line), None)

    def rel(t: float | None) -> str:
        return f"+{t - t_kill:.2f}s" if t is not None else "-"

    back = sum(1 for _, line in master.events if " re-registered from " in line)
    expected = next((int(mt.group(1)) for _, line in master.events if (mt := _REBUILD_RE.search(line))), 0)
    doubts = sum(1 for _, line in master.events if " in doubt: " in line)
    reregistered = first(" re-registered from ")
    return (f"listening {rel(master.listening_at)}, first re-registration {rel(reregistered)}, "
            f"majority back {rel(first('re-registered: resuming'))}, next all-reduce {rel(next_completion)} "
            f"({back} of {expected} member(s) back, {doubts} decision(s) in doubt)")
PEER_CODE = "import sys; from pccl.demo import peer_main; sys.exit(peer_main())"


@dataclass
class Stats:
    t0: float
    spawned: int = 0
    killed: int = 0
    stopped: int = 0
    max_rev: int = 0
    first_completion: float | None = None
    last_completion: float | None = None
    longest_gap: float = 0.0
    longest_gap_at: float = 0.0
    catchups: int = 0
    catchup_bytes: int = 0
    retries: int = 0
    evictions: int = 0
    false_evictions: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)
    crashes: list[tuple[str, int]] = field(default_factory=list)
    master_kills: list[float] = field(default_factory=list)
    master_gap: float = 0.0  # the longest gap without a completed all-reduce across a master kill
    master_listening: list[float] = field(default_factory=list)  # when each restarted master listened
    listen_gap: float = 0.0  # the longest time from a restarted master listening to the next completion
    restart_s: float = 0.0  # the longest time from a kill to the restarted master listening
    lost_joins: int = 0  # peers not yet admitted when the master died (their join fails)
    completions: list[float] = field(default_factory=list)  # recent completion times (kill timelines)

    def at(self, t: float | None = None) -> str:
        return f"[{(time.monotonic() if t is None else t) - self.t0:7.1f}s]"

    def completion(self, t: float, rev: int) -> None:
        if rev <= self.max_rev:
            return
        self.max_rev = rev
        last = self.last_completion
        if last is not None and any(last < k <= t for k in self.master_kills):
            self.master_gap = max(self.master_gap, t - last)
        for lt in self.master_listening:
            if last is not None and last < lt <= t:
                self.listen_gap = max(self.listen_gap, t - lt)
        if self.last_completion is not None and t - self.last_completion > self.longest_gap:
            self.longest_gap = t - self.last_completion
            self.longest_gap_at = self.last_completion
            if self.longest_gap > 3.0:
                print(f"{self.at(t)} !! no all-reduce completed for {self.longest_gap:.2f}s (since "
                      f"{self.at(self.last_completion).strip()}; revision {rev})", flush=True)
        if self.first_completion is None:
            self.first_completion = t
        self.last_completion = t
        self.completions.append(t)
        del self.completions[:-256]


async def consume(cluster: c.Cluster, st: Stats, verbose: bool) -> None:
    while True:
        ch, msg = await cluster.next_event()
        ev = msg.get("event")
        if ev != "exit":
            ch.info["last"] = msg
        if ev == "accepted":
            ch.info["peer"] = int(msg["peer"])
            ch.info["accepted"] = True
            if verbose:
                print(f"{st.at()} {ch.name} accepted as peer {msg['peer']} (world {msg['world']}, "
                      f"{float(msg['join_s']) * 1e3:.0f} ms after its call)", flush=True)
        elif ev in ("step", "progress"):
            st.completion(float(msg["t"]), int(msg["step"]))
            st.retries += int(msg.get("retries", 0))
        elif ev == "sync":
            if int(msg["rx"]) > 0:
                st.catchups += 1
                st.catchup_bytes += int(msg["rx"])
                if verbose:
                    print(f"{st.at()} peer {msg['peer']} caught up: {int(msg['rx']) / 1024:.0f} KB of shared "
                          f"state at revision {msg['revision']}", flush=True)
        elif ev == "done":
            ch.info["done"] = msg
        elif ev == "where":
            stats = msg.get("stats") or {}
            keys = ("op_tags", "topology_call_waiting", "sync_call_waiting", "pending_queries_waiting",
                    "world_size", "epoch", "master_ok")
            where = f"{ch.name} (peer {msg.get('peer')}) in {msg.get('phase')} for {msg.get('for_s')}s"
            print(f"{st.at()}   {where}: " + ", ".join(f"{k}={stats.get(k)}" for k in keys), flush=True)
        elif ev == "error":
            text = str(msg.get("message"))
            # A peer not admitted when the master died, or a newcomer that a restarted master accepted
            # alone before the run's members came back (they win: docs/concepts.md rule 0).
            newcomer_first = "join again as a newcomer" in text
            if st.master_kills and (newcomer_first or not ch.info.get("accepted")) \
                    and "MASTER_CONNECTION_FAILED" in text:
                st.lost_joins += 1
                ch.info["lost_join"] = True
                print(f"{st.at()} {ch.name} was not admitted yet when the master died: {text}", flush=True)
                continue
            st.errors.append((ch.name, text))
            print(f"{st.at()} !! {ch.name} failed: {msg.get('message')}", flush=True)
        elif ev == "exit":
            code = int(msg.get("code", 0))
            if ch.state == "exited" and code != 0 and not ch.info.get("lost_join"):
                st.crashes.append((ch.name, code))
                print(f"{st.at()} !! {ch.name} exited with code {code}\n{ch.log_tail(8)}", flush=True)


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    st = Stats(t0=time.monotonic())
    peer_args = ["--steps", str(10**12), "--step-delay", str(args.step_delay), "--hidden", str(args.hidden),
                 "--seed", str(args.seed), "--heartbeat-interval", str(args.peer_heartbeat_interval)]
    if args.peer_stall_timeout is not None:
        peer_args += ["--p2p-stall-timeout", str(args.peer_stall_timeout)]
    extra = ["--straggler-timeout", str(args.straggler_timeout)] if args.straggler_timeout > 0 else []
    if args.rebuild_grace is not None:
        extra += ["--rebuild-grace", str(args.rebuild_grace)]
    if args.rebuild_quiet is not None:
        extra += ["--rebuild-quiet", str(args.rebuild_quiet)]
    n_spawned = 0
    async with c.open_cluster(keep_logs=args.keep_logs) as cluster:
        master = await cluster.start_master(heartbeat_timeout=args.heartbeat_timeout, extra=extra)
        masters = [master]
        master_port = int(master.address.rsplit(":", 1)[1])
        straggler = f"{args.straggler_timeout:g}s" if args.straggler_timeout > 0 else "off"
        print(f"{st.at()} master at {master.address} (heartbeat timeout {args.heartbeat_timeout:g}s, "
              f"straggler timeout {straggler}, peers heartbeat every {args.peer_heartbeat_interval:g}s)",
              flush=True)

        async def spawn() -> c.Child:
            nonlocal n_spawned
            name = f"p{n_spawned}"
            n_spawned += 1
            st.spawned += 1
            return await cluster.spawn(name, [sys.executable, "-c", PEER_CODE, "--master", master.address,
                                              *peer_args])

        stopped: list[tuple[float, c.Child]] = []
        timelines: list[tuple[float, c.MasterProcess]] = []  # kills whose next all-reduce is not in yet
        master_seen = 0
        stall_reported: float | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume, cluster, st, args.verbose)
            for _ in range(2):
                await spawn()
            print(f"{st.at()} spawned 2 initial peers", flush=True)
            t_end = time.monotonic() + args.duration
            next_status = time.monotonic() + args.status_every
            every = args.master_kill_every
            next_kill = time.monotonic() + every if every > 0 else float("inf")
            while time.monotonic() < t_end:
                await trio.sleep(rng.uniform(args.event_min, args.event_max))
                now = time.monotonic()
                if now >= next_kill and now + args.restart_delay + 5.0 < t_end:
                    next_kill = now + every
                    master.proc.kill()
                    st.master_kills.append(time.monotonic())
                    print(f"{st.at()} SIGKILL the master; restarting it on port {master_port} in "
                          f"{args.restart_delay:g}s", flush=True)
                    await trio.sleep(args.restart_delay)
                    master = await cluster.start_master(heartbeat_timeout=args.heartbeat_timeout, extra=extra,
                                                        port=master_port)
                    masters.append(master)
                    timelines.append((st.master_kills[-1], master))
                    st.master_listening.append(master.listening_at)
                    st.restart_s = max(st.restart_s, master.listening_at - st.master_kills[-1])
                    master_seen = 0
                    print(f"{st.at()} master restarted at {master.address}", flush=True)
                    now = time.monotonic()
                for t_kill, mp in list(timelines):
                    if st.last_completion is not None and st.last_completion > mp.listening_at:
                        timelines.remove((t_kill, mp))
                        # the first completion after the restart: the soak's own timestamps
                        nxt = min((t for t in st.completions if t > t_kill), default=st.last_completion)
                        print(f"{st.at(t_kill)} master kill timeline: {kill_timeline(t_kill, mp, nxt)}",
                              flush=True)
                for t_stop, ch in list(stopped):
                    if now - t_stop > args.heartbeat_timeout + 2.0:
                        ch.kill()
                        stopped.remove((t_stop, ch))
                present = [ch for ch in cluster.children if ch.state in ("running", "stopped")]
                working = [ch for ch in cluster.children if ch.state == "running" and ch.info.get("accepted")]
                if rng.random() < 0.6:
                    if len(present) < args.max_peers:
                        ch = await spawn()
                        print(f"{st.at()} spawn {ch.name} ({len(present) + 1} processes)", flush=True)
                elif len(working) > args.min_peers:
                    victim = rng.choice(working)
                    if rng.random() < args.stop_fraction:
                        victim.stop()
                        stopped.append((time.monotonic(), victim))
                        st.stopped += 1
                        what = "SIGSTOP"
                    else:
                        victim.kill()
                        st.killed += 1
                        what = "SIGKILL"
                    print(f"{st.at()} {what} {victim.name} (peer {victim.info.get('peer')}; "
                          f"{len(working) - 1} working peers left)", flush=True)
                for _, line in master.events[master_seen:]:
                    if "still waiting" in line:
                        print(f"{st.at()} master: {line.split(' WARNING ', 1)[-1]}", flush=True)
                    if " evicted" in line or " kicked" in line:
                        print(f"{st.at()} master: {line.split(' INFO ', 1)[-1]}", flush=True)
                        mt = _EVICTED_RE.search(line)
                        if mt:
                            st.evictions += 1
                            who = [ch for ch in cluster.children if ch.info.get("peer") == int(mt.group(1))]
                            if who and who[0].state == "running":
                                # evicted although the driver never stopped it: a false suspicion
                                st.false_evictions += 1
                                print(f"{st.at()} !! {who[0].name} evicted while running", flush=True)
                master_seen = len(master.events)
                if st.last_completion is not None and now - st.last_completion > 5.0:
                    if stall_reported != st.last_completion:
                        stall_reported = st.last_completion
                        print(f"{st.at()} !! stalled for {now - st.last_completion:.1f}s; each peer's last "
                              "report:", flush=True)
                        for ch in cluster.children:
                            if ch.state == "running" and ch.info.get("accepted"):
                                last = dict(ch.info.get("last", {}))
                                age = now - float(last.pop("t", now))
                                print(f"      {ch.name} (peer {ch.info.get('peer')}): {age:.1f}s ago {last}",
                                      flush=True)
                                await ch.send({"cmd": "where"})  # answered with a "where" event
                if now >= next_status:
                    next_status = now + args.status_every
                    working = [ch for ch in cluster.live() if ch.info.get("accepted")]
                    print(f"{st.at()} status: revision {st.max_rev}, {len(working)} working peers, "
                          f"longest gap {st.longest_gap:.2f}s, {st.catchups} catch-ups", flush=True)
            # Stop: every running peer gets the flag; it rides the next all-reduce, so all stop together.
            for _, ch in stopped:
                ch.kill()
            t_churn_end = time.monotonic()
            if st.last_completion is not None and t_churn_end - st.last_completion > st.longest_gap:
                st.longest_gap = t_churn_end - st.last_completion
                st.longest_gap_at = st.last_completion
            # Peers still waiting to be admitted would only be accepted after the group has stopped and
            # left (the master then starts a new run with them): they are not part of this run's ending.
            late = [ch for ch in cluster.live() if not ch.info.get("accepted")]
            for ch in late:
                ch.kill()
            print(f"{st.at()} churn over; {len(late)} not-yet-admitted peer(s) killed; telling the peers "
                  "to stop", flush=True)
            for ch in cluster.live():
                await ch.send({"cmd": "stop"})
            with trio.move_on_after(args.stop_timeout):
                while True:
                    waiting = [ch for ch in cluster.live()
                               if ch.info.get("accepted") and "done" not in ch.info]
                    if not waiting:
                        break
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        survivors = [ch for ch in cluster.children if "done" in ch.info]
        unfinished = [ch for ch in cluster.live() if ch.info.get("accepted") and "done" not in ch.info]
        lines = [ln for mp in masters for ln in mp.membership_lines()]
    # -- summary
    hashes = {str(ch.info["done"]["hash"]) for ch in survivors}
    revisions = {int(ch.info["done"]["revision"]) for ch in survivors}
    elapsed = (st.last_completion or st.t0) - (st.first_completion or st.t0)
    kinds = (" joined ", " accepted ", " left ", " evicted", " kicked")
    counts = {k: sum(1 for ln in lines if k in ln) for k in kinds}
    print()
    rows = [
        ["duration s", f"{args.duration:g}"],
        ["seed", args.seed],
        ["heartbeat timeout / straggler timeout / peer heartbeat interval s",
         f"{args.heartbeat_timeout:g} / {straggler} / {args.peer_heartbeat_interval:g}"],
        ["peers spawned / SIGKILLed / SIGSTOPped", f"{st.spawned} / {st.killed} / {st.stopped}"],
        ["master log: joined / accepted / left / evicted / kicked",
         " / ".join(str(counts[k]) for k in kinds)],
        ["completed steps (all-reduces)", st.max_rev],
        ["steps per second", f"{st.max_rev / elapsed:.1f}" if elapsed > 0 else "-"],
        ["all-reduce retries after a lost peer", st.retries],
        ["longest gap without a completed all-reduce s",
         f"{st.longest_gap:.2f} (from t={st.longest_gap_at - st.t0:.1f}s)"],
        ["evictions (of them: peers that were running, not stopped)",
         f"{st.evictions} ({st.false_evictions})"],
        ["catch-ups through shared state", f"{st.catchups} ({st.catchup_bytes / 2**20:.1f} MB)"],
        ["survivors", len(survivors)],
        ["survivor revisions", ",".join(map(str, sorted(revisions))) or "-"],
        ["identical state hash on all survivors", "yes" if len(hashes) == 1 and len(survivors) >= 2
         else "NO"],
        ["accepted peers that did not finish", len(unfinished)],
        ["peer errors / crashes", f"{len(st.errors)} / {len(st.crashes)}"],
    ]
    master_ok = True
    if st.master_kills:
        limit = args.max_master_gap if args.max_master_gap is not None else args.restart_delay + 2.0
        master_ok = st.master_gap <= limit
        rows[1:1] = [
            ["master SIGKILLs (restarted on the same port after s)",
             f"{len(st.master_kills)} (every {args.master_kill_every:g}s, {args.restart_delay:g}s)"],
            ["longest gap without a completed all-reduce across a master kill s",
             f"{st.master_gap:.2f} (limit {limit:.2f})"],
            ["longest time from a kill to the restarted master listening s", f"{st.restart_s:.2f}"],
            ["longest time from a restarted master listening to the next all-reduce s",
             f"{st.listen_gap:.2f}"],
            ["joins lost to a master kill (not admitted yet)", st.lost_joins],
        ]
    print(c.format_table(["churn soak", "result"], rows))
    ok = len(hashes) == 1 and len(survivors) >= 2 and len(revisions) == 1 and not st.errors \
        and not st.crashes and st.longest_gap < args.max_gap and master_ok
    for ch in unfinished:
        last = dict(ch.info.get("last", {}))
        age = time.monotonic() - float(last.pop("t", st.t0))
        print(f"  unfinished: {ch.name} (peer {ch.info.get('peer')}), last report {age:.1f}s ago: {last}")
    print(f"\nsoak {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of churn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-peers", type=int, default=10)
    p.add_argument("--min-peers", type=int, default=2)
    p.add_argument("--stop-fraction", type=float, default=0.5, help="share of faults that are SIGSTOP")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="master's heartbeat timeout")
    p.add_argument("--straggler-timeout", type=float, default=1.0,
                   help="master's straggler timeout (0: off, only the heartbeat timeout applies)")
    p.add_argument("--peer-heartbeat-interval", type=float, default=0.25,
                   help="peers' heartbeat interval (s)")
    p.add_argument("--peer-stall-timeout", type=float, default=None,
                   help="peers' p2p_stall_timeout (default: the library's)")
    p.add_argument("--event-min", type=float, default=0.5, help="shortest pause between churn events (s)")
    p.add_argument("--event-max", type=float, default=2.0, help="longest pause between churn events (s)")
    p.add_argument("--step-delay", type=float, default=0.02, help="simulated compute per step (s)")
    p.add_argument("--hidden", type=int, default=128, help="MLP width of the training peers")
    p.add_argument("--max-gap", type=float, default=60.0,
                   help="fail if no all-reduce completes for this long (s)")
    p.add_argument("--master-kill-every", type=float, default=0.0,
                   help="SIGKILL the master every this many seconds, restart it on the same port (0: never)")
    p.add_argument("--restart-delay", type=float, default=1.0,
                   help="seconds from the master's SIGKILL to its restart")
    p.add_argument("--rebuild-grace", type=float, default=None,
                   help="the restarted master's --rebuild-grace (default: pccl-master's)")
    p.add_argument("--rebuild-quiet", type=float, default=None,
                   help="the restarted master's --rebuild-quiet (default: pccl-master's; 0: off)")
    p.add_argument("--max-master-gap", type=float, default=None,
                   help="fail if an all-reduce gap across a master kill exceeds this (default: delay + 2)")
    p.add_argument("--stop-timeout", type=float, default=60.0)
    p.add_argument("--status-every", type=float, default=30.0)
    p.add_argument("--verbose", action="store_true", help="also print joins and catch-ups")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    print(f"churn soak; {c.machine_line()}; {args.duration:g}s, seed {args.seed}", flush=True)
    try:
        return trio.run(run, args)
    except KeyboardInterrupt:
        print("interrupted; all children killed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
