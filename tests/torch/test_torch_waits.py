"""A TrainingRun waiting for ``min_world_size`` peers says so at WARNING (issue 37 item 1), with why the
group is short when a sync refused a peer (two widths of one model: the refused peer fails with
SHARED_STATE_SYNC_FAILED, the survivors hear why). MockClock."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import trio
import trio.testing
from _torchrun_helpers import float_data, mlp, mse_backward, sgd

from pccl._errors import SharedStateSyncError
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.torch import AsyncTrainingRun, SharedModel


def waits(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "for min_world_size=" in r.getMessage()]


async def test_waiting_for_min_world_size_says_so_and_why(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(3)
    x, y = float_data(d=6)
    failed: list[BaseException] = []

    async def peer(i: int) -> None:
        width = 8 if i == 2 else 6  # peer 2's model has another width
        model = mlp(seed=0, d=width)
        xs = torch.randn(len(x), width) if i == 2 else x
        run = AsyncTrainingRun(cluster.peer(i), SharedModel(model, sgd(model)), total_steps=3,
                               min_world_size=3)
        backward: Any = mse_backward(model, xs, y, 12)
        try:
            while await run.step(backward) is not None:
                pass
        except SharedStateSyncError as exc:
            failed.append(exc)
            await cluster.leave(i)  # as a process that fails would: it leaves the run

    with trio.move_on_after(40.0):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(peer, i)
    assert len(failed) == 1 and "shape mismatch" in str(failed[0]), failed
    said = waits(caplog)
    # Both survivors, at 5, 15 and 35 s each.
    assert len(said) == 6, said
    refused = cluster.peer(2).peer_id
    assert "has waited 5 s for min_world_size=3 peers in its group, which has 2: start more peers" in said[0]
    assert f"the last shared-state sync refused peers of this group: peer {refused} was refused: shared " \
           "state does not match the elected layout" in said[0], said[0]
