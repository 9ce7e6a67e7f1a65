"""A shared-state transfer's progress on the master's status page while it runs (issue 37 item 5; its
chunks and donors, issue 35 item 5):
virtual network with slow links, virtual time."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio
import trio.testing

import pccl
from pccl import SharedStateSyncStrategy as S
from pccl.master.metrics import MasterObserver
from pccl.master.status import build_status, render_html
from pccl.peer.communicator import Communicator
from pccl.peer.shared_state import PROGRESS_EVERY, SharedState, TensorInfo
from pccl.testing.pytest_plugin import ClusterFactory

MB = 1_000_000
RATE = 1 * MB  # bytes/s of each link into the receiver


def _state(value: float) -> SharedState:
    # eight tensors of 0.5 MB: the receiver fetches four from each holder, in parallel (its progress
    # counts whole tensors below 4 MiB)
    infos = [TensorInfo.from_numpy(np.full(MB // 8, value, np.float32), f"w{k}") for k in range(8)]
    return SharedState(infos, revision=1)


async def test_the_status_shows_a_receivers_bytes_rate_and_eta_while_it_fetches(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    cluster = await pccl_cluster(3)
    net = cluster.network
    assert net is not None
    for holder in (0, 1):
        net.set_link(cluster.host(holder), cluster.host(2), bandwidth=RATE, oneway=True)
    states = [_state(1.0), _state(1.0), _state(7.0)]
    receiver = cluster.peer(2).peer_id
    seen: list[dict[str, Any]] = []
    pages: list[str] = []

    async def watch() -> None:
        while True:
            await trio.sleep(PROGRESS_EVERY / 2)
            snap = build_status(cluster.master.state, [], trio.current_time())
            for t in snap["receiving"]:
                seen.extend(t["receivers"])
                if any(0 < r["bytes"] < r["total"] for r in t["receivers"]) and not pages:
                    pages.append(render_html(snap))

    async def sync(i: int, comm: Communicator) -> pccl.SharedStateSyncInfo:
        return await comm.sync_shared_state(states[i], S.ENFORCE_POPULAR)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        started = trio.current_time()
        infos = await cluster.run_all(sync)
        took = trio.current_time() - started
        nursery.cancel_scope.cancel()
    last = infos[2]
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in infos), infos
    assert isinstance(last, pccl.SharedStateSyncInfo) and last.rx_bytes == 4 * MB
    assert took >= 2.0  # 2 MB over each 1 MB/s link
    assert all(float(i.tensor[0]) == 1.0 for i in states[2].tensor_infos)
    # Only the receiver is listed, and in the middle of the fetch with part of its bytes, a rate near the
    # whole transfer's (which counts from the plans, as the reports do) and an ETA.
    assert {r["peer"] for r in seen} == {receiver}
    middle = [r for r in seen if 0 < r["bytes"] < r["total"]]
    assert middle, seen
    assert all(r["total"] == 4 * MB for r in seen)
    overall = 4 * MB / took
    assert all(overall / 2 <= r["bytes_per_s"] <= overall * 2 and r["eta_s"] is not None and r["eta_s"] > 0
               for r in middle), (middle, overall)
    assert [r["bytes"] for r in seen] == sorted(r["bytes"] for r in seen)  # never back
    assert f"<td>peer {receiver}</td>" in pages[0] and "4 MB (" in pages[0]
    # The sync over, nothing is listed any more.
    assert build_status(cluster.master.state, [], trio.current_time())["receiving"] == []


async def test_a_healing_newcomers_chunks_and_donors_reach_the_status_and_metrics(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """Issue 35 item 5: a newcomer fetching one large tensor chunk by chunk from two donors; the master's
    status, page and /metrics show its chunks and donors as the fetch runs."""
    cluster = await pccl_cluster(3)
    net = cluster.network
    assert net is not None
    for holder in (0, 1):
        net.set_link(cluster.host(holder), cluster.host(2), bandwidth=RATE, oneway=True)
    big = 6 << 20  # six 1 MiB chunks: about 3 s over the two links

    def state(value: float) -> SharedState:
        return SharedState([TensorInfo.from_numpy(np.full(big // 4, value, np.float32), "big")], revision=1)

    states = [state(1.0), state(1.0), state(7.0)]
    receiver = cluster.peer(2).peer_id
    seen: list[dict[str, Any]] = []
    pages: list[str] = []
    gauges: list[str] = []

    async def watch() -> None:
        while True:
            await trio.sleep(PROGRESS_EVERY / 2)
            now = trio.current_time()
            snap = build_status(cluster.master.state, [], now)
            for t in snap["receiving"]:
                seen.extend(t["receivers"])
                if any(0 < r["chunks"] < r["chunks_total"] for r in t["receivers"]) and not pages:
                    pages.append(render_html(snap))
                    gauges.append(MasterObserver().render(cluster.master.state, now).decode())

    async def sync(i: int, comm: Communicator) -> pccl.SharedStateSyncInfo:
        return await comm.sync_shared_state(states[i], S.ENFORCE_POPULAR)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        infos = await cluster.run_all(sync)
        nursery.cancel_scope.cancel()
    assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in infos), infos
    assert all(float(v) == 1.0 for v in states[2].tensor_infos[0].tensor[:: 1 << 16])
    middle = [r for r in seen if 0 < r["chunks"] < r["chunks_total"]]
    assert middle, seen
    assert all(r["peer"] == receiver and r["chunks_total"] == 6 and r["donors"] == 2 and r["donors_lost"] == 0
               for r in middle), middle
    assert [r["chunks"] for r in seen] == sorted(r["chunks"] for r in seen)
    assert " / 6 chunks, 2 donors</td>" in pages[0]
    assert f'pccl_shared_state_receiving_donors{{peer="{receiver}"}} 2.0' in gauges[0]
