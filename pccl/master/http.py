"""A small HTTP/1.1 server on trio, with h11 doing the HTTP (no hand-written parser).

It serves GET (and HEAD) requests from a synchronous ``route(path) -> Response | None`` function;
anything else gets 404 or 405. Keep-alive is supported; each connection is bounded in time and size.
Used by the master's status port (see :mod:`pccl.master.status_server`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import h11
import trio

log = logging.getLogger("pccl.master.http")

MAX_REQUEST_BYTES = 16 * 1024
IDLE_TIMEOUT = 30.0


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


async def handle_http(stream: trio.abc.Stream, route: Route) -> None:
    """Serve requests on one connection until the client closes it (or it idles out)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    try:
        while True:
            with trio.move_on_after(IDLE_TIMEOUT) as idle:
                event = conn.next_event()
                while event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(MAX_REQUEST_BYTES)))
                    event = conn.next_event()
            if idle.cancelled_caught or isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
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
            # Drain the request body (GET has none), then answer.
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(MAX_REQUEST_BYTES)))
                    continue
                if isinstance(ev, h11.EndOfMessage):
                    break
                if isinstance(ev, h11.ConnectionClosed):
                    return
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


async def serve_http(listeners: list[trio.SocketListener], route: Route) -> None:
    """Serve ``route`` on ``listeners`` until cancelled (one task per connection)."""

    async def one(stream: trio.SocketStream) -> None:
        await handle_http(stream, route)

    await trio.serve_listeners(one, listeners)


__all__ = ["Response", "Route", "bound_address", "handle_http", "open_http_listeners", "serve_http"]
