"""The accept loop every listener runs (the master's and each peer's P2P listener).

It admits each accepted connection through a :class:`~pccl.wire.admission.HandshakeGate` (a connection
over the cap on unfinished hellos is closed at once, unread; the first refusal of a flood is logged),
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
        reason, first = gate.enter(host)
        if reason is not None:
            if first:
                log.warning("%s refuses connections: %s (logged once per flood)", what, reason)
            else:
                log.debug("%s refused a connection from %s: %s", what, host, reason)
            with trio.CancelScope(shield=True):
                try:
                    await stream.aclose()
                except Exception:  # closing a fresh stream may fail; nothing else to do
                    pass
            continue
        nursery.start_soon(_run, handle, stream, gate, host)


async def _run(handle: Handler, stream: Stream, gate: HandshakeGate, host: str) -> None:
    left = False

    def hello_done() -> None:
        nonlocal left
        if not left:
            left = True
            gate.leave(host)

    try:
        await handle(stream, hello_done)
    finally:
        hello_done()


__all__ = ["BACKOFF_MAX", "BACKOFF_MIN", "HelloDone", "accept_loop", "source_host"]
