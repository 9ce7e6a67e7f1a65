"""The master link of a peer: dialing the master, the reader, heartbeat and watchdog tasks of one link,
the send paths, and reconnection to the master or a standby within ``PeerConfig.reconnect_window``
(docs/concepts.md "Surviving the master"). A part of :class:`pccl.peer.communicator.Communicator`,
which provides the attributes declared here and executes what the reader feeds its pure core.
"""

from __future__ import annotations

import logging

import trio

from .._config import RECONNECT_BACKOFF_MAX, PeerConfig
from .._errors import (
    HelloRefusedError,
    InvalidUsageError,
    KickedError,
    MasterConnectionError,
    PCCLError,
    RankConnectionLostError,
    RemoteProtocolError,
)
from .._stalls import StallCredit
from ..transport import ConnectFailed, StreamBroken, Transport
from ..wire import limits
from ..wire import messages as m
from ..wire.handshake import HandshakeFailed, offer_hello
from ..wire.stream import MessageStream
from .credentials import CredentialStore
from .state import PeerState

log = logging.getLogger("pccl.peer")


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



class MasterConnection:
    """The master-link part of :class:`~pccl.peer.communicator.Communicator`."""

    config: PeerConfig
    master_addresses: list[tuple[str, int]]
    master_host: str
    master_port: int
    p2p_address: tuple[str, int] | None
    _core: PeerState
    _ms: MessageStream | None
    _master_transport: Transport
    _link_up: trio.Event
    _nursery: trio.Nursery | None
    _closed: bool
    _credentials: CredentialStore

    @property
    def peer_id(self) -> int:
        raise NotImplementedError

    def _fail_all(self, error: PCCLError, *, closing: bool = False) -> None:
        raise NotImplementedError

    def _fail_calls(self, error: PCCLError, *, keep_in_doubt: bool = False) -> None:
        raise NotImplementedError

    def handle_master_message(self, msg: m.Message) -> PCCLError | None:
        raise NotImplementedError

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

    def _new_master_generation(self) -> None:
        """This peer was taken back by a master of another generation (a restarted master or a standby):
        what it held for its predecessor's rounds alone ends here (the communicator drops the snapshots
        pinned for live heals, which only the old master could release)."""

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
        before = self._core.generation
        problem = self._core.reregistered(reply, trio.current_time())
        if problem is not None:
            await self._close_stream(ms)
            return problem
        if self._core.generation != before:
            self._new_master_generation()
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


__all__ = ["MasterConnection", "failover_order"]
