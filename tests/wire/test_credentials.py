"""P2P credentials (issue 17 item 1), the pure part: derivation, the sets the master issues, the listener's
decision on a Hello, and the handshake keyed with a credential."""

from __future__ import annotations

import itertools

import msgpack
import pytest

from pccl import PROTOCOL_VERSION, Result
from pccl._errors import RemoteProtocolError
from pccl.wire import credentials as c
from pccl.wire import messages as m
from pccl.wire.hello import (
    HelloProblem,
    HelloRefusal,
    answer,
    challenge,
    check_challenge,
    check_hello,
    check_proof,
)

ROOT = b"r" * 32
MEMBERS = [4, 1, 7, 2]
CHANNELS = ("ring", "state", "bench")
NC, NS = b"c" * 16, b"s" * 16


def sets(root: bytes = ROOT, generation: int = 1, epoch: int = 5) -> dict[int, c.CredentialSet]:
    issuer = c.CredentialIssuer(root)
    return {p: c.CredentialSet.from_message(issuer.issue(p, MEMBERS, generation=generation, epoch=epoch))
            for p in MEMBERS}


def hello(peer_id: int = 1, channel: str = "ring", generation: int = 1, epoch: int = 5) -> m.Hello:
    return m.Hello(protocol_version=PROTOCOL_VERSION, purpose="p2p", peer_id=peer_id, channel=channel,
                   nonce=NC, generation=generation, epoch=epoch)


def test_every_member_can_dial_every_other_on_every_channel_and_the_listener_derives_the_same() -> None:
    got = sets()
    for i, j in itertools.permutations(MEMBERS, 2):
        for ch in CHANNELS:
            dial = got[i].for_dial(j, ch)
            assert dial is not None and (dial.generation, dial.epoch) == (1, 5)
            assert dial.key == got[j].for_accept(i, ch)


def test_a_credential_names_one_pair_one_channel_one_epoch_of_one_master() -> None:
    got = sets()
    key = got[1].for_dial(4, "ring")
    assert key is not None
    others = [
        got[4].for_accept(7, "ring"),  # another claimed sender
        got[4].for_accept(1, "state"),  # another channel
        got[7].for_accept(1, "ring"),  # another listener
        sets(epoch=6)[4].for_accept(1, "ring"),  # another epoch
        sets(generation=2)[4].for_accept(1, "ring"),  # another generation
        sets(root=b"x" * 32)[4].for_accept(1, "ring"),  # another master
    ]
    assert key.key not in others and len(set(others)) == len(others)


def test_a_set_holds_no_other_members_listen_key_and_no_dial_key_of_anyone_else() -> None:
    issuer = c.CredentialIssuer(ROOT)
    msgs = {p: issuer.issue(p, MEMBERS, generation=1, epoch=5) for p in MEMBERS}
    for p, msg in msgs.items():
        assert msg.peer_id == p
        assert sorted(r.peer_id for r in msg.dial) == sorted(q for q in MEMBERS if q != p)
        secrets_in_it = {msg.key, *(r.key for r in msg.dial)}
        for q, other in msgs.items():
            if q != p:
                assert other.key not in secrets_in_it  # another member's listen key
                assert not ({r.key for r in other.dial} & secrets_in_it)  # another member's dial keys
    shown = repr(c.CredentialSet.from_message(msgs[1]))
    assert all(repr(k) not in shown and k.hex() not in shown for k in (msgs[1].key, msgs[1].dial[0].key))


def test_no_credential_for_a_peer_outside_the_set() -> None:
    assert sets()[1].for_dial(99, "ring") is None


def test_the_issuer_wants_a_real_root() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        c.CredentialIssuer(b"short")


def test_judge_refuses_no_or_stale_credentials_and_waits_for_a_newer_set() -> None:
    cur = sets()[4]
    none = c.judge(cur, hello(epoch=-1))
    assert isinstance(none, HelloRefusal) and none.problem is HelloProblem.CREDENTIAL
    assert none.result is Result.INVALID_USAGE and "no P2P credential" in none.reason
    stale = c.judge(cur, hello(epoch=4))
    assert isinstance(stale, HelloRefusal) and "stale P2P credential" in stale.reason
    assert "this peer is at epoch 5" in stale.reason
    older_master = c.judge(cur, hello(generation=0, epoch=9))
    assert isinstance(older_master, HelloRefusal) and "stale" in older_master.reason
    assert c.judge(cur, hello(epoch=6)) is c.WAIT
    assert c.judge(cur, hello(generation=2, epoch=1)) is c.WAIT
    assert c.judge(None, hello()) is c.WAIT
    assert c.judge(cur, hello(peer_id=1, channel="state")) == cur.for_accept(1, "state")
    late = c.not_issued(hello(epoch=6), 2.5)
    assert late.problem is HelloProblem.CREDENTIAL and "within 2.5s" in late.reason


@pytest.mark.parametrize("secret", ["", "s3cret"])
def test_the_handshake_keyed_with_a_credential_needs_both_the_secret_and_the_credential(secret: str) -> None:
    got = sets()
    h = hello(peer_id=1)
    cred = got[4].for_accept(1, "ring")
    dial = got[1].for_dial(4, "ring")
    assert dial is not None and dial.key == cred
    ch = challenge(h, secret=secret, server_nonce=NS, credential=cred)
    assert check_challenge(ch, h, secret=secret, credential=dial.key) is None
    proof = answer(ch, h, secret=secret, credential=dial.key)
    assert check_proof(proof, h, secret=secret, server_nonce=NS, credential=cred) is None
    # Without the credential (the secret alone, as before protocol 4): refused, with the reason.
    bare = answer(challenge(h, secret=secret, server_nonce=NS), h, secret=secret)
    refusal = check_proof(bare, h, secret=secret, server_nonce=NS, credential=cred)
    assert refusal is not None and refusal.result is Result.INVALID_USAGE
    assert ("bad secret or credential" if secret else "bad credential") in refusal.reason
    assert "peer 1" in refusal.reason and "'ring'" in refusal.reason
    # Another member's credential for the same listener does not pass for peer 1's.
    other = got[7].for_dial(4, "ring")
    assert other is not None
    assert check_proof(answer(ch, h, secret=secret, credential=other.key), h, secret=secret, server_nonce=NS,
                       credential=cred) is not None
    # The credential without the secret (where there is one): refused too.
    if secret:
        wrong = answer(ch, h, secret="", credential=dial.key)
        assert check_proof(wrong, h, secret=secret, server_nonce=NS, credential=cred) is not None
    # The dialer refuses a listener that cannot prove the credential (another listener, or a fake one).
    fake = challenge(h, secret=secret, server_nonce=NS, credential=got[7].for_accept(1, "ring"))
    problem = check_challenge(fake, h, secret=secret, credential=dial.key)
    assert problem is not None and "bad secret or credential" in problem


def test_a_hello_of_another_version_is_decoded_so_that_the_version_is_what_is_refused() -> None:
    # A protocol-2 or -3 Hello had six fields; protocol 4 added generation and epoch.
    old = m.encode(m.Hello(protocol_version=2, purpose="p2p", channel="ring", nonce=NC))
    tag, values = msgpack.unpackb(old)
    short = msgpack.packb([tag, values[:6]], use_bin_type=True)
    decoded = m.decode(short)
    assert isinstance(decoded, m.Hello) and decoded.epoch == -1 and decoded.generation == 0
    refusal = check_hello(decoded, purpose="p2p")
    assert refusal is not None and refusal.problem is HelloProblem.VERSION and "version 2" in refusal.reason
    longer = msgpack.packb([tag, [*values, "a field of a later version"]], use_bin_type=True)
    assert m.decode(longer) == m.Hello(protocol_version=2, purpose="p2p", channel="ring", nonce=NC)
    with pytest.raises(RemoteProtocolError, match="expected 8 fields, got 1"):
        m.decode(msgpack.packb([tag, [3]], use_bin_type=True))
    # Every other message keeps the exact field count.
    proof = msgpack.unpackb(m.encode(m.Proof(proof=b"p")))
    with pytest.raises(RemoteProtocolError, match="expected 1 fields, got 2"):
        m.decode(msgpack.packb([proof[0], [b"p", 1]], use_bin_type=True))
