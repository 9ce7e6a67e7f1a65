#!/usr/bin/env python3
"""Throw random and mutated frames at a master and a P2P listener while peers all-reduce (issue 17).

usage: python scripts/fuzz_listeners.py [--rounds 50] [--attacks-per-round 20] [--peers 3] [--seed 0]
                                        [--secret S]

Runs a master and ``--peers`` peers on pccl's virtual network (``pccl.testing``) under trio's MockClock, so
it is deterministic for a seed. Each round the peers run one exact-checked int64 all-reduce while an
outsider host opens ``--attacks-per-round`` connections to the master port or a peer's P2P port and sends
one of: random bytes, a random length prefix, a valid frame with bytes flipped, a truncated frame, a frame
of nested lists, a valid hello followed by junk, a replayed handshake, and at P2P ports a forged ring hello
(a member's id, the victim's current credential epoch, a proof it cannot make) followed by well-formed
data frames with op_seq near the master's counter, or such data frames alone. Exit status 0 when every
all-reduce was exact and every member stayed in; 1 otherwise (with the first wrong result). Prints how many
attacks ran and the longest virtual time one all-reduce took while they did.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import struct
import sys

import numpy as np
import trio
import trio.testing

from pccl._config import PROTOCOL_VERSION
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


async def fuzz(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    net = VirtualNetwork(latency=0.001)
    master_cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, secret=args.secret)
    peer_cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, secret=args.secret)
    attacks = 0
    worst = 0.0
    cluster_cm = open_test_cluster(args.peers, network=net, master_config=master_cfg, config=peer_cfg)
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
                results = await cluster.run_all(one)
            worst = max(worst, max(ends, default=t0) - t0)
            for i, res in enumerate(results):
                if res != want.tobytes():
                    print(f"round {r}: peer {i} got a wrong result or an error: {res!r:.200}")
                    return 1
            if len(cluster.alive) != args.peers:
                print(f"round {r}: a member was lost ({cluster.alive})")
                return 1
    print(f"{args.rounds} rounds, {attacks} attacks, every all-reduce exact; "
          f"longest all-reduce {worst * 1e3:.1f} ms of virtual time")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--attacks-per-round", type=int, default=20)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--secret", default=None)
    args = p.parse_args(argv)
    status: int = trio.run(fuzz, args, clock=trio.testing.MockClock(autojump_threshold=0))
    return status


if __name__ == "__main__":
    sys.exit(main())
