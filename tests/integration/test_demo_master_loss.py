"""The demo's (and the churn soak's) membership step across a master kill (virtual network, MockClock).

The master dies after one peer voted in ``are_peers_pending()`` and before the other did: the loss fails
the first peer's query (RANK_CONNECTION_LOST), while the second one's call, made afterwards, waits for
the reconnection and votes at the restarted master. A peer that took the failure for "nobody pending"
would go on to its next step and leave the other waiting in the query for good (in the soak: a deadlock
of sync_shared_state against are_peers_pending, failed by the master with INVALID_USAGE); retried, both
meet at the new master.
"""

from __future__ import annotations

import trio
import trio.testing

from pccl.demo import _admit_pending
from pccl.testing import VirtualNetwork, open_test_cluster

from ._traffic import RECONNECTING_PEER as CONFIG


async def test_a_query_failed_by_the_master_loss_is_asked_again_at_the_new_master(
        autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.001), config=CONFIG) as cluster:
        a, b = cluster.peer(0), cluster.peer(1)
        answers: dict[str, bool] = {}

        async def admit(name: str, comm: object) -> None:
            answers[name] = await _admit_pending(comm)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(admit, "a", a)
                await trio.sleep(0.01)  # a's vote is at the master, b has not voted
                assert a.statistics()["pending_queries_waiting"] == 1
                await cluster.restart_master()
                while b.statistics()["reconnecting"] or b.statistics()["generation"] != 2:
                    await trio.sleep(0.01)  # b was computing: its call comes after its reconnection
                nursery.start_soon(admit, "b", b)
        assert answers == {"a": False, "b": False}
        assert cluster.master.statistics()["generation"] == 2
