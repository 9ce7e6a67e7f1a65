"""The master's trio server: accept loop, one reader task and one serialized writer per peer
(a message with nothing queued ahead of it is written at once, without waking the writer),
heartbeats both ways, and the heartbeat monitor. All decisions live in :class:`MasterState`; this
module only does I/O and executes the effects it returns.

A bad peer (malformed frame, illegal message, wrong version or secret, a full send queue) is
kicked with a reason; it never takes the server down.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
import time
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from .. import _tls
from .._accept import HelloDone, accept_loop
from .._address import parse_address
from .._config import DEFAULT_MASTER_PORT, PROTOCOL_VERSION, RECONNECT_BACKOFF_MAX, MasterConfig
from .._errors import LocalProtocolError, RemoteProtocolError, Result
from .._exc import sole_exception
from .._waits import WaitBoard, format_wait
from ..transport import Address, ConnectFailed, StreamBroken, TcpTransport, TlsTransport, Transport
from ..wire import limits
from ..wire import messages as m
from ..wire.admission import HandshakeGate
from ..wire.handshake import accept_hello
from ..wire.hello import check_run
from ..wire.stream import CLOSED_BY_PEER, MessageStream
from .budget import LARGE_FRAME, ConnectionBudget, FrameBudget
from .deadlock import DeadlockWatch
from .effects import Drop, Effect, Event, Kick, Send
from .http import HttpStats, Response, bound_address, open_http_listeners, serve_http
from .stall_court import StallCourt
from .state import MasterState, Phase
from .status_server import StatusService
from .timers import MasterTimers, TimerConfig
from .token_key import member_tokens

log = logging.getLogger("pccl.master")

_CLOSE = object()  # sentinel in a peer's send queue: flush, then close
_FLUSH = object()  # sentinel in a peer's send queue: send the tail a send_nowait left behind
# A vote or round that waits on the same peers this long gets a warning in the log (and again at doubling
# intervals while it lasts, pccl._waits), naming whom it waits for; so does a peer waiting to be accepted.
STALL_LOG_AFTER = 5.0


@dataclass
class _Conn:
    peer_id: int
    ms: MessageStream
    send: trio.MemorySendChannel[Any]
    recv: trio.MemoryReceiveChannel[Any]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    closing: bool = False
    flushed: trio.Event = field(default_factory=trio.Event)
    # Items put on ``send`` and not yet written by the writer. Counted, not read off the channel:
    # the writer yields between taking an item and locking the stream for it, and an immediate
    # send in that gap would overtake it.
    queued: int = 0


def _still_waiting(line: str, waited: float) -> str:
    return f"still waiting after {format_wait(waited)}: {line}"


class MasterServer:
    """Runs one master. Use :func:`serve_master` or :func:`open_master` rather than this directly."""

    def __init__(self, *, config: MasterConfig | None = None, transport: Transport | None = None) -> None:
        self.config = config or MasterConfig()
        inner: Transport = transport or TcpTransport()
        tls = self.config.tls
        if tls is not None:  # docs/security.md "TLS"
            # The handshake runs in each connection's task under hello_timeout, on its first receive.
            inner = TlsTransport(inner, server_context=_tls.server_context(tls), client_context=None)
        self.transport: Transport = inner
        self.state = MasterState(clock=time.perf_counter, quorum=self.config.quorum,
                                 rebuild_grace=self.config.rebuild_grace,
                                 rebuild_quiet=self.config.rebuild_quiet,
                                 failover_quiet=self.config.heartbeat_interval + RECONNECT_BACKOFF_MAX,
                                 rejoin_grace=self.config.rejoin_grace,
                                 go_delay=self.config.speculative_go_delay,
                                 credentials_delay=self.config.credentials_batch_delay,
                                 tokens=member_tokens(self.config.secret, self.config.token_key_file),
                                 max_open_votes=self.config.max_open_votes,
                                 live_heal_rounds=self.config.live_heal_rounds)
        self._conns: dict[int, _Conn] = {}
        self.address: Address | None = None
        self.kicked_total = 0
        self.improve_budget = 2.0
        self._nursery: trio.Nursery | None = None
        grace = self.config.deadlock_grace
        self.deadlocks = DeadlockWatch(grace) if grace is not None else None
        cfg = self.config
        self.timers = MasterTimers(self.state, TimerConfig(
            heartbeat_interval=cfg.heartbeat_interval, heartbeat_timeout=cfg.heartbeat_timeout,
            p2p_setup_timeout=cfg.p2p_setup_timeout, straggler_timeout=cfg.straggler_timeout,
            vote_timeout=cfg.vote_timeout, quorum_hold_timeout=cfg.quorum_hold_timeout,
            admission_grace=cfg.admission_grace), self.deadlocks)
        self._urgent: tuple[float | None, ...] = self.timers.urgent()
        self._wake_monitor: trio.Event | None = None
        self._wake_go = trio.Event()  # set when a held-back tableless commence is first due
        self.status: StatusService | None = None  # observes the master once it serves
        self.status_address: Address | None = None  # where /status is served (status_port set)
        self.gate = HandshakeGate()  # the cap on connections in their hello (docs/security.md)
        # After the hello: descriptors and per-source caps for peers not yet admitted, and the bytes of
        # their unfinished large frames (pccl/master/budget.py, docs/security.md "Members").
        self.budget = ConnectionBudget()
        self.frames = FrameBudget()
        self.http = HttpStats()  # the status page's connections
        # stall reports judged: strikes, lone holds, testimonies (pccl/master/stall_court.py)
        self.court = StallCourt(self.state)
        # The run this master serves ("": none yet); see pccl.wire.hello.check_run.
        self.run: str = self.config.run or ""

    def statistics(self) -> dict[str, Any]:
        """Master summary: the state's statistics plus connection counts and the run name."""
        s = self.state.statistics()
        s["run"] = self.run
        s["connections"] = len(self._conns)
        s["kicked_total"] = self.kicked_total
        return s

    def __repr__(self) -> str:
        return f"<MasterServer {self.address} {self.state!r}>"

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled."""
        listener = await self.transport.listen(host, port)
        try:
            http = await self._open_status(host) if self.config.status_port is not None else None
        except ConnectFailed:
            await listener.aclose()
            raise
        self.address = listener.address
        if http is not None:  # only the status server reads what the service observes
            self.status = StatusService(self.state, f"{self.address[0]}:{self.address[1]}")
        self._wake_monitor = trio.Event()
        log.info("master listening on %s:%d", *self.address)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if http is not None:
                    nursery.start_soon(serve_http, http, self._route, self.http)
                nursery.start_soon(self._monitor)
                if self.config.speculative_go_delay > 0:
                    nursery.start_soon(self._speculative_go)
                task_status.started(listener.address)
                nursery.start_soon(_load_deferred)
                try:
                    await accept_loop(listener, nursery, self._connection, gate=self.gate, log=log,
                                      what="the master")
                except StreamBroken:
                    log.error("listener failed; master stops accepting")
                    raise
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()

    async def _open_status(self, host: str) -> list[trio.SocketListener]:
        assert self.config.status_port is not None
        status_host = self.config.status_host or host
        try:
            listeners = await open_http_listeners(status_host, self.config.status_port)
        except OSError as exc:
            log.debug("cannot bind the status port", exc_info=True)
            raise ConnectFailed(f"cannot serve the status page on {status_host}:{self.config.status_port}: "
                                f"{exc.strerror or exc}") from None
        self.status_address = bound_address(listeners)
        log.info("status page on http://%s:%d/ (/status, /metrics)", *self.status_address)
        return listeners

    def _route(self, path: str) -> Response | None:
        return self.status.route(path) if self.status is not None else None

    # ------------------------------------------------------------------------------------------

    async def _connection(self, stream: Any, hello_done: HelloDone) -> None:
        ms = MessageStream(stream, max_frame_size=self.config.max_frame_size,
                           limits=limits.pre_auth(self.config.max_frame_size))
        host = stream.peer_address[0]
        hello = await self._hello(ms, host)
        if hello is None or not await self._run_of(ms, hello, host):
            return
        hello_done()
        ms.set_limits(limits.master_inbound(self.config.max_frame_size))
        now = trio.current_time()
        claim = hello.peer_id  # >= 0: a member coming back (Reregister)
        if claim in self._conns:
            # The id's previous connection is still closing (its peer was just kicked or dropped):
            # never two connections under one id; the member's Reregister is refused and it retries.
            claim = -1
        over = self._over_budget(host, claim)
        if over is not None:
            log.warning("refused connection from %s after its hello: %s", host, over)
            with trio.move_on_after(1.0):
                await ms.send(m.Refused(reason=over, code=int(Result.MASTER_CONNECTION_FAILED)))
            await ms.aclose()
            return
        await self._serve(ms, self.state.new_connection(host, now, claim=claim))

    async def _hello(self, ms: MessageStream, host: str) -> m.Hello | None:
        """The hello of a new connection (None: refused or dropped, the stream closed, logged why)."""
        timeout = self.config.hello_timeout
        try:
            with trio.fail_after(timeout):
                hello, refusal = await accept_hello(ms, purpose="master", secret=self.config.secret,
                                                    listener="the master", run=self.run)
            if refusal is not None:
                log.warning("refused connection from %s: %s", host, refusal.reason)
                await self._goodbye(ms, refusal.reason, int(refusal.result))
                return None
        except trio.TooSlowError:
            log.warning("connection from %s dropped during hello: it sent no complete hello within %gs "
                        "(MasterConfig.hello_timeout; a silent client, a port scanner, or not a pccl peer)",
                        host, timeout)
            await ms.aclose()
            return None
        except RemoteProtocolError as exc:
            log.warning("connection from %s dropped during hello: not a pccl peer: %s", host, exc.message)
            await ms.aclose()
            return None
        except StreamBroken as exc:
            if not ms.received_any and str(exc) == CLOSED_BY_PEER:
                # A port probe (a health check, a scanner) connects and closes without a byte.
                log.info("connection from %s closed before sending a hello (a port probe?)", host)
            else:
                log.warning("connection from %s dropped during hello: %s", host, exc)
            await ms.aclose()
            return None
        assert hello is not None  # accepted
        return hello

    async def _run_of(self, ms: MessageStream, hello: m.Hello, host: str) -> bool:
        """Whether the run ``hello`` names may join this master's (False: refused, the stream closed); an
        unnamed master takes the first name it hears (docs/concepts.md "Run names")."""
        late = check_run(self.run, hello.run)  # the master took a name during this hello
        if late is not None:
            log.warning("refused connection from %s: %s", host, late)
            await self._goodbye(ms, late, int(Result.INVALID_USAGE))
            return False
        if self.run and not hello.run:
            # Accepted (the established API names no run), but said: a foreign job's peers on the same
            # address would otherwise join without a word (docs/concepts.md "Run names", rule 1).
            log.warning("connection from %s names no run; accepted into run %r (set PCCL_RUN or "
                        "PeerConfig.run on its peers to keep other jobs out)", host, self.run)
        if hello.run and not self.run:
            # An unnamed master takes its run's name from the first named peer (a restarted master
            # takes the name back from the members that re-register): docs/concepts.md "Run names".
            self.run = hello.run
            log.warning("this master now serves run %r (taken from %s peer from %s)", self.run,
                        "a returning" if hello.peer_id >= 0 else "the first named", host)
        return True

    async def _serve(self, ms: MessageStream, pid: int) -> None:
        """Peer ``pid``'s connection after its hello, until it closes: a reader, a serialized writer and
        the heartbeats; its loss goes to the state unless the master itself stops."""
        ms.set_guard(_GuestFrames(self.frames, self.state, pid))
        send, recv = trio.open_memory_channel[Any](self.config.send_queue_size)
        conn = _Conn(peer_id=pid, ms=ms, send=send, recv=recv)
        self._conns[pid] = conn
        try:
            await ms.send(m.HelloOk(protocol_version=PROTOCOL_VERSION, peer_id=pid))
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer, conn)
                    nursery.start_soon(self._heartbeats, conn)
                    await self._reader(conn)
                    if conn.closing:
                        # Give the writer a moment to deliver the goodbye (Refused) before closing.
                        with trio.move_on_after(1.0):
                            await conn.flushed.wait()
                    nursery.cancel_scope.cancel()
        except StreamBroken:
            pass
        finally:
            # Cancelled from outside this connection (its own scope is closed by now): the master
            # itself stops, and its connections close because of it, not because their peers left.
            # A stopping master decides nothing: a vote the departure would complete (a pending
            # query, a topology round) must fail for its voters with the master's loss, not be
            # answered over a connection that has not closed yet.
            stopping = trio.current_effective_deadline() == -math.inf
            self._conns.pop(pid, None)
            with trio.CancelScope(shield=True):
                await ms.aclose()
            if not stopping:
                self._execute(self.state.peer_lost(pid, "left (connection closed)", trio.current_time(),
                                                   broken=True))

    def _over_budget(self, host: str, claim: int) -> str | None:
        """Why a connection past its hello may not stay (None: it may), see pccl/master/budget.py."""
        peers = self.state.peers
        guests = [c for c in self._conns.values()
                  if (rec := peers.get(c.peer_id)) is None or rec.phase is not Phase.ACCEPTED]
        from_host = sum(1 for c in guests if (rec := peers.get(c.peer_id)) is not None and rec.host == host)
        open_fds = len(self._conns) + self.gate.in_hello + 1 + self.http.open
        return self.budget.admit(host, open_fds=open_fds, members=len(self.state.ring),
                                 guests_from_host=from_host, away_claim=claim in self.state.away.members)

    @staticmethod
    async def _goodbye(ms: MessageStream, reason: str, code: int) -> None:
        """Tell a refused connection why (best effort: it may have closed already, e.g. a client that
        refused our challenge) and close it."""
        with trio.move_on_after(1.0):
            try:
                await ms.send(m.Refused(reason=reason, code=code))
            except StreamBroken:
                pass
        await ms.aclose()

    async def _reader(self, conn: _Conn) -> None:
        while True:
            try:
                msg = await conn.ms.receive()
            except RemoteProtocolError as exc:
                log.warning("kicking peer %d: protocol error: %s", conn.peer_id, exc.message)
                self._execute(self.state.kick(conn.peer_id, f"protocol error: {exc.message}"))
                return
            except StreamBroken:
                return
            now = trio.current_time()
            try:
                # The status page (metrics) and the stall report read the message too: inside the
                # guard, so that nothing a peer sends can fail the master outside it (issue 33).
                if self.status is not None:
                    self.status.on_message(conn.peer_id, msg, now)
                if isinstance(msg, m.CollectiveDone) and not msg.success:
                    self._execute(self.court.report(conn.peer_id, msg, now))
                    if conn.closing:
                        return
                effects = self.state.handle(conn.peer_id, msg, now)
                if self.deadlocks is not None and not isinstance(msg, m.Heartbeat):
                    self.deadlocks.changed(now)  # a vote may have come without an effect
            except Exception:
                # A bug of the master's core (or its observer) on this message must not take the
                # master, and with it every other peer's run, down: it is logged with its traceback
                # and the sender, who cannot know what the master made of its message, is refused;
                # the master serves on.
                what = type(msg).__name__
                log.exception("internal error handling a %s from peer %d: kicking it", what, conn.peer_id)
                effects = self.state.kick(conn.peer_id, f"internal error of the master handling its {what}",
                                          Result.INTERNAL_ERROR)
            self._execute(effects)
            if conn.closing:
                return

    async def _writer(self, conn: _Conn) -> None:
        try:
            async for item in conn.recv:
                if item is _CLOSE:
                    await conn.ms.flush()
                    conn.flushed.set()
                    conn.scope.cancel()
                    return
                if item is _FLUSH:
                    await conn.ms.flush()
                else:
                    try:
                        await conn.ms.send(item)
                    except LocalProtocolError as exc:
                        self._unsendable(conn, item, exc)
                        return
                conn.queued -= 1
        except StreamBroken:
            # The peer reset the connection: end this connection only (the reader sees it too).
            conn.scope.cancel()

    async def _heartbeats(self, conn: _Conn) -> None:
        while True:
            await trio.sleep(self.config.heartbeat_interval)
            self._enqueue(conn, m.Heartbeat())

    async def _monitor(self) -> None:
        """Tick the core's timers (pccl/master/timers.py: heartbeat silence, stragglers, the P2P setup,
        operations in doubt, member holds, owed credentials, vote timeouts, the quorum hold, deadlocks)
        and sleep until the next deadline.

        Sleeps until the earliest deadline (not a fixed tick), so a hung peer is evicted within a
        millisecond of its timeout: the survivors' recovery time is the timeout, not timeout + tick.
        Re-checks at least every heartbeat interval (with a straggler timeout every quarter of it: who
        is waited on changes with every message), and whenever a message moved an urgent deadline.
        """
        stalls = WaitBoard(first=STALL_LOG_AFTER)
        logged = -math.inf
        while True:
            now = trio.current_time()
            if now >= logged + self.config.heartbeat_interval:
                # O(open votes): at most once per heartbeat interval, however often a deadline or a
                # message (a deadlock check falling due) wakes the monitor.
                logged = now
                self._log_stalls(now, stalls)
            stalls_before = self.timers.stalls.stalls_total
            for effects in self.timers.tick(now):
                self._execute(effects)
            if self.timers.stalls.stalls_total != stalls_before and self.timers.stalls.last_stall >= 1.0:
                log.warning("the master did not run for %.2fs (an overloaded host?): the peers' silence "
                            "during it is not held against them", self.timers.stalls.last_stall)
            # Wake just after the deadline, or at the re-check, or when a message moved a deadline.
            wake = self.timers.wake_at(now)
            assert self._wake_monitor is not None
            with trio.move_on_at(wake):
                await self._wake_monitor.wait()
            self._wake_monitor = trio.Event()

    async def _speculative_go(self) -> None:
        """Send the tableless commences the state held back (MasterConfig.speculative_go_delay) once
        they are due and their ops still run. Sleeps while none is held: an op that completes within
        the delay costs this task one wake-up (at the delay's end), no message."""
        while True:
            due = self.state.go_deadline()
            if due is None:
                await self._wake_go.wait()
                self._wake_go = trio.Event()
                continue
            await trio.sleep_until(due)
            self._execute(self.state.go_overdue(trio.current_time()))

    def _log_stalls(self, now: float, board: WaitBoard) -> None:
        """Log a warning for every vote or round that has waited on the same peers for
        ``STALL_LOG_AFTER`` seconds, and for every peer waiting that long to be accepted (again at
        doubling intervals while it lasts)."""
        lines: dict[Hashable, str] = {line: line for line in self.state.pending_summary()}
        accepted = len(self.state.ring)
        voting = any(str(k).startswith("update_topology") for k in lines)
        called = "" if voting else "; none has called it"
        for pid in self.state.registered():
            rec = self.state.peers[pid]
            if accepted == 0:
                continue  # the first peer is accepted at once (a rebuilding master waits on its roll call)
            lines[("accept", pid)] = (f"peer {pid} (from {rec.host}) waits to be accepted: the {accepted} "
                                      f"accepted peer(s) must call update_topology(){called}")
        for key in [k for k in board.keys() if k not in lines]:
            board.end(key)
        for key, line in lines.items():
            if key not in board:
                board.begin(key, functools.partial(_still_waiting, line), now)
        for text in board.due(now):
            log.warning("%s", text)

    # ------------------------------------------------------------------------------------------

    def _enqueue(self, conn: _Conn, item: Any) -> None:
        if conn.closing:
            return
        if conn.queued == 0 and item is not _CLOSE:
            # Nothing ahead of it: write it now, from here, instead of waking the writer task.
            try:
                if conn.ms.send_nowait(item):
                    if not conn.ms.owes:
                        return
                    item = _FLUSH  # the socket took part of the frame: the writer sends the rest
            except StreamBroken:
                conn.scope.cancel()  # as the writer does: the reader sees the broken stream too
                return
            except LocalProtocolError as exc:
                self._unsendable(conn, item, exc)
                return
        try:
            conn.send.send_nowait(item)
            conn.queued += 1
        except trio.WouldBlock:
            # The peer does not read fast enough (or hangs): it cannot keep up with the protocol.
            self._drop(conn, "evicted: its send queue overflowed")
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def _unsendable(self, conn: _Conn, msg: Any, exc: LocalProtocolError) -> None:
        """A message for this peer cannot be framed (larger than ``max_frame_size``): the peer
        cannot follow the protocol without it, so it is evicted; the master carries on."""
        reason = (
            f"evicted: the master cannot send it a {type(msg).__name__}: {exc.message} "
            "(raise MasterConfig.max_frame_size)"
        )
        log.error("peer %d %s", conn.peer_id, reason)
        if conn.queued == 0:
            # Best effort: a short goodbye that says why usually still fits.
            try:
                conn.ms.send_nowait(m.Refused(reason=reason[:200], code=int(exc.result)))
            except (LocalProtocolError, StreamBroken):
                pass
        self._drop(conn, reason)

    def _drop(self, conn: _Conn, reason: str) -> None:
        """Close ``conn`` at once and tell the state its peer is gone."""
        conn.closing = True
        conn.scope.cancel()
        self._execute(self.state.peer_lost(conn.peer_id, reason, trio.current_time()))

    def _execute(self, effects: list[Effect]) -> None:
        self.court.retain()  # a member that left: its lone-hold ledger goes
        for eff in effects:
            if isinstance(eff, Send):
                conn = self._conns.get(eff.peer_id)
                if conn is not None:
                    self._enqueue(conn, eff.message)
            elif isinstance(eff, Kick):
                self.kicked_total += 1
                conn = self._conns.get(eff.peer_id)
                if conn is not None:
                    self._enqueue(conn, m.Refused(reason=eff.reason, code=eff.code))
                    self._enqueue(conn, _CLOSE)
                    conn.closing = True
            elif isinstance(eff, Drop):
                conn = self._conns.get(eff.peer_id)
                if conn is not None:
                    # A hung peer will not read a goodbye: close at once.
                    conn.closing = True
                    conn.scope.cancel()
            elif isinstance(eff, Event):
                log.info("%s", eff.text)
        if self.status is not None:
            try:
                self.status.on_effects(effects)
            except Exception:
                # Counting is not worth the run: a fault of the status page's bookkeeping is logged,
                # the master serves on (its metrics may be short of these effects).
                log.exception("internal error of the status page counting the master's effects")
        if self.deadlocks is not None and effects:
            # O(1): the check itself runs on the timers' clock (pccl/master/deadlock.py, issue 33).
            self.deadlocks.changed(trio.current_time())
        # A deadlock check fell due, a candidate deadlock appeared, a member's hold started or ended,
        # credential rows are owed: the monitor recomputes its sleep, so it acts on time.
        urgent = self.timers.urgent()
        if urgent != self._urgent:
            if self._wake_monitor is not None and any(
                    now is not None and now != was for now, was in zip(urgent, self._urgent, strict=True)):
                self._wake_monitor.set()
            self._urgent = urgent
        if self.state.go_waiting and not self._wake_go.is_set():
            self._wake_go.set()
        job = self.state.take_improvement_job()
        if job is not None and self._nursery is not None:
            self._nursery.start_soon(self._improve_ring, job)

    async def _improve_ring(self, job: tuple[list[int], list[list[float | None]]]) -> None:
        """Run the ATSP local search in a worker thread; the state adopts it at the next change."""
        from .topology import improve_ring

        ids, bw = job
        try:
            sol = await trio.to_thread.run_sync(
                functools.partial(
                    improve_ring,
                    list(range(len(ids))),
                    bw,
                    time_budget=self.improve_budget,
                    clock=time.perf_counter,
                )
            )
        except Exception as exc:  # a solver bug must not take the master down
            log.warning("background ring improvement failed: %s", exc)
            return
        self._execute(self.state.offer_ring([ids[i] for i in sol.order]))


#: Modules the master needs only on some events (the plan rule's planner on the first stalled operation, the
#: ring solver on the first topology change), kept out of its start-up so that it listens sooner
#: (tests/cli/test_master_imports.py), and loaded by :func:`_load_deferred` once it listens.
_DEFERRED = ("pccl.master.plan_rule", "pccl.master.topology")


async def _load_deferred() -> None:
    """Import :data:`_DEFERRED` in a worker thread once the master listens: an import where they are
    used would stall the trio loop (every peer's heartbeats) for its time (the planner: ~0.1-0.5 s).
    A use before this finishes waits only for the rest of the import (Python's per-module import lock)."""

    def load() -> None:
        for name in _DEFERRED:
            importlib.import_module(name)

    try:
        await trio.to_thread.run_sync(load, abandon_on_cancel=True)
    except Exception as exc:  # an import the master may never need must not take it down
        log.warning("loading %s failed: %s", ", ".join(_DEFERRED), exc)


class _GuestFrames:
    """A connection's :class:`~pccl.wire.stream.LargeFrameGuard`: its large frames count against the
    master's :class:`~pccl.master.budget.FrameBudget` while its peer is not an accepted member."""

    threshold = LARGE_FRAME

    def __init__(self, budget: FrameBudget, state: MasterState, peer_id: int) -> None:
        self.budget = budget
        self.state = state
        self.peer_id = peer_id
        self.deadline = budget.deadline

    def reserve(self, n: int) -> int | str:
        rec = self.state.peers.get(self.peer_id)
        if rec is not None and rec.phase is Phase.ACCEPTED:
            return 0
        why = self.budget.take(n)
        return n if why is None else why

    def release(self, n: int) -> None:
        self.budget.give(n)


async def serve_master(
    host: str = "0.0.0.0",
    port: int = DEFAULT_MASTER_PORT,
    *,
    config: MasterConfig | None = None,
    transport: Transport | None = None,
    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a master until cancelled.

    Args:
        host: address to bind ("0.0.0.0" for all interfaces).
        port: port to bind (0: the system picks one; ``task_status.started`` reports it).
        config: timeouts and limits.
        transport: the transport seam (default: TCP).

    Raises:
        pccl.transport.ConnectFailed: the address cannot be bound.
        InvalidArgumentError: a TLS file of ``config`` cannot be read or is not valid.
    """
    server = MasterServer(config=config, transport=transport)
    await server.serve(host, port, task_status=task_status)


class MasterHandle:
    """A running master inside :func:`open_master`."""

    def __init__(self, server: MasterServer, address: Address) -> None:
        self._server = server
        self.address = address

    @property
    def state(self) -> MasterState:
        """The pure state machine (read-only use, for tests and introspection)."""
        return self._server.state

    def statistics(self) -> dict[str, Any]:
        """See :meth:`MasterServer.statistics`."""
        return self._server.statistics()

    @property
    def run(self) -> str:
        """The run this master serves ("": none yet; docs/concepts.md "Run names")."""
        return self._server.run

    @property
    def status_address(self) -> Address | None:
        """Where the status server listens (``MasterConfig.status_port`` set), else None."""
        return self._server.status_address

    @property
    def status_url(self) -> str | None:
        """``http://HOST:PORT/`` of the status page on this machine, or None without a status server."""
        bound = self._server.status_address
        if bound is None:
            return None
        host = "127.0.0.1" if bound[0] in ("0.0.0.0", "", "::") else bound[0]
        return f"http://{host}:{bound[1]}/"

    @property
    def connect_address(self) -> str:
        """``"HOST:PORT"`` that peers on this machine can connect to."""
        host = self.address[0]
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        return f"{host}:{self.address[1]}"

    def __repr__(self) -> str:
        return f"<MasterHandle {self.connect_address} {self._server.state!r}>"


@asynccontextmanager
async def open_master(
    address: str | tuple[str, int] = "127.0.0.1:0",
    *,
    config: MasterConfig | None = None,
    transport: Transport | None = None,
    status_port: int | None = None,
) -> AsyncIterator[MasterHandle]:
    """Run a master for the duration of the block.

    Args:
        address: ``"HOST:PORT"`` or ``(host, port)`` to bind; port 0 lets the system choose (see
            ``master.address``); a missing port means 48148.
        config: timeouts and limits.
        transport: the transport seam (default: TCP).
        status_port: serve the status page and metrics on this port (0: any; see
            ``master.status_url``); overrides ``config.status_port``.

    Yields:
        A :class:`MasterHandle` with ``address``, ``connect_address``, ``status_url`` and ``statistics()``.

    Raises:
        InvalidArgumentError: malformed address, or a TLS file of ``config`` cannot be read or is not
            valid.
        pccl.transport.ConnectFailed: the address (or the status port) cannot be bound.
    """
    host, port = parse_address(address)
    config = config or MasterConfig()
    if status_port is not None:
        config = dataclasses.replace(config, status_port=status_port)
    server = MasterServer(config=config, transport=transport)
    started = False
    try:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(server.serve, host, port)
            started = True
            try:
                yield MasterHandle(server, bound)
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # A bind failure is one error: raise it as itself, not wrapped in the nursery's group.
        sole = sole_exception(group)
        if started or not isinstance(sole, ConnectFailed):
            raise
        raise sole from None


__all__ = ["MasterHandle", "MasterServer", "open_master", "serve_master"]
