"""An in-process test cluster: one master and N communicators in one trio run, with fault injection.

>>> async with open_test_cluster(4, network=VirtualNetwork(latency=0.001)) as cluster:  # doctest: +SKIP
...     cluster.kill(3)
...     await cluster.run_all(lambda i, comm: comm.all_reduce(buffers[i]))

Each peer lives on its own :class:`~pccl.testing.VirtualHost` (the master on a host of its own), so
``kill`` (the host crashes: every connection is reset, as when the process dies), ``hang`` (the
host's I/O freezes: the master evicts it by heartbeat), ``partition`` and ``heal`` act on exactly
one machine's network. With ``network=None`` the cluster runs over real loopback TCP instead; a
peer can then only be killed or leave (hang and partition raise :class:`UnsupportedFault`).

Peers are numbered by the order they were added (index 0, 1, 2, ...); an index never changes or
gets reused, so ``cluster.peers[i]`` stays the same communicator after other peers die.

Time: everything runs on trio's clock. Under ``trio.testing.MockClock(autojump_threshold=0)``
(pytest-trio's ``autojump_clock`` fixture) heartbeats, timeouts and link latencies cost no real
time; a loopback-TCP cluster needs the real clock (the kernel does not follow a mock clock).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

import trio

from .._config import MasterConfig, PeerConfig
from .._errors import MasterConnectionError, PCCLError, UpdateTopologyFailedError
from ..master.server import MasterHandle, open_master
from ..master.state import Phase
from ..peer.communicator import Communicator, open_communicator
from ..transport import StreamBroken
from .network import VirtualHost, VirtualNetwork

__all__ = [
    "DEFAULT_MASTER_CONFIG",
    "DEFAULT_PEER_CONFIG",
    "MASTER",
    "PeerStatus",
    "TestCluster",
    "UnsupportedFault",
    "open_test_cluster",
]

T = TypeVar("T")

MASTER: Final = "master"
"""Names the master in :meth:`TestCluster.partition` / :meth:`TestCluster.heal` / :meth:`TestCluster.host`.

It is also the master host's name (peer ``i`` lives on host ``"peer{i}"``); a second cluster on the
same network prefixes its names (``"c2-master"``, ``"c2-peer0"``).
"""

DEFAULT_MASTER_CONFIG: Final = MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0)
"""Short heartbeats so evictions take 2 s (of virtual time, under a MockClock)."""

DEFAULT_PEER_CONFIG: Final = PeerConfig(
    heartbeat_interval=0.2,
    heartbeat_timeout=2.0,
    connect_timeout=2.0,
    p2p_connection_timeout=4.0,
    p2p_listen_host="127.0.0.1",
)
"""Peer twin of :data:`DEFAULT_MASTER_CONFIG` (``p2p_listen_host`` is always set by the cluster)."""

# How often the harness looks at the master's state while waiting for a registration. Virtual
# time under a MockClock; real time (and a little CPU) over TCP.
_POLL_INTERVAL: Final = 0.001

NodeRef = int | str
"""A peer index, or :data:`MASTER`."""


class UnsupportedFault(NotImplementedError):
    """The fault cannot be injected on this cluster (hang and partition need a VirtualNetwork)."""


class PeerStatus(enum.Enum):
    """What the harness did to a peer; what the master thinks of it is :meth:`TestCluster.is_member`."""

    JOINING = "joining"  # started, not accepted yet
    UP = "up"
    HUNG = "hung"  # its host's I/O is frozen
    KILLED = "killed"  # its host crashed (or, over TCP, its tasks were cancelled)
    LEFT = "left"  # closed gracefully
    FAILED = "failed"  # could not join (the error is re-raised by add_peer)


@dataclasses.dataclass(eq=False)
class _Peer:
    index: int
    group: int
    host: VirtualHost | None
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    status: PeerStatus = PeerStatus.JOINING
    comm: Communicator | None = None
    nursery: trio.Nursery | None = None
    error: BaseException | None = None
    settled: trio.Event = dataclasses.field(default_factory=trio.Event)  # accepted, or failed to join
    finished: trio.Event = dataclasses.field(default_factory=trio.Event)


class TestCluster:
    """A running master plus peers. Create it with :func:`open_test_cluster`.

    Attributes:
        network: the virtual network, or None for real sockets on 127.0.0.1.
        master: the master's :class:`~pccl.master.server.MasterHandle` (``statistics()``, ``state``).
        master_address: ``"HOST:PORT"`` peers connect to.
        master_config: the master's configuration.
        peer_config: the configuration every peer is started with.
        pool_size: ``p2p_connection_pool_size`` of every peer.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        *,
        network: VirtualNetwork | None,
        nursery: trio.Nursery,
        master_config: MasterConfig,
        peer_config: PeerConfig,
        pool_size: int,
    ) -> None:
        self.network = network
        self.master_config = master_config
        self.peer_config = peer_config
        self.pool_size = pool_size
        self.master: MasterHandle
        self.master_address = ""
        self._nursery = nursery
        self._master_scope = trio.CancelScope()
        # Several clusters may share one network: later ones prefix their host names ("c2-peer0").
        self._prefix = ""
        if network is not None:
            taken = {h.name for h in network.hosts}
            k = 1
            while f"{self._prefix}{MASTER}" in taken:
                k += 1
                self._prefix = f"c{k}-"
        self._master_host = network.host(f"{self._prefix}{MASTER}") if network is not None else None
        self._master_down = False
        self._master_done: trio.Event | None = None  # set when the running master's task ended
        self._peers: list[_Peer] = []
        self._isolated: set[str] = set()

    # ------------------------------------------------------------------------------------------
    # queries

    @property
    def peers(self) -> list[Communicator]:
        """Every peer that was ever accepted, by index (killed ones included; see :attr:`alive`).

        Raises:
            RuntimeError: a peer is still joining (its communicator does not exist yet); use
                :meth:`peer` for one index.
        """
        return [self.peer(i) for i in range(len(self._peers))]

    def peer(self, index: int) -> Communicator:
        """The communicator of peer ``index``.

        Raises:
            IndexError: no such peer.
            RuntimeError: the peer has not been accepted (yet, or it failed to join).
        """
        rec = self._peers[index]
        if rec.comm is None:
            raise RuntimeError(f"peer {index} is {rec.status.value}: it has no communicator")
        return rec.comm

    @property
    def alive(self) -> list[int]:
        """Indexes of peers that are up: accepted and not killed, hung or left."""
        return [p.index for p in self._peers if p.status is PeerStatus.UP]

    @property
    def live_peers(self) -> list[Communicator]:
        """Communicators of :attr:`alive`, in index order."""
        return [self.peer(i) for i in self.alive]

    def status(self, index: int) -> PeerStatus:
        """What the harness did to peer ``index``."""
        return self._peers[index].status

    def index_of(self, comm: Communicator) -> int:
        """The index of a communicator of this cluster.

        Raises:
            ValueError: not one of this cluster's communicators.
        """
        for p in self._peers:
            if p.comm is comm:
                return p.index
        raise ValueError(f"{comm!r} is not a peer of this cluster")

    def is_member(self, index: int) -> bool:
        """Whether the master currently counts peer ``index`` as accepted (False once evicted)."""
        rec = self._peers[index]
        if self._master_down or rec.comm is None:
            return False
        return rec.comm.peer_id in self.master.state.ring

    def host(self, node: NodeRef) -> VirtualHost:
        """The virtual host of peer ``node`` (an index) or of the master (:data:`MASTER`).

        Use its ``name`` for the filters of traffic hooks (``reset_after(n, src=...)``).

        Raises:
            UnsupportedFault: the cluster runs over TCP.
        """
        self._require_network("host()")
        if node == MASTER:
            assert self._master_host is not None
            return self._master_host
        if not isinstance(node, int):
            raise ValueError(f"expected a peer index or MASTER, got {node!r}")
        host = self._peers[node].host
        assert host is not None
        return host

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for p in self._peers:
            counts[p.status.value] = counts.get(p.status.value, 0) + 1
        where = "virtual" if self.network is not None else "tcp"
        master = "down" if self._master_down else self.master_address
        return f"<TestCluster {where} master={master} peers={counts}>"

    # ------------------------------------------------------------------------------------------
    # membership

    async def add_peer(self, *, group: int = 0, admit: bool = True) -> int:
        """Start a new peer (on a new host) and return its index once the master accepted it.

        Args:
            group: the peer's ``peer_group``.
            admit: the harness admits it by calling ``update_topology()`` on every live peer
                (retrying on UPDATE_TOPOLOGY_FAILED). Pass False when the running peers admit
                newcomers themselves (a training loop calling ``are_peers_pending()``): the call then
                just waits until they do.

        Returns:
            The new peer's index.

        Raises:
            MasterConnectionError: the newcomer could not reach the master or was refused.
        """
        rec = await self._launch(group)
        if admit:
            await self._admit([rec])
        await rec.settled.wait()
        if rec.error is not None:
            raise rec.error
        return rec.index

    async def add_peers(self, count: int, *, groups: Sequence[int] | None = None) -> list[int]:
        """Start ``count`` peers one after another, then admit them all in one ``update_topology`` round.

        Peers register one at a time, so their peer ids (assigned by the master) follow index order.

        Args:
            count: how many.
            groups: each one's ``peer_group`` (default 0).

        Returns:
            Their indexes.
        """
        if groups is not None and len(groups) != count:
            raise ValueError(f"groups has {len(groups)} entries for {count} peers")
        recs = [await self._launch(groups[i] if groups is not None else 0) for i in range(count)]
        await self._admit(recs)
        for rec in recs:
            await rec.settled.wait()
            if rec.error is not None:
                raise rec.error
        return [r.index for r in recs]

    async def update_topology(self) -> None:
        """Call ``update_topology()`` on every live peer at once (retrying on UPDATE_TOPOLOGY_FAILED).

        Peers that lose the master meanwhile are skipped; any other error is raised.
        """
        while True:
            voters = [self.peer(i) for i in self.alive if self.is_member(i)]
            if not voters:
                await trio.lowlevel.checkpoint()
                return
            errors = await _gather_errors([c.update_topology for c in voters])
            if not any(isinstance(e, UpdateTopologyFailedError) for e in errors):
                for e in errors:
                    if not isinstance(e, MasterConnectionError):
                        raise e
                return

    async def run_all(
        self, fn: Callable[[int, Communicator], Awaitable[T]], *, indexes: Sequence[int] | None = None
    ) -> list[T | PCCLError]:
        """Run ``fn(index, comm)`` concurrently on every live peer (or on ``indexes``).

        Returns:
            One result per peer, in order; a call that raised a PCCLError gives the error instead
            (anything else propagates).
        """
        targets = list(self.alive if indexes is None else indexes)
        out: list[T | PCCLError] = [PCCLError("not run")] * len(targets)

        async def one(k: int) -> None:
            i = targets[k]
            try:
                out[k] = await fn(i, self.peer(i))
            except PCCLError as exc:
                out[k] = exc

        async with trio.open_nursery() as nursery:
            for k in range(len(targets)):
                nursery.start_soon(one, k)
        return out

    def start_soon(self, index: int, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` as a task of peer ``index``: killing (or closing) the peer cancels it.

        An exception escaping ``fn`` tears the whole cluster down and is re-raised by
        :func:`open_test_cluster` (so a failed assertion in a peer's loop fails the test).

        Raises:
            RuntimeError: the peer is not up.
        """
        rec = self._peers[index]
        if rec.nursery is None or rec.status is not PeerStatus.UP:
            raise RuntimeError(f"peer {index} is {rec.status.value}: cannot start tasks on it")
        rec.nursery.start_soon(fn, *args)

    # ------------------------------------------------------------------------------------------
    # faults

    def kill(self, index: int) -> None:
        """Crash peer ``index``: its host dies (every connection reset) and its tasks are cancelled.

        Over TCP there is no host to crash: the tasks are cancelled and the sockets closed, which
        the others see the same way (the kernel closes a dead process's sockets). Idempotent.
        """
        rec = self._peers[index]
        if rec.status in (PeerStatus.KILLED, PeerStatus.LEFT, PeerStatus.FAILED):
            return
        rec.status = PeerStatus.KILLED
        if self.network is not None and rec.host is not None:
            self.network.crash(rec.host)
        rec.scope.cancel()

    async def leave(self, index: int) -> None:
        """Close peer ``index`` gracefully (``Communicator.aclose``) and wait until it is gone."""
        rec = self._peers[index]
        if rec.status in (PeerStatus.KILLED, PeerStatus.LEFT, PeerStatus.FAILED):
            await trio.lowlevel.checkpoint()
            return
        rec.status = PeerStatus.LEFT
        rec.scope.cancel()
        await rec.finished.wait()

    def hang(self, index: int) -> None:
        """Freeze peer ``index``'s host: its I/O blocks, its connections stay open, it goes silent.

        The master evicts it after its heartbeat timeout, exactly as a stopped process.

        Raises:
            UnsupportedFault: the cluster runs over TCP.
        """
        net = self._require_network("hang()")
        rec = self._peers[index]
        if rec.status is not PeerStatus.UP:
            raise RuntimeError(f"peer {index} is {rec.status.value}: cannot hang it")
        assert rec.host is not None
        net.hang(rec.host)
        rec.status = PeerStatus.HUNG

    def unhang(self, index: int) -> None:
        """Resume a hung peer (it has usually been evicted by then and sees MASTER_CONNECTION_FAILED).

        Raises:
            UnsupportedFault: the cluster runs over TCP.
        """
        net = self._require_network("unhang()")
        rec = self._peers[index]
        if rec.status is not PeerStatus.HUNG:
            return
        assert rec.host is not None
        net.unhang(rec.host)
        rec.status = PeerStatus.UP

    def partition(self, a: NodeRef, b: NodeRef | None = None, *, oneway: bool = False) -> None:
        """Black-hole the traffic between two nodes (peer indexes or :data:`MASTER`).

        Data in flight waits and is retransmitted after :meth:`heal`; no FIN/RST crosses; connects
        time out. A peer cut off from the master is evicted by heartbeat; two peers cut off from
        each other stall the ring between them until healed.

        Args:
            a: a peer index or :data:`MASTER`.
            b: the other node; None isolates ``a`` from every other node, including peers added later.
            oneway: block only ``a -> b``.

        Raises:
            UnsupportedFault: the cluster runs over TCP.
        """
        net = self._require_network("partition()")
        ha = self.host(a)
        if b is None:
            if oneway:
                raise ValueError("oneway needs both ends")
            others = [h for h in self._all_hosts() if h.name != ha.name]
            for h in others:
                net.partition(ha, h)
            self._isolated.add(ha.name)
            return
        net.partition(ha, self.host(b), oneway=oneway)

    def heal(self, a: NodeRef | None = None, b: NodeRef | None = None) -> None:
        """Lift partitions: all of them, those involving ``a``, or those between ``a`` and ``b``.

        Raises:
            UnsupportedFault: the cluster runs over TCP.
        """
        net = self._require_network("heal()")
        if a is None:
            if b is not None:
                raise ValueError("heal(b=...) needs a")
            net.heal()
            self._isolated.clear()
            return
        ha = self.host(a)
        if b is None:
            net.heal(ha)
            self._isolated.discard(ha.name)
        else:
            net.heal(ha, self.host(b))

    def cut_master_link(self, index: int) -> int:
        """Reset peer ``index``'s connection to the master now (both ends fail at once, as when a
        middlebox drops it); the master and the peer stay up, so a peer with a ``reconnect_window``
        re-registers with the same, live master (docs/concepts.md "A member's link breaks").

        Returns:
            How many connections were reset (0: the peer held none to the master at that instant).

        Raises:
            UnsupportedFault: the cluster runs over TCP.
        """
        net = self._require_network("cut_master_link()")
        return net.reset(self.host(index), self.host(MASTER))

    def kill_master(self) -> None:
        """Crash the master's host (over TCP: cancel the master, closing its connections). Idempotent."""
        if self._master_down:
            return
        self._master_down = True
        if self.network is not None and self._master_host is not None:
            self.network.crash(self._master_host)
        self._master_scope.cancel()

    async def restart_master(self, *, delay: float = 0.0) -> None:
        """Crash the master (like :meth:`kill_master`, if it still runs) and start a fresh one, with
        empty state, on the same address and port: on a virtual network its host restarts as a new
        incarnation. Peers configured with a ``reconnect_window`` re-register with it and the run
        goes on (docs/concepts.md "Surviving the master"); returns once it listens.

        Args:
            delay: seconds from the crash to the new master listening. The host is back at once, so
                meanwhile connects are refused, as when ``pccl-master`` is killed on a running machine
                and restarted (a crashed host's connects time out instead).
        """
        port = int(self.master_address.rsplit(":", 1)[1])
        self.kill_master()
        if self._master_done is not None:
            await self._master_done.wait()
        if self.network is not None and self._master_host is not None:
            self._master_host = self.network.restart(self._master_host)
        if delay > 0:
            await trio.sleep(delay)
        self._master_scope = trio.CancelScope()
        self._master_down = False
        await self._nursery.start(self._start_master, port)

    def hang_master(self) -> None:
        """Freeze the master's host; peers lose it after their heartbeat timeout.

        Raises:
            UnsupportedFault: the cluster runs over TCP.
        """
        net = self._require_network("hang_master()")
        assert self._master_host is not None
        net.hang(self._master_host)

    # ------------------------------------------------------------------------------------------
    # internals

    def _require_network(self, what: str) -> VirtualNetwork:
        if self.network is None:
            raise UnsupportedFault(
                f"{what} needs a virtual network: over real loopback TCP a host cannot be frozen or "
                "cut off. Pass network=pccl.testing.VirtualNetwork() to open_test_cluster (kill() and "
                "leave() work on both)."
            )
        return self.network

    def _all_hosts(self) -> list[VirtualHost]:
        assert self._master_host is not None
        hosts = [self._master_host]
        hosts += [p.host for p in self._peers if p.host is not None and p.host.alive]
        return hosts

    def _peer_config(self, host: VirtualHost | None) -> PeerConfig:
        # Over TCP only loopback is allowed; on a virtual host the listener binds the host's own
        # address, which is the one the master hands out to the other peers.
        listen = host.address if host is not None else "127.0.0.1"
        return dataclasses.replace(self.peer_config, p2p_listen_host=listen)

    async def _start_master(
        self, port: int = 0, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        if self._master_host is not None:
            bind, transport = f"{self._master_host.address}:{port}", self._master_host
        else:
            bind, transport = f"127.0.0.1:{port}", None
        done = self._master_done = trio.Event()
        try:
            with self._master_scope:
                async with open_master(bind, config=self.master_config, transport=transport) as master:
                    self.master = master
                    host, port = master.address
                    self.master_address = f"{host}:{port}"
                    task_status.started()
                    await trio.sleep_forever()
        except (StreamBroken, PCCLError, BaseExceptionGroup):
            # A crashed host's listener fails under the master's feet; that is the point of the crash.
            if not self._master_down:
                raise
        finally:
            done.set()

    async def _launch(self, group: int) -> _Peer:
        """Start a peer and return once the master has registered it (or it failed / got accepted)."""
        if self._master_down:
            raise MasterConnectionError("the cluster's master is down")
        index = len(self._peers)
        host: VirtualHost | None = None
        if self.network is not None:
            host = self.network.host(f"{self._prefix}peer{index}")
            for name in sorted(self._isolated):
                self.network.partition(name, host)
        rec = _Peer(index=index, group=group, host=host)
        self._peers.append(rec)
        before = set(self.master.state.peers)
        self._nursery.start_soon(self._run_peer, rec)
        # Wait for the registration so the next peer cannot overtake this one: ids stay in order.
        while not rec.settled.is_set() and not self._master_down:
            state = self.master.state
            if any(pid not in before and r.phase is not Phase.CONNECTED for pid, r in state.peers.items()):
                break
            await trio.sleep(_POLL_INTERVAL)
        return rec

    async def _run_peer(self, rec: _Peer) -> None:
        try:
            with rec.scope:
                async with open_communicator(
                    self.master_address,
                    peer_group=rec.group,
                    p2p_connection_pool_size=self.pool_size,
                    config=self._peer_config(rec.host),
                    transport=rec.host,
                ) as comm:
                    rec.comm = comm
                    async with trio.open_nursery() as nursery:
                        rec.nursery = nursery
                        if rec.status is PeerStatus.JOINING:
                            rec.status = PeerStatus.UP
                        rec.settled.set()
                        await trio.sleep_forever()
        except PCCLError as exc:
            # Failing to join is reported by add_peer; a peer that dies later just dies.
            if rec.status is PeerStatus.JOINING:
                rec.status = PeerStatus.FAILED
                rec.error = exc
        finally:
            rec.nursery = None
            rec.settled.set()
            rec.finished.set()

    async def _admit(self, recs: list[_Peer]) -> None:
        """Run update_topology rounds on the live peers until every one of ``recs`` is settled."""
        while not all(r.settled.is_set() for r in recs):
            if self._master_down:
                break
            voters = [p for p in self._peers if p.status is PeerStatus.UP and self.is_member(p.index)]
            if not voters or not self.master.state.registered():
                # Nobody to vote (the master accepts a lone first peer by itself) or not registered yet.
                await trio.sleep(_POLL_INTERVAL)
                continue
            await self.update_topology()
        for r in recs:
            await r.settled.wait()

    async def _aclose(self) -> None:
        for rec in self._peers:
            if rec.status is PeerStatus.HUNG and self.network is not None and rec.host is not None:
                # A frozen host could block its own shutdown forever: let it die instead.
                self.network.crash(rec.host)
            rec.scope.cancel()
        self._master_scope.cancel()


async def _gather_errors(calls: Sequence[Callable[[], Awaitable[object]]]) -> list[PCCLError]:
    errors: list[PCCLError] = []

    async def one(fn: Callable[[], Awaitable[object]]) -> None:
        try:
            await fn()
        except PCCLError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for fn in calls:
            nursery.start_soon(one, fn)
    return errors


def _unwrap(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The single real error of a nursery's group (Cancelled noise dropped), or the group itself."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for sub in exc.exceptions:
                walk(sub)
        elif not isinstance(exc, trio.Cancelled):
            leaves.append(exc)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group


@asynccontextmanager
async def open_test_cluster(
    n_peers: int,
    *,
    network: VirtualNetwork | None = None,
    config: PeerConfig | None = None,
    master_config: MasterConfig | None = None,
    groups: Sequence[int] | None = None,
    pool_size: int = 1,
) -> AsyncIterator[TestCluster]:
    """Run a master and ``n_peers`` accepted communicators for the duration of the block.

    Args:
        n_peers: peers to start (0 is allowed; add more with :meth:`TestCluster.add_peer`).
        network: a :class:`~pccl.testing.VirtualNetwork` (each peer on its own host, the master on
            host :data:`MASTER`), or None for real sockets on 127.0.0.1 (``TcpTransport``: its same-host
            shortcut unless ``PCCL_LOCAL_SOCKETS=0``).
        config: every peer's :class:`~pccl.PeerConfig` (default :data:`DEFAULT_PEER_CONFIG`);
            ``p2p_listen_host`` is overridden (the peer's host address, or 127.0.0.1 over TCP).
        master_config: the master's :class:`~pccl.MasterConfig` (default :data:`DEFAULT_MASTER_CONFIG`).
        groups: the ``peer_group`` of each initial peer (default all 0).
        pool_size: ``p2p_connection_pool_size`` of every peer (default 1; 0: the communicator's
            default, connections sized per partner from its round trip).

    Yields:
        The :class:`TestCluster`; every initial peer is accepted and has the same peer table, and
        their peer ids increase with their index.

    Raises:
        Whatever the block raises (a single error is re-raised as itself, not as an ExceptionGroup),
        including errors escaping tasks started with :meth:`TestCluster.start_soon`.
    """
    if n_peers < 0:
        raise ValueError("n_peers must be >= 0")
    if groups is not None and len(groups) != n_peers:
        raise ValueError(f"groups has {len(groups)} entries for {n_peers} peers")
    if pool_size < 0:
        raise ValueError("pool_size must be >= 0 (0: sized per partner from its round trip)")
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            cluster = TestCluster(
                network=network,
                nursery=nursery,
                master_config=master_config or DEFAULT_MASTER_CONFIG,
                peer_config=config or DEFAULT_PEER_CONFIG,
                pool_size=pool_size,
            )
            await nursery.start(cluster._start_master)
            try:
                if n_peers:
                    await cluster.add_peers(n_peers, groups=groups)
                yield cluster
            except BaseException as exc:
                # Re-raised below, outside the nursery, so callers see it unwrapped.
                body_error = exc
            finally:
                await cluster._aclose()
    except BaseExceptionGroup as group:
        raise _unwrap(group) from None
    if body_error is not None:
        raise body_error
