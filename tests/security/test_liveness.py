"""Liveness against faulty members on the virtual network (issue 17 item 6): a newcomer that never
finishes its P2P setup is kicked after ``MasterConfig.p2p_setup_timeout`` and the accepted peers'
update_topology() succeeds without it; their all-reduces stay exact (MockClock, virtual time)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import trio
import trio.testing

from pccl import MasterConfig, PCCLError, PeerConfig
from pccl.peer.communicator import Communicator
from pccl.peer.state import Establish
from pccl.testing import VirtualNetwork, open_test_cluster

from ._helpers import COUNT, contribution, exact_all_reduces, expected, hostile

SETUP_TIMEOUT = 4.0
PEER_CFG = PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0)
MASTER_CFG = MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, p2p_setup_timeout=SETUP_TIMEOUT)


class IgnoresEstablish(Communicator):
    """A newcomer that registers, heartbeats and accepts P2P connections, but never answers
    EstablishP2P (so the master never hears it finished its setup)."""

    async def _establish(self, effect: Establish) -> None:
        await trio.sleep_forever()


async def test_newcomer_ignoring_establish_is_dropped_and_update_succeeds(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    async with open_test_cluster(
        2, network=VirtualNetwork(latency=0.0005), config=PEER_CFG, master_config=MASTER_CFG
    ) as cl:
        await exact_all_reduces(cl)
        evil = IgnoresEstablish(cl.master_address, config=PEER_CFG, transport=hostile(cl))
        outcome: list[BaseException] = []

        async def run_evil() -> None:
            async with trio.open_nursery() as n:
                try:
                    await evil._start(n)
                except PCCLError as exc:
                    outcome.append(exc)
                finally:
                    await evil.aclose()

        async with trio.open_nursery() as n:
            n.start_soon(run_evil)
            while len(cl.master.state.registered()) < 1:
                await trio.sleep(0.01)
            t0 = trio.current_time()
            with trio.fail_after(SETUP_TIMEOUT + 2.0):
                results = await cl.run_all(lambda i, c: c.update_topology())
            stall = trio.current_time() - t0
        assert results == [None, None]  # both succeeded, without the newcomer
        assert SETUP_TIMEOUT <= stall <= SETUP_TIMEOUT + 1.0  # bounded by the configured deadline
        assert outcome and "did not finish P2P setup" in str(outcome[0])
        assert "did not finish P2P setup" in caplog.text
        assert len(cl.master.state.accepted()) == 2
        await exact_all_reduces(cl)


VOTE_TIMEOUT = 5.0


async def test_member_that_never_votes_is_evicted_within_the_vote_timeout(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Peer 2 is accepted, heartbeats, and never joins the all-reduce the others wait in."""
    caplog.set_level(logging.INFO, logger="pccl")
    cfg = MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, vote_timeout=VOTE_TIMEOUT)
    async with open_test_cluster(
        3, network=VirtualNetwork(latency=0.0005), config=PEER_CFG, master_config=cfg
    ) as cl:
        await exact_all_reduces(cl)
        ids = [cl.peer(i).peer_id for i in (0, 1)]
        idle = cl.peer(2).peer_id
        t0 = trio.current_time()

        async def one(i: int, comm: Communicator) -> tuple[bytes, int]:
            out = np.zeros(COUNT, np.int64)
            info = await comm.all_reduce(contribution(comm.peer_id), out, tag=100)
            return out.tobytes(), info.local_world_size

        with trio.fail_after(VOTE_TIMEOUT + 2.0):
            results = await cl.run_all(one, indexes=[0, 1])
        stall = trio.current_time() - t0
        assert results == [(expected(ids), 2)] * 2  # exact, without the idle peer
        assert VOTE_TIMEOUT <= stall <= VOTE_TIMEOUT + 1.0  # bounded by the configured deadline
        assert f"peer {idle} kicked: did not join the collective tag 100" in caplog.text
        assert idle not in cl.master.state.peers
