"""The master's CPU per stall report of one stalled operation (issue 33: the plan rule and the rules for
the member that stops where it owes nothing run on failure reports only, in the master's loop).

For each world size and schedule, a 4 KiB float32 all-reduce stands still with rank 0 reading nothing
(its initial sends still go out, every other participant takes what reaches it and works through its
plan, as in tests/security/test_plan_holder.py); every participant still waiting testifies
(``CollectiveDone.io``) and the master judges each report as ``StallCourt.report`` does:
``StallTestimony.false_blocks``, ``add``, ``holders`` and ``last_holder``. Prints, per case, the plans'
estimated frames, whether the plans are built (under ``plan_rule.MAX_FRAMES``), the worst single report
and all reports together (CPU ms, ``time.process_time``), and the same without ``last_holder``, each
with the planner's cache of small plans (pccl/collectives/schedule.py ``cached_plan``) cleared first: a
stalled operation of a shape the master planned before costs less.

usage: python benchmarks/stall_reports.py [--worlds 4,22,64,256] [--schedules ring,hd,tree]
"""

from __future__ import annotations

import argparse
import time

from pccl._types import DataType
from pccl.collectives import schedule as plan_cache
from pccl.collectives.op_plan import DEFAULT_BLOCK_BYTES
from pccl.master import plan_rule
from pccl.master.plan_rule import OpFrames, estimated_frames, op_frames, report_frames
from pccl.master.testimony import StallTestimony
from pccl.wire.messages import CollectiveDescriptor

COUNT = 1024  # float32: 4 KiB


def descriptor(schedule: str) -> CollectiveDescriptor:
    return CollectiveDescriptor(kind="all_reduce", dtype=int(DataType.FLOAT32), element_count=COUNT, op=0,
                                root=-1, quantization=0, quantized_dtype=int(DataType.UINT8),
                                schedule=schedule)


def standstill(frames: OpFrames) -> tuple[dict[int, list[tuple[int, int, int]]], set[int]]:
    """Each waiting participant's rows, rank 0 reading nothing; and the participants that completed."""
    plans, n = frames.plans, len(frames.ids)
    done, sent = [0] * n, [set[int]() for _ in range(n)]
    where = [{(f.peer, f.seq): j for j, f in enumerate(p.sends)} for p in plans]
    moved = True
    while moved:
        moved = False
        for r, plan in enumerate(plans):
            for j in list(plan.initial) + [j for u in plan.unlocks[:done[r]] for j in u]:
                if j not in sent[r]:
                    sent[r].add(j)
                    moved = True
            while r != 0 and done[r] < len(plan.recvs):
                f = plan.recvs[done[r]]
                if where[f.peer][(r, f.seq)] not in sent[f.peer]:
                    break
                done[r] += 1
                moved = True
    rows: dict[int, list[tuple[int, int, int]]] = {}
    complete = set()
    for r in range(n):
        if r != 0 and done[r] == len(plans[r].recvs):
            complete.add(frames.ids[r])
            continue
        out = []
        for q in range(n):
            if q == r:
                continue
            to_q = sum(frames.send_bytes[r][j] for j in sent[r] if plans[r].sends[j].peer == q)
            from_q = sum(frames.send_bytes[q][j] for j in sent[q] if plans[q].sends[j].peer == r)
            if to_q or from_q or r == 0:
                out.append((frames.ids[q], to_q, from_q if r != 0 else 0))
        rows[frames.ids[r]] = out
    return rows, complete


def judge(n: int, schedule: str, rows: dict[int, list[tuple[int, int, int]]], complete: set[int],
          last: bool, cold: bool = True) -> tuple[float, float]:
    """Every report through a fresh StallTestimony; (worst, total) CPU ms."""
    ids = list(range(1, n + 1))
    if cold:
        plan_cache._PLAN_CACHE.clear()  # the ring's small plans are cached (a repeated shape is cheap)
    t = StallTestimony()
    t.plans.note(7, descriptor(schedule), ids)
    worst = total = 0.0
    for peer, mine in rows.items():
        t0 = time.process_time()
        t.false_blocks(7, peer, mine, [], schedule)
        t.add(7, peer, mine, None, (), schedule)
        t.holders(7, peer)
        if last:
            t.last_holder(7, peer, mine, complete, schedule)
        dt = (time.process_time() - t0) * 1e3
        worst, total = max(worst, dt), total + dt
    return worst, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="4,22,64,256")
    ap.add_argument("--schedules", default="ring,hd,tree")
    ap.add_argument("--max-frames", type=int, default=None,
                    help="plan_rule.MAX_FRAMES for this run (default: the module's)")
    a = ap.parse_args()
    if a.max_frames is not None:
        plan_rule.MAX_FRAMES = a.max_frames
    print("| world | schedule | est. frames: all / a report | plans built | worst report ms | "
          "all reports ms | without last_holder: worst / all ms |")
    print("|---:|---|---:|---|---:|---:|---:|")
    for n in (int(x) for x in a.worlds.split(",")):
        for schedule in a.schedules.split(","):
            ids = list(range(1, n + 1))
            est = estimated_frames(schedule, n, COUNT, DEFAULT_BLOCK_BYTES // 4)
            per = report_frames(schedule, n, COUNT, DEFAULT_BLOCK_BYTES // 4)
            full = op_frames(descriptor(schedule), ids, max_frames=1 << 62)  # the testimonies themselves
            assert full is not None
            rows, complete = standstill(full)
            built = op_frames(descriptor(schedule), ids) is not None
            w0, a0 = judge(n, schedule, rows, complete, last=False)
            w1, a1 = judge(n, schedule, rows, complete, last=True)
            yes = "yes" if built else "no (over MAX_FRAMES)"
            print(f"| {n} | {schedule} | {est} / {per} | {yes} | {w1:.1f} | {a1:.1f} | {w0:.1f} / {a0:.1f} |")


if __name__ == "__main__":
    main()
