"""P2P bound to membership (issue 17 item 1), with no secret configured, on the virtual network (MockClock):
a forged P2P hello (the right peer_id, index and even epoch guessed, no credential) is refused with a
logged reason and takes no live connection's place; forged data frames thrown at every P2P port while
the peers all-reduce (op_seq taken from the master's own counter, better than any guess) change nothing;
a credential of an earlier epoch or of a master before a restart opens nothing; a restarted master issues
credentials again."""

from __future__ import annotations

import dataclasses
import logging
import struct

import numpy as np
import pytest
import trio
import trio.testing

from pccl import PROTOCOL_VERSION, SharedState, TensorInfo
from pccl.collectives.schedule import chunk_bounds
from pccl.peer.communicator import Communicator
from pccl.peer.state import ring_neighbours
from pccl.testing import DEFAULT_PEER_CONFIG, TestCluster, VirtualHost
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.transport import StreamBroken
from pccl.wire import messages as m
from pccl.wire.data import pack_data_header
from pccl.wire.handshake import HandshakeFailed, new_nonce, offer_hello
from pccl.wire.stream import MessageStream

from ._helpers import COUNT, contribution, exact_all_reduces, expected, hostile, p2p_address


def frame(msg: m.Message) -> bytes:
    payload = m.encode(msg)
    return struct.pack("<I", len(payload)) + payload


def predecessor(comm: Communicator) -> int:
    _, prev = ring_neighbours(comm._core.group_rows(), comm.peer_id)
    assert prev is not None
    return prev.peer_id


def forged_hello(comm: Communicator, *, claim: int, credential_epoch: bool) -> m.Hello:
    """A ring hello claiming ``claim``'s slot 0, naming the victim's current set (an outsider can guess
    the epoch: it only counts up) or none."""
    cur = comm._credentials.current
    assert cur is not None
    return m.Hello(protocol_version=PROTOCOL_VERSION, purpose="p2p", peer_id=claim, channel="ring", index=0,
                   nonce=new_nonce(), generation=cur.generation if credential_epoch else 0,
                   epoch=cur.epoch if credential_epoch else -1)


async def refusal(evil: VirtualHost, addr: tuple[str, int], hello: m.Hello) -> m.Refused:
    """Send ``hello`` and, when challenged, a proof the attacker can make (random bytes)."""
    ms = MessageStream(await evil.connect(*addr), max_frame_size=1 << 20)
    try:
        await ms.send(hello)
        reply = await ms.receive()
        if isinstance(reply, m.Challenge):
            await ms.send(m.Proof(proof=new_nonce() + new_nonce()))
            reply = await ms.receive()
    finally:
        await ms.aclose()
    assert isinstance(reply, m.Refused), reply
    return reply


@pytest.mark.parametrize("credential_epoch", [False, True], ids=["no-credential", "guessed-epoch"])
async def test_a_forged_ring_hello_is_refused_and_the_live_connection_stays(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
    credential_epoch: bool,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(3)
    await exact_all_reduces(cluster, rounds=1)
    victim = cluster.peer(1)
    prev = predecessor(victim)
    live = dict(victim.pool.readers.conns)
    assert (prev, 0) in live and not live[(prev, 0)].closed
    lost = victim.pool.statistics()["connections_lost"]
    evil = hostile(cluster)
    for _ in range(3):
        reply = await refusal(evil, p2p_address(cluster, 1),
                              forged_hello(victim, claim=prev, credential_epoch=credential_epoch))
        want = "bad credential" if credential_epoch else "no P2P credential"
        assert want in reply.reason and f"peer {prev}" in reply.reason
    assert f"refused P2P connection from {evil.address}" in caplog.text and want in caplog.text
    # The live connection kept its slot, open, and no other connection got in.
    incoming = victim.pool.readers.conns
    assert incoming == live and all(incoming[k] is c and not c.closed for k, c in live.items())
    assert victim.pool.statistics()["connections_lost"] == lost
    assert cluster.alive == [0, 1, 2]
    await exact_all_reduces(cluster, rounds=3, tag=10)


async def timed_rounds(cluster: TestCluster, rounds: int, tag: int) -> list[float]:
    """Exact-checked all-reduces; the virtual time each round took."""
    ids = [cluster.peer(i).peer_id for i in cluster.alive]
    took = []
    for r in range(rounds):

        async def one(i: int, comm: Communicator, r: int = r) -> bytes:
            out = np.zeros(COUNT, np.int64)
            await comm.all_reduce(contribution(comm.peer_id), out, tag=tag + r)
            return out.tobytes()

        t0 = trio.current_time()
        results = await cluster.run_all(one)
        took.append(trio.current_time() - t0)
        assert all(res == expected(ids) for res in results), [type(res) for res in results]
    return took


async def test_forged_data_frames_during_running_all_reduces_change_nothing(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    rounds = 12
    cluster = await pccl_cluster(3)
    await exact_all_reduces(cluster, rounds=1)
    baseline = await timed_rounds(cluster, rounds, tag=100)
    lost = [cluster.peer(i).pool.statistics()["connections_lost"] for i in cluster.alive]
    # incoming (peer, index) -> connection
    live = [dict(cluster.peer(i).pool.readers.conns) for i in cluster.alive]
    # Well-formed ring frames of the right chunk length for the tags about to run and the op_seqs the
    # master is about to hand out, full of 0xFF: one landing anywhere would show in the exact sums.
    chunk = (chunk_bounds(COUNT, 3)[0][1] - chunk_bounds(COUNT, 3)[0][0]) * 8
    evil = hostile(cluster)
    stop = trio.Event()
    attacks = during_ops = 0

    def data_frames() -> bytes:
        op = cluster.master.state._op_seq
        return b"".join(
            pack_data_header(tag, op + k, seq, chunk) + b"\xff" * chunk
            for tag in range(200, 200 + rounds) for k in range(3) for seq in range(4)
        )[: 2 << 20]

    async def attack(idx: int) -> None:
        nonlocal attacks, during_ops
        victim = cluster.peer(idx)
        while not stop.is_set():
            for hello in (None, forged_hello(victim, claim=predecessor(victim), credential_epoch=True),
                          forged_hello(victim, claim=predecessor(victim), credential_epoch=False)):
                during_ops += cluster.master.state.statistics()["collectives_running"] > 0
                try:
                    stream = await evil.connect(*p2p_address(cluster, idx))
                    # Frames right behind the hello and a proof it cannot make (random bytes), without
                    # waiting for the challenge (a listener that trusted the hello would route them);
                    # or frames with no hello at all.
                    opening = frame(hello) + frame(m.Proof(proof=new_nonce() * 2)) if hello else b""
                    await stream.send_all(opening + data_frames())
                    with trio.move_on_after(0.0005):
                        await stream.receive_some(4096)
                    await stream.aclose()
                except StreamBroken:
                    pass
                attacks += 1
                await trio.sleep(0.0002)

    async with trio.open_nursery() as nursery:
        for idx in cluster.alive:
            nursery.start_soon(attack, idx)
        under_attack = await timed_rounds(cluster, rounds, tag=200)
        stop.set()
    # on average every victim attacked every round, a quarter of them while a collective ran
    assert attacks >= 3 * rounds and during_ops >= attacks // 4, (attacks, during_ops)
    assert cluster.alive == [0, 1, 2]  # no member lost
    for i, before in zip(cluster.alive, lost, strict=True):
        s = cluster.peer(i).pool.statistics()
        assert s["connections_lost"] == before and s["stashed_frames"] == 0
        incoming = cluster.peer(i).pool.readers.conns
        # No connection was replaced, and every incoming one is from a member (the schedules may open more
        # than the ring's: the tree and halving-doubling partners).
        assert all(incoming.get(k) is c for k, c in live[cluster.alive.index(i)].items())
        others = {cluster.peer(j).peer_id for j in cluster.alive} - {cluster.peer(i).peer_id}
        assert {p for p, _ in incoming} <= others
    # The stall is bounded: no round took longer than the slowest round without the attacker.
    assert max(under_attack) <= max(baseline) + 1e-9, (baseline, under_attack)
    assert "refused P2P connection" in caplog.text and "no P2P credential" in caplog.text
    await exact_all_reduces(cluster, rounds=2, tag=400)


async def test_an_earlier_epochs_credential_opens_nothing_and_the_new_epoch_works(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """What a member that left keeps (its credentials) is worth nothing once the epoch moved on."""
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(3)
    victim, leaver = cluster.peer(0), cluster.peer(2)
    old = leaver._credentials.for_dial(victim.peer_id, "ring")
    assert old is not None
    await cluster.leave(2)
    await cluster.add_peer()  # update_topology: a new epoch, new credentials for everyone
    cur = victim._credentials.current
    assert cur is not None and cur.epoch > old.epoch
    sets = [cluster.peer(i)._credentials.current for i in cluster.alive]
    assert {c.serial for c in sets if c is not None} == {cur.serial}
    evil = hostile(cluster)
    ms = MessageStream(await evil.connect(*p2p_address(cluster, 0)), max_frame_size=1 << 20)
    with pytest.raises(HandshakeFailed, match="stale P2P credential"):
        await offer_hello(ms, purpose="p2p", secret="", peer_id=leaver.peer_id, channel="ring", index=0,
                          credential=old.key, generation=old.generation, epoch=old.epoch)
    await ms.aclose()
    assert "stale P2P credential" in caplog.text
    await exact_all_reduces(cluster, rounds=2)


async def test_a_restarted_master_issues_credentials_again(
    autojump_clock: trio.testing.MockClock, pccl_cluster: ClusterFactory
) -> None:
    """Issue 18's path: the members keep their P2P pools, the rebuilt master (generation 2) issues fresh
    credentials, connections opened after it (shared-state transfers, a newcomer's ring) work, and a
    credential of the old master opens nothing."""
    config = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=30.0)
    cluster = await pccl_cluster(3, config=config)
    await exact_all_reduces(cluster, rounds=1)
    old = cluster.peer(1)._credentials.for_dial(cluster.peer(0).peer_id, "state")
    assert old is not None and old.generation == 1
    await cluster.restart_master()
    with trio.fail_after(30):
        def behind(c: Communicator) -> bool:
            return c._credentials.current is None or c._credentials.current.generation < 2

        while cluster.master.statistics()["accepted"] < 3 or any(behind(c) for c in cluster.peers):
            await trio.sleep(0.05)
    sets = [c._credentials.current for c in cluster.peers]
    assert all(s is not None and s.generation == 2 for s in sets)
    await exact_all_reduces(cluster, rounds=2)
    # A sync: the peers behind fetch peer 0's tensors over new "state" connections.
    weights = [np.full(64, float(i), np.float64) for i in range(3)]
    states = [SharedState([TensorInfo.from_numpy(w, "w")]) for w in weights]
    states[0].revision = 5
    async with trio.open_nursery() as nursery:
        for i, st in enumerate(states):
            nursery.start_soon(cluster.peer(i).sync_shared_state, st)
    assert all(w.tobytes() == weights[0].tobytes() for w in weights)
    # The old master's credential is stale at the rebuilt master's generation.
    ms = MessageStream(await hostile(cluster).connect(*p2p_address(cluster, 0)), max_frame_size=1 << 20)
    with pytest.raises(HandshakeFailed, match="stale P2P credential"):
        await offer_hello(ms, purpose="p2p", secret="", peer_id=cluster.peer(1).peer_id, channel="state",
                          credential=old.key, generation=old.generation, epoch=old.epoch)
    await ms.aclose()
    # A newcomer: a new epoch of generation 2, ring connections to and from it.
    await cluster.add_peer()
    assert len(cluster.alive) == 4
    await exact_all_reduces(cluster, rounds=2, tag=20)
