"""The broadcast root is the root's peer id, resolved in the ring the operation commenced on: the
caller's ``root`` rank is of its own view of the group, which can differ from that ring (a member
left and the caller's table does not know yet, so every later rank shifted)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl.peer.state import PeerState
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster
from pccl.wire import messages as m


@pytest.mark.parametrize("schedule", ["ring", "tree"])
async def test_broadcast_takes_the_root_the_caller_named_after_a_member_left(
    autojump_clock: trio.testing.MockClock, schedule: str
) -> None:
    config = dataclasses.replace(DEFAULT_PEER_CONFIG, schedule=schedule)
    async with open_test_cluster(4, network=VirtualNetwork(latency=0.001), config=config) as cl:
        view = list(cl.peer(0).group_ring)  # every member's view: the same table
        assert all(cl.peer(i).group_ring == view for i in range(4))
        index = {cl.peer(i).peer_id: i for i in range(4)}
        gone = index[view[1]]
        await cl.leave(gone)
        while view[1] in cl.master.state.ring:
            await trio.sleep(0.01)
        survivors = [i for i in range(4) if i != gone]
        # the survivors still see 4 members: rank 2 is view[2] to each of them
        assert all(cl.peer(i).group_ring == view and cl.peer(i).rank == view.index(cl.peer(i).peer_id)
                   for i in survivors)
        bufs = {i: np.full(64, 10 + i, np.int64) for i in survivors}
        res = await cl.run_all(lambda i, c: c.broadcast(bufs[i], root=2), indexes=survivors)
        assert all(isinstance(r, pccl.ReduceInfo) and r.local_world_size == 3 for r in res), res
        root = index[view[2]]
        for i in survivors:
            assert (bufs[i] == 10 + root).all(), (i, bufs[i][0], 10 + root)
            # the commenced ring (without the member that left) is the table now
            assert cl.peer(i).group_ring == [p for p in view if p != view[1]]


def test_the_root_position_is_looked_up_by_peer_id() -> None:
    desc = m.CollectiveDescriptor(
        kind="broadcast", dtype=int(pccl.DataType.INT64), element_count=4, op=int(pccl.ReduceOp.SUM),
        root=17, quantization=0, quantized_dtype=0,
    )
    assert PeerState.root_position(desc, [5, 9, 17, 3]) == 2
    assert PeerState.root_position(desc, [17, 3, 5]) == 0  # a reordered ring: the same peer
    assert PeerState.root_position(desc._replace(kind="all_reduce", root=-1), [5, 9]) == 0
    with pytest.raises(ValueError):
        PeerState.root_position(desc, [5, 9])
