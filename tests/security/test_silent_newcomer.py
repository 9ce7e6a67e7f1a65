"""Issue 33 item 6 on the virtual network (MockClock): a newcomer that is admitted and then calls
nothing (it answered the master's ``EstablishP2P`` with ``P2PConnectionsDone`` and stops there) no longer
holds the members' all-reduce until ``vote_timeout`` (1800 s by default): the master evicts it once the
others waited ``MasterConfig.admission_grace`` seconds on it, logs why, and the all-reduce completes
exact without it. The stall is bounded by the grace."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import trio
import trio.testing

from pccl import MasterConfig, PeerConfig
from pccl.peer.communicator import Communicator
from pccl.testing import VirtualNetwork, open_test_cluster
from pccl.wire import messages as m
from pccl.wire.handshake import offer_hello
from pccl.wire.stream import MessageStream

from ._helpers import COUNT, contribution, exact_all_reduces, expected, master_port

GRACE = 5.0
PEER_CFG = PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0)


async def test_a_newcomer_that_never_votes_is_evicted_within_the_admission_grace(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    cfg = MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, admission_grace=GRACE)
    assert cfg.vote_timeout is not None and cfg.vote_timeout > 100 * GRACE  # the default: 1800 s
    async with open_test_cluster(
        2, network=VirtualNetwork(latency=0.0005), config=PEER_CFG, master_config=cfg
    ) as cl:
        await exact_all_reduces(cl)
        idle_index = await cl.add_peer()  # admitted by the members' update_topology; then calls nothing
        idle = cl.peer(idle_index).peer_id
        ids = [cl.peer(i).peer_id for i in (0, 1)]
        assert len(cl.master.state.accepted()) == 3
        t0 = trio.current_time()

        async def one(i: int, comm: Communicator) -> tuple[bytes, int]:
            out = np.zeros(COUNT, np.int64)
            info = await comm.all_reduce(contribution(comm.peer_id), out, tag=100)
            return out.tobytes(), info.local_world_size

        with trio.fail_after(GRACE + 2.0):
            results = await cl.run_all(one, indexes=[0, 1])
        stall = trio.current_time() - t0
        assert results == [(expected(ids), 2)] * 2  # exact, without the idle newcomer
        assert GRACE <= stall <= GRACE + 1.0  # bounded by the stated limit
        assert f"peer {idle} kicked: evicted: admitted" in caplog.text
        assert "taken part in no collective or shared-state sync" in caplog.text
        assert idle not in cl.master.state.peers
        # The run goes on at world size 2, exact.
        assert await cl.run_all(one, indexes=[0, 1]) == [(expected(ids), 2)] * 2
        # It is remembered (pccl/master/penalties.py): registering again from its host is refused with
        # the reason and when to retry, and costs the members nothing.
        stream = await cl.host(idle_index).connect(*master_port(cl))
        ms = MessageStream(stream, max_frame_size=1 << 20)
        await offer_hello(ms, purpose="master", secret=None)
        await ms.send(m.Register(p2p_port=45000, public_key=bytes(range(1, 33))))
        reply = await ms.receive()
        while isinstance(reply, m.Heartbeat):
            reply = await ms.receive()
        assert isinstance(reply, m.Refused), reply
        assert "evicted 1 time(s) for liveness" in reply.reason and "retry in 60s" in reply.reason
        await ms.aclose()
        assert len(cl.master.state.accepted()) == 2
        assert await cl.run_all(one, indexes=[0, 1]) == [(expected(ids), 2)] * 2
