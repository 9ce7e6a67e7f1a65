"""Liveness against faulty members on the virtual network (issue 17 item 6): a newcomer that never
finishes its P2P setup is kicked after ``MasterConfig.p2p_setup_timeout`` and the accepted peers'
update_topology() succeeds without it; their all-reduces stay exact (MockClock, virtual time)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from pccl import MasterConfig, PCCLError, PeerConfig
from pccl.peer.communicator import Communicator
from pccl.peer.state import Establish
from pccl.testing import VirtualNetwork, open_test_cluster

from ._helpers import exact_all_reduces, hostile

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
