"""Halving-doubling and tree plans over real P2P pools on the virtual network (pccl.testing.plan_exec):
exact results through the real framing, receive slots and stash, and virtual times equal to the
schedules' step counts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import trio
import trio.testing

from pccl import ReduceOp
from pccl.collectives.schedule import SCHEDULES, Plan, all_plans, output_count, schedule_kinds
from pccl.testing import VirtualNetwork
from pccl.testing.plan_exec import open_plan_pools

CASES = [(s, k) for s in SCHEDULES for k in schedule_kinds(s) if s != "ring"]


def _links(plans: Sequence[Plan]) -> set[tuple[int, int]]:
    return {(r, f.peer) for r, p in enumerate(plans) for f in p.sends}


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize(("schedule", "kind"), CASES)
async def test_plans_run_exactly_over_pools(
    schedule: str, kind: str, n: int, autojump_clock: trio.testing.MockClock
) -> None:
    net = VirtualNetwork(latency=0.001, bandwidth=1e8)
    hosts = [net.host(f"p{i}") for i in range(n)]
    count = 1000 + n  # uneven chunks; blocks of 300 elements: several frames per transfer
    root = n - 1 if kind == "broadcast" else 0
    plans = all_plans(schedule, kind, n, count, 300, root)
    rng = np.random.default_rng(n)
    async with open_plan_pools(hosts, [h.address for h in hosts], _links(plans)) as pp:
        for op_seq, op in enumerate([ReduceOp.SUM, ReduceOp.MAX], start=1):
            xs = [rng.integers(-(1 << 40), 1 << 40, count, dtype=np.int64) for _ in range(n)]
            outs = [np.zeros(output_count(kind, n, count), np.int64) for _ in range(n)]
            await pp.run(plans, xs, outs, tag=7, op_seq=op_seq, op=op)
            if kind == "broadcast":
                ref = xs[root]
            elif kind == "all_gather":
                ref = np.concatenate(xs)
            else:
                ref = np.sum(xs, axis=0) if op == ReduceOp.SUM else np.max(xs, axis=0)
            for r in range(n):
                a, e = plans[r].owned
                assert (outs[r][a:e] == ref[a:e]).all(), (r, op)
        assert all(pool.statistics()["stashed_frames"] == 0 for pool in pp.pools)


@pytest.mark.parametrize("n", [4, 5, 16])
async def test_virtual_times_are_the_dependent_steps(n: int, autojump_clock: trio.testing.MockClock) -> None:
    """A 4 KB all-reduce over 25 ms links takes 25 ms per dependent step: 2(n-1) on the ring,
    2 log2 p (+2 when n is not a power of two) with halving-doubling, twice the depth on a tree."""
    net = VirtualNetwork(latency=0.025, bandwidth=125e6)
    hosts = [net.host(f"p{i}") for i in range(n)]
    p_log = n.bit_length() - 1
    depth = max(bin(v).count("1") for v in range(n))
    steps = {"ring": 2 * (n - 1), "hd": 2 * p_log + (0 if n & (n - 1) == 0 else 2), "tree": 2 * depth}
    for schedule, want in steps.items():
        plans = all_plans(schedule, "all_reduce", n, 1024, 1 << 20)
        async with open_plan_pools(hosts, [h.address for h in hosts], _links(plans)) as pp:
            xs = [np.full(1024, r + 1, np.float32) for r in range(n)]
            outs = [np.zeros(1024, np.float32) for _ in range(n)]
            t0 = trio.current_time()
            await pp.run(plans, xs, outs, tag=1, op_seq=1)
            elapsed = trio.current_time() - t0
        assert all((o == n * (n + 1) / 2).all() for o in outs)
        assert elapsed == pytest.approx(want * 0.025, abs=0.002), schedule
