"""Halving-doubling and tree schedules (and the ring, through the same simulator): every op x dtype x
schedule on 2 to 9 peers, executed by pccl.testing.plans.run_plans under several interleavings."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl import ReduceOp
from pccl.collectives import schedule as schedule_mod
from pccl.collectives.schedule import (
    SCHEDULES,
    all_plans,
    chunk_range,
    output_count,
    plan_ring,
    plan_schedule,
    schedule_kinds,
    tree_children,
    tree_subtree,
)
from pccl.testing.plans import PlanError, check_pairing, plan_times, run_plans

DTYPES: list[Any] = [
    np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
]
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
_UFUNC = {
    ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum
}
CASES = [(s, k) for s in SCHEDULES for k in schedule_kinds(s)]


def _inputs(dtype: Any, op: ReduceOp, n: int, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    dt = np.dtype(dtype)
    if dt.kind in "ui":
        info = np.iinfo(dt)
        # the whole range: SUM and PROD wrap, which is exact in any order
        return [rng.integers(info.min, info.max, count, dtype=dt, endpoint=True) for _ in range(n)]
    if op == ReduceOp.PROD:
        return [rng.uniform(0.9, 1.1, count).astype(dt) for _ in range(n)]
    return [rng.standard_normal(count).astype(dt) for _ in range(n)]


REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")


def _count(kind: str, n: int, count: int) -> int:
    """An input size for ``kind``: all_to_all's is ``n`` blocks of ``count``."""
    return n * count if kind == "all_to_all" else count


def _reference(kind: str, op: ReduceOp, xs: list[np.ndarray], root: int, rank: int = 0) -> np.ndarray:
    if kind == "broadcast":
        return xs[root]
    if kind == "all_gather":
        return np.concatenate(xs)
    if kind == "all_to_all":  # block i of rank's output: block ``rank`` of rank i's input
        c = xs[0].size // len(xs)
        return np.concatenate([x[rank * c : (rank + 1) * c] for x in xs])
    dt = xs[0].dtype
    if dt.kind in "ui":
        acc = xs[0].copy()
        for x in xs[1:]:
            with np.errstate(over="ignore"):
                acc = _UFUNC[op](acc, x).astype(dt)
        return acc
    wide = [x.astype(np.float64) for x in xs]
    acc = wide[0]
    for x in wide[1:]:
        acc = _UFUNC[op](acc, x)
    return acc


@pytest.mark.parametrize("n", range(2, 10))
@pytest.mark.parametrize(("schedule", "kind"), CASES)
def test_every_op_and_dtype_exact_and_bit_identical(schedule: str, kind: str, n: int) -> None:
    rng = np.random.default_rng(1000 * n + CASES.index((schedule, kind)))
    count = _count(kind, n, 29)  # a prime: uneven chunks for every world size
    root = (n - 1) if kind in ROOTED else 0
    plans = all_plans(schedule, kind, n, count, 4, root)
    ops = OPS if kind in REDUCING else [ReduceOp.SUM]
    seed = 0
    for dtype in DTYPES:
        for op in ops:
            seed += 1
            xs = _inputs(dtype, op, n, count, rng)
            outs = run_plans(plans, xs, op, output_count(kind, n, count), seed=seed)
            for r, out in enumerate(outs):
                ref = _reference(kind, op, xs, root, r)
                a, e = plans[r].owned
                got = out[a:e]
                if np.dtype(dtype).kind in "ui" or op in (ReduceOp.MIN, ReduceOp.MAX) or kind in (
                    "broadcast", "all_gather", "all_to_all",
                ):
                    assert (got.view(np.uint8) == ref[a:e].astype(got.dtype).view(np.uint8)).all(), (
                        schedule, kind, n, dtype, op, r
                    )
                else:
                    tol = {2: 0.05, 4: 1e-4, 8: 1e-10}[np.dtype(dtype).itemsize]
                    np.testing.assert_allclose(got.astype(np.float64), ref[a:e], rtol=tol, atol=tol * n)
            if kind == "reduce":  # only the root's output is the result
                assert plans[root].owned == (0, count) and all(
                    plans[r].owned == (0, 0) for r in range(n) if r != root
                )
            if kind not in ("reduce_scatter", "reduce", "all_to_all"):  # (their outputs differ by rank)
                first = outs[0].view(np.uint8)
                for r in range(1, n):
                    assert (outs[r].view(np.uint8) == first).all(), f"rank {r} differs from rank 0"


@pytest.mark.parametrize(("schedule", "kind"), CASES)
def test_float_results_identical_on_every_rank_under_any_interleaving(schedule: str, kind: str) -> None:
    """The final bits of each element are computed once: the interleaving never changes them."""
    n = 7
    count = _count(kind, n, 7) if kind == "all_to_all" else 50
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(count).astype(np.float16) for _ in range(n)]
    plans = all_plans(schedule, kind, n, count, 3, 2 if kind in ROOTED else 0)
    runs = [run_plans(plans, xs, ReduceOp.SUM, output_count(kind, n, count), seed=s) for s in range(6)]
    for outs in runs:
        for r in range(n):
            a, e = plans[r].owned
            assert (outs[r][a:e].view(np.uint16) == runs[0][r][a:e].view(np.uint16)).all()


@settings(max_examples=120, deadline=None)
@given(
    case=st.sampled_from(CASES),
    n=st.integers(2, 12),
    count=st.integers(0, 40),
    block_elems=st.integers(1, 9),
    root=st.integers(0, 11),
    seed=st.integers(0, 1000),
)
def test_plans_pair_up_and_finish_with_every_contribution_once(
    case: tuple[str, str], n: int, count: int, block_elems: int, root: int, seed: int
) -> None:
    """Plan-level invariants: every send has exactly one matching receive (peer, seq, size), no
    frame is empty, and the plans finish (no deadlock) under a random interleaving. Data: rank r
    contributes a one in column r, so after a SUM every cell counts rank r's contributions."""
    schedule, kind = case
    root %= n
    count = _count(kind, n, count)
    plans = all_plans(schedule, kind, n, count, block_elems, root)
    check_pairing(plans)
    cols = []
    for r in range(n):
        x = np.zeros((max(count, 1), n), np.int64)
        x[:, r] = 1 if kind in REDUCING else np.arange(max(count, 1)) + 100 * (r + 1)
        cols.append(x)
    # run column by column so that each column is a 1-D problem
    outs_by_col = [
        run_plans(
            plans, [x[:count, c].copy() for x in cols], ReduceOp.SUM, output_count(kind, n, count), seed=seed
        )
        for c in range(n)
    ]
    for r in range(n):
        a, e = plans[r].owned
        for c in range(n):
            got = outs_by_col[c][r][a:e]
            if kind in REDUCING:
                assert (got == 1).all()
            elif kind == "broadcast":
                assert (got == (cols[root][:count, c] if c == root else 0)).all()
            elif kind == "all_to_all":
                b = count // n
                expect = np.concatenate([cols[c][r * b : (r + 1) * b, c] if i == c else np.zeros(b, np.int64)
                                         for i in range(n)])
                assert (got == expect).all()
            else:
                expect = np.concatenate([x[:count, c] if i == c else np.zeros(count, np.int64)
                                         for i, x in enumerate(cols)])
                assert (got == expect).all()
        if kind == "reduce_scatter":
            assert (a, e) == chunk_range(count, n, r) == plan_ring(kind, n, r, count, 4).owned
        if kind == "reduce":
            assert (a, e) == ((0, count) if r == root else (0, 0))


def _critical_steps(schedule: str, kind: str, n: int) -> int:
    """Dependent steps of a small operation: its time with unit latency and free bandwidth."""
    plans = all_plans(schedule, kind, n, 64, 1 << 20)
    return round(max(plan_times(plans, 4, lambda a, b: 1.0, lambda a, b: float("inf"))))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 16, 24])
def test_latency_optimal_step_counts(n: int) -> None:
    depth = max(bin(v).count("1") for v in range(n))  # binomial tree: one level per set bit
    assert depth <= (n - 1).bit_length()  # at most ceil(log2 n)
    p_log = n.bit_length() - 1  # log2 of the largest power of two <= n
    fold = 0 if n & (n - 1) == 0 else 2
    assert _critical_steps("ring", "all_reduce", n) == 2 * (n - 1)
    assert _critical_steps("hd", "all_reduce", n) == 2 * p_log + fold
    # all_gather: pieces that need no fold start at once, so a non-power-of-two world can finish
    # sooner than fold + log2(p) + unfold
    assert p_log <= _critical_steps("hd", "all_gather", n) <= p_log + fold
    assert _critical_steps("tree", "all_reduce", n) == 2 * depth
    assert _critical_steps("tree", "broadcast", n) == depth


def test_tree_shape() -> None:
    assert tree_children(0, 8) == [1, 2, 4]
    assert tree_children(4, 8) == [5, 6]
    assert tree_children(0, 6) == [1, 2, 4] and tree_children(4, 6) == [5]
    assert tree_subtree(4, 6) == (4, 6) and tree_subtree(2, 6) == (2, 4) and tree_subtree(0, 6) == (0, 6)
    for n in range(2, 20):
        seen = sorted(c for v in range(n) for c in tree_children(v, n))
        assert seen == list(range(1, n))  # a spanning tree: every rank but 0 has one parent


def test_hd_reduce_scatter_moves_less_than_a_tree() -> None:
    """Bandwidth: halving-doubling sends about (p-1)/p of the buffer per rank, the tree's root
    receives a whole buffer per child."""
    n, count = 8, 8000
    hd = all_plans("hd", "all_reduce", n, count, 1 << 20)
    tree = all_plans("tree", "all_reduce", n, count, 1 << 20)
    assert max(p.send_elems for p in hd) == 2 * (n - 1) * count // n
    assert tree[0].recv_elems == 3 * count  # three children of the root


def test_unknown_schedule_kind_and_bad_arguments() -> None:
    with pytest.raises(ValueError):
        all_plans("hd", "broadcast", 4, 10, 4)
    with pytest.raises(ValueError):
        all_plans("bogus", "all_reduce", 4, 10, 4)
    with pytest.raises(ValueError):
        all_plans("tree", "all_reduce", 1, 10, 4)
    with pytest.raises(ValueError):
        all_plans("tree", "broadcast", 4, 10, 4, root=4)
    with pytest.raises(ValueError):
        plan_schedule("hd", "all_reduce", 4, 4, 10, 4)
    assert plan_schedule("hd", "all_reduce", 4, 1, 10, 4) is all_plans("hd", "all_reduce", 4, 10, 4)[1]


def test_simulator_catches_a_missing_dependency_and_a_missing_receive() -> None:
    """The checks can fail: a send released before its data is reduced gives wrong results under some
    interleaving, and a dropped receive is reported."""
    n, count = 4, 8
    plans = list(all_plans("hd", "all_reduce", n, count, 1 << 20))
    p0 = plans[0]
    broken_sends = tuple(dataclasses.replace(f, after=-1) for f in p0.sends)
    broken = dataclasses.replace(p0, sends=broken_sends, initial=tuple(range(len(p0.sends))),
                                 unlocks=tuple(() for _ in p0.recvs))
    xs = [np.full(count, r + 1, np.int64) for r in range(n)]
    results = [run_plans([broken, *plans[1:]], xs, ReduceOp.SUM, count, seed=s)[1] for s in range(20)]
    assert any((out != 10).any() for out in results)
    dropped = dataclasses.replace(p0, recvs=p0.recvs[:-1], unlocks=p0.unlocks[:-1])
    with pytest.raises(PlanError):
        run_plans([dropped, *plans[1:]], xs, ReduceOp.SUM, count)


def test_plan_sets_are_cached_unless_huge(monkeypatch: pytest.MonkeyPatch) -> None:
    a = all_plans("tree", "all_reduce", 6, 100, 7)
    assert all_plans("tree", "all_reduce", 6, 100, 7) is a
    assert all_plans("tree", "all_reduce", 6, 101, 7) is not a
    monkeypatch.setattr(schedule_mod, "_ALL_PLANS_CACHE_MAX_FRAMES", 100)
    big = all_plans("ring", "all_reduce", 4, 120, 5)  # 4 ranks x 6 steps x 6 blocks x 2 frames
    assert all_plans("ring", "all_reduce", 4, 120, 5) is not big
    assert all_plans("ring", "all_reduce", 4, 120, 5) == big
