"""A small HTTP/1.1 server on trio, with h11 doing the HTTP (no hand-written parser).

It serves GET (and HEAD) requests from a synchronous ``route(path) -> Response | None`` function;
anything else gets 404 or 405. Keep-alive is supported; each connection is bounded in time and size:
an idle connection closes after :data:`IDLE_TIMEOUT`, a request (headers and body) must arrive whole
within :data:`REQUEST_TIMEOUT` of its first byte, and a body may be at most :data:`MAX_REQUEST_BYTES`.
At most :data:`MAX_CONNECTIONS` connections are served at once (one more is closed unread; the first of a
flood is logged), and an accept that fails for want of descriptors backs off and logs once, without a
traceback (issue 33 finding 9). Used by the master's status port (see :mod:`pccl.master.status_server`).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass

import h11
import trio

log = logging.getLogger("pccl.master.http")

MAX_REQUEST_BYTES = 16 * 1024
IDLE_TIMEOUT = 30.0
REQUEST_TIMEOUT = 10.0
MAX_CONNECTIONS = 64
_BACKOFF_MIN = 0.01
_BACKOFF_MAX = 1.0
# accept() errors that mean "no descriptors or memory now", not a broken listener (as trio's own list)
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


@dataclass
class HttpStats:
    """Counters of one HTTP server: connections open now, refused over the cap, requests timed out."""

    open: int = 0
    refused: int = 0
    timed_out: int = 0


@dataclass(frozen=True)
class Response:
    """One HTTP response."""

    status: int
    content_type: str
    body: bytes


Route = Callable[[str], "Response | None"]


def _plain(status: int, text: str) -> Response:
    return Response(status, "text/plain; charset=utf-8", text.encode())


async def _send(stream: trio.abc.Stream, conn: h11.Connection, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def _respond(stream: trio.abc.Stream, conn: h11.Connection, resp: Response, head: bool) -> None:
    headers = [
        ("content-type", resp.content_type),
        ("content-length", str(len(resp.body))),
        ("cache-control", "no-store"),
        ("server", "pccl-master"),
    ]
    await _send(stream, conn, h11.Response(status_code=resp.status, headers=headers))
    if not head:
        await _send(stream, conn, h11.Data(data=resp.body))
    await _send(stream, conn, h11.EndOfMessage())


async def handle_http(stream: trio.abc.Stream, route: Route, stats: HttpStats | None = None) -> None:
    """Serve requests on one connection until the client closes it (or it idles out, or a request does
    not arrive whole in time)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    try:
        while True:
            event: object = None
            body = False
            with trio.move_on_after(IDLE_TIMEOUT) as idle:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(MAX_REQUEST_BYTES)))
                    event = conn.next_event()
            if idle.cancelled_caught:
                return
            # The first byte of a request is in: the rest (head and body) comes within REQUEST_TIMEOUT.
            with trio.move_on_after(REQUEST_TIMEOUT) as late:
                while event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(MAX_REQUEST_BYTES)))
                    event = conn.next_event()
                if isinstance(event, h11.Request):
                    body = await _drain_body(stream, conn)
            if late.cancelled_caught:
                if stats is not None:
                    stats.timed_out += 1
                log.debug("HTTP request not received whole within %gs: closing", REQUEST_TIMEOUT)
                return
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return
            if not isinstance(event, h11.Request):
                return
            method = event.method.decode("ascii", "replace").upper()
            path = event.target.decode("ascii", "replace").split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                resp = _plain(405, f"method {method} not allowed\n")
            else:
                try:
                    resp = route(path) or _plain(404, f"no page {path}; try /, /status or /metrics\n")
                except Exception as exc:  # a formatting bug must not take the master down
                    log.exception("status page %s failed", path)
                    resp = _plain(500, f"internal error: {exc}\n")
            if not body:
                return  # the body was too large, or the connection closed within it
            await _respond(stream, conn, resp, method == "HEAD")
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except h11.RemoteProtocolError as exc:
        log.debug("bad HTTP request: %s", exc)
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                await _respond(stream, conn, _plain(400, f"bad request: {exc}\n"), False)
            except (h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


async def _drain_body(stream: trio.abc.Stream, conn: h11.Connection) -> bool:
    """Read and drop the request's body (GET has none); False: it is over MAX_REQUEST_BYTES or the
    connection closed within it."""
    left = MAX_REQUEST_BYTES
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            data = await stream.receive_some(MAX_REQUEST_BYTES)
            left -= len(data)
            if left < 0:
                return False
            conn.receive_data(bytes(data))
            continue
        if isinstance(ev, h11.EndOfMessage):
            return True
        if isinstance(ev, h11.ConnectionClosed):
            return False


async def open_http_listeners(host: str, port: int) -> list[trio.SocketListener]:
    """Bind the HTTP port (before serving, so that a bad address fails the caller at once).

    Raises:
        OSError: the address cannot be bound (in use, unknown host, port out of range).
    """
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OverflowError as exc:  # a port beyond 65535 from the socket module
        raise OSError(f"port {port} out of range") from exc


def bound_address(listeners: list[trio.SocketListener]) -> tuple[str, int]:
    """``(host, port)`` the first listener is bound to."""
    sockname = listeners[0].socket.getsockname()
    return (str(sockname[0]), int(sockname[1]))


async def serve_http(listeners: list[trio.SocketListener], route: Route, stats: HttpStats | None = None,
                     *, max_connections: int = MAX_CONNECTIONS) -> None:
    """Serve ``route`` on ``listeners`` until cancelled (one task per connection, at most
    ``max_connections`` at once; see the module docstring)."""
    counters = stats if stats is not None else HttpStats()
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept, listener, route, counters, max_connections, nursery)


async def _accept(listener: trio.SocketListener, route: Route, stats: HttpStats, cap: int,
                  nursery: trio.Nursery) -> None:
    backoff = 0.0
    failures = 0
    refusing = False
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in _EXHAUSTED:
                raise
            if failures == 0:
                log.warning("the status page cannot accept connections: %s; backing off (logged once until "
                            "it can again)", exc.strerror or exc)
            failures += 1
            backoff = min(max(backoff * 2, _BACKOFF_MIN), _BACKOFF_MAX)
            await trio.sleep(backoff)
            continue
        if failures:
            log.warning("the status page accepts connections again after %d failed accepts", failures)
            failures, backoff = 0, 0.0
        if stats.open >= cap:
            stats.refused += 1
            if not refusing:
                log.warning("the status page refuses connections: %d are open (the cap is %d; logged "
                            "once per flood)", stats.open, cap)
            refusing = True
            with trio.CancelScope(shield=True):
                await stream.aclose()
            continue
        refusing = False
        stats.open += 1
        nursery.start_soon(_serve_one, stream, route, stats)


async def _serve_one(stream: trio.SocketStream, route: Route, stats: HttpStats) -> None:
    try:
        await handle_http(stream, route, stats)
    finally:
        stats.open -= 1


__all__ = [
    "IDLE_TIMEOUT", "MAX_CONNECTIONS", "MAX_REQUEST_BYTES", "REQUEST_TIMEOUT", "HttpStats", "Response",
    "Route", "bound_address", "handle_http", "open_http_listeners", "serve_http",
]
