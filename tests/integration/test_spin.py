"""Polling while collectives run (PeerConfig.spin_seconds) over real loopback TCP: it polls, the
results are exact either way, and ``spin_seconds=0`` turns it off."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pccl import ReduceOp

from ._cluster import FAST_PEER, gather, loopback_cluster


@pytest.mark.parametrize("spin", [1e-3, 0.0])
async def test_all_reduce_with_and_without_polling(spin: float) -> None:
    config = dataclasses.replace(FAST_PEER, spin_seconds=spin)
    async with loopback_cluster(3, peer_config=config) as cl:
        for step in range(5):
            arrays = [np.arange(1000, dtype=np.float32) * (i + 1) + step for i in range(3)]
            await gather(cl.comms, lambda i, c: c.all_reduce(arrays[i], op=ReduceOp.SUM))
            want = np.arange(1000, dtype=np.float32) * 6 + 3 * step
            for a in arrays:
                np.testing.assert_array_equal(a, want)
        passes = [c.statistics()["spin_passes"] for c in cl.comms]
        if spin:
            # one communicator of the process polls at a time, so at least one of them did
            assert sum(passes) > 0
        else:
            assert passes == [0, 0, 0]
        assert all(c.statistics()["ops_in_flight"] == 0 for c in cl.comms)
