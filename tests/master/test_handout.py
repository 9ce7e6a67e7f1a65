"""The credential handout alone (pccl/master/handout.py): who gets which set, and the owed rows."""

from __future__ import annotations

from collections.abc import Sequence

from pccl.master.effects import Send
from pccl.master.handout import CredentialHandout
from pccl.master.issued import IssuedSet
from pccl.master.membership import Membership, Phase
from pccl.wire import messages as m
from pccl.wire.credentials import CredentialIssuer
from pccl.wire.keys import KeyPair


def _handout(n: int, delay: float = 0.0) -> CredentialHandout:
    ms = Membership()
    for _ in range(n):
        pid = ms.new_connection("127.0.0.1", 0.0)
        rec = ms.peers[pid]
        rec.phase = Phase.ACCEPTED
        rec.public_key = KeyPair.from_private_bytes(pid.to_bytes(32, "big")).public
    ms.ring = list(ms.peers)
    return CredentialHandout(IssuedSet(CredentialIssuer(bytes(32)), delay=delay), ms)


def _sent(effects: Sequence[object]) -> dict[int, m.P2PCredentials]:
    out: dict[int, m.P2PCredentials] = {}
    for e in effects:
        assert isinstance(e, Send) and isinstance(e.message, m.P2PCredentials)
        out[e.peer_id] = e.message
    return out


def test_reissue_sends_one_set_to_every_member() -> None:
    h = _handout(3)
    sent = _sent(h.reissue(2, 5))
    assert list(sent) == [1, 2, 3]
    msg = sent[1]
    assert all(v is msg for v in sent.values())  # one object: encoded once
    assert (msg.generation, msg.epoch) == (2, 5) and [r.peer_id for r in msg.keys] == [1, 2, 3]


def test_a_return_under_another_serial_reissues() -> None:
    h = _handout(2)
    h.reissue(1, 1)
    assert list(_sent(h.on_return(2, 1, 2, 0.0))) == [1, 2]  # the epoch moved: everyone a new set


def test_a_return_gets_the_table_and_the_holders_its_row() -> None:
    h = _handout(2)
    h.reissue(1, 1)
    late = h.members.new_connection("127.0.0.1", 0.0)
    h.members.peers[late].phase = Phase.ACCEPTED
    h.members.peers[late].public_key = KeyPair.from_private_bytes(late.to_bytes(32, "big")).public
    h.members.ring = [*h.members.ring, late]
    effects = h.on_return(late, 1, 1, 0.0)
    assert isinstance(effects[0], Send) and effects[0].peer_id == late
    mine = effects[0].message
    assert isinstance(mine, m.P2PCredentials) and sorted(r.peer_id for r in mine.keys) == [1, 2, late]
    rows = _sent(effects[1:])
    assert sorted(rows) == [1, 2] and [r.peer_id for r in rows[1].keys] == [late]
    assert h.deadline() is None and h.pay() == []


def test_rows_wait_for_the_delay_and_for_the_hold() -> None:
    h = _handout(2, delay=0.5)
    h.reissue(1, 1)
    late = h.members.new_connection("127.0.0.1", 0.0)
    h.members.peers[late].phase = Phase.ACCEPTED
    h.members.ring = [*h.members.ring, late]
    assert len(h.on_return(late, 1, 1, 10.0)) == 1  # its table only: the holders' row is batched
    assert h.deadline() == 10.5
    assert h.overdue(10.4) == [] and h.due(resumed=False) == []
    assert sorted(_sent(h.due(resumed=True))) == [1, 2]
    assert h.deadline() is None and h.overdue(11.0) == []
