#!/usr/bin/env python3
"""Throw random and mutated frames at a master and a P2P listener while peers all-reduce (issue 17).

usage: python scripts/fuzz_listeners.py [--rounds 50] [--attacks-per-round 20] [--peers 3] [--seed 0]
                                        [--secret S] [--member]

Runs a master and ``--peers`` peers on pccl's virtual network (``pccl.testing``) under trio's MockClock; a
seed fixes the attacks (the outsider and the insider each draw from their own generator, so the mix and the
bytes of the attacks are the same on every run of a seed). The interleaving is not: trio shuffles the order
in which ready tasks run with its own unseeded generator, so which state an attack meets, and timings such
as the longest all-reduce, may differ between runs of one seed. Each round the peers run one exact-checked
int64 all-reduce while an outsider host opens ``--attacks-per-round`` connections to the master port or a
peer's P2P port and sends one of: random bytes, a random length prefix, a valid frame with bytes flipped, a
truncated frame, a frame of nested lists, a valid hello followed by junk, a replayed handshake, and at P2P
ports a forged ring hello (a member's id, the victim's current credential epoch, a proof it cannot make)
followed by well-formed data frames with op_seq near the master's counter, or such data frames alone. Exit
status 0 when every all-reduce was exact and every member stayed in; 1 otherwise (with the first wrong
result). Prints how many attacks ran and the longest virtual time one all-reduce took while they did.

``--member`` (issue 33) adds an insider: one more peer that is a member of the run, takes part in every
all-reduce honestly, and meanwhile attacks the other members' P2P listeners *with its own credentials*:
fresh ring connections (any pool index) carrying data frames of length 0 to 16 KiB for random (tag, op_seq)
in a range the master never hands out, junk after a valid hello, bench probes of random sizes and junk
requests, state requests for keys nobody holds, more connections per channel than its share, and false
stall testimonies to the master (``CollectiveDone.io`` for operations that never ran, up to 2000 rows,
with any schedule name).
Besides the exact results it checks that every victim's stash stays within ``recv_stash_frames`` frames
and ``recv_stash_limit`` bytes, its connections per peer and channel within ``CHANNEL_CAPS``, and the
master's testimony rows within ``pccl.master.testimony.MAX_ROWS`` (no member removed).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import struct
import sys
from typing import Any

import numpy as np
import trio
import trio.testing

from pccl._config import PROTOCOL_VERSION
from pccl._errors import PCCLError
from pccl.master.testimony import MAX_ROWS as TESTIMONY_ROWS
from pccl.peer.p2p import CHANNEL_CAPS, open_p2p
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster
from pccl.transport import StreamBroken
from pccl.wire import messages as m
from pccl.wire.data import pack_data_header
from pccl.wire.handshake import new_nonce

COUNT = 2048


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def data_frames(rng: random.Random, op_seq: int) -> bytes:
    """Well-formed ring data frames for op_seqs around ``op_seq`` (the master's counter), random tags and
    lengths, payload 0xFF."""
    out = b""
    for _ in range(rng.randrange(1, 6)):
        length = rng.choice([COUNT * 8 // 3, COUNT * 8 // 3 + 8, rng.randrange(1, 1 << 14)])
        seq = max(0, op_seq + rng.randrange(-2, 4))
        out += pack_data_header(rng.randrange(64), seq, rng.randrange(4), length)
        out += b"\xff" * length
    return out


def attack_bytes(rng: random.Random, purpose: str, cred: tuple[int, int] = (0, -1), op_seq: int = 0) -> bytes:
    """One hostile byte string for a new connection (``cred``: the victim's current credential
    ``(generation, epoch)``, which an outsider can guess; ``op_seq``: the master's counter)."""
    channel = "ring" if purpose == "p2p" else ""
    claimed = cred if purpose == "p2p" and rng.random() < 0.5 else (0, -1)
    hello = m.encode(m.Hello(protocol_version=PROTOCOL_VERSION, purpose=purpose, channel=channel,
                             peer_id=rng.randrange(8), nonce=new_nonce(), generation=claimed[0],
                             epoch=claimed[1]))
    kind = rng.randrange(9 if purpose == "p2p" else 7)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 5000))
    if kind == 1:
        return struct.pack("<I", rng.randrange(1 << 32)) + rng.randbytes(rng.randrange(64))
    if kind == 2:
        data = bytearray(_frame(hello))
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 3:
        return _frame(hello)[: rng.randrange(1, len(hello) + 4)]
    if kind == 4:
        return _frame(bytes([0x92, 1]) + b"\x91" * rng.randrange(10, 1 << 16))[: 1 << 16]
    if kind == 5:
        return _frame(hello) + rng.randbytes(rng.randrange(1, 3000))
    if kind == 6:
        return _frame(hello) + _frame(m.encode(m.Proof(proof=rng.randbytes(32))))
    if kind == 7:
        return _frame(hello) + _frame(m.encode(m.Proof(proof=rng.randbytes(32)))) + data_frames(rng, op_seq)
    return data_frames(rng, op_seq)


JUNK_OP_SEQ = 1 << 31  # insider frames use op_seqs from here: the master never hands these out
JUNK_TAG = 1 << 40  # and tags from here, which no member calls


async def member_attack(rng: random.Random, evil: Any, victim: Any, config: Any) -> str:
    """One attack by member ``evil`` on member ``victim``'s P2P listener, with ``evil``'s own credentials;
    returns its name."""
    host, port = victim.p2p_address
    kind = rng.choice(["frames", "junk", "bench", "state", "flood", "testimony"])
    if kind == "testimony":
        # False stall testimony to the master (CollectiveDone.io) for operations that never ran: rows
        # for every member and made-up ones, claiming bytes sent that nobody took. The master keeps
        # them bounded and accuses nobody (no honest member testified for those operations).
        n = rng.randrange(1, 2000)
        rows = [m.IoRow(rng.randrange(1 << 10), rng.randrange(1 << 40), 0) for _ in range(n)]
        rows.append(m.IoRow(victim.peer_id, 1 << 20, 0))
        op_seq = JUNK_OP_SEQ + rng.randrange(1 << 30)
        schedule = rng.choice(["ring", "hd", "tree", "", "auto", "x" * rng.randrange(1, 300)])
        await evil._send(m.CollectiveDone(tag=JUNK_TAG + rng.randrange(1 << 20), success=False,
                                          reason="fuzz", op_seq=op_seq, io=rows, schedule=schedule))
        return kind
    channel = {"frames": "ring", "junk": "ring", "bench": "bench", "state": "state", "flood": "bench"}[kind]
    opened = []
    try:
        for _ in range(CHANNEL_CAPS["bench"] + 2 if kind == "flood" else 1):
            opened.append(await open_p2p(evil.transport, host, port, my_peer_id=evil.peer_id, channel=channel,
                                         index=rng.randrange(1, 200), config=config, to_peer=victim.peer_id,
                                         credentials=evil._credentials, secret=config.secret or ""))
        ms = opened[0]
        if kind == "frames":
            out = b""
            for _ in range(rng.randrange(1, 400)):
                length = rng.choice([0, 0, 0, rng.randrange(1, 1 << 14)])
                out += pack_data_header(rng.randrange(1 << 16), JUNK_OP_SEQ + rng.randrange(1 << 30),
                                        rng.randrange(1 << 16), length) + b"\xee" * length
            await ms.stream.send_all(out)
        elif kind == "junk":
            await ms.stream.send_all(rng.randbytes(rng.randrange(1, 3000)))
        elif kind == "bench":
            nbytes = rng.choice([-1, 0, 1 << 20, 1 << 40, rng.randrange(1 << 16)])
            await ms.stream.send_all(_frame(m.encode(m.BenchRequest(nbytes=nbytes))) + rng.randbytes(4096))
        elif kind == "state":
            keys = [rng.randbytes(8).hex() for _ in range(rng.randrange(1, 50))]
            request = m.StateRequest(sync_seq=rng.randrange(1 << 20), keys=keys)
            await ms.stream.send_all(_frame(m.encode(request)))
        with trio.move_on_after(0.05):
            await ms.stream.receive_some(4096)
    except (PCCLError, StreamBroken):
        pass  # refused (over its share, or a bad request): what is expected
    finally:
        for ms in opened:
            await ms.aclose()
    return kind


def bounds_broken(victim: Any) -> str | None:
    """What of ``victim``'s per-peer bounds an insider broke, if anything."""
    s = victim.pool.statistics()
    cfg = victim.config
    if s["stashed_frames"] > cfg.recv_stash_frames or s["stash_peak_bytes"] > cfg.recv_stash_limit:
        return f"peer {victim.peer_id}'s stash is over its bounds: {s}"
    for channel, cap in CHANNEL_CAPS.items():
        for pid in {p for p, _i in victim.pool.readers.conns} | {-1}:
            if victim.p2p_connections.count(pid, channel) > cap:
                return f"peer {pid} holds more than {cap} {channel!r} connections at peer {victim.peer_id}"
    return None


async def fuzz(args: argparse.Namespace) -> int:
    # One generator per concurrent task: trio runs ready tasks in an order it shuffles (unseeded), so
    # tasks drawing from one shared generator would each get different draws from run to run.
    rng = random.Random(args.seed)
    inside = random.Random(f"{args.seed}/insider")
    net = VirtualNetwork(latency=0.001)
    master_cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, secret=args.secret)
    peer_cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, secret=args.secret)
    attacks = 0
    worst = 0.0
    members = args.peers + (1 if args.member else 0)
    cluster_cm = open_test_cluster(members, network=net, master_config=master_cfg, config=peer_cfg)
    kinds: dict[str, int] = {}
    async with cluster_cm as cluster:
        evil = net.host("fuzzer")
        mhost, mport = cluster.master_address.rsplit(":", 1)
        ids = [cluster.peer(i).peer_id for i in cluster.alive]
        want = sum((np.arange(COUNT, dtype=np.int64) + 1) * (p + 1) for p in ids)
        for r in range(args.rounds):

            async def attack() -> None:
                nonlocal attacks
                for _ in range(args.attacks_per_round):
                    cred = (0, -1)
                    if rng.random() < 0.5:
                        target, purpose = (mhost, int(mport)), "master"
                    else:
                        victim = cluster.peer(rng.choice(cluster.alive))
                        addr = victim.p2p_address
                        assert addr is not None
                        target, purpose = addr, "p2p"
                        held = victim._credentials.current
                        if held is not None:
                            cred = held.serial
                    try:
                        stream = await evil.connect(*target)
                        await stream.send_all(attack_bytes(rng, purpose, cred, cluster.master.state._op_seq))
                        with trio.move_on_after(0.05):
                            await stream.receive_some(4096)
                        await stream.aclose()
                    except StreamBroken:
                        pass
                    attacks += 1

            async def insider() -> None:
                evil = cluster.peer(cluster.alive[-1])
                for _ in range(args.attacks_per_round):
                    victim = cluster.peer(inside.choice(cluster.alive[:-1]))
                    kind = await member_attack(inside, evil, victim, peer_cfg)
                    kinds[kind] = kinds.get(kind, 0) + 1

            async def one(i: int, comm: object, r: int = r) -> bytes:
                out = np.zeros(COUNT, np.int64)
                src = (np.arange(COUNT, dtype=np.int64) + 1) * (comm.peer_id + 1)  # type: ignore[attr-defined]
                await comm.all_reduce(src, out, tag=r)  # type: ignore[attr-defined]
                ends.append(trio.current_time())
                return out.tobytes()

            ends: list[float] = []
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(attack)
                if args.member:
                    nursery.start_soon(insider)
                results = await cluster.run_all(one)
            worst = max(worst, max(ends, default=t0) - t0)
            for i, res in enumerate(results):
                if res != want.tobytes():
                    print(f"round {r}: peer {i} got a wrong result or an error: {res!r:.200}")
                    return 1
            if len(cluster.alive) != members or len(cluster.master.state.accepted()) != members:
                print(f"round {r}: a member was lost ({cluster.alive})")
                return 1
            held = cluster.master._server.court.testimony.rows
            if held > TESTIMONY_ROWS:
                print(f"round {r}: the master holds {held} stall testimony rows")
                return 1
            for i in cluster.alive:
                broken = bounds_broken(cluster.peer(i))
                if broken is not None:
                    print(f"round {r}: {broken}")
                    return 1
    insiders = sum(kinds.values())
    print(f"{args.rounds} rounds, {attacks} attacks, every all-reduce exact; "
          f"longest all-reduce {worst * 1e3:.1f} ms of virtual time")
    if args.member:
        print(f"{insiders} insider attacks ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}), "
              "every member's stash and connections within their bounds")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--attacks-per-round", type=int, default=20)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--secret", default=None)
    p.add_argument("--member", action="store_true", help="add an insider attacking with its own credentials")
    args = p.parse_args(argv)
    status: int = trio.run(fuzz, args, clock=trio.testing.MockClock(autojump_threshold=0))
    return status


if __name__ == "__main__":
    sys.exit(main())
