#!/usr/bin/env python3
"""P2P connection set-up cost (loopback TCP connect + handshake) and the master's cost of issuing P2P
credentials (docs/security.md "Measured costs").

usage: python benchmarks/p2p_handshake.py [--connections 300] [--no-credentials] [--cold] [--secret S]
                                          [--issue 64,256,1024]

Opens ``--connections`` P2P connections one after another from one task to a ``serve_p2p`` listener in
the same process and prints the median and p90 time of one connect + handshake (Hello, Challenge,
Proof, HelloOk). With credentials (the default where this tree has them, as every communicator uses):
the dialer presents a master-issued credential and the listener checks it; ``--no-credentials`` (and
trees before issue 17 item 1) run the secret-only handshake. Since protocol 5 each end derives a
connection's credential from an X25519 Diffie-Hellman value, once per (peer, epoch); ``--cold`` gives
both ends fresh key pairs and a fresh set before every connection, so each one pays the key generation
and both exchanges (the first connection of a pair in an epoch pays only the exchanges; later ones
nothing). ``--issue`` times the master's credential issue for one epoch of N members (one table of N
public keys, the same for every member), as the master does before each EstablishP2P.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any

import trio

from pccl import PeerConfig
from pccl.peer.p2p import open_p2p, serve_p2p
from pccl.transport import StreamBroken, TcpTransport
from pccl.wire.messages import Hello
from pccl.wire.stream import MessageStream

try:  # trees before issue 17 item 1 have no credentials
    from pccl.peer.credentials import CredentialStore
    from pccl.wire.credentials import CredentialIssuer
    from pccl.wire.keys import KeyPair
except ImportError:  # pragma: no cover - measuring an older tree
    CredentialStore = None  # type: ignore[assignment,misc]
    CredentialIssuer = None  # type: ignore[assignment,misc]


async def handshakes(n: int, *, credentials: bool, secret: str, cold: bool = False) -> list[float]:
    config = PeerConfig(connect_timeout=5.0)
    listen_kw: dict[str, Any] = {}
    dial_kw: dict[str, Any] = {}
    issuer = CredentialIssuer(b"r" * 32) if credentials else None
    listener_store = CredentialStore(wait=1.0) if credentials else None
    dialer_store = CredentialStore(wait=1.0) if credentials else None

    def install(epoch: int, *, fresh_keys: bool) -> None:
        assert issuer is not None and listener_store is not None and dialer_store is not None
        if fresh_keys:
            listener_store.keys, dialer_store.keys = KeyPair.generate(), KeyPair.generate()
        msg = issuer.table([(1, listener_store.public_key), (2, dialer_store.public_key)], generation=1,
                           epoch=epoch)
        listener_store.install(msg, me=1)
        dialer_store.install(msg, me=2)

    if credentials:
        install(1, fresh_keys=False)
        listen_kw = {"credentials": listener_store}
        dial_kw = {"to_peer": 1, "credentials": dialer_store}

    async def sink(ms: MessageStream, hello: Hello) -> None:
        with contextlib.suppress(StreamBroken):
            await ms.receive()  # until the dialer closes

    times: list[float] = []
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(
            lambda task_status: serve_p2p(TcpTransport(), "127.0.0.1", 0, {"bench": sink}, config=config,
                                          secret=secret, task_status=task_status, **listen_kw))
        for i in range(n):
            t0 = time.perf_counter()
            if cold:
                # Fresh key pairs and a fresh epoch's set at both ends: this connection pays the key
                # generation and both Diffie-Hellman exchanges.
                install(i + 2, fresh_keys=True)
            ms = await open_p2p(TcpTransport(), *addr, my_peer_id=2, channel="bench", config=config,
                                secret=secret, **dial_kw)
            times.append(time.perf_counter() - t0)
            await ms.aclose()
        nursery.cancel_scope.cancel()
    return times


def issue_cost(n: int) -> float:
    """Seconds to issue one epoch's credentials to ``n`` members (what _start_establish does: one table)."""
    issuer = CredentialIssuer(b"r" * 32)
    rows = [(p, p.to_bytes(32, "big")) for p in range(1, n + 1)]
    t0 = time.perf_counter()
    issuer.table(rows, generation=1, epoch=7)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the measurements; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=300)
    p.add_argument("--no-credentials", action="store_true")
    p.add_argument("--cold", action="store_true", help="fresh keys and epoch before every connection")
    p.add_argument("--secret", default="")
    p.add_argument("--issue", default="")
    args = p.parse_args(argv)
    creds = CredentialStore is not None and not args.no_credentials
    times = trio.run(lambda: handshakes(args.connections, credentials=creds, secret=args.secret,
                                        cold=args.cold and creds))
    times.sort()
    print(f"p2p connect+handshake ({'credentials' if creds else 'no credentials'}"
          f"{', cold' if args.cold and creds else ''}"
          f"{', secret' if args.secret else ''}): median {statistics.median(times) * 1e3:.3f} ms, "
          f"p90 {times[int(len(times) * 0.9)] * 1e3:.3f} ms over {len(times)} connections")
    for n in [int(x) for x in args.issue.split(",") if x]:
        if CredentialIssuer is None:
            print("this tree issues no credentials")
            break
        cost = issue_cost(n)
        print(f"issue credentials to {n} members: {cost * 1e3:.1f} ms ({cost / n * 1e6:.0f} us per member)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
