"""Bounded work before trust (issue 17, item 4): frames before the hello are a few KiB and decoded with
msgpack's limits; after it, every message type has a size cap that follows its schema."""

from __future__ import annotations

import logging
import struct
from typing import Any

import msgpack
import pytest
import trio
import trio.testing

from pccl._config import PROTOCOL_VERSION
from pccl._errors import InvalidArgumentError, RemoteProtocolError
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.transport import Stream, StreamBroken
from pccl.wire import limits
from pccl.wire import messages as m
from pccl.wire.framing import Framer
from pccl.wire.handshake import offer_hello
from pccl.wire.stream import MessageStream

from ._helpers import exact_all_reduces, hostile, master_port, p2p_address

NESTED = b"\x91" * (3 << 20)  # 3 MiB of nested one-item lists: the frame that froze a master for 5 s


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def test_pre_auth_refuses_a_large_length_prefix_before_buffering() -> None:
    f = Framer(max_frame_size=limits.PRE_AUTH.max_frame)
    f.feed(struct.pack("<I", len(NESTED)))
    with pytest.raises(RemoteProtocolError, match="exceeds the limit of 4096"):
        f.next_frame()


def test_pre_auth_decodes_only_small_handshake_frames() -> None:
    hello = m.encode(m.Hello(protocol_version=PROTOCOL_VERSION, purpose="master", nonce=b"n" * 16))
    assert isinstance(limits.PRE_AUTH.decode(hello), m.Hello)
    # A non-handshake message is decoded only when tiny (then refused as "expected Hello").
    big_vote = m.encode(m.CollectiveDone(tag=1, success=False, reason="x" * 1000))
    with pytest.raises(RemoteProtocolError, match=r"CollectiveDone of 1\d+ bytes exceeds the limit of 256"):
        limits.PRE_AUTH.check(big_vote)
    # Arrays, strings and maps in a hello are bounded by msgpack's limits, whatever the frame size.
    for bad in (
        msgpack.packb([m.Hello.TAG, [1, "master", "", -1, "", [0] * 17]]),
        msgpack.packb([m.Hello.TAG, [1, "x" * 1025, "", -1, "", 0]]),
        msgpack.packb([m.Hello.TAG, [1, "master", "", -1, "", {"a": 1}]]),
        bytes([0x92, m.Hello.TAG]) + b"\x91" * 4000 + b"\xc0",  # nested 4000 deep
        b"\xdc\xff\xff" + b"\x00" * 100,  # no [tag, values] envelope
    ):
        with pytest.raises(RemoteProtocolError):
            limits.PRE_AUTH.decode(bad)


def test_master_inbound_caps_follow_the_schema() -> None:
    lim = limits.master_inbound(16 << 20)
    entries = [[f"k{i}", 1, [1], 8, 0, False] for i in range(80000)]
    sync = m.encode(m.SharedStateSync(revision=0, strategy=0, entries=entries))
    assert len(sync) > limits.STATE_SYNC_MAX_FRAME
    want = r"SharedStateSync of \d+ bytes exceeds the limit of 32768 bytes from a peer"
    with pytest.raises(RemoteProtocolError, match=want):
        lim.decode(sync)
    ok = m.encode(m.SharedStateSync(revision=0, strategy=0, entries=entries[:1000]))
    assert lim.decode(ok) == m.decode(ok)
    # The rows travel in chunks that each fit the cap, in order, nothing lost (issue 17 item 4).
    chunks = limits.split_rows(entries)
    assert len(chunks) > 1 and [r for c in chunks for r in c] == entries
    for chunk in chunks:
        ahead = m.encode(m.SharedStateEntries(entries=chunk))
        vote = m.encode(m.SharedStateSync(revision=2**63 - 1, strategy=2, entries=chunk))  # 9 bytes, the most
        assert len(vote) <= limits.STATE_SYNC_MAX_FRAME
        assert lim.decode(ahead) == m.decode(ahead) and lim.decode(vote) == m.decode(vote)
    too_many = r"SharedStateEntries of \d+ bytes exceeds the limit of 32768 "
    with pytest.raises(RemoteProtocolError, match=too_many):
        lim.decode(m.encode(m.SharedStateEntries(entries=entries[:5000])))
    keys = [f"layer.{i}.weight" for i in range(20000)]
    p2p = limits.p2p_inbound(16 << 20)
    with pytest.raises(RemoteProtocolError, match=r"StateRequest of \d+ bytes exceeds the limit of 32768"):
        p2p.decode(m.encode(m.StateRequest(sync_seq=1, keys=keys)))
    key_chunks = limits.split_rows(keys)
    assert [k for c in key_chunks for k in c] == keys
    for key_chunk in key_chunks:
        req = m.encode(m.StateRequest(sync_seq=2**63 - 1, keys=key_chunk))
        assert p2p.decode(req) == m.decode(req)
    assert limits.split_rows([]) == [[]]
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        limits.split_rows(["k" * 40000])
    # A message the master never receives is capped small (then refused by the state machine).
    table = m.encode(m.Accepted(peers=[m.PeerRow(i, "10.0.0.1", 4000, 0) for i in range(5000)], epoch=1))
    with pytest.raises(RemoteProtocolError, match=r"Accepted of \d+ bytes exceeds the limit of 65536"):
        lim.decode(table)
    # The trusted side (a peer reading its master) still takes any message up to the frame size.
    assert isinstance(limits.trusted(16 << 20).decode(table), m.Accepted)
    # No cap exceeds the configured frame size.
    assert limits.master_inbound(40).default_tag_max == 40
    assert limits.pre_auth(40).max_frame == limits.PRE_AUTH_MAX_FRAME  # the handshake always fits
    assert limits.pre_auth(40).default_tag_max == 40


async def _throw(stream: Stream, data: bytes) -> bytes:
    """Send ``data``; return what comes back until the other side closes."""
    got = b""
    try:
        await stream.send_all(data)
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return got
            got += chunk
    except StreamBroken:
        return got


@pytest.mark.parametrize("target", ["master", "p2p"])
@pytest.mark.parametrize("attack", ["huge", "nested_small", "post_hello_huge"])
async def test_hostile_pre_auth_msgpack_is_refused_and_the_run_stays_exact(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
    target: str,
    attack: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(3)
    await exact_all_reduces(cluster, rounds=1)
    evil = hostile(cluster)
    addr = master_port(cluster) if target == "master" else p2p_address(cluster, 1)
    if attack == "huge":
        data = frame(bytes([0x92, m.Hello.TAG]) + NESTED)[: 64 * 1024]
        want = "exceeds the limit of 4096 bytes"
    elif attack == "nested_small":
        data = frame(bytes([0x92, m.Hello.TAG]) + b"\x91" * 4000)
        want = "malformed message"
    else:
        # A valid handshake (no secret in this run), then a huge frame of a list-carrying type.
        tag = m.SharedStateSync.TAG if target == "master" else m.StateRequest.TAG
        data = frame(bytes([0x92, tag, 0x93, 0, 0, 0xDD]) + NESTED)[: 64 * 1024]
        want = f"exceeds the limit of {limits.STATE_SYNC_MAX_FRAME} bytes"
    stream = await evil.connect(*addr)
    if attack == "post_hello_huge":
        ms = MessageStream(stream, max_frame_size=1 << 20)
        cred: dict[str, Any] = {}
        if target == "p2p":
            # Past a P2P hello only with a member's credential (issue 17 item 1): peer 0's, for peer 1.
            got = cluster.peer(0)._credentials.for_dial(cluster.peer(1).peer_id, "state")
            assert got is not None
            cred = {"peer_id": cluster.peer(0).peer_id, "credential": got.key, "generation": got.generation,
                    "epoch": got.epoch}
        await offer_hello(ms, purpose=target, secret="", channel="state" if target == "p2p" else "", **cred)

    async def legit() -> None:
        await exact_all_reduces(cluster, rounds=3, tag=10)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(legit)
        await _throw(stream, data)
    await stream.aclose()
    assert want in caplog.text
    assert cluster.alive == [0, 1, 2]
    await exact_all_reduces(cluster, rounds=1, tag=20)
