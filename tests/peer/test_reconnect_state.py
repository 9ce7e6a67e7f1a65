"""Issue 18: the peer core's rules for surviving the master, message by message (no trio)."""

from __future__ import annotations

import pytest

import pccl
from pccl._address import parse_addresses
from pccl._env import master_address
from pccl.peer.state import PeerState
from pccl.wire import messages as m


def member(peer_id: int = 2) -> PeerState:
    st = PeerState(peer_id=peer_id, group=0)
    st.handle(m.Registered(peer_id=peer_id, generation=3), now=0.0)
    rows = [m.PeerRow(p, "10.0.0.1", 40000 + p, 0) for p in (3, 2, 1)]
    st.handle(m.Accepted(peers=rows, epoch=5), now=0.0)
    return st


def test_registered_sets_the_generation_and_reregister_reports_what_the_master_needs() -> None:
    st = member()
    st.begin_sync()
    st.handle(m.SharedStateResult(sync_seq=1, success=True, revision=9), now=0.0)
    st.end_membership()
    assert st.generation == 3 and st.revision == 9
    want = m.Reregister(peer_id=2, p2p_port=41002, peer_group=0, epoch=5, ring=[3, 2, 1], revision=9,
                        generation=3)
    assert st.reregister(41002) == want


def test_only_an_accepted_member_with_a_window_reconnects() -> None:
    assert not PeerState(peer_id=4).link_down(1.0, 60.0)  # not accepted: nothing to keep
    st = member()
    assert not st.link_down(1.0, 0.0)  # no window: the loss is final
    assert st.link_down(1.0, 60.0) and st.reconnecting_until == 61.0
    assert st.link_down(2.0, 60.0) and st.reconnecting_until == 61.0  # the deadline stays
    assert st.statistics()["reconnecting"] and not st.statistics()["master_ok"]
    st.lose(pccl.MasterConnectionError("gone"))
    assert not st.reconnecting and not st.link_down(3.0, 60.0)


def test_reregistered_takes_the_peer_back_and_fences_older_generations() -> None:
    st = member()
    st.link_down(1.0, 60.0)
    older = st.reregistered(m.Reregistered(peer_id=2, generation=2, epoch=5), now=2.0)
    assert isinstance(older, pccl.MasterConnectionError) and "older" in older.message and st.reconnecting
    other = st.reregistered(m.Reregistered(peer_id=7, generation=4, epoch=5), now=2.0)
    assert other is not None and st.reconnecting
    refused = st.reregistered(m.Refused(reason="epoch moved on", code=9), now=2.0)
    assert refused is not None and "epoch moved on" in refused.message
    assert st.reregistered(m.Reregistered(peer_id=2, generation=4, epoch=5), now=2.5) is None
    assert not st.reconnecting and st.generation == 4 and st.last_heard == 2.5
    assert [r.peer_id for r in st.table] == [3, 2, 1]  # it kept its place


def test_master_address_lists() -> None:
    assert parse_addresses("h1:1,h2:2") == [("h1", 1), ("h2", 2)]
    assert parse_addresses(["h1:1", ("h2", 2), "h1:1"]) == [("h1", 1), ("h2", 2)]
    assert parse_addresses(("h", 5)) == [("h", 5)]
    assert master_address(None, {"PCCL_MASTER": "a:1,b:2"}) == "a:1,b:2"
    with pytest.raises(pccl.InvalidArgumentError):
        parse_addresses([])
    with pytest.raises(pccl.InvalidArgumentError):
        parse_addresses("h1:1,,h2:2")
