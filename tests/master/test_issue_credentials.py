"""The master issues P2P credentials (issue 17 item 1; protocol 5, issue 21 item 4), message by message: one
set per epoch, the same message for every member of a topology round, before its EstablishP2P, fresh per
epoch, and again after a re-registration (issue 18's rebuild included, where the rows of members coming
back reach the members back before them), always consistent between the two ends of every pair."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from pccl import Result
from pccl.master.issued import IssuedSet
from pccl.master.state import Kick, MasterState
from pccl.wire import messages as m
from pccl.wire.credentials import CredentialIssuer, CredentialSet
from pccl.wire.keys import KeyPair

from ._effects import member_reregister, sends

CHANNELS = ("ring", "state", "bench")
KEYS: dict[int, KeyPair] = {}  # peer id -> its key pair (one per member process)


def key(pid: int) -> bytes:
    if pid not in KEYS:
        KEYS[pid] = KeyPair.from_private_bytes(pid.to_bytes(32, "big"))
    return KEYS[pid].public


def join(st: MasterState) -> tuple[int, list[Any]]:
    pid = st.new_connection("127.0.0.1", 0.0)
    return pid, st.handle(pid, m.Register(p2p_port=40000 + pid, public_key=key(pid)), 0.0)


def vote(st: MasterState, voters: list[int]) -> list[Any]:
    eff: list[Any] = []
    for p in voters:
        eff += st.handle(p, m.UpdateTopologyVote(), 0.0)
    return eff


def confirm(st: MasterState, eff: list[Any]) -> list[Any]:
    out: list[Any] = []
    for pid, msg in sends(eff, m.EstablishP2P):
        out += st.handle(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True), 0.0)
    return out


def held(eff: list[Any], before: dict[int, CredentialSet] | None = None) -> dict[int, CredentialSet]:
    """What each receiver holds after ``eff`` (installing each message as a peer's store does)."""
    got = dict(before or {})
    for p, msg in sends(eff, m.P2PCredentials):
        cur = got.get(p)
        got[p] = cur.merged(msg) if cur is not None and (msg.generation, msg.epoch) >= cur.serial else \
            CredentialSet.from_message(msg, me=p, keys=KEYS[p])
    return got


def assert_pairs_agree(got: dict[int, CredentialSet], members: list[int]) -> None:
    for i, j in itertools.permutations(members, 2):
        for ch in CHANNELS:
            dial = got[i].for_dial(j, ch)
            assert dial is not None, (i, j)
            assert dial.key == got[j].for_accept(i, ch), (i, j, ch)


def world(n: int) -> tuple[MasterState, list[int]]:
    st = MasterState()
    ids = [join(st)[0] for _ in range(n)]
    confirm(st, vote(st, ids[:1]))
    assert st.accepted() == ids
    return st, ids


def test_a_lone_first_peer_gets_no_credentials() -> None:
    st = MasterState()
    _, eff = join(st)
    assert sends(eff, m.Accepted) and not sends(eff, m.P2PCredentials)


def test_every_member_gets_the_same_set_before_its_establish_and_every_pair_agrees() -> None:
    st = MasterState()
    first, _ = join(st)
    a, b = join(st)[0], join(st)[0]
    eff = vote(st, [first])
    order = [(p, type(msg)) for p, msg in sends(eff)]
    for p in (first, a, b):
        mine = [t for q, t in order if q == p]
        assert mine == [m.P2PCredentials, m.EstablishP2P], mine  # the credentials first
    msgs = [msg for _, msg in sends(eff, m.P2PCredentials)]
    # O(n): one message object (encoded once) with one row per member, for every member.
    assert all(msg is msgs[0] for msg in msgs)
    assert [(r.peer_id, r.public_key) for r in msgs[0].keys] == [(p, key(p)) for p in (first, a, b)]
    got = held(eff)
    est = sends(eff, m.EstablishP2P)[0][1]
    assert all(s.epoch == est.epoch and s.generation == st.generation for s in got.values())
    assert_pairs_agree(got, [first, a, b])


def test_one_round_at_many_peers_sends_n_rows_not_n_squared() -> None:
    st, ids = world(2)
    newcomers = [join(st)[0] for _ in range(62)]
    eff = vote(st, ids)
    distinct = {id(msg): msg for _, msg in sends(eff, m.P2PCredentials)}
    assert len(sends(eff, m.P2PCredentials)) == 64
    assert sum(len(msg.keys) for msg in distinct.values()) == 64
    assert_pairs_agree(held(eff), [ids[0], newcomers[0], newcomers[-1]])


def test_a_round_sends_one_object_of_each_answer_so_that_each_is_encoded_once() -> None:
    st, ids = world(2)
    newcomers = [join(st)[0] for _ in range(3)]
    eff = vote(st, ids)
    cls: type[m.Message]
    for cls in (m.P2PCredentials, m.EstablishP2P):
        objs = {id(msg) for _, msg in sends(eff, cls)}
        assert len(objs) == 1 and cls.SHARED, cls  # one group: one object for its 5 members
    done = confirm(st, eff)
    for cls, who in ((m.Accepted, newcomers), (m.TopologyResult, ids)):
        got = sends(done, cls)
        assert [p for p, _ in got] == who and len({id(msg) for _, msg in got}) == 1 and cls.SHARED, cls


def test_each_epoch_has_fresh_credentials() -> None:
    st, ids = world(3)
    new, _ = join(st)
    first = held(vote(st, ids))
    # A failed round, then the retry: a new epoch each time, new keys each time.
    failed = m.P2PConnectionsDone(epoch=first[ids[0]].epoch, success=False, failed_peers=[new])
    eff = st.handle(ids[0], failed, 0.0)
    assert sends(eff, m.TopologyResult)
    second = held(vote(st, ids))
    assert second[ids[0]].epoch == first[ids[0]].epoch + 1
    assert second[ids[0]].binding != first[ids[0]].binding
    assert_pairs_agree(second, [*ids, new])
    for i, j in itertools.permutations([*ids, new], 2):
        old, cur = first[i].for_dial(j, "ring"), second[i].for_dial(j, "ring")
        assert old is not None and cur is not None and old.key != cur.key


def test_two_masters_issue_different_credentials_for_the_same_epoch() -> None:
    rounds = []
    for _ in range(2):
        st, ids = world(2)
        join(st)
        rounds.append(held(vote(st, ids)))
    a, b = rounds
    assert sorted(a) == sorted(b) and all(a[p].serial == b[p].serial for p in a)
    for i, j in itertools.permutations(sorted(a), 2):
        assert a[i].for_dial(j, "ring") != b[i].for_dial(j, "ring")


def test_a_register_with_a_malformed_public_key_is_kicked_with_the_reason() -> None:
    st = MasterState()
    pid = st.new_connection("127.0.0.1", 0.0)
    eff = st.handle(pid, m.Register(p2p_port=40001, public_key=b"k" * 31), 0.0)
    (kick,) = [e for e in eff if isinstance(e, Kick)]
    assert kick.peer_id == pid and kick.code == int(Result.INVALID_USAGE)
    assert "public key has 31 bytes" in kick.reason and pid not in st.peers


def test_a_dropped_member_taken_back_gets_the_credentials_of_the_current_epoch() -> None:
    st, ids = world(3)
    eff = vote(st, ids)  # re-establish (no newcomers): everyone holds this epoch's set
    before = held(eff)
    confirm(st, eff)
    epoch = st.epoch
    assert all(s.epoch == epoch for s in before.values())
    st.peer_lost(ids[1], "connection lost")
    got = st.new_connection("127.0.0.1", 0.0, claim=ids[1])
    eff = st.handle(got, member_reregister(st,
        peer_id=ids[1], p2p_port=40000 + ids[1], peer_group=0, epoch=epoch,
                                      ring=list(ids), revision=-1, generation=st.generation,
                                      public_key=key(ids[1])), 0.0)
    kinds = [type(msg) for _, msg in sends(eff)]
    assert kinds.index(m.Reregistered) < kinds.index(m.P2PCredentials)  # the peer reads Reregistered itself
    assert [p for p, _ in sends(eff, m.P2PCredentials)] == [ids[1]]  # the others' sets are unchanged
    again = held(eff)[ids[1]]
    assert again == before[ids[1]]  # derived, not drawn: the same set as the others still hold
    assert_pairs_agree({**before, ids[1]: again}, ids)


def rereg(st: MasterState, pid: int, ring: list[int], epoch: int) -> list[Any]:
    got = st.new_connection("127.0.0.1", 0.0, claim=pid)
    msg = member_reregister(st,
        peer_id=pid, p2p_port=40000 + pid, peer_group=0, epoch=epoch, ring=ring, revision=-1,
                       generation=1, public_key=key(pid))
    return st.handle(got, msg, 0.0)


def test_a_rebuilt_master_sends_each_member_back_the_rows_of_those_back_after_it() -> None:
    st = MasterState()  # a restarted master: empty
    ring = [3, 1, 2]
    first = held(rereg(st, 3, ring, epoch=7))
    assert first[3].generation == 2 and first[3].epoch == 7
    assert sorted(first[3].table) == [3]  # the others are not back yet: their keys are not known
    eff = rereg(st, 1, ring, epoch=7)
    rows = {p: msg for p, msg in sends(eff, m.P2PCredentials)}
    assert sorted(rows) == [1, 3]
    assert [r.peer_id for r in rows[3].keys] == [1]  # to the one back before: only the new row
    both = held(eff, first)
    assert_pairs_agree(both, [3, 1])
    third = held(rereg(st, 2, ring, epoch=7), both)
    assert_pairs_agree(third, ring)


def test_a_rebuild_that_moves_to_a_newer_epoch_reissues_to_the_members_already_back() -> None:
    st = MasterState()
    got = held(rereg(st, 3, [3, 1], epoch=7))
    eff = rereg(st, 2, [3, 2, 1], epoch=8)  # a member that saw a later epoch
    got = held(eff, got)
    assert sorted(p for p, _ in sends(eff, m.P2PCredentials)) == [2, 3]
    assert sorted(got) == [2, 3] and all(s.epoch == 8 for s in got.values())
    rest = held(rereg(st, 1, [3, 2, 1], epoch=8), got)
    assert_pairs_agree(rest, [3, 2, 1])


def rereg_at(st: MasterState, pid: int, ring: list[int], now: float) -> list[Any]:
    got = st.new_connection("127.0.0.1", now, claim=pid)
    msg = member_reregister(st,
        peer_id=pid, p2p_port=40000 + pid, peer_group=0, epoch=7, ring=ring, revision=-1,
                       generation=1, public_key=key(pid))
    return st.handle(got, msg, now)


def test_with_a_delay_the_rows_of_members_back_go_to_the_holders_in_one_batch() -> None:
    # As the server runs it: the rows are batched while the roll call holds the votes (rebuild_grace).
    st = MasterState(credentials_delay=0.01, rebuild_grace=1.0)
    ring = [4, 1, 2, 3]
    got = held(rereg_at(st, 4, ring, 0.0))
    assert st.credentials_deadline() is None  # the first one back starts the set: nobody lacks a row
    for i, pid in enumerate([1, 2], start=1):
        eff = rereg_at(st, pid, ring, 0.001 * i)
        # Each one back gets the whole table at once; nobody else hears of it yet.
        assert [p for p, _ in sends(eff, m.P2PCredentials)] == [pid]
        got = held(eff, got)
        assert sorted(got[pid].table) == sorted(ring[:i + 1])
    assert st.statistics()["held"]  # 3 is not back: the roll call waits for it
    assert st.credentials_deadline() == 0.011  # the first owed row's time + the delay
    assert st.credentials_overdue(0.0105) == []  # not due yet
    eff = st.credentials_overdue(0.011)
    rows = dict(sends(eff, m.P2PCredentials))
    # One message for every holder but the one back last (its table had them all), all the rows in it.
    assert sorted(rows) == [1, 4]
    assert len({id(msg) for msg in rows.values()}) == 1  # one object: encoded once
    assert sorted(r.peer_id for r in rows[4].keys) == [1, 2]
    got = held(eff, got)
    assert st.credentials_deadline() is None and st.credentials_overdue(1.0) == []
    # The last one back ends the roll call: its row goes out before the votes resume, in the same step.
    eff = rereg_at(st, 3, ring, 0.02)
    assert not st.statistics()["held"]
    rows = dict(sends(eff, m.P2PCredentials))
    assert sorted(rows) == [1, 2, 3, 4] and [r.peer_id for r in rows[4].keys] == [3]
    assert_pairs_agree(held(eff, got), ring)
    assert st.credentials_deadline() is None


def test_a_return_at_a_master_that_is_not_held_goes_to_the_holders_at_once() -> None:
    st = MasterState(credentials_delay=0.01, rebuild_grace=1.0)
    ring = [3, 1, 2, 4]
    for i, pid in enumerate(ring[:3]):
        rereg_at(st, pid, ring, 0.001 * i)
    st.doubts_overdue(1.5, 3.0)  # the roll call's grace ran out without 4: the votes resume
    assert not st.statistics()["held"] and st.credentials_deadline() is None  # the batch went out
    eff = rereg_at(st, 4, ring, 1.6)  # 4 comes back late, nothing moved on: taken back
    assert sends(eff, m.Reregistered)
    assert sorted(p for p, _ in sends(eff, m.P2PCredentials)) == [1, 2, 3, 4]  # its table; its row, now
    assert st.credentials_deadline() is None


def test_batched_rows_are_void_once_a_new_set_goes_to_everyone() -> None:
    st = MasterState(credentials_delay=0.01)
    ring = [3, 1, 2, 4, 5]  # a quorum is 3: the rebuild still runs when 2 comes
    got = held(rereg_at(st, 3, ring, 0.0))
    got = held(rereg_at(st, 1, ring, 0.001), got)
    assert st.credentials_deadline() is not None
    # A member that saw a later epoch: the rebuild moves there and everyone back gets a new set.
    late = st.new_connection("127.0.0.1", 0.002, claim=2)
    eff = st.handle(late, member_reregister(st, peer_id=2, p2p_port=40002, peer_group=0, epoch=8, ring=ring,
                                       revision=-1, generation=1, public_key=key(2)), 0.002)
    assert sorted(p for p, _ in sends(eff, m.P2PCredentials)) == [1, 2, 3]
    assert st.credentials_deadline() is None  # nothing owed under the new set
    assert_pairs_agree(held(eff, got), [3, 1, 2])


def test_without_a_delay_the_holders_hear_of_each_return_at_once() -> None:
    st = MasterState()  # credentials_delay 0 (the pure core's default)
    rereg_at(st, 3, [3, 1, 2], 0.0)
    eff = rereg_at(st, 1, [3, 1, 2], 0.0)
    assert sorted(p for p, _ in sends(eff, m.P2PCredentials)) == [1, 3]
    assert st.credentials_deadline() is None


def test_a_holder_that_left_is_not_sent_the_batch() -> None:
    st = MasterState(credentials_delay=0.01, rebuild_grace=1.0)
    ring = [3, 1, 2, 4]  # 4 does not come back (yet): the roll call holds the votes
    rereg_at(st, 3, ring, 0.0)
    rereg_at(st, 1, ring, 0.001)
    rereg_at(st, 2, ring, 0.002)
    st.peer_lost(3, "left", 0.003)
    rows = dict(sends(st.credentials_overdue(0.02), m.P2PCredentials))
    assert sorted(rows) == [1]  # 3 is gone; 2 came back last and holds every row
    assert sorted(r.peer_id for r in rows[1].keys) == [1, 2]


def test_a_negative_batch_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="batch delay"):
        IssuedSet(CredentialIssuer(b"r" * 32), delay=-0.1)
