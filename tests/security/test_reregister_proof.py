"""Issue 33 item 2: a ``Reregister`` is taken only from a member that proves it (its member token, bound
to its id and the master generation: pccl/master/tokens.py), never from a fresh hello claiming an id;
refusals name no epoch of the run.

Before, a stranger said ``Hello`` claiming an unused peer id, then ``Reregister`` with a guessed epoch; the
refusal named the run's epoch, and a second ``Reregister`` with it was answered ``Reregistered``: the
stranger was in the ring, held the epoch's P2P credentials, and every honest collective waited for its vote.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import trio
import trio.testing

from pccl._errors import Result
from pccl.master.state import Effect, Kick, MasterState, Send
from pccl.master.tokens import MemberTokens
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.wire import messages as m
from pccl.wire.handshake import offer_hello
from pccl.wire.stream import MessageStream

from ._helpers import exact_all_reduces, hostile, master_port


def _effects_sends(effects: Sequence[Effect], cls: type) -> list[tuple[int, m.Message]]:
    return [(e.peer_id, e.message) for e in effects if isinstance(e, Send) and isinstance(e.message, cls)]


def _kicks(effects: Sequence[Effect]) -> list[Kick]:
    return [e for e in effects if isinstance(e, Kick)]


def _run(st: MasterState, n: int) -> tuple[list[int], dict[int, bytes]]:
    """``n`` newcomers registered and admitted by a topology round; their ids and member tokens."""
    ids, tokens = [], {}
    for _ in range(n):
        pid = st.new_connection("127.0.0.1", 0.0)
        for pid_, msg in _effects_sends(st.handle(pid, m.Register(p2p_port=40000 + pid), 0.0), m.Registered):
            assert isinstance(msg, m.Registered) and pid_ == pid
            tokens[pid] = msg.token
        ids.append(pid)
    eff: list[Effect] = []
    for p in st.accepted():
        eff += st.handle(p, m.UpdateTopologyVote(), 0.0)
    for pid, msg in _effects_sends(eff, m.EstablishP2P):
        assert isinstance(msg, m.EstablishP2P)
        st.handle(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True), 0.0)
    assert sorted(st.accepted()) == ids
    return ids, tokens


def _rereg(st: MasterState, pid: int, ring: list[int], epoch: int, token: bytes = b"") -> list[Effect]:
    got = st.new_connection("10.9.9.9", 0.0, claim=pid)
    assert got == pid
    return st.handle(got, m.Reregister(peer_id=pid, p2p_port=41000, peer_group=0, epoch=epoch, ring=ring,
                                       revision=-1, generation=st.generation, token=token), 0.0)


def test_a_stranger_claiming_a_dropped_members_id_is_refused_whatever_the_epoch() -> None:
    st = MasterState()
    ids, tokens = _run(st, 3)
    st.peer_lost(ids[2], "left (connection closed)", 0.0, broken=True)
    for guess in range(st.epoch + 3):
        eff = _rereg(st, ids[2], ids, guess)
        (kick,) = _kicks(eff)
        # (retryable: without a shared secret this master cannot tell another master's member from a
        # stranger, and a standby may hold that member's run)
        assert kick.code == int(Result.MASTER_CONNECTION_FAILED)
        assert "member token" in kick.reason
        assert not re.search(r"epoch \d", kick.reason)
        assert not _effects_sends(eff, m.Reregistered) and not _effects_sends(eff, m.P2PCredentials)
        assert st.accepted() == ids[:2]
    # A forged token (another member's, or random bytes) proves nothing either.
    for forged in (tokens[ids[0]], bytes(32)):
        (kick,) = _kicks(_rereg(st, ids[2], ids, st.epoch, forged))
        assert "member token" in kick.reason
    # The member itself, with its token, is taken back in its old place.
    eff = _rereg(st, ids[2], ids, st.epoch, tokens[ids[2]])
    assert not _kicks(eff) and [p for p, _ in _effects_sends(eff, m.Reregistered)] == [ids[2]]
    assert sorted(st.accepted()) == ids


def test_refusals_of_an_epoch_name_no_epoch() -> None:
    """A genuine member with a wrong epoch is refused without the run's epoch in the reason."""
    st = MasterState()
    ids, tokens = _run(st, 3)
    st.peer_lost(ids[2], "left (connection closed)", 0.0, broken=True)
    (kick,) = _kicks(_rereg(st, ids[2], ids, st.epoch + 5, tokens[ids[2]]))
    assert "join again" in kick.reason and not re.search(r"epoch \d", kick.reason)


def test_with_a_secret_a_restarted_master_verifies_the_old_masters_tokens() -> None:
    """The tokens of a master with a shared secret are verifiable at any master with that secret: a
    restarted one takes the genuine members back and refuses a stranger's claim even while rebuilding."""
    old = MasterState(tokens=MemberTokens.for_secret("s3cret"))
    ids, tokens = _run(old, 3)
    new = MasterState(tokens=MemberTokens.for_secret("s3cret"))
    new.generation = 0  # a fresh process
    eff = new.handle(new.new_connection("127.0.0.1", 0.0, claim=ids[0]), m.Reregister(
        peer_id=ids[0], p2p_port=41000, peer_group=0, epoch=old.epoch, ring=ids, revision=-1,
        generation=old.generation, token=tokens[ids[0]]), 0.0)
    assert _effects_sends(eff, m.Reregistered) and new.statistics()["rebuilding"]
    stranger = new.new_connection("10.9.9.9", 0.0, claim=ids[1])
    eff = new.handle(stranger, m.Reregister(peer_id=ids[1], p2p_port=41001, peer_group=0, epoch=old.epoch,
                                            ring=ids, revision=-1, generation=old.generation,
                                            token=tokens[ids[0]]), 0.0)
    (kick,) = _kicks(eff)
    assert kick.code == int(Result.KICKED) and "member token" in kick.reason
    assert not _effects_sends(eff, m.Reregistered) and new.accepted() == [ids[0]]
    # Another secret derives other tokens: a master of another run verifies none of them.
    other = MasterState(tokens=MemberTokens.for_secret("other"))
    eff = other.handle(other.new_connection("127.0.0.1", 0.0, claim=ids[0]), m.Reregister(
        peer_id=ids[0], p2p_port=41000, peer_group=0, epoch=old.epoch, ring=ids, revision=-1,
        generation=old.generation, token=tokens[ids[0]]), 0.0)
    assert _kicks(eff) and not _effects_sends(eff, m.Reregistered)


async def test_a_hostile_client_cannot_reregister_into_a_running_cluster(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """The attack of the issue, end to end: a stranger's hello claims a dropped member's id and
    re-registers with every epoch it can guess; every attempt is refused without naming the epoch,
    and the honest members' all-reduces stay exact (no vote waits on the stranger)."""
    master_cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG)
    cluster = await pccl_cluster(3, master_config=master_cfg, config=DEFAULT_PEER_CONFIG)
    await exact_all_reduces(cluster, rounds=1)
    ring = [cluster.peer(i).peer_id for i in range(3)]
    victim = ring[2]
    cluster.kill(2)
    state = cluster.master.state
    while victim in state.peers:
        await trio.sleep(0.01)
    evil = hostile(cluster)
    reasons = []
    for guess in range(state.epoch + 3):
        stream = await evil.connect(*master_port(cluster))
        ms = MessageStream(stream, max_frame_size=1 << 20)
        ok = await offer_hello(ms, purpose="master", secret=None, peer_id=victim)
        assert ok.peer_id == victim  # the claim itself is granted (the id is free) ...
        await ms.send(m.Reregister(peer_id=victim, p2p_port=45000, peer_group=0, epoch=guess, ring=ring,
                                   revision=-1, generation=state.generation))
        while True:
            reply = await ms.receive()
            if not isinstance(reply, m.Heartbeat):
                break
        assert isinstance(reply, m.Refused), reply  # ... the re-registration is not
        reasons.append(reply.reason)
        await ms.aclose()
    assert all("member token" in r and not re.search(r"epoch \d", r) for r in reasons), reasons
    assert sorted(state.accepted()) == ring[:2]
    await exact_all_reduces(cluster, rounds=2, tag=10)


def test_member_tokens_are_the_documented_prf_bound_to_key_generation_and_id() -> None:
    from pccl.master.tokens import _prf

    t = MemberTokens(b"k" * 32)
    assert t.issue(5, 7) == _prf(b"k" * 32, b"member", (5).to_bytes(8, "big"), (7).to_bytes(8, "big"))
    assert len({t.issue(5, 7), t.issue(6, 7), t.issue(5, 8), MemberTokens(b"j" * 32).issue(5, 7)}) == 4
    assert t.valid(5, 7, t.issue(5, 7)) and not t.valid(5, 7, t.issue(5, 8))
    assert MemberTokens.for_secret("s").issue(1, 2) == MemberTokens.for_secret("s").issue(1, 2)
    assert MemberTokens.for_secret(None).issue(1, 2) != MemberTokens.for_secret(None).issue(1, 2)
