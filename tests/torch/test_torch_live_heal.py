"""A DiLoCo run with live heals (issue 35 item 4): a newcomer heals while the members keep stepping."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import trio
import trio.testing
from _torchrun_helpers import state_bytes
from test_torch_diloco import INNER, train

from pccl.testing import DEFAULT_MASTER_CONFIG
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import StepResult

OUTER = 30


async def test_diloco_members_step_on_while_a_newcomer_heals(
        autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory) -> None:
    """The members' DiLoCo rounds go on while the newcomer heals (live_heal_rounds=2), and all end equal."""
    cluster = await pccl_cluster(2, master_config=dataclasses.replace(DEFAULT_MASTER_CONFIG,
                                                                      live_heal_rounds=2))
    out: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as peers:
            for i in cluster.alive:
                peers.start_soon(functools.partial(train, cluster, i, nursery, delayed=False,
                                                   outer_steps=OUTER, quantization=None, out=out))
            net = cluster.network
            assert net is not None
            net.set_link(cluster.host(0), cluster.host(1), latency=0.05)  # a round takes ~0.2 s
            await trio.sleep(0.05)
            newcomer = await cluster.add_peer(admit=False)
            for d in (0, 1):  # slow links to the newcomer: its heal takes a few rounds
                net.set_link(cluster.host(d), cluster.host(newcomer), bandwidth=1000.0, latency=0.005)
            peers.start_soon(lambda: train(cluster, newcomer, nursery, delayed=False, outer_steps=OUTER,
                                           quantization=None, out=out, seed=99))
    states = [state_bytes(out[i][0].shared) for i in (0, 1, newcomer)]
    assert states[0] == states[1] == states[2]
    for i in (0, 1):  # the members ran every step, none twice
        assert [r.index for r in out[i][3]] == list(range(OUTER * INNER))
    new_results: list[StepResult] = out[newcomer][3]
    # it joined at a round boundary, rounds after it started healing (the members went on meanwhile: in
    # DiLoCo every outer step changes every parameter, so after live_heal_rounds live rounds the last
    # difference moved in an ordinary sync), and nothing moved after
    assert new_results[0].index >= 5 * INNER and new_results[0].index % INNER == 0
    assert new_results[0].sync_rx_bytes > 0 and all(r.sync_rx_bytes == 0 for r in new_results[1:])
    assert new_results[-1].index == OUTER * INNER - 1
    heals = cluster.master.state.statistics()["heals"]
    assert heals["started"] == 2 and heals["rejoined"] == 1 and heals["behind"] == heals["healing"] == 0
