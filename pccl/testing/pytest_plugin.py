"""pytest plugin for testing code that uses pccl (registered through the ``pytest11`` entry point).

Fixtures (async ones need pytest-trio, e.g. ``trio_mode = true``):

* ``pccl_master``: a master on 127.0.0.1 with an OS-chosen port, yielding its
  :class:`~pccl.master.server.MasterHandle` (``.connect_address`` for ``open_communicator``).
* ``pccl_fast_configs``: ``(MasterConfig, PeerConfig)`` with short heartbeats, for failure tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .._config import MasterConfig, PeerConfig


@pytest.fixture
def pccl_fast_configs() -> tuple[MasterConfig, PeerConfig]:
    """Short heartbeat settings so eviction tests finish quickly (use with a MockClock for zero waiting)."""
    return (
        MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0),
        PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, p2p_listen_host="127.0.0.1"),
    )


@pytest.fixture
async def pccl_master(pccl_fast_configs: tuple[MasterConfig, PeerConfig]) -> AsyncIterator[object]:
    """A running master on loopback (port chosen by the OS)."""
    from ..master.server import open_master

    async with open_master("127.0.0.1:0", config=pccl_fast_configs[0]) as master:
        yield master
