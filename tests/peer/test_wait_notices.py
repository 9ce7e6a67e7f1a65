"""No call waits silently (issue 37 item 1): a wait that lasts is said at WARNING after 5 s and then at
doubling intervals (10 s, 20 s, ... at most every 5 min), saying what it waits for and who could end it:
to be accepted (on the peer and in the master's log), a collective's vote, a training loop's wait for
``min_world_size`` peers, and a sync whose co-voter was refused (the survivor learns why). MockClock."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import trio
import trio.testing

from pccl import SharedState, TensorInfo
from pccl._errors import SharedStateSyncError
from pccl._types import ReduceOp
from pccl._waits import WaitBoard, format_wait
from pccl.testing.pytest_plugin import ClusterFactory


def warnings_about(caplog: pytest.LogCaptureFixture, text: str, logger: str = "pccl") -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith(logger) and text in r.getMessage()]


def test_the_schedule_doubles_up_to_the_cap() -> None:
    board = WaitBoard(first=5.0, longest=40.0)
    board.begin("a", lambda w: f"a {w:g}", now=100.0)
    said = []
    for t in range(100, 400):
        said += board.due(float(t))
    # first after 5 s, then 10, 20, 40, 40, ... after the previous report
    assert said[:6] == ["a 5", "a 15", "a 35", "a 75", "a 115", "a 155"]
    assert board.next_deadline() is not None
    board.end("a")
    assert board.next_deadline() is None and board.due(1e9) == []
    # A wait that describes itself as no wait (None) is skipped, and its schedule still moves on.
    board.begin("b", lambda w: None, now=0.0)
    assert board.due(5.0) == [] and board.next_deadline() == 15.0
    with pytest.raises(ValueError):
        WaitBoard(first=0.0)
    assert [format_wait(s) for s in (4.9, 65, 120, 7300)] == ["4 s", "1 min 5 s", "2 min", "2 h 1 min"]


async def test_a_peer_nobody_admits_says_so_on_both_sides(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: cluster.add_peer(admit=False))
        await trio.sleep(36.0)  # virtual: reports at 5, 15 and 35 s
        peer = warnings_about(caplog, "to be accepted by the master", "pccl.peer")
        assert len(peer) == 3, peer
        assert "has waited 5 s to be accepted" in peer[0] and "has waited 35 s" in peer[2]
        assert "the peers already accepted must call update_topology()" in peer[0]
        assert "set PeerConfig.accept_timeout to bound it" in peer[0]
        master = warnings_about(caplog, "waits to be accepted", "pccl.master")
        assert master, caplog.text
        assert "the 2 accepted peer(s) must call update_topology(); none has called it" in master[0]
        assert "still waiting after 5 s" in master[0]
        await cluster.update_topology()  # admitted: the wait ends, and its reports with it
    said = len(warnings_about(caplog, "to be accepted"))
    await trio.sleep(100.0)
    assert len(warnings_about(caplog, "to be accepted")) == said


async def test_a_collective_waiting_for_a_peer_that_does_not_call_it(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(2)
    x = np.ones(16, np.float32)
    with trio.move_on_after(16.0):
        await cluster.peer(0).all_reduce(x, x, op=ReduceOp.SUM, tag=7)
    said = warnings_about(caplog, "all_reduce (tag 7) has waited", "pccl.peer")
    assert [s.split("has waited ")[1].split(" for")[0] for s in said] == ["5 s", "15 s"], said
    assert "for the other accepted peers of peer group 0 to call it with the same tag" in said[0]
    stalled = warnings_about(caplog, "collective tag 7", "pccl.master")
    assert stalled and f"waits for [{cluster.peer(1).peer_id}]" in stalled[0], stalled


async def test_a_survivor_learns_why_its_partner_was_refused(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(3)
    # Two peers agree on the layout (a 16-element model), the third has another width.
    states = [SharedState([TensorInfo.from_numpy(np.zeros(n, np.float32), "w")]) for n in (16, 16, 8)]
    results: dict[int, BaseException | None] = {}

    async def sync(i: int) -> None:
        try:
            await cluster.peer(i).sync_shared_state(states[i])
            results[i] = None
        except SharedStateSyncError as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(sync, i)
    assert results[0] is None and results[1] is None and isinstance(results[2], SharedStateSyncError)
    refused = cluster.peer(2).peer_id
    for i in (0, 1):
        note = cluster.peer(i).refused_note
        assert note.startswith(f"peer {refused} was refused: shared state does not match"), note
    said = warnings_about(caplog, "went on without refused peers", "pccl.shared_state")
    assert len(said) == 2 and f"peer {refused} was refused" in said[0], said
