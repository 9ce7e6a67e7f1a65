"""Every collective kind through the blocking API, blocking and with async handles: reduce_scatter,
all_gather, broadcast, reduce and all_to_all (all_reduce has tests/blocking/test_collectives.py), numpy
and torch buffers, argument errors raised before voting."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from pccl.blocking import Communicator, PCCLError, ReduceInfo, ReduceOp, Result

from ._helpers import run_threads

Cluster = Callable[..., list[Communicator]]
N = 3


def _ranks(comms: list[Communicator]) -> list[int]:
    """Each communicator's rank, learned with a blocking all_gather of its index."""
    gathered = [np.full(N, -1, np.int64) for _ in comms]
    infos = run_threads([lambda i=i: comms[i].all_gather(np.array([i], np.int64), gathered[i], tag=9)
                         for i in range(N)])
    assert all(isinstance(info, ReduceInfo) and info.local_world_size == N for info in infos)
    order = gathered[0].tolist()
    assert all(g.tolist() == order for g in gathered) and sorted(order) == list(range(N))
    return [order.index(i) for i in range(N)]


def test_every_kind_blocking_numpy(cluster_factory: Cluster) -> None:
    comms = cluster_factory(N)
    rank = _ranks(comms)
    count = 7  # uneven chunks
    xs = [(np.arange(count) + 10 * (rank[i] + 1)).astype(np.int32) for i in range(N)]
    total = np.sum(xs, axis=0)
    # reduce_scatter: each peer its chunk, the rest untouched
    outs = [np.full(count, -1, np.int32) for _ in range(N)]
    got = run_threads([lambda i=i: comms[i].reduce_scatter(xs[i], outs[i], op=ReduceOp.SUM)
                       for i in range(N)])
    for i, (info, chunk) in enumerate(got):
        assert info.local_world_size == N
        assert (outs[i][chunk] == total[chunk]).all()
        assert (np.delete(outs[i], np.arange(count)[chunk]) == -1).all()
    # broadcast from rank 1
    bufs = [x.copy() for x in xs]
    run_threads([lambda i=i: comms[i].broadcast(bufs[i], root=1) for i in range(N)])
    src = xs[rank.index(1)]
    assert all((b == src).all() for b in bufs)
    # reduce to rank 2 with MAX: only the root's recv is written
    outs = [np.full(count, -1, np.int32) for _ in range(N)]
    run_threads([lambda i=i: comms[i].reduce(xs[i], outs[i], root=2, op=ReduceOp.MAX) for i in range(N)])
    for i in range(N):
        want = np.maximum.reduce(xs) if rank[i] == 2 else np.full(count, -1, np.int32)
        assert (outs[i] == want).all(), i
    # all_to_all in place: block j of peer i's buffer goes to rank j
    blocks = [np.arange(N * 2, dtype=np.int32) + 100 * rank[i] for i in range(N)]
    keep = [b.copy() for b in blocks]
    run_threads([lambda i=i: comms[i].all_to_all(blocks[i]) for i in range(N)])
    by_rank = [keep[rank.index(r)] for r in range(N)]
    for i in range(N):
        want = np.concatenate([by_rank[s][2 * rank[i] : 2 * rank[i] + 2] for s in range(N)])
        assert (blocks[i] == want).all(), i


def test_every_kind_async_torch(cluster_factory: Cluster) -> None:
    comms = cluster_factory(N)
    rank = _ranks(comms)
    xs = [torch.arange(6, dtype=torch.float32) + rank[i] for i in range(N)]
    rs = [torch.full((6,), -1.0) for _ in range(N)]
    gs = [torch.zeros(N * 6) for _ in range(N)]
    bs = [x.clone() for x in xs]
    ds = [torch.zeros(6) for _ in range(N)]
    a2a = [torch.zeros(6) for _ in range(N)]
    handles = [
        [comms[i].reduce_scatter_async(xs[i], rs[i], op=ReduceOp.AVG, tag=1),
         comms[i].all_gather_async(xs[i], gs[i], tag=2),
         comms[i].broadcast_async(bs[i], root=0, tag=3),
         comms[i].reduce_async(xs[i], ds[i], root=0, op=ReduceOp.SUM, tag=4),
         comms[i].all_to_all_async(xs[i], a2a[i], tag=5)]
        for i in range(N)
    ]
    for i in range(N):
        for h in handles[i]:
            ok, status, info = h.wait()
            assert ok and status == Result.SUCCESS and info.local_world_size == N, h.error
    by_rank = [xs[rank.index(r)] for r in range(N)]
    total = torch.stack(by_rank).sum(0)
    mean = total / N
    for i in range(N):
        chunk = handles[i][0].chunk
        assert chunk is not None and torch.equal(rs[i][chunk], mean[chunk])
        assert torch.equal(gs[i], torch.cat(by_rank))
        assert torch.equal(bs[i], by_rank[0])
        assert torch.equal(ds[i], total if rank[i] == 0 else torch.zeros(6))
        assert torch.equal(a2a[i], torch.cat([by_rank[s][2 * rank[i] : 2 * rank[i] + 2] for s in range(N)]))


def test_kind_argument_errors_before_voting(pair: list[Communicator]) -> None:
    a = pair[0]
    with pytest.raises(PCCLError) as exc:  # 5 elements are not 2 equal blocks
        a.all_to_all(np.zeros(5, np.float32), np.zeros(5, np.float32))
    assert exc.value.result == Result.INVALID_ARGUMENT
    with pytest.raises(PCCLError) as exc:
        a.reduce(np.zeros(4, np.float32), root=2)
    assert exc.value.result == Result.INVALID_ARGUMENT
    with pytest.raises(PCCLError) as exc:
        a.all_gather(np.zeros(4, np.float32), np.zeros(4, np.float32))
    assert exc.value.result == Result.INVALID_ARGUMENT
    with pytest.raises(PCCLError) as exc:
        a.reduce_scatter(np.zeros(4, np.float32), np.zeros(4, np.float64))
    assert exc.value.result == Result.INVALID_ARGUMENT
    # nothing was voted: the pair still runs an operation
    xs = [np.ones(4, np.float32), np.ones(4, np.float32)]
    run_threads([lambda i=i: pair[i].reduce(xs[i], root=0) for i in range(2)])
