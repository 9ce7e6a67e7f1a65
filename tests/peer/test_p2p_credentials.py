"""The P2P listener and dialer bound to membership (issue 17 item 1): a connection gets in only with the
credential the master issued for the claimed peer, that channel and the current epoch (virtual network,
MockClock)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Required, TypedDict

import pytest
import trio
import trio.testing

from pccl import PROTOCOL_VERSION, PeerConfig, RankConnectionFailedError, Result
from pccl.peer.credentials import CredentialStore
from pccl.peer.p2p import open_p2p, serve_p2p
from pccl.testing.network import VirtualHost, VirtualNetwork
from pccl.transport import Address
from pccl.wire.credentials import CredentialIssuer, CredentialSet
from pccl.wire.handshake import new_nonce
from pccl.wire.hello import answer
from pccl.wire.keys import KeyPair
from pccl.wire.messages import Challenge, Hello, HelloOk, P2PCredentials, Refused
from pccl.wire.stream import MessageStream

CONFIG = PeerConfig(connect_timeout=4.0)
LISTENER, DIALER, OTHER = 1, 2, 3
MEMBERS = [LISTENER, DIALER, OTHER]


KEYS = {p: KeyPair.generate() for p in MEMBERS}  # one per member process


def issue(epoch: int = 5, generation: int = 1, root: bytes = b"r" * 32,
          members: list[int] = MEMBERS) -> P2PCredentials:
    return CredentialIssuer(root).table([(p, KEYS[p].public) for p in members], generation=generation,
                                        epoch=epoch)


def store(peer: int, *, members: list[int] = MEMBERS, **kw: Any) -> CredentialStore:
    s = CredentialStore(wait=CONFIG.connect_timeout / 2, keys=KEYS[peer])
    s.install(issue(members=members, **kw), me=peer)
    return s


@asynccontextmanager
async def listening(
    creds: CredentialStore, seen: list[Hello], *, secret: str = ""
) -> AsyncIterator[tuple[VirtualHost, Address]]:
    net = VirtualNetwork(latency=0.001)
    server = net.host("listener")

    async def handler(ms: MessageStream, hello: Hello) -> None:
        seen.append(hello)
        await ms.send(await ms.receive())

    async with trio.open_nursery() as nursery:
        serve = functools.partial(serve_p2p, config=CONFIG, secret=secret, credentials=creds)
        addr: Address = await nursery.start(serve, server, "0.0.0.0", 0, {"ring": handler, "state": handler})
        yield net.host("client"), (server.address, addr[1])
        nursery.cancel_scope.cancel()


async def dial(client: VirtualHost, addr: Address, creds: CredentialStore, *, me: int = DIALER,
               to: int = LISTENER, channel: str = "ring", secret: str = "") -> MessageStream:
    return await open_p2p(client, *addr, my_peer_id=me, channel=channel, index=0, config=CONFIG,
                          secret=secret, to_peer=to, credentials=creds)


@pytest.mark.parametrize("secret", ["", "s3cret"])
async def test_a_member_with_its_credential_gets_in_and_its_identity_reaches_the_handler(
    autojump_clock: trio.testing.MockClock, secret: str
) -> None:
    seen: list[Hello] = []
    async with listening(store(LISTENER), seen, secret=secret) as (client, addr):
        for channel in ("ring", "state"):
            ms = await dial(client, addr, store(DIALER), channel=channel, secret=secret)
            await ms.send(HelloOk(protocol_version=1))  # echoed by the handler
            assert isinstance(await ms.receive(), HelloOk)
            await ms.aclose()
    assert [(h.peer_id, h.channel, h.epoch) for h in seen] == [(DIALER, "ring", 5), (DIALER, "state", 5)]


class _Binding(TypedDict):
    """The membership a forged Hello names (:func:`forged`'s ``generation`` and ``epoch``)."""

    generation: int
    epoch: int


class _Forgery(TypedDict, total=False):
    """:func:`forged`'s keywords, as a case lists them."""

    peer_id: Required[int]
    credential: bytes
    generation: int
    epoch: int


async def forged(client: VirtualHost, addr: Address, *, peer_id: int, credential: bytes = b"",
                 generation: int = 0, epoch: int = -1, channel: str = "ring") -> str:
    """What an attacker does: a Hello, then (it cannot check the Challenge) a Proof made with
    ``credential``; returns the listener's refusal."""
    ms = MessageStream(await client.connect(*addr), max_frame_size=1 << 20)
    hello = Hello(protocol_version=PROTOCOL_VERSION, purpose="p2p", peer_id=peer_id, channel=channel,
                  index=0, nonce=new_nonce(), generation=generation, epoch=epoch)
    try:
        await ms.send(hello)
        reply = await ms.receive()
        if isinstance(reply, Challenge):
            await ms.send(answer(reply, hello, secret="", credential=credential))
            reply = await ms.receive()
    finally:
        await ms.aclose()
    assert isinstance(reply, Refused) and reply.code == int(Result.INVALID_USAGE)
    return reply.reason


async def test_every_forgery_is_refused_with_its_reason_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl.p2p")
    seen: list[Hello] = []
    mine = store(DIALER)
    ring = mine.for_dial(LISTENER, "ring")
    assert ring is not None
    other = store(OTHER).for_dial(LISTENER, "ring")
    bench = mine.for_dial(LISTENER, "bench")
    wrong_master = store(DIALER, root=b"x" * 32).for_dial(LISTENER, "ring")
    assert other is not None and bench is not None and wrong_master is not None
    at: _Binding = {"generation": 1, "epoch": 5}
    async with listening(store(LISTENER), seen) as (client, addr):
        cases: list[tuple[_Forgery, str]] = [
            ({"peer_id": DIALER}, "no P2P credential"),  # the right id and index guessed, no credential
            ({"peer_id": DIALER, "credential": b"g" * 32, **at}, "bad credential"),  # a guessed one
            ({"peer_id": DIALER, "credential": other.key, **at}, "bad credential"),  # another member's
            ({"peer_id": DIALER, "credential": bench.key, **at}, "bad credential"),  # another channel's
            ({"peer_id": DIALER, "credential": wrong_master.key, **at}, "bad credential"),  # another master's
            ({"peer_id": OTHER, "credential": ring.key, **at}, "bad credential"),  # claiming someone else
            ({"peer_id": DIALER, "credential": ring.key, "generation": 1, "epoch": 4},
             "stale P2P credential"),
        ]
        for kw, want in cases:
            reason = await forged(client, addr, **kw)
            assert want in reason, (kw, reason)
            assert want in caplog.text
        # The genuine article still works.
        ms = await dial(client, addr, mine)
        await ms.aclose()
    assert [h.peer_id for h in seen] == [DIALER]  # no forgery reached a handler


async def test_the_listener_waits_for_a_newer_set_it_is_about_to_get_then_accepts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    listener_creds = store(LISTENER, epoch=5)
    seen: list[Hello] = []
    async with listening(listener_creds, seen) as (client, addr):
        async with trio.open_nursery() as nursery:

            async def deliver_late() -> None:
                await trio.sleep(0.5)  # the master's message to the listener arrives after the dial
                assert listener_creds.install(issue(epoch=6), me=LISTENER)

            nursery.start_soon(deliver_late)
            t0 = trio.current_time()
            ms = await dial(client, addr, store(DIALER, epoch=6))
            assert 0.5 <= trio.current_time() - t0 < 0.6
            await ms.aclose()
        assert seen[-1].epoch == 6
        # One that never comes: refused after the bounded wait, with the reason.
        t0 = trio.current_time()
        with pytest.raises(RankConnectionFailedError, match="did not issue to this peer within 2s"):
            await dial(client, addr, store(DIALER, epoch=9))
        assert 2.0 <= trio.current_time() - t0 < 2.1
        # Now at epoch 6, the listener refuses epoch 5's credential.
        with pytest.raises(RankConnectionFailedError, match="stale P2P credential"):
            await dial(client, addr, store(DIALER, epoch=5))


async def test_the_dialer_refuses_a_listener_that_cannot_prove_the_credential(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A listener at the dialed address with another master's keys (or an impostor on a reused port).
    async with listening(store(LISTENER, root=b"x" * 32), []) as (client, addr):
        with pytest.raises(RankConnectionFailedError, match="bad secret or credential") as info:
            await dial(client, addr, store(DIALER))
        assert "not the peer the master named" in str(info.value)


async def test_no_credential_for_the_peer_dialed_is_a_local_refusal() -> None:
    creds = store(DIALER)
    with pytest.raises(RankConnectionFailedError, match="no P2P credential for peer 42") as info:
        await open_p2p(VirtualNetwork().host("c"), "10.0.0.9", 1, my_peer_id=DIALER, channel="ring",
                       config=CONFIG, to_peer=42, credentials=creds)
    assert info.value.result is Result.RANK_CONNECTION_FAILED


def test_the_store_keeps_the_newest_set() -> None:
    s = store(DIALER, epoch=5)
    assert not s.install(issue(epoch=4), me=DIALER)
    cur = s.current
    assert cur is not None and cur.epoch == 5
    assert s.install(issue(generation=2, epoch=1), me=DIALER)  # a rebuilt master: a newer generation
    cur = s.current
    assert cur is not None and cur.serial == (2, 1)
    assert s.public_key == KEYS[DIALER].public
    dial = s.for_dial(LISTENER, "ring")
    assert dial is not None
    shown = repr(s)
    assert all(k.hex() not in shown and repr(k) not in shown for k in (cur.binding, dial.key))


def test_the_store_adds_rows_of_its_epoch_and_takes_a_new_key_pair_only_by_a_new_set() -> None:
    s = store(DIALER, members=[LISTENER, DIALER], generation=2, epoch=7)
    assert s.for_dial(OTHER, "ring") is None
    assert s.install(issue(generation=2, epoch=7, members=[OTHER]), me=DIALER)  # one row, as a rebuild sends
    cur = s.current
    assert cur is not None and sorted(cur.table) == MEMBERS
    theirs = store(OTHER, generation=2, epoch=7).for_dial(DIALER, "ring")
    assert theirs is not None and theirs.key == cur.for_accept(OTHER, "ring")


async def test_the_listener_waits_for_the_row_of_a_member_back_after_it_then_accepts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A rebuilding master sends OTHER its table (listing the listener) and the listener OTHER's row; the
    # row may arrive after OTHER's connection.
    listener_creds = store(LISTENER, members=[LISTENER, DIALER], generation=2, epoch=7)
    seen: list[Hello] = []
    async with listening(listener_creds, seen) as (client, addr):
        async with trio.open_nursery() as nursery:

            async def deliver_late() -> None:
                await trio.sleep(0.5)
                assert listener_creds.install(issue(generation=2, epoch=7, members=[OTHER]), me=LISTENER)

            nursery.start_soon(deliver_late)
            t0 = trio.current_time()
            ms = await dial(client, addr, store(OTHER, generation=2, epoch=7), me=OTHER)
            assert 0.5 <= trio.current_time() - t0 < 0.6
            await ms.aclose()
        assert [h.peer_id for h in seen] == [OTHER]
    # A claimed member whose row never comes: refused after the bounded wait.
    async with listening(store(LISTENER, members=[LISTENER, DIALER]), seen) as (client, addr):
        t0 = trio.current_time()
        with pytest.raises(RankConnectionFailedError, match="did not issue to this peer within 2s"):
            await dial(client, addr, store(OTHER), me=OTHER)
        assert 2.0 <= trio.current_time() - t0 < 2.1


async def test_a_removed_member_is_refused_at_the_next_epoch_as_itself_or_as_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # OTHER was a member of epoch 5; epoch 6's set lists only LISTENER and DIALER.
    old = store(OTHER, epoch=5)
    async with listening(store(LISTENER, members=[LISTENER, DIALER], epoch=6), []) as (client, addr):
        with pytest.raises(RankConnectionFailedError, match="stale P2P credential"):
            await dial(client, addr, old, me=OTHER)
        # It never got epoch 6's binding; with a guessed one, and epoch 6 named, as itself: not listed,
        # refused after the bounded wait; as DIALER (whose key it lacks): refused at the proof.
        cur = old.current
        assert cur is not None
        guess = CredentialSet(me=OTHER, keys=KEYS[OTHER], generation=1, epoch=6, binding=cur.binding,
                              table={p: KEYS[p].public for p in MEMBERS})
        as_itself = guess.for_dial(LISTENER, "ring")
        posing = CredentialSet(me=DIALER, keys=KEYS[OTHER], generation=1, epoch=6, binding=cur.binding,
                               table=guess.table).for_dial(LISTENER, "ring")
        assert as_itself is not None and posing is not None
        at: _Binding = {"generation": 1, "epoch": 6}
        t0 = trio.current_time()
        reason = await forged(client, addr, peer_id=OTHER, credential=as_itself.key, **at)
        assert "unknown P2P credential" in reason and trio.current_time() - t0 >= 2.0
        assert "bad credential" in await forged(client, addr, peer_id=DIALER, credential=posing.key, **at)
