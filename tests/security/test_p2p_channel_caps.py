"""Issue 33 finding 5: nothing capped a member's P2P connections after the hello (60 bench connections,
each with its 4 MiB probe buffer, cost the target +241 MiB). Now each peer may hold at most
``CHANNEL_CAPS[channel]`` connections per channel at another peer's listener; one more is refused with
a logged reason, and the places come back when its connections close. Virtual network, virtual time."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from pccl import RankConnectionFailedError
from pccl.peer.p2p import CHANNEL_CAPS
from pccl.testing import VirtualNetwork, open_test_cluster, wait_until

from ._helpers import exact_all_reduces


@pytest.mark.parametrize("channel", ["bench", "state"])
async def test_a_member_cannot_open_more_than_its_share(
    channel: str, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.0005)) as cl:
        evil, victim = cl.peer(0), cl.peer(1)
        assert evil._dialer is not None and victim.p2p_address is not None
        cap = CHANNEL_CAPS[channel]
        held = [await evil._dialer.dial(*victim.p2p_address, channel=channel, peer_id=victim.peer_id)
                for _ in range(cap)]
        await wait_until(lambda: victim.p2p_connections.count(evil.peer_id, channel) == cap)
        with pytest.raises(RankConnectionFailedError, match=f"the cap per peer is {cap}"):
            await evil._dialer.dial(*victim.p2p_address, channel=channel, peer_id=victim.peer_id)
        assert f"holds {cap} {channel!r} connections to this peer" in caplog.text
        assert victim.p2p_connections.statistics()["refused_over_cap"] == 1
        await exact_all_reduces(cl)  # the ring is another channel: unaffected
        for ms in held:
            await ms.aclose()
        await wait_until(lambda: victim.p2p_connections.count(evil.peer_id, channel) == 0)
        again = await evil._dialer.dial(*victim.p2p_address, channel=channel, peer_id=victim.peer_id)
        await again.aclose()
