"""P2P credentials (issue 17 item 1; protocol 5: X25519 keys, one public table per epoch, issue 21 item 4),
the pure part: derivation, the set the master issues, the listener's decision on a Hello, and the
handshake keyed with a credential."""

from __future__ import annotations

import dataclasses
import itertools

import msgpack
import pytest
import trio
import trio.testing

from pccl import PROTOCOL_VERSION, Result
from pccl._errors import RemoteProtocolError
from pccl.testing import VirtualNetwork, open_stream_pair
from pccl.transport import Stream
from pccl.wire import credentials as c
from pccl.wire import messages as m
from pccl.wire import stream as stream_mod
from pccl.wire.hello import (
    HelloProblem,
    HelloRefusal,
    answer,
    challenge,
    check_challenge,
    check_hello,
    check_proof,
)
from pccl.wire.keys import KeyPair
from pccl.wire.limits import PUBLIC_KEY_MAX, master_inbound

ROOT = b"r" * 32
MEMBERS = [4, 1, 7, 2]
CHANNELS = ("ring", "state", "bench")
NC, NS = b"c" * 16, b"s" * 16
# One fixed X25519 key pair per member (deterministic tests); a peer draws a fresh one per process.
KEYS = {p: KeyPair.from_private_bytes(bytes([p]) * 32) for p in [*MEMBERS, 9]}


def message(root: bytes = ROOT, generation: int = 1, epoch: int = 5, members: list[int] = MEMBERS,
            keys: dict[int, KeyPair] = KEYS) -> m.P2PCredentials:
    return c.CredentialIssuer(root).table([(p, keys[p].public) for p in members], generation=generation,
                                          epoch=epoch)


def sets(root: bytes = ROOT, generation: int = 1, epoch: int = 5) -> dict[int, c.CredentialSet]:
    msg = message(root, generation, epoch)
    return {p: c.CredentialSet.from_message(msg, me=p, keys=KEYS[p]) for p in MEMBERS}


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


def test_a_credential_names_one_pair_one_direction_one_channel_one_epoch_of_one_master() -> None:
    got = sets()
    key = got[1].for_dial(4, "ring")
    assert key is not None
    others = [
        got[4].for_accept(7, "ring"),  # another claimed sender
        got[4].for_accept(1, "state"),  # another channel
        got[7].for_accept(1, "ring"),  # another listener
        got[1].for_accept(4, "ring"),  # the other direction (4 dials 1)
        sets(epoch=6)[4].for_accept(1, "ring"),  # another epoch
        sets(generation=2)[4].for_accept(1, "ring"),  # another generation
        sets(root=b"x" * 32)[4].for_accept(1, "ring"),  # another master (another binding)
    ]
    assert key.key not in others and len(set(others)) == len(others)


def test_every_member_gets_the_same_message_and_it_holds_no_member_secret() -> None:
    issuer = c.CredentialIssuer(ROOT)
    rows = [(p, KEYS[p].public) for p in MEMBERS]
    msg = issuer.table(rows, generation=1, epoch=5)
    # O(n): one table of the members' public keys and the epoch's binding, for everyone alike.
    assert [(r.peer_id, r.public_key) for r in msg.keys] == rows
    assert msg.binding == c.epoch_binding(ROOT, 1, 5) and len(msg.binding) == c.KEY_BYTES
    assert issuer.table(rows, generation=1, epoch=5) == msg  # derived, not drawn: the same when re-sent
    assert issuer.table(rows, generation=1, epoch=6).binding != msg.binding
    # No credential travels: none of the pair credentials is in the message's bytes.
    raw = m.encode(msg)
    got = sets()
    for i, j in itertools.permutations(MEMBERS, 2):
        dial = got[i].for_dial(j, "ring")
        assert dial is not None and dial.key not in raw
    shown = repr(got[1])
    assert msg.binding.hex() not in shown and repr(msg.binding) not in shown
    assert "private" not in repr(KEYS[1]) and KEYS[1].public.hex() not in repr(KEYS[1])


def test_a_member_cannot_pose_as_another_with_the_table_and_its_own_key() -> None:
    # Member 7 holds the same message as everyone; claiming to be peer 1 it derives with its own key.
    msg = message()
    posing = c.CredentialSet.from_message(msg, me=1, keys=KEYS[7])
    listener = c.CredentialSet.from_message(msg, me=4, keys=KEYS[4])
    forged = posing.for_dial(4, "ring")
    assert forged is not None and forged.key != listener.for_accept(1, "ring")
    # An outsider with its own key pair and the public table but not the binding: nothing either.
    outsider = c.CredentialSet(me=1, keys=KEYS[1], generation=1, epoch=5, binding=b"o" * 32,
                               table={r.peer_id: r.public_key for r in msg.keys})
    guessed = outsider.for_dial(4, "ring")
    assert guessed is not None and guessed.key != listener.for_accept(1, "ring")


def test_no_credential_for_a_peer_outside_the_set_nor_to_dial_oneself() -> None:
    got = sets()[1]
    assert got.for_dial(99, "ring") is None and got.for_accept(99, "ring") is None
    assert got.for_dial(1, "ring") is None  # nobody dials itself
    own = got.for_accept(1, "ring")  # a Hello claiming the listener's own id: a proof nobody else can make
    assert own is not None and all(own != sets()[p].for_accept(1, "ring") for p in (2, 4, 7))


def test_a_member_without_a_usable_key_can_open_and_accept_nothing() -> None:
    # b"": registered none; 32 zero bytes: a point of small order (its Diffie-Hellman value is all zeros).
    for bad in (b"", bytes(32)):
        msg = c.CredentialIssuer(ROOT).table([(1, KEYS[1].public), (2, bad)], generation=1, epoch=5)
        one = c.CredentialSet.from_message(msg, me=1, keys=KEYS[1])
        assert one.for_dial(2, "ring") is None and one.for_accept(2, "ring") is None
        refusal = c.judge(one, hello(peer_id=2))
        assert isinstance(refusal, HelloRefusal) and refusal.problem is HelloProblem.CREDENTIAL
        assert "no usable P2P key" in refusal.reason and "peer 2" in refusal.reason


def test_the_master_checks_the_length_of_a_public_key() -> None:
    assert c.check_public_key(b"") is None and c.check_public_key(KEYS[1].public) is None
    why = c.check_public_key(b"k" * 31)
    assert why is not None and "31 bytes" in why and "32" in why


def test_rows_of_the_same_epoch_and_binding_add_to_a_set_another_binding_replaces_it() -> None:
    issuer = c.CredentialIssuer(ROOT)
    first = c.CredentialSet.from_message(issuer.table([(1, KEYS[1].public), (4, KEYS[4].public)],
                                                      generation=2, epoch=5), me=1, keys=KEYS[1])
    assert first.for_dial(7, "ring") is None
    before = first.for_dial(4, "ring")
    grown = first.merged(issuer.table([(7, KEYS[7].public)], generation=2, epoch=5))
    assert grown.serial == (2, 5) and sorted(grown.table) == [1, 4, 7]
    assert grown.for_dial(4, "ring") == before
    seven = c.CredentialSet.from_message(message(generation=2, epoch=5), me=7, keys=KEYS[7])
    dial = grown.for_dial(7, "ring")
    assert dial is not None and dial.key == seven.for_accept(1, "ring")
    other = grown.merged(c.CredentialIssuer(b"x" * 32).table([(9, KEYS[9].public)], generation=2, epoch=5))
    assert sorted(other.table) == [9]  # another master's set of the same serial replaces it


def test_key_pairs_agree_and_refuse_unusable_keys() -> None:
    a, b = KeyPair.generate(), KeyPair.generate()
    assert a.public != b.public and len(a.public) == c.PUBLIC_KEY_BYTES
    assert a.shared(b.public) == b.shared(a.public) is not None
    assert a.shared(bytes(32)) is None  # small order: all-zero value
    assert a.shared(b"short") is None
    with pytest.raises(ValueError):
        KeyPair.from_private_bytes(b"short")


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
    # A peer the current set does not list (yet: a rebuilding master sends its row when it is back).
    assert c.judge(cur, hello(peer_id=9)) is c.WAIT
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
    elsewhere = got[7].for_accept(1, "ring")
    assert elsewhere is not None
    fake = challenge(h, secret=secret, server_nonce=NS, credential=elsewhere)
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
    with pytest.raises(RemoteProtocolError, match="expected 9 fields, got 1"):
        m.decode(msgpack.packb([tag, [3]], use_bin_type=True))
    # A protocol-5 Hello from before run names (eight fields) decodes with no run: the same framing.
    named = m.Hello(protocol_version=5, purpose="master", nonce=NC, run="job")
    tag5, values5 = msgpack.unpackb(m.encode(named))
    assert values5[-1] == "job"
    unnamed = m.decode(msgpack.packb([tag5, values5[:8]], use_bin_type=True))
    assert unnamed == dataclasses.replace(named, run="")
    # Every other message keeps the exact field count.
    proof = msgpack.unpackb(m.encode(m.Proof(proof=b"p")))
    with pytest.raises(RemoteProtocolError, match="expected 1 fields, got 2"):
        m.decode(msgpack.packb([proof[0], [b"p", 1]], use_bin_type=True))


async def test_a_stream_encodes_the_set_every_member_gets_once(
    autojump_clock: trio.testing.MockClock, encoded_types: list[type]
) -> None:
    calls = encoded_types
    net = VirtualNetwork()

    async def pair() -> tuple[Stream, Stream]:
        peer = net.host("peer")
        return await open_stream_pair(net.host("master"), peer, connect_host=peer.address)

    msg = message()
    pairs = [await pair() for _ in range(3)]
    for a, _ in pairs:
        await stream_mod.MessageStream(a, max_frame_size=1 << 20).send(msg)
    got = [await stream_mod.MessageStream(b, max_frame_size=1 << 20).receive() for _, b in pairs]
    assert got == [msg, msg, msg] and calls == [m.P2PCredentials]  # three streams, one encoding
    # Another object (the next epoch's, a rebuild's row) is encoded anew.
    other = message(epoch=6)
    a, b = await pair()
    await stream_mod.MessageStream(a, max_frame_size=1 << 20).send(other)
    assert await stream_mod.MessageStream(b, max_frame_size=1 << 20).receive() == other
    assert calls == [m.P2PCredentials, m.P2PCredentials]


class CountingKeys:
    """A real key pair that counts the Diffie-Hellman values asked of it."""

    def __init__(self, keys: KeyPair) -> None:
        self.keys, self.asked = keys, 0

    @property
    def public(self) -> bytes:
        return self.keys.public

    def shared(self, peer_public: bytes) -> bytes | None:
        self.asked += 1
        return self.keys.shared(peer_public)


def test_a_pair_key_is_derived_lazily_once_per_peer_direction_and_epoch() -> None:
    spy = CountingKeys(KEYS[1])
    one = c.CredentialSet.from_message(message(), me=1, keys=spy)
    assert spy.asked == 0  # nothing derived on install
    for _ in range(2):
        for ch in CHANNELS:
            assert one.for_dial(4, ch) is not None and one.for_accept(4, ch) is not None
    assert spy.asked == 2  # one per direction, whatever the channels and repeats
    grown = one.merged(c.CredentialIssuer(ROOT).table([(9, KEYS[9].public)], generation=1, epoch=5))
    assert grown.for_dial(4, "ring") == one.for_dial(4, "ring") and spy.asked == 2  # kept across rows
    assert grown.for_dial(9, "ring") is not None and spy.asked == 3
    nxt = c.CredentialSet.from_message(message(epoch=6), me=1, keys=spy)
    assert nxt.for_dial(4, "ring") is not None and spy.asked == 4  # a new epoch: derived again
    # The exchange itself is the key pair's, cached per public key: the same value every time.
    assert KEYS[1].shared(KEYS[4].public) is KEYS[1].shared(KEYS[4].public)


def test_the_master_decodes_a_register_with_its_key_and_no_longer_binary() -> None:
    limits = master_inbound(1 << 20)
    reg = m.Register(p2p_port=5000, public_key=KEYS[1].public)
    assert limits.decode(m.encode(reg)) == reg
    with pytest.raises(RemoteProtocolError, match="max_bin_len"):
        limits.decode(m.encode(m.Register(p2p_port=5000, public_key=b"k" * (PUBLIC_KEY_MAX + 1))))
