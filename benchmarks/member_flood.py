#!/usr/bin/env python3
"""Memory a member takes at its ring successor by flooding data frames of length 0 for random (tag, op_seq)
(issue 33 finding 5), measured with tracemalloc in one process on pccl's virtual network, virtual time.

usage: python benchmarks/member_flood.py [--frames 100000]

Two members; one sends ``--frames`` empty frames on its second ring connection for operations nobody will
run, then the run goes on with an exact all-reduce. Prints the successor's stashed frames and the traced
memory the flood added (the virtual network's own buffers of the flood included, alike on both trees),
then the same once the flooder has closed its connections (a reader parked on a full stash notices the
close at its ``p2p_stall_timeout`` at the latest). Runs against any tree (it only
uses ``P2PPool.send`` and ``statistics()``), so the same command measures the code before and after.
"""

from __future__ import annotations

import argparse
import random
import tracemalloc

import numpy as np
import trio
import trio.testing

from pccl import PeerConfig, RankConnectionLostError
from pccl.testing import VirtualNetwork, open_test_cluster

JUNK_OP_SEQ = 1 << 31


def _pool_bytes() -> int:
    """Traced bytes allocated by pccl/peer/pool.py and still alive."""
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*pccl/peer/pool.py")])
    return sum(stat.size for stat in snap.statistics("filename"))


async def run(frames: int) -> None:
    cfg = PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0)
    async with open_test_cluster(2, network=VirtualNetwork(latency=0.0005), config=cfg, pool_size=2) as cl:
        evil, victim = cl.peer(0), cl.peer(1)
        rng = random.Random(0)
        empty = memoryview(b"")

        async def all_reduce(tag: int) -> None:
            async def one(i: int, comm: object) -> bytes:
                out = np.zeros(1024, np.int64)
                await comm.all_reduce(np.full(1024, 1, np.int64), out, tag=tag)  # type: ignore[attr-defined]
                return out.tobytes()

            for res in await cl.run_all(one):
                assert res == np.full(1024, 2, np.int64).tobytes(), res

        await all_reduce(0)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]

        async def flood() -> None:
            try:
                for _ in range(frames):
                    await evil.pool.send(victim.peer_id, 1, JUNK_OP_SEQ + rng.randrange(1 << 30),
                                         rng.randrange(1 << 16), empty, conn_index=1)
            except RankConnectionLostError:
                pass

        with trio.move_on_after(60):  # virtual: the flood ends, or its connection is closed
            await flood()
        await trio.sleep(1)
        stashed = victim.pool.statistics()["stashed_frames"]
        during = tracemalloc.get_traced_memory()[0] - base
        in_pool = _pool_bytes()
        await evil.pool.retire(set())  # the flooder closes its connections
        await trio.sleep(1)
        after = tracemalloc.get_traced_memory()[0] - base
        after_pool = _pool_bytes()
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        await all_reduce(2)
        left = victim.pool.statistics()["stashed_frames"]
        print(f"{frames} empty frames flooded: {stashed} stashed at the successor, {in_pool / 2**20:.2f} MiB "
              f"allocated by the pool (+{during / 2**20:.1f} MiB traced in all, "
              f"peak +{peak / 2**20:.1f} MiB, "
              f"the virtual network's buffers included); after its connections closed: {left} stashed, "
              f"{after_pool / 2**20:.2f} MiB by the pool (+{after / 2**20:.1f} MiB in all); the all-reduce "
              "after it exact")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100_000)
    args = ap.parse_args()
    trio.run(run, args.frames, clock=trio.testing.MockClock(autojump_threshold=0))


if __name__ == "__main__":
    main()
