"""The accept loop every listener runs (the master's and each peer's P2P listener).

It admits each accepted connection through a :class:`~pccl.wire.admission.HandshakeGate` (over the cap
on unfinished hellos, the oldest connection in its hello is closed to make room; the first of a flood is
logged),
and survives a listener that runs out of descriptors or memory (:class:`~pccl.transport.AcceptExhausted`:
EMFILE and the like): it backs off, doubling from :data:`BACKOFF_MIN` to :data:`BACKOFF_MAX` seconds,
logs once until accepting works again, and carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from .transport import AcceptExhausted, Listener, Stream
from .wire.admission import HandshakeGate

BACKOFF_MIN = 0.01
BACKOFF_MAX = 1.0

HelloDone = Callable[[], None]
Handler = Callable[[Stream, HelloDone], Awaitable[None]]


def source_host(stream: Stream) -> str:
    """The connection's source address ("?" when the stream cannot say)."""
    try:
        return str(stream.peer_address[0])
    except Exception:  # an exotic stream: admission and logs must not fail
        return "?"


async def accept_loop(
    listener: Listener,
    nursery: trio.Nursery,
    handle: Handler,
    *,
    gate: HandshakeGate,
    log: logging.Logger,
    what: str,
) -> None:
    """Accept connections until the listener closes; run ``handle(stream, hello_done)`` for each
    admitted one in ``nursery``.

    ``handle`` calls ``hello_done()`` once the connection's hello is over (it is called for it when
    ``handle`` returns, at the latest), which frees its place in ``gate``.

    Args:
        listener: where connections come from.
        nursery: where their tasks run.
        handle: the connection's handler (closes the stream when done).
        gate: the cap on connections in their hello.
        log: where refusals and back-offs are logged.
        what: how the log lines name the listener ("the master", "P2P listener").

    Raises:
        pccl.transport.StreamBroken: the listener failed or was closed (not for AcceptExhausted).
    """
    backoff = 0.0
    failures = 0
    while True:
        try:
            stream = await listener.accept()
        except AcceptExhausted as exc:
            if failures == 0:
                log.warning("%s cannot accept connections: %s; backing off (logged once until it can again)",
                            what, exc)
            failures += 1
            backoff = min(max(backoff * 2, BACKOFF_MIN), BACKOFF_MAX)
            await trio.sleep(backoff)
            continue
        if failures:
            log.warning("%s accepts connections again after %d failed accepts", what, failures)
            failures, backoff = 0, 0.0
        host = source_host(stream)
        scope = trio.CancelScope()
        evicted, reason, first = gate.enter(host, scope)
        if evicted is not None:
            assert isinstance(evicted, trio.CancelScope)
            evicted.cancel()  # its task closes its stream
            if first:
                log.warning("%s is flooded: %s (logged once per flood)", what, reason)
            else:
                log.debug("%s closed a connection in its hello: %s", what, reason)
        nursery.start_soon(_run, handle, stream, gate, scope)


async def _run(handle: Handler, stream: Stream, gate: HandshakeGate, scope: trio.CancelScope) -> None:
    def hello_done() -> None:
        gate.leave(scope)

    try:
        with scope:
            await handle(stream, hello_done)
        if scope.cancelled_caught:  # evicted in its hello: the handler may not have closed it
            with trio.CancelScope(shield=True):
                try:
                    await stream.aclose()
                except Exception:  # closing a half-open stream may fail; nothing else to do
                    pass
    finally:
        hello_done()


__all__ = ["BACKOFF_MAX", "BACKOFF_MIN", "HelloDone", "accept_loop", "source_host"]
