"""Regression (found by the churn soak with master kills): a connection reset right after the connect
(the master SIGKILLed as it accepted) made ``getpeername()`` fail with ENOTCONN inside
``TcpTransport.connect``, and the raw OSError crashed the reconnecting peer. It is a ConnectFailed."""

from __future__ import annotations

import errno
from typing import Any

import pytest
import trio

from pccl.transport import ConnectFailed, TcpTransport


class _ResetSocket:
    closed = False

    def setsockopt(self, *args: Any) -> None:
        pass

    def getpeername(self) -> Any:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    def close(self) -> None:
        self.closed = True


async def test_a_reset_right_after_connect_is_a_connect_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    sock = _ResetSocket()

    class _Stream:
        socket = sock

    async def fake_open_tcp_stream(host: str, port: int) -> _Stream:
        await trio.lowlevel.checkpoint()
        return _Stream()

    monkeypatch.setattr(trio, "open_tcp_stream", fake_open_tcp_stream)
    with pytest.raises(ConnectFailed, match="not connected"):
        await TcpTransport().connect("127.0.0.1", 1)
    assert sock.closed
