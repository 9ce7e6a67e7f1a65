"""The peer: the native async communicator.

The protocol rules live in the pure :class:`pccl.peer.state.PeerState` (the peer table and epoch, the
collectives in flight and their op_seq matching, one membership call at a time, shared-state rounds,
the master's liveness): the reader task feeds it each message from the master and executes the effects
it returns (:meth:`Communicator.handle_master_message`, through a table of one handler per effect
type). This module keeps the lifecycle, the waiters and the shared-state sync; the master link
(dialing, reader, heartbeat, watchdog, reconnection) is :mod:`pccl.peer.master_link`'s, the membership
calls :mod:`pccl.peer.membership`'s and the collective calls :mod:`pccl.peer.collective_api`'s (their
data side: :mod:`pccl.collectives.executor`). Messages are described in docs/protocol.md.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from .. import _env, _tls
from .._address import Addresses, parse_addresses
from .._config import PeerConfig
from .._errors import (
    HelloRefusedError,
    InvalidArgumentError,
    InvalidUsageError,
    MasterConnectionError,
    PCCLError,
    RankConnectionLostError,
    Result,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)
from .._types import (
    Attribute,
    SharedStateSyncInfo,
    SharedStateSyncStrategy,
)
from .._waits import format_wait
from ..collectives.cost import SCHEDULE_REQUESTS, LinkModel
from ..kernels.buffers import BufferCache
from ..transport import ConnectFailed, TcpTransport, TlsTransport, Transport
from ..wire import messages as m
from ..wire.stream import MessageStream
from . import bandwidth, shared_state
from .collective_api import PHASES, CollectiveCalls, OpState
from .credentials import CredentialStore
from .mailbox import Mailbox, Waiter
from .master_link import MasterConnection, failover_order
from .membership import MembershipCalls
from .notices import WaitReporter
from .p2p import P2PConnections, P2PDialer, serve_p2p
from .pool import P2PPool
from .progress import TransferProgress
from .spin import Spinner
from .stall import StallWatch
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
    ReleasePin,
    RemoveMember,
    Resolve,
    error_from_code,
)

log = logging.getLogger("pccl.peer")

#: A peer not accepted this soon after registering says at INFO that it waits (the first peer of a run
#: is accepted at once and says nothing).
_WAITING_NOTICE_AFTER = 0.25


def _no_limit(seconds: float | None) -> float:
    return float("inf") if seconds is None else seconds


class Communicator(MasterConnection, MembershipCalls, CollectiveCalls):
    """A peer of a pccl run (native async API). Create it with :func:`open_communicator`.

    The collective calls (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``,
    ``reduce``, ``all_to_all``, ``all_reduce_multiple_with_retry``) come from
    :class:`~pccl.peer.collective_api.CollectiveCalls`, the membership calls (``update_topology``,
    ``optimize_topology``, ``are_peers_pending``) from :class:`~pccl.peer.membership.MembershipCalls`.
    """

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
        self._ops: dict[int, OpState] = {}  # the waiting side of the core's ops, by tag
        self._sync_inbox: Mailbox | None = None  # the running sync's plan and result
        self._state_server = shared_state.StateServer(
            plan_timeout=self.config.connect_timeout, stall_timeout=self.config.p2p_stall_timeout,
            serve_rate=self.config.state_serve_rate, serve_idle_rate=self.config.state_serve_idle_rate)
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
        self._phase_seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
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
        ``sync`` (the running sync, see :meth:`pccl.peer.shared_state.StateServer.statistics`; its
        ``progress``: bytes, chunks, donors, rate of this peer's fetch), the ``heal_*`` counters over
        this peer's fetches (:meth:`pccl.peer.shared_state.StateServer.count`), ``heal_last`` (its last
        fetch's statistics),
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
            **self._state_server.totals,
            "heal_last": self._state_server.last,
            "heal_pins": self._state_server.pin_statistics(),
        }

    def __repr__(self) -> str:
        core = self._core
        return (
            f"<Communicator peer={core.peer_id} group={self.peer_group} world={len(core.table)} "
            f"epoch={core.epoch} ops={sorted(core.ops)} master={'ok' if core.lost is None else 'lost'}>"
        )

    # ------------------------------------------------------------------------------------------
    # lifecycle

    async def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        ms, reply = await self._dial_first_master()
        self._ms = ms
        self._core.peer_id = reply.peer_id
        self.p2p_address = address = await self._open_data_plane(nursery, ms)
        self._core.last_heard = trio.current_time()
        self._start_link_tasks(ms)
        self._stall.name = f"peer {self.peer_id}"
        nursery.start_soon(self._stall.run)
        nursery.start_soon(self._spinner.run)
        await self._send(m.Register(p2p_port=address[1], peer_group=self.peer_group,
                                     public_key=self._credentials.public_key))
        if self._standbys():
            await self._send(m.Standbys(count=self._standbys()))
        nursery.start_soon(self._notices.run)
        await self._await_accept()
        log.info("peer %d accepted (world size %d)", self.peer_id, len(self._core.table))

    async def _dial_first_master(self) -> tuple[MessageStream, m.HelloOk]:
        """The link to the first of ``master_addresses`` that answers, and its reply."""
        errors: list[MasterConnectionError] = []
        for host, port in self.master_addresses:
            try:
                ms, reply = await self._dial(host, port)
            except MasterConnectionError as exc:
                errors.append(exc)
                continue
            self.master_host, self.master_port = host, port
            return ms, reply
        text = "; ".join(e.message for e in errors) + self._origin
        if all(isinstance(e, HelloRefusedError) for e in errors):
            raise HelloRefusedError(text)
        raise MasterConnectionError(text)

    async def _open_data_plane(self, nursery: trio.Nursery, ms: MessageStream) -> tuple[str, int]:
        """Open the P2P dialer, the ring pool and the P2P listener; the listener's address. Closes ``ms``
        if the listener cannot be opened."""
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
            address: tuple[str, int] = await nursery.start(
                _guard(serve, "P2P listener"),
                self.transport,
                self.config.p2p_listen_host,
                self.config.p2p_listen_port,
                handlers,
            )
        except (ConnectFailed, PCCLError) as exc:
            await ms.aclose()
            raise MasterConnectionError(f"cannot open the P2P listener: {exc}") from exc
        return address

    async def _await_accept(self) -> None:
        """Wait until the master accepts this peer (a notice while it waits long), or raise after
        ``accept_timeout``."""
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

    def _fail_all(self, error: PCCLError, *, closing: bool = False) -> None:
        """The master is gone for good (or we close): fail every pending and future call."""
        if self._core.lose(error) and not closing:
            log.error("peer %d: %s", self.peer_id, error)
        self._fail_calls(error)
        self._link_up.set()  # calls waiting for a reconnection see the loss

    def _new_master_generation(self) -> None:
        """A master of another generation took this peer back: it knows none of its predecessor's live
        heals, so it never releases their pinned snapshots; their fetchers' calls failed with that master
        (a fetch not finished is abandoned at its loss) or wait in doubt with every byte fetched, so
        nobody asks for those snapshots any more (docs/concepts.md "Live heals")."""
        self._state_server.release_all("the master they were pinned for is gone")

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

    # --- executing the core's effects -------------------------------------------------------

    def handle_master_message(self, msg: m.Message) -> PCCLError | None:
        """What the reader task does with each message from the master: the core applies it, this
        executes the effects (synchronously: no checkpoint) through :attr:`_EFFECTS`. Public so that a
        test can script the master's messages exactly as they would arrive.

        Returns:
            The error that ended the master link, if this message ended it (the reader then stops).
        """
        lost: PCCLError | None = None
        for effect in self._core.handle(msg, trio.current_time()):
            ended = self._EFFECTS[type(effect)](self, effect)
            if ended is not None:
                lost = ended
        return lost

    def _on_lost(self, effect: Effect) -> PCCLError | None:
        assert isinstance(effect, Lost)
        self._fail_all(effect.error)
        return effect.error

    def _on_dismissed(self, effect: Effect) -> PCCLError | None:
        # The master gave the run up (no quorum): fail over as if the link broke.
        assert isinstance(effect, Dismissed)
        if self._ms is not None:
            self._link_failed(self._ms, effect.error)
        else:
            self._fail_all(effect.error)
        return effect.error

    def _on_resolve(self, effect: Effect) -> None:
        assert isinstance(effect, Resolve)
        self._RESOLVE[effect.call](self, effect)

    def _on_abort(self, effect: Effect) -> None:
        assert isinstance(effect, AbortOp)
        st = self._ops.get(effect.tag)
        if st is not None:
            st.abort_error = effect.error
            st.commence.fail(effect.error)
            st.complete.fail(effect.error)
            if st.scope is not None:
                st.scope.cancel()

    def _on_establish(self, effect: Effect) -> None:
        assert isinstance(effect, Establish) and self._nursery is not None
        self._nursery.start_soon(self._establish, effect)

    def _on_measure(self, effect: Effect) -> None:
        assert isinstance(effect, Measure) and self._nursery is not None
        self._nursery.start_soon(self._measure, effect.request)

    def _on_forget(self, effect: Effect) -> None:
        assert isinstance(effect, Forget)
        if self.pool is not None:
            for op_seq in effect.op_seqs:
                if 0 <= op_seq < 2**32:
                    self.pool.forget_op(op_seq)

    def _on_credentials(self, effect: Effect) -> None:
        assert isinstance(effect, InstallCredentials)
        self._credentials.install(effect.message, me=self.peer_id)

    def _on_member_removed(self, effect: Effect) -> None:
        # Its credential stops working here at once, and what it holds here is closed and freed
        # (its ring connections and their stash, its state and bench connections).
        assert isinstance(effect, RemoveMember)
        self._credentials.revoke(effect.peer_id)
        closed = self.p2p_connections.drop_peer(effect.peer_id)
        log.info("peer %d was removed from the run (%s): its P2P credential is revoked here, %d of its "
                 "connections closed", effect.peer_id, effect.reason, closed)
        if self.pool is not None and self._nursery is not None:
            self._nursery.start_soon(self.pool.disconnect, effect.peer_id)

    def _on_release_pin(self, effect: Effect) -> None:
        assert isinstance(effect, ReleasePin)
        self._state_server.release(effect.sync_seq)

    #: How each of the core's effects is executed (a table: every effect type has its one entry).
    _EFFECTS: dict[type, Callable[[Communicator, Effect], PCCLError | None]] = {
        Lost: _on_lost,
        Dismissed: _on_dismissed,
        Resolve: _on_resolve,
        AbortOp: _on_abort,
        Establish: _on_establish,
        Measure: _on_measure,
        Forget: _on_forget,
        InstallCredentials: _on_credentials,
        RemoveMember: _on_member_removed,
        ReleasePin: _on_release_pin,
    }

    def _resolve_commence(self, effect: Resolve) -> None:
        st = self._ops.get(effect.tag)
        if st is not None:
            assert isinstance(effect.message, m.CollectiveCommence)
            st.commence.set(effect.message)

    def _resolve_complete(self, effect: Resolve) -> None:
        st = self._ops.get(effect.tag)
        if st is not None:
            assert isinstance(effect.message, m.CollectiveComplete)
            st.complete.set(effect.message)

    def _resolve_sync(self, effect: Resolve) -> None:
        if self._sync_inbox is not None:
            self._sync_inbox.put(effect.message)

    def _resolve_topology(self, effect: Resolve) -> None:
        assert isinstance(effect.message, m.TopologyResult)
        if self._topology_waiter is not None:
            self._topology_waiter.set(effect.message)

    def _resolve_pending(self, effect: Resolve) -> None:
        assert isinstance(effect.message, m.PeersPendingResult)
        if self._pending_waiters:
            self._pending_waiters.popleft().set(effect.message)

    def _resolve_accepted(self, effect: Resolve) -> None:
        assert isinstance(effect.message, m.Accepted)
        self._accepted.set(effect.message)

    #: Which waiter each kind of call's answer resolves.
    _RESOLVE: dict[Call, Callable[[Communicator, Resolve], None]] = {
        Call.COMMENCE: _resolve_commence,
        Call.COMPLETE: _resolve_complete,
        Call.SYNC: _resolve_sync,
        Call.TOPOLOGY: _resolve_topology,
        Call.PENDING: _resolve_pending,
        Call.ACCEPTED: _resolve_accepted,
    }

    def _blocked_partners(self) -> list[int]:
        return self.pool.blocked_partners() if self.pool is not None else []

    def _pool_progress(self) -> tuple[int, int]:
        """The pool's byte counters: what the stall watch samples."""
        stats = self.pool.statistics()
        return (stats["tx_bytes"], stats["rx_bytes"])

    # ------------------------------------------------------------------------------------------
    # shared state

    async def sync_shared_state(
        self,
        state: Any,
        strategy: SharedStateSyncStrategy = SharedStateSyncStrategy.ENFORCE_POPULAR,
        *,
        progress: Callable[[int, int], None] | None = None,
        observe: Callable[[bool, int], None] | None = None,
    ) -> SharedStateSyncInfo:
        """Synchronize ``state`` with the group (a group vote); see docs/protocol.md section 5.

        Tensors are updated in place; ``state.revision`` is set to the group's revision.

        Args:
            state: the :class:`pccl.SharedState`.
            strategy: ENFORCE_POPULAR, RECEIVE_ONLY or SEND_ONLY.
            progress: optional ``callback(bytes_done, bytes_total)`` for long transfers (None: the
                default display, ``PeerConfig.progress``).
            observe: issue 35 item 4 (docs/concepts.md "Replaying the rounds missed"): should this peer
                fetch in a live heal, it takes part in its group's collectives meanwhile, contributing
                nothing, and replays them (the caller's job: ``pccl.torch``'s DiLoCo with
                ``replay_heals``). ``observe(live, revision)`` is called once the master's plan came,
                ``live`` True when this peer fetches a live heal of ``revision``; the call then returns
                as soon as this peer has that revision (complete and verified).

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
                    observe,
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

    def revote(self) -> None:
        """The sync votes again in the same call (a live heal that ended behind the group)."""
        self._comm._core.revote_sync()

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
            ``PeerConfig.p2p_stripe_target_mbit`` in flight (one on a LAN), then adapted to the
            throughput its large transfers reach (docs/topology.md "Connections per partner").
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


__all__ = ["Communicator", "error_from_code", "failover_order", "open_communicator"]
