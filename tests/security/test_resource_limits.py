"""Resource limits (issue 17, item 5): a cap on connections in their hello (total and per source host),
accept loops that survive EMFILE (back off, log once), the hello timeout still closing idle ones."""

from __future__ import annotations

import errno
import logging
from typing import Any

import pytest
import trio
import trio.testing

from pccl.testing import VirtualListener
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.transport import AcceptExhausted, Stream, StreamBroken, TcpListener
from pccl.wire.admission import HandshakeGate

from ._helpers import exact_all_reduces, hostile, master_port, p2p_address


def test_gate_caps_total_and_per_host_by_closing_the_oldest_and_logs_the_first_of_a_flood() -> None:
    gate = HandshakeGate(max_total=3, max_per_host=2)
    assert gate.enter("a", "a1") == (None, None, False)
    assert gate.enter("a", "a2") == (None, None, False)
    evicted, reason, first = gate.enter("a", "a3")  # the host's cap: its oldest makes room
    assert evicted == "a1" and reason is not None and first
    assert "from a" in reason and "per host is 2" in reason
    evicted, reason, first = gate.enter("a", "a4")
    assert evicted == "a2" and not first  # same flood: not logged again
    assert gate.enter("b", "b1") == (None, None, False)  # another host gets in
    evicted, reason, _ = gate.enter("c", "c1")  # the total cap: the oldest of all makes room
    assert evicted == "a3" and reason is not None and "the cap is 3" in reason
    gate.leave("a4")
    gate.leave("a4")  # idempotent (a connection evicted, then its task ending)
    assert gate.enter("c", "c2") == (None, None, False)
    assert gate.in_hello == 3 and gate.evicted_total == 3


class _FullSocket:
    """A listening socket whose accept fails with EMFILE."""

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", 9)

    async def accept(self) -> Any:
        await trio.lowlevel.checkpoint()
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        pass


async def test_tcp_listener_reports_emfile_as_accept_exhausted() -> None:
    listener = TcpListener(_FullSocket())  # type: ignore[arg-type]
    with pytest.raises(AcceptExhausted, match="Too many open files"):
        await listener.accept()


async def _closed_at_once(stream: Stream, window: float) -> bool:
    """True when the other side closes ``stream`` within ``window`` (virtual) seconds."""
    with trio.move_on_after(window):
        try:
            return await stream.receive_some(1024) == b""
        except StreamBroken:
            return True
    return False


@pytest.mark.parametrize("target", ["master", "p2p"])
async def test_connection_flood_is_capped_and_legitimate_peers_carry_on(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
    target: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(2)
    evil = hostile(cluster)
    addr = master_port(cluster) if target == "master" else p2p_address(cluster, 0)
    flood = [await evil.connect(*addr) for _ in range(100)]
    closed: list[bool] = [False] * len(flood)

    async def probe(i: int) -> None:
        closed[i] = await _closed_at_once(flood[i], 0.3)

    async with trio.open_nursery() as nursery:
        for i in range(len(flood)):
            nursery.start_soon(probe, i)
    # 64 (the per-host cap) wait for their hello; each one over it closed the oldest to make room.
    assert closed.count(True) == 100 - 64 and closed[: 100 - 64] == [True] * (100 - 64)
    assert caplog.text.count("is flooded") == 1
    assert "are in their hello (the cap per host is 64): the oldest is closed" in caplog.text
    # While the flood holds its places, a newcomer joins and everyone's results are exact.
    t0 = trio.current_time()
    await cluster.add_peer()
    assert trio.current_time() - t0 < 1.0  # not queued behind the flood
    await exact_all_reduces(cluster, rounds=2)
    # The hello timeout still closes the idle ones, and their places are free again.
    assert all([await _closed_at_once(s, 6.0) for s in flood])
    if target == "master":
        assert cluster.master._server.gate.in_hello == 0
    for s in flood:
        await s.aclose()
    await exact_all_reduces(cluster, rounds=1, tag=5)


async def test_master_accept_loop_survives_emfile_and_logs_once(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(2)
    port = master_port(cluster)[1]
    fails = {"left": 5}
    real_accept = VirtualListener.accept

    async def accept(self: VirtualListener) -> Any:
        if self.address[1] == port and fails["left"] > 0:
            fails["left"] -= 1
            await trio.lowlevel.checkpoint()
            raise AcceptExhausted("accept failed: [Errno 24] Too many open files")
        return await real_accept(self)

    monkeypatch.setattr(VirtualListener, "accept", accept)
    await cluster.add_peer()  # the accept already under way takes this one
    await cluster.add_peer()  # the next accepts fail 5 times, back off, then take this one
    assert fails["left"] == 0
    assert caplog.text.count("cannot accept connections") == 1
    assert "accepts connections again after 5 failed accepts" in caplog.text
    await exact_all_reduces(cluster, rounds=2)
