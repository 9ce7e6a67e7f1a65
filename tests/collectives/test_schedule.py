"""Pure ring schedules: chunking, step tables, and a frame-level simulation of every plan."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl.collectives.schedule import (
    KINDS,
    SRC_SEND,
    RecvFrame,
    SendFrame,
    cached_plan,
    chunk_bounds,
    chunk_range,
    chunk_sizes,
    output_count,
    plan_exchange,
    plan_ring,
    ring_steps,
)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("count", [0, 1, 2, 3, 6, 7, 100, 1001])
def test_chunks_follow_the_protocol_formula(n: int, count: int) -> None:
    bounds = chunk_bounds(count, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    for c, (a, e) in enumerate(bounds):
        assert e - a == count // n + (1 if c < count % n else 0)
        assert chunk_range(count, n, c) == (a, e)
        if c:
            assert bounds[c - 1][1] == a  # contiguous, in order
    assert chunk_sizes(count, n) == [e - a for a, e in bounds]


def test_chunk_range_rejects_bad_index() -> None:
    with pytest.raises(ValueError):
        chunk_range(10, 3, 3)
    with pytest.raises(ValueError):
        chunk_sizes(-1, 3)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_all_reduce_steps_form_a_ring(n: int) -> None:
    steps = [ring_steps("all_reduce", n, r) for r in range(n)]
    assert all(len(s) == 2 * (n - 1) for s in steps)
    for r in range(n):
        for t in range(2 * (n - 1)):
            # what r sends at step t is what its successor receives at step t
            assert steps[r][t].send_chunk == steps[(r + 1) % n][t].recv_chunk
            assert steps[r][t].reduce == (t <= n - 2)
            if t:
                # the chunk sent at step t is the one received (and reduced) at step t-1
                assert steps[r][t].send_chunk == steps[r][t - 1].recv_chunk
        rs_received = [s.recv_chunk for s in steps[r][: n - 1]]
        assert sorted(rs_received) == sorted(set(range(n)) - {(r - 1) % n})
        assert rs_received[-1] == r  # reduce-scatter leaves chunk r on rank r
        ag_received = [s.recv_chunk for s in steps[r][n - 1 :]]
        assert sorted(ag_received) == sorted(set(range(n)) - {r})


@pytest.mark.parametrize("n", [2, 3, 6])
def test_all_gather_steps_form_a_ring(n: int) -> None:
    steps = [ring_steps("all_gather", n, r) for r in range(n)]
    for r in range(n):
        assert steps[r][0].send_chunk == r
        assert sorted(s.recv_chunk for s in steps[r]) == sorted(set(range(n)) - {r})
        for t, s in enumerate(steps[r]):
            assert s.send_chunk == steps[(r + 1) % n][t].recv_chunk


def test_ring_steps_reject_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ring_steps("all_reduce", 1, 0)
    with pytest.raises(ValueError):
        ring_steps("all_reduce", 3, 3)
    with pytest.raises(ValueError):
        ring_steps("broadcast", 3, 0)
    with pytest.raises(ValueError):
        plan_ring("bogus", 3, 0, 10, 4)
    with pytest.raises(ValueError):
        plan_ring("broadcast", 3, 0, 10, 4, root=3)
    with pytest.raises(ValueError):
        plan_ring("all_reduce", 3, 0, 10, 0)


def simulate(
    kind: str, n: int, count: int, block_elems: int, root: int = 0, *, exchange: bool = False
) -> list[np.ndarray]:
    """Execute every rank's plan frame by frame, delivering sends to the successor by ``seq``.

    Data: rank r's input is a (count, n) matrix of zeros with ones in column r, so after a SUM
    every cell counts how often each rank's contribution reached that element. The simulation
    also checks that ranges match between sender and receiver, that a send is released only
    after its dependency, and that every frame is used exactly once.
    """
    if exchange:
        plans = [plan_exchange(r, count, block_elems) for r in range(n)]
    else:
        plans = [plan_ring(kind, n, r, count, block_elems, root) for r in range(n)]
    for r in range(n):
        succ = plans[(r + 1) % n]
        assert len(plans[r].sends) == len(succ.recvs), "sender and receiver disagree on frame count"
        for f, g in zip(plans[r].sends, succ.recvs, strict=True):
            assert f.seq == g.seq and f.end - f.start == g.end - g.start > 0
    out_count = output_count(kind, n, count)
    inputs = []
    for r in range(n):
        x = np.zeros((count, n), np.int64)
        if kind in ("all_gather", "broadcast"):
            x[:, r] = np.arange(count) + 1000 * (r + 1)  # distinct, recognizable values
        else:
            x[:, r] = 1  # one unit of "rank r's contribution"
        inputs.append(x)
    outs = [np.full((out_count, n), -1, np.int64) for _ in range(n)]
    for r, p in enumerate(plans):
        if p.local_copy is not None:
            s0, s1, o0 = p.local_copy
            outs[r][o0 : o0 + s1 - s0] = inputs[r][s0:s1]
    inbox: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
    released = [list(p.initial) for p in plans]
    sent = [set[int]() for _ in range(n)]
    next_recv = [0] * n
    progress = True
    while progress:
        progress = False
        for r, p in enumerate(plans):
            while released[r]:
                j = released[r].pop(0)
                assert j not in sent[r]
                sent[r].add(j)
                f = p.sends[j]
                src = inputs[r] if f.source == SRC_SEND else outs[r]
                inbox[(r + 1) % n][f.seq] = src[f.start : f.end].copy()
                progress = True
            while next_recv[r] < len(p.recvs) and p.recvs[next_recv[r]].seq in inbox[r]:
                i = next_recv[r]
                g = p.recvs[i]
                if g.to_scratch:  # out holds this rank's input (local_copy): add the received part
                    assert g.reduce and p.local_copy == (0, count, 0)
                    outs[r][g.start : g.end] += inbox[r].pop(g.seq)
                else:
                    outs[r][g.start : g.end] = inbox[r].pop(g.seq)
                    if g.reduce:
                        outs[r][g.start : g.end] += inputs[r][g.start : g.end]
                released[r].extend(p.unlocks[i])
                next_recv[r] += 1
                progress = True
    for r, p in enumerate(plans):
        assert next_recv[r] == len(p.recvs), "a receive never completed: the plan deadlocks"
        assert sent[r] == set(range(len(p.sends)))
        assert not inbox[r]
    return outs


# the kinds whose ring plans talk to the ring neighbours only (this simulator's model; all_to_all's
# pairwise plan is checked with every other plan in test_schedules.py)
NEIGHBOUR_KINDS = [k for k in KINDS if k != "all_to_all"]


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(NEIGHBOUR_KINDS),
    n=st.integers(2, 6),
    count=st.integers(0, 40),
    block_elems=st.integers(1, 9),
    root=st.integers(0, 5),
)
def test_every_plan_delivers_exactly_once(kind: str, n: int, count: int, block_elems: int, root: int) -> None:
    root %= n
    outs = simulate(kind, n, count, block_elems, root)
    if kind == "all_reduce":
        for r in range(n):
            assert (outs[r] == 1).all(), "each element must hold every rank's contribution exactly once"
    elif kind == "reduce_scatter":
        for r in range(n):
            a, e = chunk_range(count, n, r)
            assert (outs[r][a:e] == 1).all()
            assert plan_ring(kind, n, r, count, block_elems).owned == (a, e)
    elif kind == "all_gather":
        expected = np.concatenate([np.arange(count) + 1000 * (r + 1) for r in range(n)])
        for r in range(n):
            col = np.array([outs[r][i, i // count] if count else 0 for i in range(n * count)])
            assert (col == expected).all()
    elif kind == "reduce":
        # the root holds every rank's contribution exactly once; nothing else is the result
        assert (outs[root] == 1).all()
        for r in range(n):
            want = (0, count) if r == root else (0, 0)
            assert plan_ring(kind, n, r, count, block_elems, root).owned == want
    else:
        for r in range(n):
            assert (outs[r][:, root] == np.arange(count) + 1000 * (root + 1)).all()


@settings(max_examples=60, deadline=None)
@given(count=st.integers(0, 40), block_elems=st.integers(1, 9))
def test_exchange_plan_delivers_every_contribution_once(count: int, block_elems: int) -> None:
    outs = simulate("all_reduce", 2, count, block_elems, exchange=True)
    for r in range(2):
        assert (outs[r] == 1).all()


def test_exchange_plan_puts_rank_0_first_on_both_ranks() -> None:
    p0, p1 = plan_exchange(0, 10, 4), plan_exchange(1, 10, 4)
    # One step: every frame can go at once, and the whole input crosses in each direction.
    assert p0.initial == tuple(range(3)) and p1.initial == tuple(range(3))
    assert [(f.start, f.end) for f in p0.sends] == [(0, 4), (4, 8), (8, 10)]
    assert p0.send_elems == p0.recv_elems == p1.send_elems == p1.recv_elems == 10
    # rank 0 starts from its own input and reduces x1 into it: op(x0, x1);
    # rank 1 receives x0 into out and reduces its own input into it: op(x0, x1) again.
    assert p0.local_copy == (0, 10, 0) and all(f.to_scratch and f.reduce for f in p0.recvs)
    assert p1.local_copy is None and all(f.reduce and not f.to_scratch for f in p1.recvs)
    assert plan_exchange(0, 0, 4).sends == () and plan_exchange(0, 0, 4).local_copy is None
    assert cached_plan("all_reduce", 2, 0, 10, 4, exchange=True) == p0
    assert cached_plan("all_reduce", 2, 0, 10, 4) != p0  # the ring plan, cached separately
    with pytest.raises(ValueError):
        cached_plan("all_reduce", 3, 0, 10, 4, exchange=True)
    with pytest.raises(ValueError):
        cached_plan("reduce_scatter", 2, 0, 10, 4, exchange=True)
    with pytest.raises(ValueError):
        plan_exchange(2, 10, 4)


def test_blocks_respect_block_size_and_lanes_stripe() -> None:
    p = plan_ring("all_reduce", 2, 0, 100, 10)
    assert all(f.end - f.start <= 10 for f in p.sends)
    lanes = [f.lane for f in p.sends if f.step == 0]
    assert lanes == list(range(len(lanes)))  # consecutive blocks of a step take consecutive lanes
    assert len(p.sends) == len(p.recvs) == 10  # 50 elements per chunk, 5 blocks, 2 steps


def test_count_zero_and_tiny_counts_have_no_empty_frames() -> None:
    assert plan_ring("all_reduce", 4, 1, 0, 8).sends == ()
    p = plan_ring("all_reduce", 4, 1, 2, 8)  # chunks 1,1,0,0
    frames: tuple[SendFrame | RecvFrame, ...] = (*p.sends, *p.recvs)
    assert all(f.end > f.start for f in frames)


def test_cached_plan_is_reused() -> None:
    a = cached_plan("all_reduce", 3, 1, 1000, 64)
    assert cached_plan("all_reduce", 3, 1, 1000, 64) is a
    assert cached_plan("all_reduce", 3, 1, 1001, 64) is not a


@pytest.mark.parametrize(
    "path",
    [
        "pccl/collectives/schedule.py",
        "pccl/collectives/cost.py",
        "pccl/testing/plans.py",
        "pccl/wire/data.py",
    ],
)
def test_pure_modules_import_neither_trio_nor_socket(path: str) -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    tree = ast.parse((root / path).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    assert not names & {"trio", "socket", "select", "asyncio"}
