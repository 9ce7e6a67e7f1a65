"""Issue 33 item 5: what a removed member leaves behind, and its credentials.

A member evicted by the master (here: its master link black-holed, so it goes silent and is evicted after
the heartbeat timeout, while its P2P links still work) kept working P2P credentials until the next epoch:
it could dial the other members afresh and hold connections open. Now the master tells every member at
once (``MemberRemoved``); each revokes the credential (a fresh dial is refused with a logged reason), closes
the removed member's connections and frees what they held. The survivors' all-reduces stay exact.
Virtual network, virtual time."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from pccl import RankConnectionFailedError
from pccl.testing import MASTER, VirtualNetwork, open_test_cluster, wait_until

from ._helpers import exact_all_reduces


async def test_an_evicted_member_is_cut_off_at_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.0005)) as cl:
        await exact_all_reduces(cl)
        evil, victim = cl.peer(0), cl.peer(1)
        assert evil._dialer is not None and victim.p2p_address is not None
        held = await evil._dialer.dial(*victim.p2p_address, channel="bench", peer_id=victim.peer_id)
        await wait_until(lambda: victim.p2p_connections.count(evil.peer_id) >= 1)
        epoch = victim._credentials.current.epoch  # type: ignore[union-attr]

        cl.partition(0, MASTER)  # silent to the master; its P2P links still work
        await wait_until(lambda: evil.peer_id not in cl.master.state.peers, timeout=10, interval=0.01)
        await wait_until(lambda: evil.peer_id in victim._credentials.revoked, timeout=1)
        await wait_until(lambda: victim.p2p_connections.count(evil.peer_id) == 0, timeout=1)
        with trio.fail_after(1):
            assert await held.stream.receive_some(100) == b""  # its open connection was closed
        s = victim.pool.statistics()
        assert evil.peer_id not in s["incoming"] and s["stashed_frames"] == 0
        assert victim._credentials.current.epoch == epoch  # type: ignore[union-attr]  # same epoch

        with pytest.raises(RankConnectionFailedError, match="revoked P2P credential"):
            await evil._dialer.dial(*victim.p2p_address, channel="bench", peer_id=victim.peer_id)
        assert f"revoked P2P credential: peer {evil.peer_id} was removed from the run" in caplog.text
        assert f"peer {evil.peer_id} was removed from the run" in caplog.text

        cl.kill(0)
        await cl.update_topology()
        await exact_all_reduces(cl, tag=10)
