"""The backend's reduce and all_to_all on a pccl.testing cluster whose torch ranks are not the ring order.

The multi-process tests against Gloo (test_torch_distributed.py) run with torch rank == ring position;
here every peer's torch rank is the reverse of its ring position, so a chunk or a root addressed by
ring position instead of torch rank shows up as a wrong result.
"""

from __future__ import annotations

from typing import Any

import torch
import trio
import trio.testing

from pccl import ReduceOp
from pccl.peer.communicator import Communicator
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch._dist_kinds import Configuration, Kinds

N = 3


def _kinds(comm: Communicator, calls: list[str]) -> Kinds:
    rank_of_pos = tuple(reversed(range(N)))
    config = Configuration(rank=rank_of_pos[comm.rank], rank_of_pos=rank_of_pos,
                           peer_ids=tuple(comm.group_ring), newcomers=0)
    kinds = Kinds(comm, config)
    for name in ("all_to_all", "all_gather", "reduce", "all_reduce"):  # which kinds ran (the traffic)
        real = getattr(comm, name)

        async def spy(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return await _real(*args, **kw)

        setattr(comm, name, spy)
    return kinds


async def test_reduce_and_all_to_all_address_torch_ranks(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    cluster = await pccl_cluster(N)
    out: dict[int, dict[str, Any]] = {}
    calls: dict[int, list[str]] = {}

    async def peer(i: int) -> None:
        calls[i] = []
        kinds = _kinds(cluster.peer(i), calls[i])
        me = kinds.config.rank
        res: dict[str, Any] = {}
        even = [torch.full((2,), 10 * me + dst, dtype=torch.int64) for dst in range(N)]
        res["even"] = await kinds.all_to_all("all_to_all", even, tag=3)
        res["even_calls"] = list(calls[i])
        uneven = [torch.full((me + 1 + dst,), 100.0 * me + dst, dtype=torch.float64) for dst in range(N)]
        res["uneven"] = await kinds.all_to_all("all_to_all", uneven, tag=4)
        send = torch.arange(5, dtype=torch.int64) + 10 * me
        res["reduce"] = await kinds.reduce("reduce", send, op=ReduceOp.SUM, root=0, tag=5)
        res["send_after"] = send
        out[me] = res

    async with trio.open_nursery() as nursery:
        for i in cluster.alive:
            nursery.start_soon(peer, i)

    for me, res in out.items():
        assert [t.tolist() for t in res["even"]] == [[10 * src + me] * 2 for src in range(N)]
        assert res["even_calls"] == ["all_gather", "all_to_all"]  # sizes, then the native kind
        expected = [[100.0 * src + me] * (src + 1 + me) for src in range(N)]
        assert [t.tolist() for t in res["uneven"]] == expected
        if me == 0:
            assert res["reduce"].tolist() == (torch.arange(5) * N + 10 * sum(range(N))).tolist()
        else:
            assert res["reduce"] is None
        assert torch.equal(res["send_after"], torch.arange(5, dtype=torch.int64) + 10 * me)
    for i in calls:  # the uneven call took the padded all-gather; reduce the native kind
        assert calls[i] == ["all_gather", "all_to_all", "all_gather", "all_gather", "reduce"]
