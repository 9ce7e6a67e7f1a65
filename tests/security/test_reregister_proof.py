"""Issue 33 item 2: a ``Reregister`` is taken only from a member that proves it (its member token, bound
to its id and the master generation: pccl/master/tokens.py), never from a fresh hello claiming an id;
refusals name no epoch of the run.

Before, a stranger said ``Hello`` claiming an unused peer id, then ``Reregister`` with a guessed epoch; the
refusal named the run's epoch, and a second ``Reregister`` with it was answered ``Reregistered``: the
stranger was in the ring, held the epoch's P2P credentials, and every honest collective waited for its vote.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
import stat
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from pccl._errors import InvalidArgumentError, Result
from pccl.master.state import Effect, Kick, MasterState, Send
from pccl.master.token_key import default_path, load_or_create, member_tokens
from pccl.master.tokens import MemberTokens
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster
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


# --- Without a secret: the token key kept in a file (MasterConfig.token_key_file, pccl/master/token_key.py)


def _claim(st: MasterState, pid: int, ring: list[int], epoch: int, generation: int, token: bytes = b"",
           host: str = "10.9.9.9") -> list[Effect]:
    got = st.new_connection(host, 0.0, claim=pid)
    assert got == pid
    return st.handle(got, m.Reregister(peer_id=pid, p2p_port=41000 + pid, peer_group=0, epoch=epoch,
                                       ring=ring, revision=-1, generation=generation, token=token), 0.0)


def test_a_restarted_master_with_the_key_file_refuses_strangers_and_takes_every_member_back(
    tmp_path: pathlib.Path,
) -> None:
    key_file = str(tmp_path / "token.key")
    old = MasterState(tokens=member_tokens(None, key_file))
    ids, tokens = _run(old, 3)
    gen, epoch = old.generation, old.epoch
    new = MasterState(tokens=member_tokens(None, key_file))  # the restarted process: same file, same key
    new.generation = 0
    # A stranger first, before any member is back: claiming a run of its own (an unused id) changes
    # nothing, no rebuild starts.
    (kick,) = _kicks(_claim(new, 77, [77], 9, gen))
    assert kick.code == int(Result.KICKED) and "member token" in kick.reason
    assert not new.statistics()["rebuilding"] and new.accepted() == []
    # The first member back starts the rebuild.
    eff = _claim(new, ids[0], ids, epoch, gen, tokens[ids[0]], host="127.0.0.1")
    assert _effects_sends(eff, m.Reregistered) and new.statistics()["rebuilding"]
    # A stranger claiming an unused id with the run's ring, and one claiming a member's id before that
    # member is back (with no token, another member's, or random bytes): refused, nothing changes.
    for pid, forged in ((88, b""), (ids[1], b""), (ids[1], tokens[ids[0]]), (ids[2], bytes(32))):
        ring = [*ids, 88] if pid == 88 else ids
        eff = _claim(new, pid, ring, epoch, gen, forged)
        (kick,) = _kicks(eff)
        assert kick.code == int(Result.KICKED) and "member token" in kick.reason, kick
        assert not re.search(r"epoch \d", kick.reason)
        assert not _effects_sends(eff, m.Reregistered) and not _effects_sends(eff, m.P2PCredentials)
        assert new.accepted() == [ids[0]]
    # Every member is back.
    for p in ids[1:]:
        eff = _claim(new, p, ids, epoch, gen, tokens[p], host="127.0.0.1")
        assert not _kicks(eff) and [q for q, _ in _effects_sends(eff, m.Reregistered)] == [p]
    assert sorted(new.accepted()) == ids and not new.statistics()["rebuilding"]


def test_without_the_key_file_a_restarted_master_cannot_tell_a_stranger_from_a_member() -> None:
    """The gap the key file closes: a secret-less master with a key of its own process takes a
    stranger's claim on trust while it rebuilds (and a stranger first even starts the rebuild)."""
    old = MasterState()
    _run(old, 3)
    new = MasterState()
    new.generation = 0
    eff = _claim(new, 77, [77], 9, old.generation)
    assert _effects_sends(eff, m.Reregistered) and new.accepted() == [77]


def test_the_key_file_is_made_private_reread_and_checked(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "k"
    key = load_or_create(str(path))
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create(str(path)) == key  # a restart reads the same key
    t1, t2 = member_tokens(None, str(path)), member_tokens(None, str(path))
    assert t1.shared and t1.issue(3, 4) == t2.issue(3, 4)
    # a secret wins over the file
    assert member_tokens("s", str(path)).issue(3, 4) == MemberTokens.for_secret("s").issue(3, 4)
    path.chmod(0o644)
    with pytest.raises(InvalidArgumentError, match="chmod 600"):
        load_or_create(str(path))
    bad = tmp_path / "bad"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    with pytest.raises(InvalidArgumentError, match="hex digits"):
        load_or_create(str(bad))
    with pytest.raises(InvalidArgumentError, match="cannot create"):
        load_or_create(str(tmp_path / "no" / "such" / "dir"))


def test_masters_starting_at_once_read_one_whole_key(tmp_path: pathlib.Path) -> None:
    """Two masters making the key file at the same moment: neither reads a file created but not yet
    written (that would end in the warning path and a key of its own), both end with the same key."""
    import threading

    path = str(tmp_path / "k")
    start = threading.Barrier(8)
    keys: list[bytes] = []
    errors: list[BaseException] = []

    def one() -> None:
        start.wait()
        try:
            keys.append(load_or_create(path))
        except BaseException as exc:  # collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(keys) == 8 and len(set(keys)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]  # no temporary file left behind


def test_by_default_the_key_is_kept_in_a_per_user_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PCCL_STATE_DIR", str(tmp_path / "state"))
    path = default_path()
    assert path == str(tmp_path / "state" / "master-token.key")
    t1 = member_tokens(None, None)  # the directory is made (0700), the key file too (0600)
    assert t1.shared and stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert stat.S_IMODE(pathlib.Path(path).stat().st_mode) == 0o600
    assert member_tokens(None, None).issue(2, 5) == t1.issue(2, 5)  # a restart: the same key
    monkeypatch.delenv("PCCL_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_path() == str(tmp_path / "xdg" / "pccl" / "master-token.key")
    # "" asks for a key of this process only (its restart takes claims on trust while it rebuilds)
    assert not member_tokens(None, "").shared
    # A key that cannot be kept: logged, and claims it cannot verify are refused, not trusted.
    monkeypatch.setenv("PCCL_STATE_DIR", str(tmp_path / "state"))
    pathlib.Path(path).chmod(0o644)
    caplog.set_level(logging.WARNING, logger="pccl")
    fallback = member_tokens(None, None)
    assert fallback.shared and fallback.issue(2, 5) != t1.issue(2, 5)
    assert "cannot keep the member-token key" in caplog.text and "chmod 600" in caplog.text
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("PCCL_STATE_DIR", str(blocked / "sub"))  # a directory that cannot be made
    assert member_tokens(None, None).shared


@pytest.mark.parametrize("key", ["file", "default"])
async def test_a_stranger_cannot_claim_a_place_in_a_restarted_masters_rebuild(
    autojump_clock: trio.testing.MockClock, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    """End to end, no secret: the master keeps its token key in a file (given, or by default the per-user
    one) and is restarted; a stranger claims an unused id and a member's id at once; it is refused,
    every member is back, results exact."""
    if key == "file":
        master_cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, token_key_file=str(tmp_path / "token.key"))
    else:  # the default configuration: nothing about keys
        monkeypatch.setenv("PCCL_STATE_DIR", str(tmp_path / "state"))
        master_cfg = DEFAULT_MASTER_CONFIG
        assert master_cfg.token_key_file is None and master_cfg.secret is None
    peer_cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=30.0)
    async with open_test_cluster(3, network=VirtualNetwork(latency=0.0005), config=peer_cfg,
                                 master_config=master_cfg) as cluster:
        await exact_all_reduces(cluster, rounds=1)
        ring = [cluster.peer(i).peer_id for i in range(3)]
        await cluster.restart_master()
        evil = hostile(cluster)
        reasons: list[str] = []

        async def claim(pid: int, claimed_ring: list[int]) -> None:
            stream = await evil.connect(*master_port(cluster))
            ms = MessageStream(stream, max_frame_size=1 << 20)
            await offer_hello(ms, purpose="master", secret=None, peer_id=pid)
            await ms.send(m.Reregister(peer_id=pid, p2p_port=45000, peer_group=0, epoch=1, ring=claimed_ring,
                                       revision=-1, generation=1, token=bytes(32)))
            while True:
                reply = await ms.receive()
                if not isinstance(reply, m.Heartbeat):
                    break
            assert isinstance(reply, m.Refused), reply
            reasons.append(reply.reason)
            await ms.aclose()

        async with trio.open_nursery() as nursery:  # at once, racing the members' returns
            nursery.start_soon(claim, 99, [*ring, 99])
            nursery.start_soon(claim, 98, [98])
        state = cluster.master.state
        with trio.fail_after(10):
            while not (sorted(state.accepted()) == ring and not cluster.master.statistics()["held"]):
                await trio.sleep(0.001)
        assert len(reasons) == 2 and all("member token" in r for r in reasons), reasons
        assert 98 not in state.peers and 99 not in state.peers
        await exact_all_reduces(cluster, rounds=2, tag=10)
