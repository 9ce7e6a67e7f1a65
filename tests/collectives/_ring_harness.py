"""In-process ring of P2P pools over real loopback TCP (no master): the data plane alone."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from pccl import PeerConfig, ReduceOp
from pccl.collectives.executor import run_collective
from pccl.peer.p2p import serve_p2p
from pccl.peer.pool import P2PPool
from pccl.transport import Address, TcpTransport, Transport

CONFIG = PeerConfig(connect_timeout=5.0)



@dataclass
class Ring:
    ids: list[int]
    pools: list[P2PPool]
    addresses: list[Address]
    nursery: trio.Nursery
    cancel_scopes: list[trio.CancelScope] = field(default_factory=list)

    def addr_of(self, peer_id: int) -> Address:
        return self.addresses[self.ids.index(peer_id)]

    async def connect_ring(self) -> None:
        n = len(self.ids)
        async with trio.open_nursery() as nursery:
            for i, pool in enumerate(self.pools):
                nxt = self.ids[(i + 1) % n]
                host, port = self.addr_of(nxt)
                nursery.start_soon(pool.connect, nxt, host, port)
        # wait until every pool sees all its incoming connections (they are accepted asynchronously)
        for i, pool in enumerate(self.pools):
            prv = self.ids[(i - 1) % n]
            while pool.statistics()["incoming"].get(prv, 0) < pool.pool_size:
                await trio.sleep(0.001)


@asynccontextmanager
async def open_ring(
    n: int,
    *,
    pool_size: int = 1,
    transport_factory: Callable[[], Transport] = TcpTransport,
    transports: list[Transport] | None = None,
    config: PeerConfig = CONFIG,
    connect: bool = True,
) -> AsyncIterator[Ring]:
    ids = [10 + 7 * i for i in range(n)]  # ids unrelated to ring positions on purpose
    if transports is None:
        transports = [transport_factory() for _ in range(n)]
    async with trio.open_nursery() as nursery:
        pools = [
            P2PPool(transport=transports[i], my_peer_id=pid, pool_size=pool_size, config=config)
            for i, pid in enumerate(ids)
        ]
        addresses: list[Address] = []
        for pool in pools:
            serve = functools.partial(serve_p2p, config=config)
            addr = await nursery.start(serve, pool.transport, "127.0.0.1", 0, {"ring": pool.handle_incoming})
            addresses.append(addr)
        ring = Ring(ids, pools, addresses, nursery)
        if connect:
            await ring.connect_ring()
        try:
            yield ring
        finally:
            for pool in pools:
                await pool.aclose()
            nursery.cancel_scope.cancel()


async def run_ranks(
    ring: Ring,
    *,
    kind: str,
    sends: list[Any],
    outs: list[Any],
    tag: int,
    op_seq: int,
    op: ReduceOp = ReduceOp.SUM,
    root: int = 0,
    block_bytes: int = 1 << 20,
    ranks: list[int] | None = None,
) -> list[tuple[int, int] | None]:
    """Run one collective on every rank (or ``ranks``) concurrently; the (tx, rx) of each."""
    results: list[tuple[int, int] | None] = [None] * len(ring.ids)

    async def one(i: int) -> None:
        results[i] = await run_collective(
            ring.pools[i], kind=kind, ring=ring.ids, my_id=ring.ids[i], tag=tag, op_seq=op_seq,
            send=sends[i], out=outs[i], op=op, root=root, block_bytes=block_bytes,
        )

    async with trio.open_nursery() as nursery:
        for i in ranks if ranks is not None else range(len(ring.ids)):
            nursery.start_soon(one, i)
    return results
