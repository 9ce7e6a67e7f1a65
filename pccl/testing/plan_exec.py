"""A reference executor for plans of any schedule over real :class:`~pccl.peer.pool.P2PPool` s.

The live executor (:func:`pccl.collectives.executor.run_collective`) runs every schedule inside the
communicator (master, descriptors, abort and retry). This one, without any of that, runs any plan
(:func:`pccl.collectives.schedule.all_plans`: ring, halving-doubling, tree) with frames to and from
whichever rank each names, over pools that are connected to every rank the plans name
(:func:`open_plan_pools`) - on the virtual network under a ``MockClock`` that gives the schedules'
virtual times with the real data-plane code underneath (framing, receive slots, stash, windows).
It is a test and benchmark tool, kept short: sends go inline from the operation's task (no sender
tasks, no striping), and on failure it only forgets the operation.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from .._config import PeerConfig
from .._types import ReduceOp
from ..collectives.schedule import SRC_SEND, Plan
from ..kernels.reduce import reduce_into
from ..peer.p2p import serve_p2p
from ..peer.pool import P2PPool
from ..transport import Address, Transport

__all__ = ["PlanPools", "open_plan_pools", "run_plan"]


def _bytes(a: np.ndarray[Any, Any]) -> memoryview:
    return memoryview(a.view(np.uint8))  # type: ignore[arg-type]  # ndarray implements the buffer protocol


async def run_plan(
    pool: P2PPool,
    plan: Plan,
    ids: Sequence[int],
    *,
    tag: int,
    op_seq: int,
    send: np.ndarray[Any, Any],
    out: np.ndarray[Any, Any],
    op: ReduceOp = ReduceOp.SUM,
) -> None:
    """Execute this rank's ``plan`` (``ids[r]`` is rank ``r``'s peer id).

    Receives are registered up front and land straight in ``out`` or in the plan's scratch area;
    each is applied in plan order; a send goes when the receive it depends on has been applied.

    Args:
        pool: this peer's pool, connected to every rank the plan sends to.
        plan: this rank's plan.
        ids: peer ids by rank.
        tag: operation tag.
        op_seq: operation sequence number (unique per operation on this pool).
        send: this rank's input (never written).
        out: the output (``output_count`` elements, same dtype).
        op: SUM, PROD, MIN or MAX.

    Raises:
        RankConnectionLostError: a connection broke.
        RemoteProtocolError: a peer sent a frame that does not fit the plan.
    """
    isz = send.dtype.itemsize
    send_b, out_b = _bytes(send), _bytes(out)
    scratch = np.empty(plan.scratch_elems, send.dtype)
    # to_scratch frames without a scratch offset land at their out offsets (the exchange plan)
    at_out_offsets = any(f.to_scratch and f.scratch < 0 for f in plan.recvs)
    landing = np.empty(out.shape[0] if at_out_offsets else 0, send.dtype)

    def dest(i: int) -> np.ndarray[Any, Any]:
        f = plan.recvs[i]
        if not f.to_scratch:
            return out[f.start : f.end]
        if f.scratch >= 0:
            return scratch[f.scratch : f.scratch + f.end - f.start]
        return landing[f.start : f.end]

    async def go(j: int) -> None:
        f = plan.sends[j]
        src = send_b if f.source == SRC_SEND else out_b
        payload = src[f.start * isz : f.end * isz]
        await pool.send(ids[f.peer], tag, op_seq, f.seq, payload, conn_index=tag + f.lane)

    try:
        slots = [
            pool.expect(ids[f.peer], tag, op_seq, f.seq, _bytes(dest(i))) for i, f in enumerate(plan.recvs)
        ]
        if plan.local_copy is not None:
            s0, s1, o0 = plan.local_copy
            out[o0 : o0 + s1 - s0] = send[s0:s1]
        for j in plan.initial:
            await go(j)
        for i, slot in enumerate(slots):
            await slot.wait()
            f = plan.recvs[i]
            if f.to_scratch:
                reduce_into(out[f.start : f.end], dest(i), op)
            elif f.reduce:
                reduce_into(out[f.start : f.end], send[f.start : f.end], op)
            for j in plan.unlocks[i]:
                await go(j)
        await trio.lowlevel.checkpoint()
    finally:
        pool.forget_op(op_seq)


@dataclass
class PlanPools:
    """Pools of ``n`` peers, each connected to the ranks it sends to (see :func:`open_plan_pools`)."""

    ids: list[int]
    pools: list[P2PPool]
    addresses: list[Address]

    async def run(
        self,
        plans: Sequence[Plan],
        sends: Sequence[np.ndarray[Any, Any]],
        outs: Sequence[np.ndarray[Any, Any]],
        *,
        tag: int,
        op_seq: int,
        op: ReduceOp = ReduceOp.SUM,
    ) -> None:
        """Run one operation on every rank at once."""
        async with trio.open_nursery() as nursery:
            for r, plan in enumerate(plans):
                nursery.start_soon(
                    functools.partial(
                        run_plan, self.pools[r], plan, self.ids, tag=tag, op_seq=op_seq, send=sends[r],
                        out=outs[r], op=op,
                    )
                )


@asynccontextmanager
async def open_plan_pools(
    transports: Sequence[Transport],
    hosts: Sequence[str],
    links: set[tuple[int, int]],
    *,
    config: PeerConfig | None = None,
) -> AsyncIterator[PlanPools]:
    """One pool per transport, listening on ``hosts[r]``, with ``r -> s`` connected for every
    ``(r, s)`` in ``links`` (e.g. every ``(rank, frame.peer)`` of the plans' sends).

    Args:
        transports: one per rank (``VirtualNetwork.host(...)`` or TCP).
        hosts: the address each rank listens on and is reached at.
        links: directed rank pairs to connect.
        config: the pools' config (default :class:`~pccl.PeerConfig` defaults).

    Yields:
        The connected pools.
    """
    cfg = config or PeerConfig()
    ids = [100 + r for r in range(len(transports))]
    async with trio.open_nursery() as nursery:
        pools = [
            P2PPool(transport=t, my_peer_id=pid, pool_size=1, config=cfg)
            for t, pid in zip(transports, ids, strict=True)
        ]
        addresses: list[Address] = []
        for r, pool in enumerate(pools):
            serve = functools.partial(serve_p2p, config=cfg)
            handlers = {"ring": pool.handle_incoming}
            addresses.append(await nursery.start(serve, pool.transport, hosts[r], 0, handlers))
        async with trio.open_nursery() as connecting:
            for r, s in sorted(links):
                connecting.start_soon(pools[r].connect, ids[s], addresses[s][0], addresses[s][1])
        # wait until every incoming connection has been accepted on its receiving side
        want: dict[int, int] = {}
        for _r, s in links:
            want[s] = want.get(s, 0) + 1
        for s, count in want.items():
            while sum(pools[s].statistics()["incoming"].values()) < count:
                await trio.sleep(0.001)
        try:
            yield PlanPools(ids, pools, addresses)
        finally:
            for pool in pools:
                await pool.aclose()
            nursery.cancel_scope.cancel()
