"""The master's per-round collective messages are one object for every receiver, and the streams encode
such an object once (``Message.SHARED``): the slow path's ``CollectiveCommence`` carries the n-row table,
so encoding it per voter made a round's encoding O(n^2) (docs/history/benchmarks-control-plane.md "Control
plane at many
peers")."""

from __future__ import annotations

from typing import Any

from pccl.master.state import MasterState, Send
from pccl.wire import messages as m
from pccl.wire import stream as stream_mod

DESC = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)


def setup(n: int) -> tuple[MasterState, list[int]]:
    st = MasterState()
    peers = []
    for _ in range(n):
        pid = st.new_connection("127.0.0.1", 0.0)
        st.handle(pid, m.Register(p2p_port=40000 + pid, peer_group=0), 0.0)
        peers.append(pid)
    for e in st.handle(peers[0], m.UpdateTopologyVote(), 0.0):
        if isinstance(e, Send) and isinstance(e.message, m.EstablishP2P):
            st.handle(e.peer_id, m.P2PConnectionsDone(epoch=e.message.epoch, success=True), 0.0)
    return st, peers


def sent(effects: list[Any], cls: type) -> list[tuple[int, Any]]:
    return [(e.peer_id, e.message) for e in effects if isinstance(e, Send) and isinstance(e.message, cls)]


def test_every_voter_gets_the_same_commence_and_complete_object_and_each_is_encoded_once(
    encoded_types: list[type],
) -> None:
    calls = encoded_types
    st, peers = setup(5)
    eff: list[Any] = []
    for p in peers:
        eff += st.handle(p, m.CollectiveInitiate(tag=1, descriptor=DESC), 1.0)
    com = sent(eff, m.CollectiveCommence)
    assert sorted(p for p, _ in com) == peers and len(com[0][1].peers) == 5
    assert len({id(c) for _, c in com}) == 1  # one object, with the table
    frames = {stream_mod.encode_message(c) for _, c in com}
    assert len(frames) == 1 and calls == [m.CollectiveCommence]
    eff = []
    for p in peers:
        eff += st.handle(p, m.CollectiveDone(tag=1, success=True, op_seq=com[0][1].op_seq), 2.0)
    comp = sent(eff, m.CollectiveComplete)
    assert sorted(p for p, _ in comp) == peers and len({id(c) for _, c in comp}) == 1
    assert len({stream_mod.encode_message(c) for _, c in comp}) == 1
    assert calls == [m.CollectiveCommence, m.CollectiveComplete]
    # the decoded messages are what each peer would have got before
    got = m.decode(stream_mod.encode_message(comp[0][1]))
    assert got == m.CollectiveComplete(tag=1, op_seq=com[0][1].op_seq, next_op_seq=comp[0][1].next_op_seq)
