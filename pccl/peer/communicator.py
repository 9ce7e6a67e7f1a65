"""The peer: the native async communicator.

The protocol rules live in the pure :class:`pccl.peer.state.PeerState` (the peer table and epoch, the
collectives in flight and their op_seq matching, one membership call at a time, shared-state rounds,
the master's liveness): the reader task feeds it each message from the master and executes the effects
it returns (:meth:`Communicator.handle_master_message`). This module keeps the tasks, the waiters and
the public API. Messages are described in docs/protocol.md.

One nursery holds the master reader, the heartbeat sender, the master watchdog, the P2P listener
and the P2P pool. Every call that needs the master registers a waiter; the reader task fills it.
If the master is lost (broken connection or missed heartbeats) every pending and later call
fails with MASTER_CONNECTION_FAILED instead of hanging.

Each collective runs in its own ``trio.CancelScope`` registered under its tag: the master's
abort (or the loss of the master) cancels it, and the caller's output buffer is untouched because
results are committed only after the master confirms that every participant succeeded.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from .. import _env, _tls
from .._address import Addresses, parse_addresses
from .._config import RECONNECT_BACKOFF_MAX, PeerConfig
from .._errors import (
    HelloRefusedError,
    InvalidArgumentError,
    InvalidUsageError,
    KickedError,
    MasterConnectionError,
    PCCLError,
    RankConnectionFailedError,
    RankConnectionLostError,
    RemoteProtocolError,
    Result,
    TooFewPeersError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)
from .._stalls import StallCredit
from .._types import (
    Attribute,
    DataType,
    QuantizationAlgorithm,
    QuantizationOptions,
    ReduceInfo,
    ReduceOp,
    SharedStateSyncInfo,
    SharedStateSyncStrategy,
)
from .._waits import format_wait
from ..collectives.cost import SCHEDULE_REQUESTS, LinkModel, same_host, schedule_for
from ..collectives.ring import plan_for, plan_partners, run_collective
from ..collectives.schedule import chunk_bounds, send_partners
from ..collectives.staging import Staging, device_for
from ..kernels import backend, reduce
from ..kernels.buffers import BufferCache
from ..transport import ConnectFailed, StreamBroken, TcpTransport, TlsTransport, Transport
from ..wire import limits
from ..wire import messages as m
from ..wire.handshake import HandshakeFailed, offer_hello
from ..wire.stream import MessageStream
from . import bandwidth, shared_state
from .credentials import CredentialStore
from .mailbox import Mailbox, Waiter
from .notices import WaitReporter
from .p2p import P2PConnections, P2PDialer, serve_p2p
from .pool import P2PPool
from .progress import TransferProgress
from .spin import Spinner
from .stall import StalledOn, StallWatch
from .state import (
    AbortOp,
    Call,
    Dismissed,
    Effect,
    Establish,
    Forget,
    InstallCredentials,
    Lost,
    Measure,
    PeerState,
    RemoveMember,
    Resolve,
    error_from_code,
)

log = logging.getLogger("pccl.peer")

#: The one-host link model (pccl.collectives.cost.same_host) for this machine's cores.
_SAME_HOST = same_host(os.cpu_count() or 1)

# Between two attempts to open a partner connection inside an operation (_connect_riding_out):
# doubling from the first to the last.
_PARTNER_BACKOFF = 0.05
_PARTNER_BACKOFF_MAX = 1.0

# The phases of a collective that statistics() reports, in call order (see _record_phases).
_PHASES = ("vote", "ring", "confirm", "commit")

#: A peer not accepted this soon after registering says at INFO that it waits (the first peer of a run
#: is accepted at once and says nothing).
_WAITING_NOTICE_AFTER = 0.25


#: Backoff between reconnection rounds (each round tries every master address once): doubles, capped.
#: The cap bounds how long after a restarted master (or standby) starts listening a peer finds it: a
#: refused connect costs a fraction of a millisecond, a round every 0.1 s is nothing for a master that
#: is not there, and the run's gap across a master kill is the restart delay plus at most one cap
#: (docs/history/benchmarks-churn-soak.md "With master kills"; it was 1 s, then 0.25 s).
_RECONNECT_BACKOFF_START = 0.05  # ... capped at pccl._config.RECONNECT_BACKOFF_MAX (the master reads it too)


def failover_order(addresses: list[tuple[str, int]], lost: tuple[str, int]) -> list[tuple[str, int]]:
    """The order a peer that lost the master at ``lost`` tries ``addresses`` in each reconnection
    round: the others first, in list order after it, then ``lost`` itself. A hung master (or its dead
    host) holds a connect or a hello for up to ``connect_timeout``; trying the standby first keeps a
    failover at the heartbeat timeout instead of that plus ``connect_timeout``. A master restarted on
    the same address is still found in the same round.

    Args:
        addresses: the peer's master addresses, in the order it was given them.
        lost: the address of the master it lost (need not be in ``addresses``).

    Returns:
        Every address once.
    """
    if lost not in addresses:
        return list(addresses)
    i = addresses.index(lost)
    return [*addresses[i + 1:], *addresses[:i + 1]]


def _no_limit(seconds: float | None) -> float:
    return float("inf") if seconds is None else seconds


@dataclass
class _OpState:
    """A collective in flight, registered under its tag."""

    tag: int
    commence: Waiter[m.CollectiveCommence]
    complete: Waiter[m.CollectiveComplete]
    scope: trio.CancelScope | None = None
    op_seq: int = -1
    abort_error: PCCLError | None = None
    concluded: bool = False
    plane_done: bool = False  # this peer's data plane finished


class Communicator:
    """A peer of a pccl run (native async API). Create it with :func:`open_communicator`."""

    def __init__(
        self,
        address: Addresses | None = None,
        *,
        peer_group: int = 0,
        p2p_connection_pool_size: int = 0,
        config: PeerConfig | None = None,
        transport: Transport | None = None,
    ) -> None:
        if p2p_connection_pool_size < 0:
            raise InvalidArgumentError("p2p_connection_pool_size must be >= 0")
        self.config = _env.peer_config(config)
        if self.config.schedule not in SCHEDULE_REQUESTS:
            raise InvalidArgumentError(
                f"PeerConfig.schedule must be one of {', '.join(SCHEDULE_REQUESTS)}, "
                f"not {self.config.schedule!r}"
            )
        # The master and its standbys, in order (docs/concepts.md "Surviving the master").
        self.master_addresses = parse_addresses(_env.master_address(address))
        self._origin = _env.master_origin(address)  # " (from PCCL_MASTER=...)" for errors
        self._notices = WaitReporter(log)  # long waits said at WARNING (docs/concepts.md "Long waits")
        self.master_host, self.master_port = self.master_addresses[0]
        self._link_up = trio.Event()  # set when a reconnection succeeded or finally failed
        self.peer_group = int(peer_group)
        # 0: each partner's connections are sized from its measured round trip (pccl.peer.striping)
        self.pool_size = int(p2p_connection_pool_size)
        inner: Transport = transport or TcpTransport(connect_timeout=self.config.connect_timeout)
        # P2P connections and the listener; the master connection has its own (it checks names).
        self.transport: Transport = inner
        self._master_transport: Transport = inner
        tls = self.config.tls
        if tls is not None:  # docs/security.md "TLS"
            timeout = self.config.connect_timeout
            self.transport = TlsTransport(
                inner, server_context=_tls.server_context(tls),
                client_context=_tls.client_context(tls, check_hostname=False), handshake_timeout=timeout,
            )
            self._master_transport = TlsTransport(
                inner, server_context=None, client_context=_tls.client_context(tls, check_hostname=True),
                handshake_timeout=timeout, server_name=self.config.tls_server_name,
            )
        self.p2p_address: tuple[str, int] | None = None
        self._core = PeerState(group=self.peer_group)  # the protocol rules (pure)
        self._ms: MessageStream | None = None
        self._accepted: Waiter[m.Accepted] = Waiter()
        self._topology_waiter: Waiter[m.TopologyResult] | None = None
        self._pending_waiters: collections.deque[Waiter[m.PeersPendingResult]] = collections.deque()
        self._ops: dict[int, _OpState] = {}  # the waiting side of the core's ops, by tag
        self._sync_inbox: Mailbox | None = None  # the running sync's plan and result
        self._state_server = shared_state.StateServer(plan_timeout=self.config.connect_timeout)
        self._dialer: P2PDialer | None = None
        # The P2P credentials the master issues per epoch (docs/security.md): the listener accepts only
        # connections that prove one; a listener waits up to half its hello timeout for a newer set.
        self._credentials = CredentialStore(wait=self.config.connect_timeout / 2)
        #: The connections past their hello at this peer's P2P listener, capped per peer and channel.
        self.p2p_connections = P2PConnections()
        self._nursery: trio.Nursery | None = None
        self._closed = False
        # Ring outputs of CPU ops; GPU ops take their host copy of ``send`` and their ring output from
        # _gpu_cache (page-locked where possible, so kept apart).
        self._work_cache = BufferCache()
        self._gpu_cache = BufferCache()
        self._stats = collections.Counter[str]()
        # Where successful collectives spent their time (wall seconds, summed; and the latest one's):
        # "vote" (initiate sent -> master's commence), "ring" (the data plane), "confirm" (done sent
        # -> master's complete) and "commit" (result into the caller's buffer).
        self._phase_seconds: dict[str, float] = dict.fromkeys(_PHASES, 0.0)
        self._last_phases: dict[str, float] = {}
        self._stall = StallWatch(self.config.p2p_stall_timeout, self._pool_progress,
                                 blocked=self._blocked_partners)
        self._spinner = Spinner(self.config.spin_seconds)
        self.pool: Any = None
        # What the schedule choice knows of the links: the master's summary from the last
        # EstablishP2P (the same on every member of the group), None: the cost model's defaults.
        self._links: LinkModel | None = None

    # ------------------------------------------------------------------------------------------
    # public queries

    def get_attribute(self, attribute: Attribute) -> int:
        """Read an attribute (world sizes, groups).

        Values change only at the calls that can change them: connect, update_topology,
        optimize_topology, collectives and shared-state syncs.

        Raises:
            InvalidArgumentError: unknown attribute.
        """
        groups = self._core.group_sizes()
        if attribute == Attribute.GLOBAL_WORLD_SIZE:
            return len(self._core.table)
        if attribute == Attribute.PEER_GROUP_WORLD_SIZE:
            return groups.get(self.peer_group, 0)
        if attribute == Attribute.NUM_DISTINCT_PEER_GROUPS:
            return len(groups)
        if attribute == Attribute.LARGEST_PEER_GROUP_WORLD_SIZE:
            return max(groups.values(), default=0)
        raise InvalidArgumentError(f"unknown attribute {attribute!r}")

    @property
    def peer_id(self) -> int:
        """This peer's id, given by the master (-1 before the hello)."""
        return self._core.peer_id

    @property
    def world_size(self) -> int:
        """Accepted peers in the run (GLOBAL_WORLD_SIZE)."""
        return len(self._core.table)

    @property
    def table(self) -> list[m.PeerRow]:
        """The accepted peers in ring order, as last told by the master (a copy)."""
        return list(self._core.table)

    @property
    def group_ring(self) -> list[int]:
        """Peer ids of this peer's group in ring order, as last told by the master."""
        return self._core.group_ring

    @property
    def notices(self) -> WaitReporter:
        """This peer's long waits, said at WARNING while they last (docs/concepts.md "Long waits"); a
        driver that waits on its own (e.g. for ``min_world_size`` peers) registers its wait here."""
        return self._notices

    @property
    def refused_note(self) -> str:
        """The last successful shared-state sync's word on the group members it refused, and why (""
        when none): why a partner that then left is gone."""
        return self._core.refused_note

    @property
    def rank(self) -> int:
        """This peer's position in its group's ring (-1 if not accepted)."""
        return self._core.rank

    def statistics(self) -> dict[str, Any]:
        """A summary of this peer's state (tests assert on it).

        Keys: the core's (``peer_id``, ``world_size``, ``group_world_size``, ``epoch``,
        ``ops_in_flight``, ``op_tags``, ``ops`` (tag -> op_seq, -1 until commenced),
        ``membership_call``, ``topology_call_waiting``, ``master_ok``), then ``sync_call_waiting``,
        ``sync`` (the running sync, see :meth:`pccl.peer.shared_state.StateServer.statistics`),
        ``pending_queries_waiting``, ``data_planes_running``, ``pool``, ``phase_seconds``,
        ``last_op_phases``, ``spin_passes`` (polling passes while collectives ran, see
        ``PeerConfig.spin_seconds``), the per-kind ``<kind>_ok`` / ``<kind>_failed`` counters and
        ``schedule_<name>_ok`` (successful collectives per schedule: ring, hd, tree).
        """
        return {
            **self._core.statistics(),
            "sync_call_waiting": self._sync_inbox is not None,
            "sync": self._state_server.statistics(),
            "pending_queries_waiting": len(self._pending_waiters),
            "data_planes_running": self._stall.running,
            "pool": self.pool.statistics() if self.pool is not None else None,
            "phase_seconds": dict(self._phase_seconds),
            "last_op_phases": dict(self._last_phases),
            "spin_passes": self._spinner.passes,
            **dict(self._stats),
        }

    def __repr__(self) -> str:
        core = self._core
        return (
            f"<Communicator peer={core.peer_id} group={self.peer_group} world={len(core.table)} "
            f"epoch={core.epoch} ops={sorted(core.ops)} master={'ok' if core.lost is None else 'lost'}>"
        )

    # ------------------------------------------------------------------------------------------
    # lifecycle

    async def _dial(self, host: str, port: int, claim: int = -1) -> tuple[MessageStream, m.HelloOk]:
        """Connect to the master at ``host:port`` and say hello (``claim``: the id to claim back).

        Raises:
            MasterConnectionError: unreachable, refused, or a bad answer.
        """
        try:
            stream = await self._master_transport.connect(host, port)
        except ConnectFailed as exc:
            raise MasterConnectionError(str(exc)) from exc
        max_frame = self.config.max_frame_size
        ms = MessageStream(stream, max_frame_size=max_frame, limits=limits.pre_auth(max_frame))
        timeout = self.config.connect_timeout
        try:
            with trio.fail_after(timeout):
                reply = await offer_hello(ms, purpose="master", secret=self.config.secret, peer_id=claim,
                                          run=self.config.run or "")
        except trio.TooSlowError:
            await ms.aclose()
            raise MasterConnectionError(
                f"hello with master {host}:{port} failed: {host}:{port} accepted the connection but did "
                f"not answer the hello within {timeout:g}s (PeerConfig.connect_timeout): it is silent, not "
                "a pccl master (a status page's port?), or overloaded"
            ) from None
        except RemoteProtocolError as exc:
            await ms.aclose()
            raise HelloRefusedError(
                f"hello with master {host}:{port} failed: not a pccl master: {exc.message}"
            ) from None
        except StreamBroken as exc:
            await ms.aclose()
            hint = ""
            if self.config.tls is None:
                # A master with TLS closes a plain connection at its first bytes (docs/security.md).
                hint = " (if the master uses TLS, this peer needs PeerConfig.tls_cert, tls_key and tls_ca)"
            raise MasterConnectionError(f"hello with master {host}:{port} failed: {exc}{hint}") from exc
        except HandshakeFailed as exc:
            await ms.aclose()
            # A refusal (bad secret, another run or protocol version) is the same on every attempt.
            if exc.refused:
                raise HelloRefusedError(
                    f"master {host}:{port} refused the connection: {exc.reason}"
                ) from None
            raise HelloRefusedError(f"hello with master {host}:{port}: {exc.reason}") from None
        ms.set_limits(limits.trusted(max_frame))
        return ms, reply

    async def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        errors: list[MasterConnectionError] = []
        for host, port in self.master_addresses:  # the first master that answers
            try:
                ms, reply = await self._dial(host, port)
            except MasterConnectionError as exc:
                errors.append(exc)
                continue
            self.master_host, self.master_port = host, port
            break
        else:
            text = "; ".join(e.message for e in errors) + self._origin
            if all(isinstance(e, HelloRefusedError) for e in errors):
                raise HelloRefusedError(text)
            raise MasterConnectionError(text)
        self._ms = ms
        self._core.peer_id = reply.peer_id
        self._dialer = P2PDialer(
            self.transport, my_peer_id=self.peer_id, config=self.config, secret=self.config.secret or "",
            credentials=self._credentials,
        )
        self.pool = P2PPool(
            transport=self.transport,
            my_peer_id=self.peer_id,
            pool_size=self.pool_size,
            config=self.config,
            secret=self.config.secret or "",
            credentials=self._credentials,
        )
        handlers: dict[str, Callable[[MessageStream, m.Hello], Awaitable[None]]] = {
            "ring": self.pool.handle_incoming,
            "state": self._serve_state,
            "bench": self._serve_bench,
        }
        serve = functools.partial(serve_p2p, config=self.config, secret=self.config.secret or "",
                                  credentials=self._credentials, connections=self.p2p_connections)
        try:
            self.p2p_address = await nursery.start(
                _guard(serve, "P2P listener"),
                self.transport,
                self.config.p2p_listen_host,
                self.config.p2p_listen_port,
                handlers,
            )
        except (ConnectFailed, PCCLError) as exc:
            await ms.aclose()
            raise MasterConnectionError(f"cannot open the P2P listener: {exc}") from exc
        assert self.p2p_address is not None
        self._core.last_heard = trio.current_time()
        self._start_link_tasks(ms)
        self._stall.name = f"peer {self.peer_id}"
        nursery.start_soon(self._stall.run)
        nursery.start_soon(self._spinner.run)
        await self._send(m.Register(p2p_port=self.p2p_address[1], peer_group=self.peer_group,
                                     public_key=self._credentials.public_key))
        if self._standbys():
            await self._send(m.Standbys(count=self._standbys()))
        nursery.start_soon(self._notices.run)
        deadline = trio.current_time() + _no_limit(self.config.accept_timeout)
        accepted = False
        with self._notices.waiting("accept", self._describe_accept_wait):
            with trio.move_on_at(min(deadline, trio.current_time() + _WAITING_NOTICE_AFTER)):
                await self._accepted.wait()  # the core has the table now
                accepted = True
            if not accepted and trio.current_time() < deadline:
                log.info(
                    "peer %d is waiting to be accepted by the master at %s:%d: the accepted peers must call "
                    "update_topology() (the first peer of a run is accepted at once)",
                    self.peer_id, self.master_host, self.master_port,
                )
                with trio.move_on_at(deadline):
                    await self._accepted.wait()
                    accepted = True
        if not accepted:
            raise PCCLError(
                f"peer {self.peer_id} was not accepted within {self.config.accept_timeout:g}s: a peer that "
                "connects waits until the accepted peers call update_topology()",
                Result.MASTER_CONNECTION_FAILED,
            )
        log.info("peer %d accepted (world size %d)", self.peer_id, len(self._core.table))

    def _describe_accept_wait(self, waited: float) -> str:
        run = f" (run {self.config.run!r})" if self.config.run else ""
        bound = (f"PeerConfig.accept_timeout ends it after {self.config.accept_timeout:g}s"
                 if self.config.accept_timeout is not None else "set PeerConfig.accept_timeout to bound it")
        return (f"peer {self.peer_id} has waited {format_wait(waited)} to be accepted by the master at "
                f"{self.master_host}:{self.master_port}{run}: the peers already accepted must call "
                f"update_topology() (a training loop does when are_peers_pending() says a peer waits); "
                f"the master's log says whether any does; {bound}")

    async def aclose(self) -> None:
        """Leave the run. The others see it exactly like a failure, minus the wait."""
        if self._closed:
            return
        self._closed = True
        self._fail_all(InvalidUsageError("the communicator is closed", Result.INVALID_USAGE), closing=True)
        with trio.CancelScope(shield=True):
            if self.pool is not None:
                with trio.move_on_after(1.0):
                    await self.pool.aclose()
            if self._ms is not None:
                await self._ms.aclose()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # ------------------------------------------------------------------------------------------
    # master link

    def _start_link_tasks(self, ms: MessageStream) -> None:
        """The reader, heartbeat and watchdog of one master link (they end with it)."""
        assert self._nursery is not None
        self._nursery.start_soon(self._reader, ms)
        self._nursery.start_soon(self._heartbeat, ms)
        self._nursery.start_soon(self._watchdog, ms)

    def _sending_link(self) -> MessageStream:
        """The master link to send on. Raises RankConnectionLostError while reconnecting (retry),
        MasterConnectionError once the master is lost for good."""
        self._core.check_usable()
        ms = self._ms
        if self._core.reconnecting or ms is None:
            raise RankConnectionLostError("lost the master; reconnecting: retry")
        return ms

    def _send_broke(self, ms: MessageStream, exc: StreamBroken) -> RankConnectionLostError:
        """The link broke under a send: fail it (reconnection starts) and return the error to raise
        (raises MasterConnectionError instead when the master is lost for good)."""
        err = MasterConnectionError(f"lost the master while sending: {exc}")
        self._link_failed(ms, err)
        self._core.check_usable()
        return RankConnectionLostError(f"{err.message}; reconnecting: retry")

    async def _send(self, msg: m.Message) -> None:
        ms = self._sending_link()
        try:
            await ms.send(msg)
        except StreamBroken as exc:
            raise self._send_broke(ms, exc) from exc

    async def _send_now(self, msg: m.Message) -> None:
        """:meth:`_send` for the collective path's votes and reports: written straight into the
        socket when nothing else is being sent and the socket takes it (``MessageStream.send_nowait``),
        which spares the send lock's and the socket send's scheduler passes (a pass is an epoll call
        here); otherwise (or for the rest of a partly taken frame) as :meth:`_send`. Not a checkpoint
        when the socket takes the whole frame: the collective path waits for the master right after.

        Raises:
            RankConnectionLostError: the master link is down or broke while sending (reconnecting).
            MasterConnectionError: the master is lost for good.
        """
        ms = self._sending_link()
        try:
            if ms.send_nowait(msg):
                if ms.owes:
                    await ms.flush()
                return
        except StreamBroken as exc:
            raise self._send_broke(ms, exc) from exc
        await self._send(msg)

    async def _await_link(self) -> None:
        """Admit a call: at once while the master link is up; while reconnecting, wait for the
        reconnection (at most the reconnect window), then fail with MASTER_CONNECTION_FAILED.

        Raises:
            InvalidUsageError: closed.
            MasterConnectionError: the master is lost for good.
        """
        while True:
            self._check_usable()
            if not self._core.reconnecting:
                return
            await self._link_up.wait()

    def _link_failed(self, ms: MessageStream, error: PCCLError) -> None:
        """The master link ``ms`` broke: reconnect within the window, or lose the master for good.

        A stale link (already replaced) is ignored. Calls in flight fail either way; with a
        reconnection ahead they fail with a retryable error (collectives: RANK_CONNECTION_LOST, the
        caller's buffers untouched), later calls wait for the link (:meth:`_await_link`).
        """
        if ms is not self._ms or self._closed or self._core.lost is not None:
            return
        if self._core.reconnecting:
            return
        if not self._core.link_down(trio.current_time(), self.config.reconnect_window):
            self._fail_all(error)
            return
        log.warning("peer %d: %s; reconnecting (window %gs)", self.peer_id, error,
                    self.config.reconnect_window)
        self._fail_calls(RankConnectionLostError(f"{error.message}; reconnecting to the master: retry"),
                         keep_in_doubt=True)
        self._ms = None
        assert self._nursery is not None
        self._nursery.start_soon(self._close_stream, ms)
        self._nursery.start_soon(self._reconnect)

    @staticmethod
    async def _close_stream(ms: MessageStream) -> None:
        with trio.CancelScope(shield=True):
            await ms.aclose()

    async def _reconnect(self) -> None:
        """Reconnect to the master addresses in turn, with backoff, until the window ends."""
        deadline = self._core.reconnecting_until
        if deadline is None:  # lost for good, or closed, before this task ran
            self._link_up.set()
            return
        backoff = _RECONNECT_BACKOFF_START
        last = "no master address answered"
        order = failover_order(self.master_addresses, (self.master_host, self.master_port))
        while not self._closed and self._core.lost is None:
            for host, port in order:
                if trio.current_time() >= deadline:
                    break
                with trio.move_on_at(deadline):
                    problem = await self._try_reregister(host, port)
                    if problem is None:
                        return
                    last = f"{host}:{port}: {problem.message}"
                    if isinstance(problem, KickedError):
                        # The run went on without this peer: no master will take it back.
                        self._fail_all(MasterConnectionError(f"lost the master; {last}"))
                        self._link_up.set()
                        return
            if trio.current_time() >= deadline:
                break
            await trio.sleep_until(min(deadline, trio.current_time() + backoff))
            backoff = min(backoff * 2, RECONNECT_BACKOFF_MAX)
        if not self._closed:
            window = self.config.reconnect_window
            self._fail_all(MasterConnectionError(
                f"lost the master and could not reconnect within the reconnect window ({window:g}s): {last}"))
        self._link_up.set()

    async def _try_reregister(self, host: str, port: int) -> PCCLError | None:
        """One attempt: hello claiming our id, Reregister, the master's answer. None: the link is up."""
        assert self.p2p_address is not None
        try:
            ms, _ = await self._dial(host, port, claim=self.peer_id)
        except MasterConnectionError as exc:
            return exc
        try:
            with trio.fail_after(self.config.connect_timeout):
                await ms.send(self._core.reregister(self.p2p_address[1], epoch_members=self._standbys() > 0,
                                                    public_key=self._credentials.public_key))
                reply = await ms.receive()
                while isinstance(reply, m.Heartbeat):
                    reply = await ms.receive()
        except (StreamBroken, RemoteProtocolError, trio.TooSlowError) as exc:
            await self._close_stream(ms)
            return MasterConnectionError(f"re-registration failed: {exc}")
        problem = self._core.reregistered(reply, trio.current_time())
        if problem is not None:
            await self._close_stream(ms)
            return problem
        self._ms = ms
        self.master_host, self.master_port = host, port
        log.warning("peer %d reconnected to the master at %s:%d (generation %d)",
                    self.peer_id, host, port, self._core.generation)
        self._start_link_tasks(ms)
        up, self._link_up = self._link_up, trio.Event()
        up.set()
        if self._standbys():
            self._send_soon(m.Standbys(count=self._standbys()))
        return None

    def _standbys(self) -> int:
        """How many other master addresses this peer fails over to (0 without a reconnect window):
        told to the master, whose "auto" quorum rule then applies (docs/concepts.md "No split brain")."""
        if self.config.reconnect_window <= 0:
            return 0
        return len(set(self.master_addresses)) - 1

    def _send_soon(self, msg: m.Message) -> None:
        """Send from a context that must not wait (cleanup paths)."""
        if self._nursery is not None and self._core.lost is None and not self._core.reconnecting \
                and not self._closed:

            async def go() -> None:
                try:
                    await self._send(msg)
                except PCCLError:
                    pass

            self._nursery.start_soon(go)

    def _check_usable(self) -> None:
        if self._closed:
            raise InvalidUsageError("the communicator is closed")
        self._core.check_usable()

    def _fail_all(self, error: PCCLError, *, closing: bool = False) -> None:
        """The master is gone for good (or we close): fail every pending and future call."""
        if self._core.lose(error) and not closing:
            log.error("peer %d: %s", self.peer_id, error)
        self._fail_calls(error)
        self._link_up.set()  # calls waiting for a reconnection see the loss

    def _fail_calls(self, error: PCCLError, *, keep_in_doubt: bool = False) -> None:
        """Fail every call waiting on the master with ``error`` (topology calls with their own
        retryable error when ``error`` is retryable).

        ``keep_in_doubt`` (the master is lost and this peer reconnects): collectives and a sync whose
        part is finished here stay waiting, buffers untouched, for the decision of the master they
        reconnect to (docs/concepts.md "Operations in doubt"); the window's end fails them.
        """
        self._accepted.fail(error)
        if self._topology_waiter is not None and not (keep_in_doubt and self._core.topology_in_doubt):
            # (A topology call that confirmed its setup is in doubt: it waits for the decision of the
            # master it reconnects to, docs/concepts.md "Rounds in doubt".)
            topo = error
            if isinstance(error, RankConnectionLostError):
                cls = TopologyOptimizationFailedError if self._core.membership == "optimize_topology" \
                    else UpdateTopologyFailedError
                topo = cls(error.message)
            self._topology_waiter.fail(topo)
        while self._pending_waiters and not keep_in_doubt:  # (votes out: in doubt, like the above)
            self._pending_waiters.popleft().fail(error)
        for st in self._ops.values():
            if keep_in_doubt and self._core.in_doubt(st.tag):
                continue
            st.abort_error = error
            st.commence.fail(error)
            st.complete.fail(error)
            if st.scope is not None:
                st.scope.cancel()
        if keep_in_doubt and self._core.sync_in_doubt:
            return  # and it keeps serving its tensors: the others may still be finishing their part
        if self._sync_inbox is not None:
            self._sync_inbox.fail(error)
        self._state_server.abort(error)

    async def _reader(self, ms: MessageStream) -> None:
        try:
            while ms is self._ms:
                msg = await ms.receive()
                if ms is not self._ms:
                    return
                if self.handle_master_message(msg) is not None:
                    break  # kicked, or the master broke the protocol
        except StreamBroken as exc:
            self._link_failed(ms, MasterConnectionError(f"lost the connection to the master: {exc}"))
            return
        except RemoteProtocolError as exc:
            self._link_failed(ms, MasterConnectionError(f"master protocol error: {exc.message}"))
        await self._close_stream(ms)

    async def _heartbeat(self, ms: MessageStream) -> None:
        while self._core.lost is None and ms is self._ms:
            await trio.sleep(self.config.heartbeat_interval)
            if ms is not self._ms:
                return
            try:
                await self._send(m.Heartbeat())
            except PCCLError:
                return

    async def _watchdog(self, ms: MessageStream) -> None:
        """Fail the link once the master has been silent for ``heartbeat_timeout``: sleeps until that
        deadline (re-read after each wake, as messages move it; at most a heartbeat interval at a
        time), so a hung master is noticed within a millisecond of the timeout, not up to a quarter
        of it later. This process's own stalls are not counted (:class:`~pccl._stalls.StallCredit`)."""
        timeout = self.config.heartbeat_timeout
        # This process's own stalls (an overloaded host) are not the master's silence: its messages of
        # that time wait unread until the reader runs (pccl/_stalls.py).
        stalls = StallCredit(timeout)
        while self._core.lost is None and ms is self._ms:
            now = trio.current_time()
            silent = self._core.silence(now) - stalls.credit(now)
            # At most a heartbeat interval at a time: a stall is credited from the last wake.
            wake = now + min(max(timeout - silent, 0.0) + 0.001, self.config.heartbeat_interval)
            until = stalls.until(now)
            if until is not None:
                wake = min(wake, until + 0.001)  # judged in full again when the credit ends
            stalls.plan(wake, now)
            await trio.sleep_until(wake)
            now = trio.current_time()
            stalls.woke(now)
            silent = self._core.silence(now)
            if silent - stalls.credit(now) > timeout and ms is self._ms:
                limit = self.config.heartbeat_timeout
                msg = f"master silent for {silent:.1f}s (heartbeat timeout {limit:g}s)"
                self._link_failed(ms, MasterConnectionError(msg))
                await self._close_stream(ms)
                return

    # --- executing the core's effects -------------------------------------------------------

    def handle_master_message(self, msg: m.Message) -> PCCLError | None:
        """What the reader task does with each message from the master: the core applies it, this
        executes the effects (synchronously: no checkpoint). Public so that a test can script the
        master's messages exactly as they would arrive.

        Returns:
            The error that ended the master link, if this message ended it (the reader then stops).
        """
        lost: PCCLError | None = None
        for effect in self._core.handle(msg, trio.current_time()):
            if isinstance(effect, Lost):
                lost = effect.error
                self._fail_all(lost)
            elif isinstance(effect, Dismissed):
                # The master gave the run up (no quorum): fail over as if the link broke.
                lost = effect.error
                if self._ms is not None:
                    self._link_failed(self._ms, lost)
                else:
                    self._fail_all(lost)
            else:
                self._execute(effect)
        return lost

    def _execute(self, effect: Effect) -> None:
        if isinstance(effect, Resolve):
            self._resolve(effect)
        elif isinstance(effect, AbortOp):
            st = self._ops.get(effect.tag)
            if st is not None:
                st.abort_error = effect.error
                st.commence.fail(effect.error)
                st.complete.fail(effect.error)
                if st.scope is not None:
                    st.scope.cancel()
        elif isinstance(effect, Establish):
            assert self._nursery is not None
            self._nursery.start_soon(self._establish, effect)
        elif isinstance(effect, Measure):
            assert self._nursery is not None
            self._nursery.start_soon(self._measure, effect.request)
        elif isinstance(effect, Forget):
            if self.pool is not None:
                for op_seq in effect.op_seqs:
                    if 0 <= op_seq < 2**32:
                        self.pool.forget_op(op_seq)
        elif isinstance(effect, InstallCredentials):
            self._credentials.install(effect.message, me=self.peer_id)
        elif isinstance(effect, RemoveMember):
            # Its credential stops working here at once, and what it holds here is closed and freed
            # (its ring connections and their stash, its state and bench connections).
            self._credentials.revoke(effect.peer_id)
            closed = self.p2p_connections.drop_peer(effect.peer_id)
            log.info("peer %d was removed from the run (%s): its P2P credential is revoked here, %d of its "
                     "connections closed", effect.peer_id, effect.reason, closed)
            if self.pool is not None and self._nursery is not None:
                self._nursery.start_soon(self.pool.disconnect, effect.peer_id)

    def _resolve(self, effect: Resolve) -> None:
        msg, call = effect.message, effect.call
        if call is Call.COMMENCE:
            assert isinstance(msg, m.CollectiveCommence)
            st = self._ops.get(effect.tag)
            if st is not None:
                st.commence.set(msg)
        elif call is Call.COMPLETE:
            assert isinstance(msg, m.CollectiveComplete)
            st = self._ops.get(effect.tag)
            if st is not None:
                st.complete.set(msg)
        elif call is Call.SYNC:
            if self._sync_inbox is not None:
                self._sync_inbox.put(msg)
        elif call is Call.TOPOLOGY:
            assert isinstance(msg, m.TopologyResult)
            if self._topology_waiter is not None:
                self._topology_waiter.set(msg)
        elif call is Call.PENDING:
            assert isinstance(msg, m.PeersPendingResult)
            if self._pending_waiters:
                self._pending_waiters.popleft().set(msg)
        elif call is Call.ACCEPTED:
            assert isinstance(msg, m.Accepted)
            self._accepted.set(msg)

    async def _establish(self, effect: Establish) -> None:
        self._links = LinkModel.from_summary(effect.links)
        nxt = effect.successor
        ok, failed, reason = True, [], ""
        targets = [] if nxt is None else [nxt]
        ids = [r.peer_id for r in effect.group]
        if nxt is not None and self.config.schedule != "ring" and self.peer_id in ids:
            # every rank the halving-doubling and tree plans may send to, opened now rather than on
            # first use (a connect on first use would fail under a partition that the data plane
            # rides out, and costs the operation a round trip)
            rank = ids.index(self.peer_id)
            targets += [effect.group[r] for r in send_partners(len(ids), rank) if effect.group[r] != nxt]

        async def one(row: m.PeerRow) -> None:
            nonlocal ok, reason
            try:
                with trio.fail_after(self.config.p2p_connection_timeout):
                    await self.pool.connect(row.peer_id, row.host, row.port)
            except (PCCLError, trio.TooSlowError) as exc:
                ok, reason = False, reason or str(exc)
                failed.append(row.peer_id)

        async with trio.open_nursery() as nursery:
            for row in targets:
                nursery.start_soon(one, row)
        self._core.setup_done(effect.epoch, ok)  # in doubt from here on, even if the send fails
        try:
            await self._send(
                m.P2PConnectionsDone(epoch=effect.epoch, success=ok, failed_peers=failed, reason=reason)
            )
        except PCCLError:
            pass
        if not self._ops:
            # The peers no plan of the new ring sends to lose this peer's connections (kept, every
            # membership change of a long run would add some until this peer held one to each).
            # Never under an operation, whose frames may be on them; an operation that starts
            # meanwhile sends only to the peers kept.
            await self.pool.retire({row.peer_id for row in targets})

    # ------------------------------------------------------------------------------------------
    # membership calls

    async def update_topology(self) -> None:
        """Vote to admit pending peers; returns once every accepted peer voted and connected.

        Raises:
            PendingAsyncOpsError: collectives of this peer are still in flight.
            UpdateTopologyFailedError: P2P setup failed somewhere; retry.
            MasterConnectionError: the master is lost.
        """
        await self._topology_call(m.UpdateTopologyVote(), "update_topology")

    async def optimize_topology(self) -> None:
        """Vote to measure missing link bandwidths and re-solve the ring (no newcomers admitted).

        Raises:
            PendingAsyncOpsError, TopologyOptimizationFailedError, MasterConnectionError.
        """
        await self._topology_call(m.OptimizeTopologyVote(), "optimize_topology")

    async def _topology_call(self, vote: m.Message, name: str) -> None:
        await self._await_link()
        self._core.begin_topology(name)
        waiter: Waiter[m.TopologyResult] = Waiter()
        self._topology_waiter = waiter
        try:
            await self._send(vote)
            with self._notices.waiting(("topology", name), functools.partial(self._describe_vote_wait, name)):
                result = await waiter.wait()
        finally:
            self._topology_waiter = None
            self._core.end_membership()
        if not result.success:
            raise error_from_code(result.code, result.reason or f"{name} failed")

    def _describe_vote_wait(self, name: str, waited: float) -> str:
        return (f"peer {self.peer_id}: {name}() has waited {format_wait(waited)} for the master's answer: "
                f"the vote completes once every accepted peer of the run calls {name}() (the master's log "
                f"names those it waits for); MasterConfig.vote_timeout bounds it")

    async def are_peers_pending(self) -> bool:
        """Collective query (all accepted peers call it): are peers waiting to be accepted?

        May be called while collectives are in flight.
        """
        await self._await_link()
        waiter: Waiter[m.PeersPendingResult] = Waiter()
        self._pending_waiters.append(waiter)
        self._core.begin_pending()
        try:
            try:
                await self._send(m.PeersPendingVote())
            except RankConnectionLostError:
                if not self._core.reconnecting:
                    raise
                # The link broke as the vote went out: it waits like a vote that went out. The
                # re-registration reports it waiting, and the master it reconnects to counts it
                # (docs/concepts.md "A member's link breaks", "Rounds in doubt").
            with self._notices.waiting(("pending", id(waiter)),
                                       functools.partial(self._describe_vote_wait, "are_peers_pending")):
                return (await waiter.wait()).pending
        finally:
            self._core.end_pending()
            if waiter in self._pending_waiters:
                self._pending_waiters.remove(waiter)

    # ------------------------------------------------------------------------------------------
    # collectives

    async def all_reduce(
        self,
        send: Any,
        recv: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
    ) -> ReduceInfo:
        """Ring all-reduce of ``send`` into ``recv`` (``recv`` None or ``send`` itself: in place).

        GPU tensors are staged through host memory (:mod:`pccl.collectives.staging`): ``send`` is
        copied to the host block by block (ordered after the work queued on the current CUDA stream)
        as the data plane needs each block; an in-place result is copied back range by range as it
        becomes final (and rolled back if the operation fails), any other at the commit. Every copy
        is complete when the call returns. This applies to every collective.

        Args:
            send: contiguous numpy array, torch tensor (CPU or CUDA) or cupy array.
            recv: output of the same dtype and element count (may be ``send``), on the same device as
                ``send`` (other peers may use other devices).
            op: SUM, AVG, PROD, MIN or MAX (accumulated in the tensor's dtype).
            tag: operations with different tags may run concurrently.
            quantization: optional wire compression (floats only).

        Returns:
            ReduceInfo(local_world_size, tx_bytes, rx_bytes).

        Raises:
            TooFewPeersError: fewer than 2 peers in the group.
            InvalidArgumentError: bad buffers (type, dtype, size, contiguity, ``send`` and ``recv`` on
                different devices), raised before voting.
            InvalidUsageError: ``tag`` is already running.
            RankConnectionLostError: a participant failed; ``recv`` holds its previous bits.
            MasterConnectionError: the master is lost.
        """
        return await self._collective("all_reduce", send, recv, op=op, tag=tag, quantization=quantization)

    async def reduce_scatter(
        self, send: Any, recv: Any = None, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0
    ) -> tuple[ReduceInfo, slice]:
        """Reduce ``send`` across the group; this peer receives its own chunk.

        Returns:
            (info, chunk): ``recv[chunk]`` holds this peer's reduced chunk (the rest of ``recv`` is
            unchanged). Chunk r has ``count // n`` elements plus one if ``r < count % n``.
        """
        info = await self._collective("reduce_scatter", send, recv, op=op, tag=tag)
        return info, self._last_chunk

    async def all_gather(self, send: Any, recv: Any, *, tag: int = 0) -> ReduceInfo:
        """Gather every peer's ``send`` into ``recv`` in ring (rank) order.

        ``recv`` must hold ``group_world_size * len(send)`` elements; if the group changed since the
        last call the operation fails with INVALID_ARGUMENT and ``recv`` is untouched.
        """
        return await self._collective("all_gather", send, recv, op=ReduceOp.SUM, tag=tag)

    async def broadcast(self, tensor: Any, *, root: int = 0, tag: int = 0) -> ReduceInfo:
        """Overwrite ``tensor`` on every peer with the root's contents.

        Args:
            root: rank of the root in this group's ring (see :attr:`rank`) as this peer sees it when
                it calls; the operation names that peer by id, so the same peer stays the root when
                the ring it commences on lost a member this peer did not know of yet.
            tag: the operation's tag.

        Returns:
            The operation's :class:`ReduceInfo`.

        Raises:
            InvalidArgumentError: ``root`` is not a rank of the group.
            RankConnectionLostError: the root (or another participant) was lost.
        """
        return await self._collective("broadcast", tensor, tensor, op=ReduceOp.SUM, tag=tag, root=root)

    _last_chunk: slice = slice(0, 0)

    async def _collective(
        self,
        kind: str,
        send: Any,
        recv: Any,
        *,
        op: ReduceOp,
        tag: int,
        root: int = 0,
        quantization: QuantizationOptions | None = None,
    ) -> ReduceInfo:
        await self._await_link()
        self._core.check_tag(tag)
        op = ReduceOp(op)
        if recv is None:
            recv = send
        sdesc = backend.describe(send)
        rdesc = backend.describe(recv)
        if sdesc.dtype != rdesc.dtype:
            raise InvalidArgumentError(f"send is {sdesc.dtype.name} but recv is {rdesc.dtype.name}")
        # Checked before voting so that the other peers are not dragged into a failed op.
        device = backend.device_index(send)
        backend.check_same_device(device, backend.device_index(recv))
        staging_device = device_for(send)  # None for host tensors
        on_gpu = staging_device is not None
        q = quantization or QuantizationOptions(algorithm=QuantizationAlgorithm.NONE)
        descriptor = self._core.describe_collective(
            kind,
            tag=tag,
            dtype=sdesc.dtype,
            send_count=sdesc.count,
            recv_count=rdesc.count,
            op=op,
            root=root,
            quantization=q,
            schedule=self.config.schedule,
        )
        stage: np.ndarray | None = None
        staging: Staging | None = None
        committed = False
        t_start = time.perf_counter()
        st = _OpState(tag=tag, commence=Waiter(), complete=Waiter())
        self._notices.begin(("op", tag), functools.partial(self._describe_op_wait, kind, st))
        self._core.begin_op(tag)
        self._spinner.begin()  # poll instead of sleeping while it runs (pccl/peer/spin.py)
        self._ops[tag] = st
        work: np.ndarray | None = None
        partners: list[int] = []  # every peer this op's plan sends to or receives from
        plane_ok = False  # this peer's data plane finished (the op may still fail elsewhere)
        stalled_on = -1  # the partner whose frames were not taken when the data plane stalled
        try:
            # The speculative start (docs/protocol.md section 4): with the op_seq the last confirmation
            # of this tag reserved, the data plane starts right after the vote, on the current ring, and
            # the master's one answer (Complete or Abort) settles it.
            proposal = self._core.speculate(tag, rdesc.nbytes)
            st.op_seq = proposal
            await self._send_now(m.CollectiveInitiate(tag=tag, descriptor=descriptor, op_seq=proposal))
            if proposal >= 0:
                rows = self._core.group_rows()
            else:
                commence = await st.commence.wait()
                st.op_seq = commence.op_seq
                rows = commence.peers
            t_commence = time.perf_counter()
            ring = [r.peer_id for r in rows]
            self._core.reconcile_group(rows)
            self._core.commenced(tag, ring)
            problem = self._core.commence_problem(descriptor, rdesc.count, ring)
            if problem is not None:
                self.pool.forget_op(st.op_seq)  # frames others already sent must not stay stashed
                await self._report_failure(st, problem[0])
                raise problem[1]
            # from here on ``root`` is the root's position in this ring, not the caller's rank
            root = self._core.root_position(descriptor, ring)
            if staging_device is not None:
                # Host staging, pipelined with the data plane (pccl/collectives/staging.py): the ring
                # runs on a host stage of ``send`` filled block by block; an in-place result goes
                # back range by range, and is rolled back if the operation fails.
                stage = self._gpu_cache.take(backend.dtype_to_numpy(sdesc.dtype), sdesc.count, send)
                staging = Staging(
                    staging_device, send, stage, recv=recv,
                    average_over=len(ring) if op == ReduceOp.AVG else 0, dtype=sdesc.dtype,
                )
            send_np = stage if stage is not None else backend.as_numpy(send)
            cache = self._gpu_cache if on_gpu else self._work_cache
            work = cache.take(send_np.dtype, rdesc.count, recv if on_gpu else None)
            ok, reason, tx, rx = False, "", 0, 0
            with trio.CancelScope() as scope:
                st.scope = scope
                if st.abort_error is not None:
                    # The abort arrived right behind the commence, before this task ran again, so
                    # the AbortOp effect found no scope to cancel: cancel now, before the ring starts (the
                    # failure path below forgets the op's stashed frames and raises the abort).
                    scope.cancel()
                try:
                    schedule = self._schedule(descriptor, rows, sdesc.dtype, root)
                    try:
                        partners = await self._connect_partners(
                            kind, rows, descriptor, sdesc.dtype, schedule, root
                        )
                    except BaseException:
                        self.pool.forget_op(st.op_seq)  # run_collective never ran: drop early frames
                        raise
                    # A speculative data plane may wait for peers that have not voted yet: its stall
                    # clock starts with the master's commence (every participant voted), which comes
                    # off the critical path; the master's vote timeout bounds the wait before.
                    tx, rx = await self._stall.guarded(
                        functools.partial(
                            self._run_dataplane, kind, st, ring, send_np, work, op, root, q, schedule,
                            staging,
                        ),
                        arm_when=(lambda: st.commence.done) if proposal >= 0 else None,
                    )
                    ok = plane_ok = st.plane_done = True
                except PCCLError as exc:
                    reason = str(exc)
                    stalled_on = exc.peer_id if isinstance(exc, StalledOn) else -1
            st.scope = None
            if st.abort_error is not None:
                raise st.abort_error
            if not ok:
                await self._report_failure(st, reason, stalled_on)
                if proposal >= 0:
                    # The vote may still be open (a descriptor mismatch shows up as frames of the wrong
                    # size): the master's verdict names the real cause, and it is an abort.
                    await st.complete.wait()
                raise RankConnectionLostError(reason)
            t_ring = time.perf_counter()
            # In doubt from here until the master answers: a master lost now (even while this
            # report is being sent) leaves the op waiting for the decision of the master this peer
            # reconnects to, instead of failing it (docs/concepts.md "Operations in doubt").
            self._core.op_done(tag)
            try:
                await self._send_now(m.CollectiveDone(tag=tag, success=True, op_seq=st.op_seq))
            except RankConnectionLostError:
                if not self._core.reconnecting:
                    raise
            await st.complete.wait()
            t_complete = time.perf_counter()
            st.concluded = True
            # Commit: the only place the caller's buffer is written (but for a device tensor's
            # in-place result, delivered during the data plane and rolled back by staging.abort()
            # if the operation fails). Synchronous: a cancellation cannot land half-way.
            delivered = staging is not None and staging.delivered
            self._commit(kind, op, work, recv, len(ring), ring.index(self.peer_id), sdesc.dtype, delivered)
            committed = True
            self._core.op_committed(tag, st.op_seq)
            # Only buffers of successful ops are reused: a failed op's buffer may still be referenced.
            cache.give_back(work)
            work = None
            if stage is not None:
                cache.give_back(stage)
            self._stats[f"{kind}_ok"] += 1
            self._stats[f"schedule_{schedule}_ok"] += 1
            self._record_phases(t_start, t_commence, t_ring, t_complete, time.perf_counter())
            return ReduceInfo(local_world_size=len(ring), tx_bytes=tx, rx_bytes=rx)
        except PCCLError:
            self._stats[f"{kind}_failed"] += 1
            if plane_ok:
                # Our data plane finished but the op failed elsewhere: a partner whose data plane
                # failed closed its connections with us. Close ours too, so that the retry opens
                # fresh ones instead of writing into one the partner gave up (a generic stream
                # cannot tell that without a failed send).
                await self.pool.disconnect_all(partners)
            raise
        finally:
            if not st.concluded and st.abort_error is None and self._core.lost is None \
                    and not self._core.reconnecting:
                # Cancelled by the caller while voting or running: withdraw, so the master aborts the
                # op for the other participants instead of leaving them waiting for us.
                self._send_soon(m.CollectiveDone(tag=tag, success=False, reason="cancelled on peer"))
            self._ops.pop(tag, None)
            self._notices.end(("op", tag))
            self._core.end_op(tag)
            self._spinner.end()
            if staging is not None and not committed:
                # Failed or cancelled: no device copy may outlive this call, and recv gets back the
                # bits a pipelined delivery overwrote (shielded inside; raises if it cannot).
                await staging.abort()

    def _describe_op_wait(self, kind: str, st: _OpState, waited: float) -> str | None:
        group = f"peer group {self.peer_group}"
        if not st.commence.done and not st.plane_done:  # (a speculative plane too: not everyone voted)
            return (f"peer {self.peer_id}: {kind} (tag {st.tag}) has waited {format_wait(waited)} for the "
                    f"other accepted peers of {group} to call it with the same tag (the master's log names "
                    f"those it waits for); MasterConfig.vote_timeout bounds it")
        if st.plane_done and not st.complete.done:
            return (f"peer {self.peer_id}: {kind} (tag {st.tag}) finished here and has waited "
                    f"{format_wait(waited)} in all for the other participants to finish it")
        return None  # moving data (PeerConfig.p2p_stall_timeout bounds a stalled transfer)

    def _record_phases(self, *t: float) -> None:
        """Record a successful collective's phases from the ``len(_PHASES) + 1`` instants between them."""
        phases = {name: t[i + 1] - t[i] for i, name in enumerate(_PHASES)}
        self._last_phases = phases
        for name, seconds in phases.items():
            self._phase_seconds[name] += seconds

    async def _report_failure(self, st: _OpState, reason: str, stalled_on: int = -1) -> None:
        st.concluded = True
        try:
            await self._send(m.CollectiveDone(tag=st.tag, success=False, reason=reason, op_seq=st.op_seq,
                                              stalled_on=stalled_on))
        except PCCLError:
            pass

    def _blocked_partners(self) -> list[int]:
        return self.pool.blocked_partners() if self.pool is not None else []

    def _pool_progress(self) -> tuple[int, int]:
        """The pool's byte counters: what the stall watch samples."""
        stats = self.pool.statistics()
        return (stats["tx_bytes"], stats["rx_bytes"])

    def _schedule(
        self, descriptor: m.CollectiveDescriptor, rows: list[m.PeerRow], dtype: DataType, root: int
    ) -> str:
        """The schedule this operation runs: from the descriptor (equal on every participant, the
        master checked), the operation's group (its table, the same on every participant) and the
        link summary the master sent every member, so every participant picks the same. Without a
        summary, a group whose members all have one address (one host) is priced with
        :func:`~pccl.collectives.cost.same_host` for this host's cores (one host: the same count on
        every member), any other with the LAN defaults."""
        links = self._links
        if links is None and len({r.host for r in rows}) == 1:
            links = _SAME_HOST
        return schedule_for(
            descriptor.schedule,
            descriptor.kind,
            len(rows),
            descriptor.element_count * backend.dtype_to_numpy(dtype).itemsize,
            quantized=descriptor.quantization != int(QuantizationAlgorithm.NONE),
            links=links,
            root=root,
        )

    async def _connect_partners(
        self,
        kind: str,
        rows: list[m.PeerRow],
        descriptor: m.CollectiveDescriptor,
        dtype: DataType,
        schedule: str,
        root: int,
    ) -> list[int]:
        """Open (or check) the outgoing connections to every rank this peer's plan sends to: the
        ring successor under the ring, the halving-doubling partners or tree parent and children
        otherwise. Already open connections cost nothing; new ones one round trip, concurrently.

        Returns:
            The peer ids the plan sends to or receives from.

        Raises:
            RankConnectionFailedError: a connection could not be opened.
        """
        ids = [r.peer_id for r in rows]
        plan = plan_for(
            kind,
            len(ids),
            ids.index(self.peer_id),
            descriptor.element_count,
            backend.dtype_to_numpy(dtype).itemsize,
            schedule=schedule,
            root=root,
            quantized=descriptor.quantization != int(QuantizationAlgorithm.NONE),
        )
        to_ranks, from_ranks = plan_partners(plan)
        partners = sorted({ids[r] for r in to_ranks} | {ids[r] for r in from_ranks})
        # the steady state: every connection open (a peek each, as pool.connect would do); no tasks
        targets = [rows[r] for r in to_ranks if not self.pool.is_connected(rows[r].peer_id)]
        if not targets:
            await trio.lowlevel.checkpoint()
            return partners
        errors: list[PCCLError] = []

        async def one(row: m.PeerRow) -> None:
            try:
                await self._connect_riding_out(row)
            except PCCLError as exc:  # reported once, as itself (not as an exception group)
                errors.append(exc)

        try:
            if len(targets) == 1:
                await self._connect_riding_out(targets[0])
            else:
                async with trio.open_nursery() as nursery:
                    for row in targets:
                        nursery.start_soon(one, row)
            if errors:
                raise errors[0]
        except BaseException:
            # The operation fails here, before its data plane: the partners whose data planes did
            # start fail too and close their connections with this peer (run_collective's failure
            # path). Close ours with every partner as well, as that path would have, so that the
            # retry opens fresh ones instead of writing into one a partner gave up.
            await self.pool.disconnect_all(partners)
            raise
        return partners

    async def _connect_riding_out(self, row: m.PeerRow) -> None:
        """``pool.connect`` to a partner, tried again while it fails for up to ``p2p_stall_timeout``:
        an operation rides out a partitioned link while it opens a connection, as its data plane
        does while it sends (docs/concepts.md "Partitioned P2P link"). A partner that died is
        evicted by the master meanwhile, whose abort cancels this.

        Raises:
            RankConnectionFailedError: still failing at the deadline.
        """
        deadline = trio.current_time() + self.config.p2p_stall_timeout
        backoff = _PARTNER_BACKOFF
        while True:
            try:
                await self.pool.connect(row.peer_id, row.host, row.port)
                return
            except RankConnectionFailedError:
                if self._closed or trio.current_time() + backoff >= deadline:
                    raise
            await trio.sleep(backoff)  # a back-off between attempts, not a synchronization
            backoff = min(2 * backoff, _PARTNER_BACKOFF_MAX)

    async def _run_dataplane(
        self,
        kind: str,
        st: _OpState,
        ring: list[int],
        send_np: np.ndarray,
        work: np.ndarray,
        op: ReduceOp,
        root: int,
        q: QuantizationOptions,
        schedule: str = "ring",
        staging: Staging | None = None,
    ) -> tuple[int, int]:
        ring_op = ReduceOp.SUM if op == ReduceOp.AVG else op
        kwargs: dict[str, Any] = {}
        if q.algorithm != QuantizationAlgorithm.NONE:
            kwargs["quantization"] = q
        return await run_collective(
            self.pool,
            kind=kind,
            ring=ring,
            my_id=self.peer_id,
            tag=st.tag,
            op_seq=st.op_seq,
            send=send_np,
            out=work,
            op=ring_op,
            root=root,
            schedule=schedule,
            staging=staging,
            **kwargs,
        )

    def _commit(
        self,
        kind: str,
        op: ReduceOp,
        work: np.ndarray,
        recv: Any,
        n: int,
        rank: int,
        dtype: DataType,
        delivered: bool = False,
    ) -> None:
        """Write the result (host ``work``) into the caller's ``recv``; AVG is finalized here, on host.

        reduce_scatter writes only this rank's chunk. A GPU ``recv`` gets a synchronous host-to-device
        copy (complete on return), unless the staging pipeline already ``delivered`` the result
        (finalized) into it during the data plane.
        """
        lo, hi = chunk_bounds(work.size, n)[rank] if kind == "reduce_scatter" else (0, work.size)
        if not delivered:
            if op == ReduceOp.AVG:  # all_reduce and reduce_scatter only: the others run as SUM
                reduce.finalize_avg(work[lo:hi], n, dtype=dtype)
            if backend.is_cuda(recv):
                backend.copy_from_host(recv, work, lo, hi)
            else:
                backend.as_numpy(recv)[lo:hi] = work[lo:hi]
        if kind == "reduce_scatter":
            self._last_chunk = slice(lo, hi)

    async def all_reduce_multiple_with_retry(
        self,
        ops: Sequence[tuple[Any, Any, ReduceOp] | dict[str, Any]],
        *,
        max_in_flight: int = 4,
        base_tag: int = 0,
    ) -> ReduceInfo:
        """Run several all-reduces concurrently, retrying failed ones until all succeed.

        Args:
            ops: items ``(send, recv, op)`` or dicts with keys send, recv, op, tag, quantization.
            max_in_flight: cap on operations running at once.
            base_tag: tags used are ``base_tag + index`` unless a dict names its own ``tag``.

        Returns:
            Summed ReduceInfo (world size of the last successful op).

        Raises:
            TooFewPeersError: the world dropped below 2 before all succeeded.
        """
        if max_in_flight < 1:
            raise InvalidArgumentError("max_in_flight must be >= 1")
        items: list[dict[str, Any]] = []
        for i, o in enumerate(ops):
            if isinstance(o, dict):
                d = dict(o)
            else:
                d = {"send": o[0], "recv": o[1], "op": o[2]}
            d.setdefault("tag", base_tag + i)
            items.append(d)
        tx = rx = 0
        world = 0
        remaining = list(range(len(items)))
        while remaining:
            failures: list[int] = []
            fatal: list[PCCLError] = []
            limiter = trio.CapacityLimiter(max_in_flight)
            results: dict[int, ReduceInfo] = {}

            async def one(i: int) -> None:
                d = items[i]
                try:
                    results[i] = await self.all_reduce(
                        d["send"],
                        d.get("recv"),
                        op=d.get("op", ReduceOp.SUM),
                        tag=d["tag"],
                        quantization=d.get("quantization"),
                    )
                except RankConnectionLostError:
                    failures.append(i)
                except PCCLError as exc:
                    fatal.append(exc)
                finally:
                    limiter.release_on_behalf_of(i)

            async with trio.open_nursery() as nursery:
                # Launch strictly in index order: every peer then has the same window of tags in
                # flight (random task start order could give peers disjoint windows: a deadlock).
                for i in remaining:
                    await limiter.acquire_on_behalf_of(i)
                    nursery.start_soon(one, i)
            if fatal:
                raise fatal[0]
            for info in results.values():
                tx += info.tx_bytes
                rx += info.rx_bytes
                world = info.local_world_size
            remaining = sorted(failures)
            if remaining and len(self.group_ring) < 2:
                raise TooFewPeersError("the world dropped below 2 peers before all operations succeeded")
        return ReduceInfo(local_world_size=world or len(self.group_ring), tx_bytes=tx, rx_bytes=rx)

    # ------------------------------------------------------------------------------------------
    # shared state

    async def sync_shared_state(
        self,
        state: Any,
        strategy: SharedStateSyncStrategy = SharedStateSyncStrategy.ENFORCE_POPULAR,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> SharedStateSyncInfo:
        """Synchronize ``state`` with the group (a group vote); see docs/protocol.md section 5.

        Tensors are updated in place; ``state.revision`` is set to the group's revision.

        Args:
            state: the :class:`pccl.SharedState`.
            strategy: ENFORCE_POPULAR, RECEIVE_ONLY or SEND_ONLY.
            progress: optional ``callback(bytes_done, bytes_total)`` for long transfers (None: the
                default display, ``PeerConfig.progress``).

        Raises:
            SharedStateSyncError / NoSharedStateAvailableError: refused or failed; tensors unchanged.
            RankConnectionLostError: a participant (or the master) was lost mid-sync; retry.
        """
        await self._await_link()
        self._core.begin_sync()
        assert self._dialer is not None
        inbox = Mailbox()
        self._sync_inbox = inbox
        moved = [-math.inf]  # when bytes last arrived: a transfer that moves is no wait
        shown = progress
        if shown is None and self.config.progress:
            shown = TransferProgress(f"peer {self.peer_id}: shared state")

        def on_progress(done: int, total: int) -> None:
            moved[0] = trio.current_time()
            if shown is not None:
                shown(done, total)

        def describe(waited: float) -> str | None:
            if trio.current_time() - moved[0] < self._notices.board.first:
                return None
            return (f"peer {self.peer_id}: sync_shared_state() has waited {format_wait(waited)}: it "
                    f"completes once every accepted peer of peer group {self.peer_group} calls it and the "
                    f"transfers its plan names are done (the master's log names those it waits for)")

        try:
            with self._notices.waiting(("sync",), describe):
                return await shared_state.run_sync(
                    _SyncLink(self, inbox),
                    self._dialer,
                    self._state_server,
                    state,
                    SharedStateSyncStrategy(strategy),
                    on_progress,
                )
        finally:
            if isinstance(shown, TransferProgress):
                shown.close()
            self._sync_inbox = None
            self._core.end_membership()

    async def _serve_state(self, ms: MessageStream, hello: m.Hello) -> None:
        await shared_state.serve_state_requests(self._state_server, ms, hello)

    # ------------------------------------------------------------------------------------------
    # bandwidth

    async def _serve_bench(self, ms: MessageStream, hello: m.Hello) -> None:
        await bandwidth.serve_probe(ms)

    async def _measure(self, msg: m.MeasureBandwidth) -> None:
        assert self._dialer is not None
        results = await bandwidth.measure_targets(self._dialer, msg.targets, msg.duration)
        try:
            await self._send(m.BandwidthReport(epoch=msg.epoch, results=results))
        except PCCLError:
            pass


class _SyncLink:
    """The master link of one shared-state sync (a :class:`pccl.peer.links.MasterLink`).

    Its ``SharedStateDone(success)`` puts the sync in doubt (:meth:`PeerState.sync_done`) before it
    is sent: if the master is lost from then on, the sync waits for the decision of the master this
    peer reconnects to instead of failing (docs/concepts.md "Operations in doubt").
    """

    def __init__(self, comm: Communicator, inbox: Mailbox) -> None:
        self._comm = comm
        self._inbox = inbox

    @property
    def inbox(self) -> Mailbox:
        return self._inbox

    async def send(self, msg: m.Message) -> None:
        core = self._comm._core
        in_doubt = isinstance(msg, m.SharedStateDone) and msg.success
        if in_doubt:
            core.sync_done()
        try:
            await self._comm._send(msg)
        except RankConnectionLostError:
            if not (in_doubt and core.reconnecting):
                raise


def _guard(fn: Callable[..., Awaitable[None]], what: str) -> Callable[..., Awaitable[None]]:
    """Wrap a background task so a bug in it is logged instead of tearing down the nursery silently."""

    async def wrapped(*args: Any, **kwargs: Any) -> None:
        try:
            await fn(*args, **kwargs)
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception:
            log.exception("%s crashed", what)
            raise

    return wrapped


@asynccontextmanager
async def open_communicator(
    address: Addresses | None = None,
    *,
    peer_group: int = 0,
    p2p_connection_pool_size: int = 0,
    config: PeerConfig | None = None,
    transport: Transport | None = None,
) -> AsyncIterator[Communicator]:
    """Connect to the master and yield a :class:`Communicator` once this peer is accepted.

    The first peer is accepted at once; later peers wait until the accepted peers call
    ``update_topology()``.

    Args:
        address: master ``"HOST:PORT"`` or ``(host, port)`` (port 48148 when omitted), or several
            (a list, or one comma-separated string: the master, then its standbys; the first that
            answers is used, and a peer that loses its master reconnects to them in turn within
            ``config.reconnect_window``); None: ``$PCCL_MASTER`` (comma-separated likewise).
        peer_group: collectives and shared-state syncs run within a group.
        p2p_connection_pool_size: TCP connections per partner and direction; 0 (default): sized per
            partner from the round trip of its first connection, enough to keep
            ``PeerConfig.p2p_stripe_target_mbit`` in flight (one on a LAN; docs/topology.md).
        config: timeouts and limits (:class:`pccl.PeerConfig`).
        transport: the transport seam (default TCP; pccl.testing provides a virtual network).

    Raises:
        MasterConnectionError: the master cannot be reached, refuses us (a TLS certificate it does
            not accept included), or is lost while waiting.
        InvalidArgumentError: a TLS file of ``config`` cannot be read or is not valid.
    """
    comm = Communicator(
        address,
        peer_group=peer_group,
        p2p_connection_pool_size=p2p_connection_pool_size,
        config=config,
        transport=transport,
    )
    # Errors are re-raised outside the nursery so callers see one exception, never an ExceptionGroup.
    start_error: BaseException | None = None
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        try:
            await comm._start(nursery)
        except BaseException as exc:
            start_error = exc
            await comm.aclose()
        if start_error is None:
            try:
                yield comm
            except BaseException as exc:
                body_error = exc
            finally:
                await comm.aclose()
    if start_error is not None:
        raise start_error
    if body_error is not None:
        raise body_error


__all__ = ["Communicator", "error_from_code", "open_communicator"]
