"""Peer-to-peer connection set-up: the P2P listener and the outgoing handshake.

Every P2P connection starts with the handshake of :mod:`pccl.wire.handshake` (``Hello(purpose="p2p",
peer_id, channel, index, nonce, generation, epoch)``, ``Challenge``, ``Proof``); the listener answers
``HelloOk`` or ``Refused`` (then closes). After the
handshake the connection belongs to the handler registered for its channel ("ring" for the
collective data plane, "state" for shared-state transfers, "bench" for bandwidth probes).

Bound to membership: given a :class:`~pccl.peer.credentials.CredentialStore` (the communicator always
gives one), the listener accepts a connection only when it proves the credential of the claimed peer,
that channel and the current epoch (derived from the two peers' keys and the set the master issued),
so the Hello's ``peer_id`` (the key every data frame is routed by) and ``channel`` are authenticated,
not trusted as sent; the dialer presents the credential for the peer it dials and checks that the
listener can prove it too. Without a store (unit
tests of the pool and the data plane) the secret alone decides, as before.

A client must not send anything after its Hello until it has read HelloOk: the listener parses
the Hello through a :class:`MessageStream`, and handlers may switch to raw reads on the
underlying stream right after it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from .._accept import HelloDone, accept_loop
from .._config import PROTOCOL_VERSION, PeerConfig
from .._errors import PCCLError, RankConnectionFailedError, RemoteProtocolError, Result
from ..transport import Address, Listener, Stream, StreamBroken, Transport
from ..wire.admission import HandshakeGate
from ..wire.handshake import HandshakeFailed, accept_hello, offer_hello
from ..wire.limits import p2p_inbound, pre_auth, trusted
from ..wire.messages import Hello, HelloOk, Refused
from ..wire.stream import MessageStream
from .credentials import CredentialStore

log = logging.getLogger("pccl.p2p")

P2PHandler = Callable[[MessageStream, Hello], Awaitable[None]]

#: The most connections one peer may hold open at this peer's listener on each channel, after its hello
#: (issue 33 item 5): the ring pool (``p2p_connection_pool_size`` per neighbour; twice 64 leaves room for
#: a pool of 64 being replaced), shared-state transfers (one per sync and holder) and bandwidth probes
#: (one per measurement; each holds a 4 MiB receive buffer). A channel not named here: 4.
CHANNEL_CAPS: Mapping[str, int] = {"ring": 128, "state": 4, "bench": 2}
DEFAULT_CHANNEL_CAP = 4


class P2PConnections:
    """The connections past their hello at one P2P listener, by peer and channel: each peer's count per
    channel is capped (:data:`CHANNEL_CAPS`), and :meth:`drop_peer` closes every connection of a peer
    the run removed, at once.

    Args:
        caps: channel -> most connections of one peer on it (default :data:`CHANNEL_CAPS`).
    """

    def __init__(self, caps: Mapping[str, int] | None = None) -> None:
        self.caps = dict(CHANNEL_CAPS if caps is None else caps)
        self._open: dict[tuple[int, str], set[trio.CancelScope]] = {}
        self.refused_total = 0
        self.dropped_total = 0

    def cap(self, channel: str) -> int:
        """The most connections one peer may hold on ``channel``."""
        return self.caps.get(channel, DEFAULT_CHANNEL_CAP)

    def enter(self, peer_id: int, channel: str, scope: trio.CancelScope) -> str | None:
        """Count a connection of ``peer_id`` on ``channel`` (its handler runs in ``scope``), or say why
        not (call :meth:`leave` when it ends)."""
        held = self._open.setdefault((peer_id, channel), set())
        if len(held) >= self.cap(channel):
            self.refused_total += 1
            return (f"peer {peer_id} holds {len(held)} {channel!r} connections to this peer "
                    f"(the cap per peer is {self.cap(channel)})")
        held.add(scope)
        return None

    def leave(self, peer_id: int, channel: str, scope: trio.CancelScope) -> None:
        """The connection counted by :meth:`enter` ended."""
        held = self._open.get((peer_id, channel))
        if held is not None:
            held.discard(scope)
            if not held:
                del self._open[(peer_id, channel)]

    def drop_peer(self, peer_id: int) -> int:
        """Close every connection of ``peer_id`` (its handlers are cancelled); returns how many."""
        n = 0
        for (pid, _channel), held in self._open.items():
            if pid == peer_id:
                for scope in held:
                    scope.cancel()
                    n += 1
        self.dropped_total += n
        return n

    def count(self, peer_id: int | None = None, channel: str | None = None) -> int:
        """Connections open (of ``peer_id`` and on ``channel``; None: any)."""
        return sum(len(h) for (p, c), h in self._open.items()
                   if (peer_id is None or p == peer_id) and (channel is None or c == channel))

    def statistics(self) -> dict[str, int]:
        """Open connections, refusals over the cap and connections closed by :meth:`drop_peer`."""
        return {"open": self.count(), "refused_over_cap": self.refused_total,
                "dropped_removed": self.dropped_total}


async def serve_p2p(
    transport: Transport,
    host: str,
    port: int,
    handlers: Mapping[str, P2PHandler],
    *,
    config: PeerConfig,
    secret: str = "",
    gate: HandshakeGate | None = None,
    credentials: CredentialStore | None = None,
    connections: P2PConnections | None = None,
    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen for P2P connections and hand each one, after its hello, to its channel's handler.

    Runs until cancelled (or until the listener is closed). Each connection runs in its own task
    and every error on it is contained: a bad connection never takes the listener down.

    Args:
        transport: where to listen.
        host: address to bind.
        port: port to bind; 0 lets the system choose.
        handlers: channel name -> ``async handler(ms, hello)``; the stream is closed when the
            handler returns or fails.
        config: timeouts (``connect_timeout`` bounds the wait for the Hello) and frame limits.
        secret: when non-empty, a Hello must carry exactly this secret.
        gate: the cap on connections in their hello (default: a fresh
            :class:`~pccl.wire.admission.HandshakeGate` with the default caps).
        credentials: when given, a connection must prove the credential (of the master's current set)
            for the peer, channel and epoch its Hello claims.
        connections: counts the connections past their hello per peer and channel and refuses one
            over the cap (default: a fresh :class:`P2PConnections`).
        task_status: receives the bound ``(host, port)`` once listening.

    Raises:
        PCCLError: (SYSTEM_ERROR) the address cannot be bound.
    """
    try:
        listener = await transport.listen(host, port)
    except StreamBroken as exc:
        raise PCCLError(
            f"cannot listen for P2P connections on {host}:{port}: {exc}", Result.SYSTEM_ERROR
        ) from exc
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(listener.address)
            await _accept_loop(
                listener, nursery, handlers, config, secret, gate or HandshakeGate(), credentials,
                connections or P2PConnections(),
            )
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()


async def _accept_loop(
    listener: Listener,
    nursery: trio.Nursery,
    handlers: Mapping[str, P2PHandler],
    config: PeerConfig,
    secret: str,
    gate: HandshakeGate,
    credentials: CredentialStore | None,
    connections: P2PConnections,
) -> None:
    async def handle(stream: Stream, hello_done: HelloDone) -> None:
        limits = pre_auth(config.max_frame_size)
        ms = MessageStream(stream, max_frame_size=config.max_frame_size, limits=limits)
        await _serve_connection(ms, handlers, config, secret, hello_done, credentials, connections)

    try:
        await accept_loop(listener, nursery, handle, gate=gate, log=log, what="P2P listener")
    except StreamBroken:
        log.debug("P2P listener %s closed", listener.address)


async def _refuse(ms: MessageStream, reason: str, code: Result, timeout: float) -> None:
    log.warning("refused P2P connection from %s: %s", _peer_of(ms), reason)
    with trio.move_on_after(timeout):
        try:
            await ms.send(Refused(reason=reason, code=int(code)))
        except (StreamBroken, PCCLError):
            pass


def _peer_of(ms: MessageStream) -> str:
    try:
        host, port = ms.stream.peer_address
    except Exception:  # an exotic stream: the log line must not fail
        return "?"
    return f"{host}:{port}"


async def _serve_connection(
    ms: MessageStream,
    handlers: Mapping[str, P2PHandler],
    config: PeerConfig,
    secret: str,
    hello_done: HelloDone,
    credentials: CredentialStore | None = None,
    connections: P2PConnections | None = None,
) -> None:
    lookup = None if credentials is None else credentials.credential_for
    table = connections if connections is not None else P2PConnections()
    removal = trio.CancelScope()  # cancelled by P2PConnections.drop_peer
    counted: tuple[int, str] | None = None
    try:
        done = False
        hello: Hello | None = None
        refusal = None
        with trio.move_on_after(config.connect_timeout):
            try:
                hello, refusal = await accept_hello(
                    ms, purpose="p2p", secret=secret, channels=handlers, listener="this peer",
                    credential_for=lookup,
                )
            except (StreamBroken, RemoteProtocolError) as exc:
                log.warning("refused P2P connection from %s: bad hello (%s)", _peer_of(ms), exc)
                return
            done = True
        if not done:
            log.warning("refused P2P connection from %s: no hello within %.1fs", _peer_of(ms),
                        config.connect_timeout)
            return
        if refusal is not None:
            await _refuse(ms, refusal.reason, refusal.result, config.connect_timeout)
            return
        assert hello is not None
        # Counted once its proof holds (a stranger cannot spend a member's places); over the cap,
        # refused like a bad credential.
        over = table.enter(hello.peer_id, hello.channel, removal)
        if over is not None:
            await _refuse(ms, over, Result.RANK_CONNECTION_FAILED, config.connect_timeout)
            return
        counted = (hello.peer_id, hello.channel)
        ms.set_limits(p2p_inbound(config.max_frame_size))
        with trio.move_on_after(config.connect_timeout) as scope:
            try:
                await ms.send(HelloOk(protocol_version=PROTOCOL_VERSION))
            except StreamBroken:
                return
        if scope.cancelled_caught:
            return
        hello_done()
        with removal:
            await handlers[hello.channel](ms, hello)
        if removal.cancelled_caught:
            log.warning("closed the %r connection from peer %d: the run removed it", hello.channel,
                        hello.peer_id)
    except Exception as exc:
        # Contain everything: one connection's failure must never kill the listener.
        log.warning("P2P connection from %s ended with an error: %r", _peer_of(ms), exc)
    finally:
        if counted is not None:
            table.leave(*counted, removal)
        with trio.CancelScope(shield=True):
            try:
                await ms.aclose()
            except Exception:  # closing a broken stream may fail; nothing left to do
                pass


async def _credential_args(
    credentials: CredentialStore | None, to_peer: int, channel: str, where: str
) -> dict[str, Any]:
    """The Hello's credential fields for dialing ``to_peer`` on ``channel`` (none without credentials).

    Raises:
        RankConnectionFailedError: this peer holds no credential for it.
    """
    if credentials is None:
        return {}
    cred = credentials.for_dial(to_peer, channel)
    if cred is None:
        await trio.lowlevel.checkpoint()
        cur = credentials.current
        held = "none yet" if cur is None else f"epoch {cur.epoch} of generation {cur.generation}"
        raise RankConnectionFailedError(
            f"no P2P credential for {where}: the master issued none for it in this peer's set ({held})"
        )
    return {"credential": cred.key, "generation": cred.generation, "epoch": cred.epoch}


async def _connect(transport: Transport, host: str, port: int, timeout: float, where: str) -> Stream:
    """A connection to ``host:port`` within ``timeout`` seconds.

    Raises:
        RankConnectionFailedError: it timed out or failed.
    """
    try:
        with trio.fail_after(timeout):
            return await transport.connect(host, port)
    except trio.TooSlowError as exc:
        raise RankConnectionFailedError(f"P2P connect to {where} timed out") from exc
    except StreamBroken as exc:
        raise RankConnectionFailedError(f"P2P connect to {where} failed: {exc}") from exc


async def open_p2p(
    transport: Transport,
    host: str,
    port: int,
    *,
    my_peer_id: int,
    channel: str,
    index: int = 0,
    config: PeerConfig,
    secret: str = "",
    to_peer: int = -1,
    credentials: CredentialStore | None = None,
) -> MessageStream:
    """Open a P2P connection and complete its handshake.

    Args:
        transport: how to connect.
        host: the other peer's P2P listener address.
        port: its port.
        my_peer_id: this peer's id, presented in the Hello.
        channel: which handler the other side should run ("ring", "state", "bench").
        index: slot of this connection in the caller's pool.
        config: ``connect_timeout`` bounds the connect and, separately, the wait for HelloOk.
        secret: the shared secret, if the group uses one.
        to_peer: the peer listening there (which credential to present).
        credentials: when given, present the credential (of the master's current set) for ``to_peer``
            and ``channel`` (and require the listener to prove it too).

    Returns:
        The stream, ready for the channel's traffic.

    Raises:
        RankConnectionFailedError: the connection could not be opened, timed out, broke, or was
            refused (the message carries the other side's reason), or this peer holds no credential
            for ``to_peer``.
    """
    where = f"{host}:{port}" if to_peer < 0 else f"peer {to_peer} at {host}:{port}"
    cred_args = await _credential_args(credentials, to_peer, channel, where)
    stream = await _connect(transport, host, port, config.connect_timeout, where)
    ms = MessageStream(stream, max_frame_size=config.max_frame_size, limits=pre_auth(config.max_frame_size))
    ok = False
    try:
        with trio.fail_after(config.connect_timeout):
            await offer_hello(ms, purpose="p2p", secret=secret, peer_id=my_peer_id, channel=channel,
                              index=index, **cred_args)
        ms.set_limits(trusted(config.max_frame_size))
        ok = True
        return ms
    except HandshakeFailed as exc:
        if exc.refused:
            raise RankConnectionFailedError(f"P2P connection to {where} refused: {exc.reason}") from exc
        raise RankConnectionFailedError(f"P2P handshake with {where} failed: {exc.reason}") from exc
    except trio.TooSlowError as exc:
        raise RankConnectionFailedError(f"P2P handshake with {where} timed out") from exc
    except StreamBroken as exc:
        raise RankConnectionFailedError(f"P2P handshake with {where} failed: {exc}") from exc
    except RemoteProtocolError as exc:
        raise RankConnectionFailedError(f"P2P handshake with {where}: {exc}") from exc
    finally:
        if not ok:
            with trio.CancelScope(shield=True):
                try:
                    await ms.aclose()
                except Exception:  # already broken; the error above is what matters
                    pass


class P2PDialer:
    """Opens this peer's P2P connections (a :class:`pccl.peer.links.Dialer`).

    Args:
        transport: how to connect.
        my_peer_id: this peer's id, presented in every Hello.
        config: timeouts and frame limits.
        secret: the shared secret, if the group uses one.
        credentials: this peer's P2P credentials (None: none are presented).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        my_peer_id: int,
        config: PeerConfig,
        secret: str = "",
        credentials: CredentialStore | None = None,
    ) -> None:
        self.transport = transport
        self.my_peer_id = my_peer_id
        self.config = config
        self.secret = secret
        self.credentials = credentials

    @property
    def connect_timeout(self) -> float:
        """``config.connect_timeout``."""
        return self.config.connect_timeout

    async def dial(
        self, host: str, port: int, *, channel: str, index: int = 0, peer_id: int = -1
    ) -> MessageStream:
        """Open and handshake a connection on ``channel`` to ``peer_id`` (see :func:`open_p2p`).

        Raises:
            RankConnectionFailedError: see :func:`open_p2p`.
        """
        return await open_p2p(
            self.transport,
            host,
            port,
            my_peer_id=self.my_peer_id,
            channel=channel,
            index=index,
            config=self.config,
            secret=self.secret,
            to_peer=peer_id,
            credentials=self.credentials,
        )

    def __repr__(self) -> str:
        return f"<P2PDialer peer={self.my_peer_id}>"
