"""Issue 18 item 3: the peer core's side of the quorum rule, message by message (no trio).

A master that gives its run up closes the link with ``MASTER_CONNECTION_FAILED``: the peer treats
it as a broken link (fail over), not as a kick; and a re-registration reports the epoch's members
as the master established them, not the table reconciled by collectives (docs/concepts.md
"No split brain").
"""

from __future__ import annotations

import pccl
from pccl import Result
from pccl.peer.state import Dismissed, Lost, PeerState
from pccl.wire import messages as m


def rows(*ids: int) -> list[m.PeerRow]:
    return [m.PeerRow(p, "10.0.0.1", 40000 + p, 0) for p in ids]


def member(peer_id: int = 2) -> PeerState:
    st = PeerState(peer_id=peer_id, group=0)
    st.handle(m.Registered(peer_id=peer_id, generation=1), now=0.0)
    st.handle(m.Accepted(peers=rows(3, 2, 1, 4, 5), epoch=5), now=0.0)
    return st


def test_a_no_quorum_refusal_is_a_broken_link_any_other_refusal_a_kick() -> None:
    st = member()
    (eff,) = st.handle(m.Refused(reason="no quorum: look for a newer master",
                                 code=int(Result.MASTER_CONNECTION_FAILED)), now=1.0)
    assert isinstance(eff, Dismissed) and isinstance(eff.error, pccl.MasterConnectionError)
    assert "look for a newer master" in eff.error.message
    assert st.link_down(1.0, 60.0)  # an accepted member with a window reconnects
    (eff,) = member().handle(m.Refused(reason="join again", code=int(Result.KICKED)), now=1.0)
    assert isinstance(eff, Lost) and isinstance(eff.error, pccl.KickedError)


def test_reregister_reports_the_epoch_s_members_not_the_reconciled_table() -> None:
    st = member()
    st.begin_sync()
    plan = m.SharedStatePlan(sync_seq=1, revision=1, fetch=[], peers=rows(3, 2, 1))  # 4 and 5 are gone
    st.handle(plan, now=1.0)
    assert [r.peer_id for r in st.table] == [3, 2, 1]
    assert st.reregister(41002).ring == [3, 2, 1, 4, 5]
    assert st.reregister(41002, epoch_members=False).ring == [3, 2, 1]  # a peer without a standby
    # a failed topology round leaves the epoch's members as they were ...
    st.handle(m.TopologyResult(success=False, epoch=6, peers=rows(3, 2, 1), reason="x", code=11), now=2.0)
    assert st.reregister(41002).ring == [3, 2, 1, 4, 5] and st.reregister(41002).epoch == 6
    # ... a successful one makes its table the new members
    st.handle(m.TopologyResult(success=True, epoch=7, peers=rows(1, 2, 3)), now=3.0)
    assert st.reregister(41002).ring == [1, 2, 3]
