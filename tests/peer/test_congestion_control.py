"""``PeerConfig.p2p_congestion_control``: the ring connections to far partners send with it (bbr by
default), near ones keep the kernel's default, and a refusal is counted and said once; the socket
helpers on real loopback connections."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Set as AbstractSet
from typing import Any

import pytest
import trio
import trio.testing

from pccl import PeerConfig
from pccl.peer import ring_cc
from pccl.peer.ring_conn import congestion_control, restart_congestion_control, set_congestion_control
from pccl.testing import VirtualNetwork

from .test_striping import _loopback_tcp, two_pools

linux_only = pytest.mark.skipif(sys.platform != "linux" or not hasattr(socket, "TCP_CONGESTION"),
                                reason="TCP_CONGESTION is Linux's")


def test_the_config_takes_a_name_or_none() -> None:
    assert PeerConfig().p2p_congestion_control == "bbr"
    assert PeerConfig(p2p_congestion_control=None).p2p_congestion_control is None
    assert PeerConfig(p2p_congestion_control="cubic").p2p_congestion_control == "cubic"
    for bad in ("", "bbr;rm", "x" * 16, "bbr\0", "bbr ", 7):
        with pytest.raises(ValueError, match="p2p_congestion_control"):
            PeerConfig(p2p_congestion_control=bad)  # type: ignore[arg-type]


class _Recorder:
    """Stands in for the kernel: records each (stream, name) and refuses names in ``refuse``."""

    def __init__(self, refuse: AbstractSet[str] = frozenset()) -> None:
        self.calls: list[tuple[Any, str]] = []
        self.refuse = refuse

    def __call__(self, stream: Any, name: str) -> str | None:
        self.calls.append((stream, name))
        return "No such file or directory" if name in self.refuse else None


@pytest.mark.parametrize(("one_way", "pool_size", "connections"), [
    (0.025, 0, 4),  # 50 ms: sized, far: all four
    (0.05, 3, 3),  # an explicit pool over a long round trip: far too
])
async def test_far_connections_get_it(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, one_way: float,
    pool_size: int, connections: int,
) -> None:
    kernel = _Recorder()
    monkeypatch.setattr(ring_cc, "set_congestion_control", kernel)
    async with two_pools(VirtualNetwork(latency=one_way), pool_size, PeerConfig()) as (a, _b, addr):
        await a.connect(2, *addr)
        assert a.stripes(2) == connections
        # each outgoing connection once (the receiving side's cc does not matter)
        assert len(kernel.calls) == connections
        assert len({id(stream) for stream, _ in kernel.calls}) == connections
        assert {name for _, name in kernel.calls} == {"bbr"}
        stats = a.statistics()
        assert (stats["congestion_control_set"], stats["congestion_control_refused"]) == (connections, 0)


@pytest.mark.parametrize(("one_way", "pool_size", "cc"), [
    (0.0005, 0, "bbr"),  # a LAN: the default stays
    (0.0005, 4, "bbr"),  # an explicit pool on a LAN: too
    (0.025, 0, None),  # far, but asked to keep the default
])
async def test_near_connections_and_none_keep_the_default(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, one_way: float,
    pool_size: int, cc: str | None,
) -> None:
    kernel = _Recorder()
    monkeypatch.setattr(ring_cc, "set_congestion_control", kernel)
    config = PeerConfig(p2p_congestion_control=cc)
    async with two_pools(VirtualNetwork(latency=one_way), pool_size, config) as (a, _b, addr):
        await a.connect(2, *addr)
        assert a.is_connected(2)
    assert kernel.calls == []


async def test_a_refusal_is_counted_and_said_once(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    kernel = _Recorder(refuse={"bbr"})
    monkeypatch.setattr(ring_cc, "set_congestion_control", kernel)
    monkeypatch.setattr(ring_cc, "_warned", False)
    caplog.set_level(logging.WARNING, logger="pccl.p2p")
    async with two_pools(VirtualNetwork(latency=0.05), 0, PeerConfig()) as (a, _b, addr):
        await a.connect(2, *addr)
        assert a.is_connected(2)  # the connections work on with the default
        stats = a.statistics()
        assert (stats["congestion_control_set"], stats["congestion_control_refused"]) == (0, 5)
    warnings = [r.getMessage() for r in caplog.records if "p2p_congestion_control" in r.getMessage()]
    assert len(warnings) == 1
    assert "'bbr'" in warnings[0] and "No such file or directory" in warnings[0]
    assert "p2p_congestion_control=None" in warnings[0]


@linux_only
@pytest.mark.timeout(30)
async def test_the_socket_helpers_on_a_real_connection() -> None:
    async with _loopback_tcp() as (client, _server):
        default = congestion_control(client)
        assert default  # the kernel's default
        assert set_congestion_control(client, "reno") is None  # reno: any process may pick it
        assert congestion_control(client) == "reno"
        refused = set_congestion_control(client, "no_such_cc")
        assert isinstance(refused, str) and refused
        assert congestion_control(client) == "reno"  # unchanged by the refusal
        assert restart_congestion_control(client)
        assert congestion_control(client) == "reno"
    # not a TCP socket's stream: nothing to set, nothing known
    assert set_congestion_control(object(), "bbr") is None  # type: ignore[arg-type]
    assert congestion_control(object()) is None  # type: ignore[arg-type]


@pytest.mark.timeout(30)
async def test_restart_congestion_control_of_a_real_connection() -> None:
    async with _loopback_tcp() as (client, _server):
        name = congestion_control(client) if sys.platform == "linux" else None
        done = restart_congestion_control(client)
        assert done == (sys.platform == "linux")
        if name is not None:  # the same algorithm as before, started afresh
            assert congestion_control(client) == name
    assert restart_congestion_control(client) is False  # closed
    assert restart_congestion_control(object()) is False  # type: ignore[arg-type]  # not a socket stream
