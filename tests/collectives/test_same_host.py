"""Peers of one host, nothing measured: the schedule choice prices their links with
``cost.SAME_HOST`` (no wire: per-step software cost, copy-speed bytes) instead of the LAN defaults,
on every member alike, from the operation's table."""

from __future__ import annotations

import numpy as np
import pytest
import trio.testing

import pccl
from pccl.collectives.cost import SAME_HOST, SAME_HOST_FRAME_CPU, frames, predict, same_host, schedule_for
from pccl.collectives.schedule import SCHEDULES
from pccl.peer import collective_api
from pccl.testing import VirtualNetwork
from pccl.testing.pytest_plugin import ClusterFactory

KB, MB = 1 << 10, 1 << 20


def test_same_host_choices() -> None:
    """Where the LAN defaults keep the ring, one host's model takes the tree or halving-doubling
    (what a 2-vCPU VM measured fastest: docs/topology.md "Peers on one host"); big operations and
    two peers keep the ring."""
    assert schedule_for("auto", "all_reduce", 3, 64 * KB) == "ring"
    assert schedule_for("auto", "all_reduce", 3, 64 * KB, links=SAME_HOST) == "tree"
    assert schedule_for("auto", "all_reduce", 4, MB) == "ring"
    assert schedule_for("auto", "all_reduce", 4, MB, links=SAME_HOST) == "hd"
    assert schedule_for("auto", "all_reduce", 3, 16 * MB, links=SAME_HOST) == "ring"
    assert schedule_for("auto", "all_reduce", 2, 64 * KB, links=SAME_HOST) == "ring"
    # every prediction is cheaper than over a LAN: no wire, and bytes at copy speed
    for s in SCHEDULES:
        assert predict(s, "all_reduce", 4, MB, SAME_HOST) < predict(s, "all_reduce", 4, MB)


async def _all_reduce_64k_runs(pccl_cluster: ClusterFactory, n: int, *, loopback: bool, want: str) -> None:
    """``n`` peers with nothing measured (on one host with ``loopback``) all-reduce 64 KB of float32:
    the results are exact and every peer ran ``want`` and no other schedule."""
    cluster = await pccl_cluster(n, network=VirtualNetwork(latency=0.0002, bandwidth=1e9, loopback=loopback))
    assert all(cluster.peer(i)._links is None for i in cluster.alive)  # nothing measured
    xs = {i: np.full(16 * KB, i + 1, np.float32) for i in cluster.alive}
    infos = await cluster.run_all(lambda i, c: c.all_reduce(xs[i]))
    assert all(isinstance(r, pccl.ReduceInfo) for r in infos), infos
    for i in cluster.alive:
        assert (xs[i] == n * (n + 1) // 2).all()
        stats = cluster.peer(i).statistics()
        assert {s: stats.get(f"schedule_{s}_ok", 0) for s in SCHEDULES} == {
            s: int(s == want) for s in SCHEDULES
        }


@pytest.mark.parametrize(("loopback", "want"), [(True, "tree"), (False, "ring")])
async def test_one_host_runs_the_same_host_choice(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, loopback: bool, want: str
) -> None:
    """Three peers, a 64 KB all-reduce, nothing measured: on one host (every address 127.0.0.1)
    each peer runs the tree, on three hosts the ring, and the results are exact either way."""
    await _all_reduce_64k_runs(pccl_cluster, 3, loopback=loopback, want=want)


def test_frames_are_counted_from_the_plans() -> None:
    # one block per transfer: the ring sends 2(n-1) frames per rank, the binomial tree 2(n-1) in all,
    # halving-doubling one frame per round (the adjacent chunks a rank gives its partner in one
    # round are one range): 2 log2(p) per rank, 4 at 4 peers, 12 at 64 (not 2(p - 1): 6 and 126)
    assert frames("ring", "all_reduce", 4, 64 * KB) == 4 * 6
    assert frames("tree", "all_reduce", 4, 64 * KB) == 6
    assert frames("hd", "all_reduce", 4, 64 * KB) == 4 * 4
    assert frames("hd", "all_reduce", 64, 4 * KB) == 64 * 12
    assert frames("tree", "all_reduce", 3, 64 * KB) == 4
    # a transfer larger than a block is several frames
    assert frames("tree", "all_reduce", 4, 8 * MB, block_bytes=4 * MB) == 12


def test_frame_cpu_counts_only_with_more_peers_than_cores() -> None:
    with pytest.raises(ValueError):
        same_host(0)
    for s in SCHEDULES:
        base = predict(s, "all_reduce", 4, 64 * KB, SAME_HOST)
        assert predict(s, "all_reduce", 4, 64 * KB, same_host(4)) == base  # a core per peer
        extra = predict(s, "all_reduce", 4, 64 * KB, same_host(2)) - base
        assert extra == pytest.approx(frames(s, "all_reduce", 4, 64 * KB) * SAME_HOST_FRAME_CPU / 2)


def test_four_peers_on_two_cores_take_the_tree_for_small_operations() -> None:
    """What the 2-vCPU VM measured (docs/topology.md "Peers on one host"): four peers there run the
    6-frame tree faster than the halving-doubling up to 256 KB (24 frames then; 16 since a round's
    adjacent chunks go as one frame); with a core per peer the frame count does not decide, and three
    peers choose as before."""
    two, many = same_host(2), same_host(16)
    assert [schedule_for("auto", "all_reduce", 4, b, links=two) for b in (4 * KB, 64 * KB, MB)] == \
        ["tree", "tree", "hd"]
    assert [schedule_for("auto", "all_reduce", 4, b, links=many) for b in (4 * KB, 64 * KB, MB)] == \
        ["hd", "hd", "hd"]
    for links in (two, many):
        assert schedule_for("auto", "all_reduce", 3, 64 * KB, links=links) == "tree"
        assert schedule_for("auto", "all_reduce", 3, MB, links=links) == "ring"
        assert schedule_for("auto", "all_reduce", 2, 64 * KB, links=links) == "ring"


@pytest.mark.parametrize(("cores", "want"), [(2, "tree"), (16, "hd")])
async def test_a_live_one_host_group_prices_this_hosts_cores(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch,
    cores: int, want: str
) -> None:
    """Four peers on one host, a 64 KB all-reduce, nothing measured: the communicator prices the
    host's cores (pinned here: the test must not depend on the machine running it)."""
    monkeypatch.setattr(collective_api, "_SAME_HOST", same_host(cores))
    await _all_reduce_64k_runs(pccl_cluster, 4, loopback=True, want=want)
