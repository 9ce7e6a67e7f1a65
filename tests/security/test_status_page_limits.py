"""Issue 33 finding 9: the status page server. A request whose ``Content-Length`` body never comes stayed
open indefinitely (the idle timer covered only the headers), nothing capped its connections, and running
out of descriptors filled the log with tracebacks. Now a request must arrive whole within REQUEST_TIMEOUT
of its first byte, at most MAX_CONNECTIONS are served at once (one more is closed unread), and EMFILE is
logged once, without a traceback. Real sockets on loopback, virtual time."""

from __future__ import annotations

import errno
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from pccl.master import http
from pccl.master.http import HttpStats, Response, open_http_listeners, serve_http
from pccl.testing import wait_until


def _route(path: str) -> Response | None:
    return Response(200, "text/plain", b"ok\n") if path == "/status" else None


@asynccontextmanager
async def _server(listeners: list[Any] | None = None) -> AsyncIterator[tuple[int, HttpStats]]:
    real = await open_http_listeners("127.0.0.1", 0)
    port = real[0].socket.getsockname()[1]
    stats = HttpStats()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_http, listeners or real, _route, stats)
        yield port, stats
        nursery.cancel_scope.cancel()


async def _closed(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some(4096) == b""
    except trio.BrokenResourceError:
        return True


async def test_a_body_that_never_comes_is_timed_out(autojump_clock: trio.testing.MockClock) -> None:
    async with _server() as (port, stats):
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(b"GET /status HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        t0 = trio.current_time()
        with trio.fail_after(http.IDLE_TIMEOUT):  # well before the idle timer would
            assert await _closed(s)
        assert trio.current_time() - t0 == pytest.approx(http.REQUEST_TIMEOUT, abs=0.01)
        assert stats.timed_out == 1
        await wait_until(lambda: stats.open == 0)  # its task ends just after closing
        # a whole request is answered as ever
        ok = await trio.open_tcp_stream("127.0.0.1", port)
        await ok.send_all(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await ok.receive_some(4096)).startswith(b"HTTP/1.1 200")
        await ok.aclose()
        await s.aclose()


async def test_connections_are_capped(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    async with _server() as (port, stats):
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(http.MAX_CONNECTIONS)]
        await wait_until(lambda: stats.open == http.MAX_CONNECTIONS)
        extra = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(1):
            assert await _closed(extra)  # closed unread
        assert stats.refused == 1
        assert f"the status page refuses connections: {http.MAX_CONNECTIONS} are open" in caplog.text
        await idle[0].aclose()
        await wait_until(lambda: stats.open < http.MAX_CONNECTIONS)
        ok = await trio.open_tcp_stream("127.0.0.1", port)
        await ok.send_all(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await ok.receive_some(4096)).startswith(b"HTTP/1.1 200")
        for s in [*idle[1:], extra, ok]:
            await s.aclose()


class _Exhausted:
    """A listener whose first accepts fail with EMFILE."""

    def __init__(self, inner: trio.SocketListener, fails: int) -> None:
        self.inner = inner
        self.fails = fails

    async def accept(self) -> trio.SocketStream:
        if self.fails:
            self.fails -= 1
            await trio.lowlevel.checkpoint()
            raise OSError(errno.EMFILE, "Too many open files")
        return await self.inner.accept()


async def test_emfile_is_logged_once_without_a_traceback(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    real = await open_http_listeners("127.0.0.1", 0)
    port = real[0].socket.getsockname()[1]
    async with _server([_Exhausted(real[0], 20)]) as (_port, _stats):
        ok = await trio.open_tcp_stream("127.0.0.1", port)
        await ok.send_all(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await ok.receive_some(4096)).startswith(b"HTTP/1.1 200")
        await ok.aclose()
    assert caplog.text.count("cannot accept connections") == 1
    assert "accepts connections again after 20 failed accepts" in caplog.text
    assert not [r for r in caplog.records if r.exc_info]
