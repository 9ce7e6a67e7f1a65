"""The outer all-reduce of DiLoCo's ``replay_heals`` on a fake communicator: sums plus an unquantized count,
run again whole (every bucket, the count too) when a peer is lost after some buckets completed, so one
set of contributors makes every bucket and the count; a driver core that divides by the count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
from torch import nn

from pccl import RankConnectionLostError, ReduceInfo, ReduceOp, TooFewPeersError
from pccl.torch._diloco import DiLoCoCore
from pccl.torch._exec import Executor
from pccl.torch._ops import AllReduce


class FakeComm:
    """Each all-reduce adds to ``send`` what the other peers add in that pass (``others[pass][tag]``; a
    tag's n-th call is of pass n); ``lose`` names (pass, tag) pairs that fail with
    RankConnectionLostError, as when a peer is lost mid-op (the ring then has one peer less)."""

    def __init__(self, others: list[dict[int, float]], lose: set[tuple[int, int]], ring: int = 3) -> None:
        self.others, self.lose = others, lose
        self.group_ring = list(range(ring))
        self.calls: list[tuple[int, int, Any, Any]] = []  # (pass, tag, op, quantization)

    async def all_reduce(self, send: torch.Tensor, recv: torch.Tensor, *, op: ReduceOp, tag: int,
                         quantization: Any) -> ReduceInfo:
        await trio.lowlevel.checkpoint()
        n = sum(1 for _, t, _, _ in self.calls if t == tag)
        self.calls.append((n, tag, op, quantization))
        if (n, tag) in self.lose:
            self.group_ring = self.group_ring[:-1]
            raise RankConnectionLostError("a peer was lost")
        recv.copy_(send + self.others[n][tag])
        return ReduceInfo(local_world_size=len(self.group_ring), tx_bytes=4, rx_bytes=4)


def _buffers() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    pairs = [(torch.full((4,), 1.0), torch.zeros(4)) for _ in range(3)]
    return pairs, (torch.ones(1), torch.zeros(1))


async def _call(ex: Executor, op: AllReduce) -> Any:
    return await ex.all_reduce(op)


def test_a_lost_peer_after_some_buckets_completed_runs_every_bucket_again() -> None:
    pairs, count = _buffers()
    # first pass: three peers (the others add 2.0, and 2 to the count); bucket 2 fails after 0 and 1
    # completed; second pass: the survivors (the other adds 1.0, and 1 to the count)
    first = {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0}
    second = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    comm = FakeComm([first, second], lose={(0, 2)})
    ex = Executor(comm)  # type: ignore[arg-type]
    op = AllReduce(pairs, ReduceOp.SUM, None, max_in_flight=1, retry_lost=True, exact=[count])
    info = trio.run(_call, ex, op)
    assert ex.whole_retries == 1
    # every bucket and the count ran again in the second pass; the count unquantized and summed
    assert sorted(t for n, t, _, _ in comm.calls if n == 1) == [0, 1, 2, 3]
    assert [(o, q) for _, t, o, q in comm.calls if t == 3] == [(ReduceOp.SUM, None)] * 2
    # one set of contributors everywhere: the survivors' (buckets 0 and 1 lost the dead peer's part)
    assert all(torch.equal(r, torch.full((4,), 2.0)) for _, r in pairs) and float(count[1][0]) == 2.0
    assert info.local_world_size == 2


def test_without_a_count_only_the_failed_buckets_are_retried() -> None:
    """The established path (AVG, no ``exact``): the communicator's own retry of the failed buckets."""
    pairs, _ = _buffers()
    asked: list[list[Any]] = []

    class Comm:
        group_ring = [0, 1, 2]

        async def all_reduce_multiple_with_retry(self, ops: list[dict[str, Any]], **kw: Any) -> ReduceInfo:
            asked.append([d["op"] for d in ops])
            return ReduceInfo(local_world_size=3, tx_bytes=0, rx_bytes=0)

    trio.run(_call, Executor(Comm()), AllReduce(pairs, ReduceOp.AVG, retry_lost=True))  # type: ignore[arg-type]
    assert asked == [[ReduceOp.AVG] * 3]


def test_nobody_left_is_too_few_peers() -> None:
    pairs, count = _buffers()
    comm = FakeComm([{0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}], lose={(0, 0)}, ring=2)
    op = AllReduce(pairs, ReduceOp.SUM, retry_lost=True, exact=[count])
    with pytest.raises(TooFewPeersError):
        trio.run(_call, Executor(comm), op)  # type: ignore[arg-type]


def test_the_core_divides_the_sums_by_the_count_and_keeps_the_average_identical() -> None:
    model = nn.Linear(3, 1)
    core = DiLoCoCore(model, torch.optim.SGD(model.parameters(), lr=0.1), outer_optimizer=None, inner_steps=1,
                      delayed=False, quantization=None, just_joined=False, total_outer_steps=None,
                      bucket_bytes=1 << 20, max_in_flight=4, min_world_size=1, poll_interval=0.1,
                      replay_heals=True)
    op = core._reduce()
    assert op.op == ReduceOp.SUM and op.exact == [(core.count_send, core.count_recv)]
    for _, recv in core.buckets.pairs:
        recv.copy_(torch.arange(recv.numel(), dtype=torch.float32) * 3.0)
    core.count_recv.fill_(3.0)
    averages = core._averages()
    assert torch.equal(torch.cat([a.flatten() for a in averages]), torch.arange(4, dtype=torch.float32))
    core.count_recv.fill_(0.0)
    with pytest.raises(Exception, match="0 contributors"):
        core._averages()
    with pytest.raises(Exception, match="delayed=False"):
        DiLoCoCore(model, torch.optim.SGD(model.parameters(), lr=0.1), outer_optimizer=None, inner_steps=1,
                   delayed=True, quantization=None, just_joined=False, total_outer_steps=None,
                   bucket_bytes=1 << 20, max_in_flight=4, min_world_size=1, poll_interval=0.1,
                   replay_heals=True)
