"""A tiny in-process loopback cluster for integration tests (the full harness is pccl.testing)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

import pccl
from pccl import MasterConfig, PeerConfig
from pccl import SharedStateSyncStrategy as S
from pccl.master.server import MasterHandle, open_master
from pccl.peer.communicator import Communicator, open_communicator
from pccl.peer.shared_state import SharedState
from pccl.transport import Transport

FAST_MASTER = MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0)
FAST_PEER = PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, p2p_listen_host="127.0.0.1")


class LoopbackCluster:
    """A master and peers in one trio run; each peer lives in its own cancel scope (kill = cancel)."""

    def __init__(
        self, master: MasterHandle, nursery: trio.Nursery, pool_size: int, transport: Transport | None = None,
        peer_config: PeerConfig = FAST_PEER,
    ) -> None:
        self.master = master
        self.peer_config = peer_config
        self.nursery = nursery
        self.pool_size = pool_size
        self.transport = transport
        self.comms: list[Communicator] = []
        self._scopes: dict[int, trio.CancelScope] = {}

    async def add_peer(self, group: int = 0) -> Communicator:
        """Start a peer; if others exist, they all call update_topology to admit it."""
        ready: list[Communicator] = []
        got = trio.Event()
        scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                async with open_communicator(
                    self.master.connect_address,
                    peer_group=group,
                    p2p_connection_pool_size=self.pool_size,
                    config=self.peer_config,
                    transport=self.transport,
                ) as c:
                    ready.append(c)
                    got.set()
                    await trio.sleep_forever()

        self.nursery.start_soon(run)
        alive = list(self.comms)
        if alive:
            while self.master.statistics()["registered"] < 1:
                await trio.sleep(0.002)
            async with trio.open_nursery() as n:
                for c in alive:
                    n.start_soon(c.update_topology)
        await got.wait()
        c = ready[0]
        self.comms.append(c)
        self._scopes[c.peer_id] = scope
        return c

    def kill(self, comm: Communicator) -> None:
        """Abruptly end a peer (its connections close as if the process died)."""
        self._scopes[comm.peer_id].cancel()
        self.comms.remove(comm)

    async def update_all(self) -> None:
        async with trio.open_nursery() as n:
            for c in self.comms:
                n.start_soon(c.update_topology)


@asynccontextmanager
async def loopback_cluster(
    n_peers: int,
    *,
    groups: list[int] | None = None,
    pool_size: int = 1,
    transport: Transport | None = None,
    master_config: MasterConfig = FAST_MASTER,
    peer_config: PeerConfig = FAST_PEER,
) -> AsyncIterator[LoopbackCluster]:
    async with open_master(config=master_config, transport=transport) as master:
        async with trio.open_nursery() as nursery:
            cl = LoopbackCluster(master, nursery, pool_size, transport, peer_config)
            for i in range(n_peers):
                await cl.add_peer(groups[i] if groups else 0)
            await cl.update_all()  # everyone has the same table
            try:
                yield cl
            finally:
                nursery.cancel_scope.cancel()


async def gather(comms: list[Communicator], fn: Callable[[int, Communicator], Awaitable[Any]]) -> list[Any]:
    """Run ``fn(i, comm)`` on every communicator at once; the results in order (errors propagate)."""
    out: list[Any] = [None] * len(comms)

    async def one(i: int) -> None:
        out[i] = await fn(i, comms[i])

    async with trio.open_nursery() as n:
        for i in range(len(comms)):
            n.start_soon(one, i)
    return out


async def sync_all(
    comms: list[Communicator], states: list[SharedState], strategies: list[S] | None = None
) -> list[Any]:
    """``sync_shared_state`` on every communicator at once; each result, or the PCCLError it raised."""

    async def one(i: int, comm: Communicator) -> Any:
        try:
            return await comm.sync_shared_state(states[i], strategies[i] if strategies else S.ENFORCE_POPULAR)
        except pccl.PCCLError as exc:
            return exc

    return await gather(comms, one)


async def sync_killing_the_holder(cl: LoopbackCluster, states: list[SharedState], *,
                                  both: bool = False) -> Any:
    """Sync the three peers of ``cl`` (peers 0 and 1 hold the state, peer 2 fetches it) and kill the
    holder peer 2 fetches from first (``both``: both holders) as soon as its first bytes arrived.
    Returns peer 2's result (the PCCLError it raised, or what it returned)."""
    a, b, c = cl.comms
    progressed = trio.Event()
    results: dict[str, Any] = {}

    def on_progress(done: int, total: int) -> None:
        if done > 0:
            progressed.set()

    async def run(name: str, comm: Communicator, st: SharedState, **kw: Any) -> None:
        try:
            results[name] = await comm.sync_shared_state(st, **kw)
        except pccl.PCCLError as exc:
            results[name] = exc

    async with trio.open_nursery() as n:
        n.start_soon(lambda: run("b", b, states[1]))
        n.start_soon(lambda: run("c", c, states[2], progress=on_progress))
        n.start_soon(lambda: run("a", a, states[0]))
        await progressed.wait()
        # kill the holder c is fetching from (its plan names it first)
        sync = c.statistics()["sync"]
        assert sync is not None and sync["fetch"]
        first_holder = next(iter(sync["fetch"].values()))[0]
        holder = a if a.peer_id == first_holder else b
        cl.kill(holder)
        if both:
            cl.kill(b if holder is a else a)
    return results["c"]


Op = Callable[[int], Awaitable[Any]]  # one peer's call of an operation, by peer index


def _recording(op: Op, results: dict[int, object]) -> Callable[[int], Awaitable[None]]:
    """``op`` whose result (or PCCLError) lands in ``results[i]``."""

    async def call(i: int) -> None:
        try:
            results[i] = await op(i)
        except pccl.PCCLError as exc:
            results[i] = exc

    return call


async def cancel_peer0_mid_ring(cl: Any, op: Op, min_rx: int) -> dict[int, object]:
    """Run ``op(i)`` for every peer of test cluster ``cl`` at once and cancel peer 0's call (its
    caller's cancel scope) once peer 0 has received ``min_rx`` bytes of this operation, i.e. in the
    middle of the ring. Returns each call's result or PCCLError; peer 0's is ``"cancelled"``."""
    results: dict[int, object] = {}
    call = _recording(op, results)
    rx0 = cl.peer(0).statistics()["pool"]["rx_bytes"]
    moved: list[bool] = []

    async def cancelled_call() -> None:
        with trio.CancelScope() as scope:

            async def watch() -> None:
                while cl.peer(0).statistics()["pool"]["rx_bytes"] - rx0 < min_rx:
                    await trio.sleep(0.005)
                moved.append(True)
                scope.cancel()

            async with trio.open_nursery() as n:
                n.start_soon(watch)
                await call(0)
                n.cancel_scope.cancel()
        results.setdefault(0, "cancelled")

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            n.start_soon(cancelled_call)
            for i in range(1, len(cl.peers)):
                n.start_soon(call, i)
    assert moved, "the call finished before the ring moved a chunk"
    assert results[0] == "cancelled"
    return results


async def kill_peer2_mid_ring(cl: Any, op: Op, min_rx: int) -> dict[int, object]:
    """Run ``op(i)`` for peers 0-2 of test cluster ``cl`` at once and kill peer 2 once peers 0 and 1
    have each received ``min_rx`` bytes of this operation, i.e. in the middle of the ring. Returns
    the survivors' results or PCCLErrors."""
    results: dict[int, object] = {}
    call = _recording(op, results)
    rx0 = [cl.peer(i).statistics()["pool"]["rx_bytes"] for i in range(2)]

    async def killer() -> None:
        while any(cl.peer(i).statistics()["pool"]["rx_bytes"] - rx0[i] < min_rx for i in range(2)):
            await trio.sleep(0.005)
        cl.kill(2)

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            n.start_soon(killer)
            n.start_soon(call, 0)
            n.start_soon(call, 1)
            cl.start_soon(2, call, 2)  # dies with its peer
    return results
