"""The master's status port over real HTTP: ``/status`` (JSON), ``/metrics`` (Prometheus), ``/`` (HTML)."""

from __future__ import annotations

import dataclasses
import functools

import httpx
import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pccl.master.server import open_master
from pccl.peer.communicator import Communicator
from pccl.transport import ConnectFailed

from ._cluster import FAST_MASTER, gather, loopback_cluster

STATUS_MASTER = dataclasses.replace(FAST_MASTER, status_port=0)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_status_metrics_and_page_of_a_running_master() -> None:
    async with loopback_cluster(3, master_config=STATUS_MASTER) as cl:
        url = cl.master.status_url
        assert url is not None and url.startswith("http://127.0.0.1:")

        async def reduce(i: int, c: Communicator) -> None:
            await c.all_reduce(np.ones(100, np.float32), tag=1)
            await c.all_reduce(np.ones(100, np.float32), tag=2)

        await gather(cl.comms, reduce)
        ids = [c.peer_id for c in cl.comms]
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.get("/status")
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            st = r.json()
            assert st["version"] == 1
            assert st["epoch"] == cl.master.state.epoch and sorted(st["ring"]) == ids
            assert st["groups"] == {"0": st["ring"]}
            assert [(p["id"], p["group"], p["phase"], p["host"]) for p in st["peers"]] == [
                (i, 0, "accepted", "127.0.0.1") for i in ids
            ]
            assert all(0 <= p["last_seen_s"] < 5 for p in st["peers"])
            assert st["counts"]["collectives_started"] == 2 and st["counts"]["collectives_completed"] == 2
            assert st["counts"]["collectives_failed"] == 0
            texts = [e["text"] for e in st["events"]]
            assert any(f"peer {ids[2]} accepted (world size 3)" in t for t in texts)
            assert st["rounds"] == [] and st["calls"] == {}

            r = await http.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
            samples = _samples(r.text)
            assert samples[("pccl_peers", (("phase", "accepted"),))] == 3
            assert samples[("pccl_peers", (("phase", "registered"),))] == 0
            assert samples[("pccl_collectives_started_total", ())] == 2
            assert samples[("pccl_collectives_completed_total", ())] == 2
            assert samples[("pccl_vote_wait_seconds_count", (("kind", "collective"),))] == 2
            assert samples[("pccl_topology_epoch", ())] == cl.master.state.epoch

            r = await http.get("/")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert '<meta http-equiv="refresh"' in r.text
            assert f"group 0: {' -&gt; '.join(map(str, st['ring']))}" in r.text
            assert "Who is waited on" in r.text and "Recent events" in r.text

            assert (await http.get("/nope")).status_code == 404
            assert (await http.post("/status", content=b"x")).status_code == 405
            assert (await http.head("/status")).status_code == 200

        # A peer that leaves shows in the counters and the events.
        cl.kill(cl.comms[2])
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(200):
                st = (await http.get("/status")).json()
                if len(st["peers"]) == 2:
                    break
                await trio.sleep(0.01)
            assert [p["id"] for p in st["peers"]] == ids[:2]
            assert any(f"peer {ids[2]} (127.0.0.1) left" in e["text"] for e in st["events"])


async def test_status_shows_who_waits_and_the_deadlock_failure() -> None:
    cfg = dataclasses.replace(STATUS_MASTER, deadlock_grace=None)  # detection off: the wait stays visible
    async with loopback_cluster(2, master_config=cfg) as cl:
        a, b = cl.comms
        url = cl.master.status_url
        assert url is not None

        async with trio.open_nursery() as n:
            n.start_soon(functools.partial(a.all_reduce, np.ones(4, np.float32), tag=5))
            async with httpx.AsyncClient(base_url=url) as http:
                while not (st := (await http.get("/status")).json())["rounds"]:
                    await trio.sleep(0.005)
                assert st["calls"] == {str(a.peer_id): ["all_reduce tag 5"]}
                assert st["rounds"][0]["waits_for"] == [b.peer_id]
                waited = {p["id"]: p["waited_on"] for p in st["peers"]}
                assert waited == {a.peer_id: False, b.peer_id: True}
                page = (await http.get("/")).text
                assert "all_reduce tag 5" in page and "waits for [" in page
            await b.all_reduce(np.ones(4, np.float32), tag=5)


async def test_open_master_status_port_argument_and_a_port_in_use() -> None:
    async with open_master(status_port=0) as master:
        assert master.status_address is not None
        port = master.status_address[1]
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{port}/status")).json()["peers"] == []
        with pytest.raises(ConnectFailed, match=f"cannot serve the status page on 127.0.0.1:{port}"):
            async with open_master(status_port=port):
                pass
    async with open_master() as master:
        assert master.status_url is None and master.status_address is None
