#!/usr/bin/env python3
"""CPU one hostile control frame costs the process that reads it, under each stage's limits.

usage: python benchmarks/hostile_frames.py [--repeats 5]

For each stage of :mod:`pccl.wire.limits` (before the hello, the master reading a peer, a P2P listener
reading a peer) it builds the most expensive frames it can think of that still fit that stage's caps
(nested lists, many empty lists, many small ints, long strings, real-looking entry tables), and times
(``time.process_time``) the receive path's work on each: the head check, msgpack with the stage's limits
and the schema check, until it returns or refuses. It prints the worst median per stage: the longest a
single frame can hold the event loop. Compare with ``--no-limits`` (the old path: decode only, up to
the 16 MiB frame limit).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import msgpack

from pccl._errors import RemoteProtocolError
from pccl.wire import limits
from pccl.wire import messages as m


def shapes(tag: int, cap: int) -> dict[str, bytes]:
    """Payloads of message ``tag`` about ``cap`` bytes long (clipped to fit)."""
    n = max(cap - 16, 1)
    out = {
        "nested": bytes([0x92, tag]) + b"\x91" * (n - 1) + b"\xc0",
        "empty lists": msgpack.packb([tag, [0, 0, [[]] * min(n - 8, (1 << 17))]]),
        "small ints": msgpack.packb([tag, [0, 0, [0] * min(n - 8, (1 << 17))]]),
        "entry rows": msgpack.packb([tag, [0, 0, [["k", 1, [1], 8, 0, False]] * min(n // 13, 1 << 17)]]),
        "long string": msgpack.packb([tag, [0, False, "x" * (n - 8)]]),
    }
    return {k: v[:cap] if len(v) > cap else v for k, v in out.items()}


def cost(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        try:
            fn()
        except RemoteProtocolError:
            pass
        times.append(time.process_time() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-limits", action="store_true", help="also time unlimited 16 MiB decodes")
    args = ap.parse_args()
    stages = {
        "pre-auth (Hello)": (limits.PRE_AUTH, m.Hello.TAG),
        "master <- peer (SharedStateSync)": (limits.master_inbound(16 << 20), m.SharedStateSync.TAG),
        "master <- peer (SharedStateEntries)": (limits.master_inbound(16 << 20), m.SharedStateEntries.TAG),
        "master <- peer (CollectiveDone)": (limits.master_inbound(16 << 20), m.CollectiveDone.TAG),
        "p2p <- peer (StateRequest)": (limits.p2p_inbound(16 << 20), m.StateRequest.TAG),
    }
    for name, (lim, tag) in stages.items():
        cap = lim.tag_max.get(tag, lim.default_tag_max)
        worst = ("", 0.0)
        for shape, payload in shapes(tag, cap).items():

            def work(lim: limits.FrameLimits = lim, payload: bytes = payload) -> object:
                return lim.decode(payload)

            t = cost(work, args.repeats)
            if t > worst[1]:
                worst = (shape, t)
        print(f"{name:38s} cap {cap:>8d} B  worst {worst[1] * 1e3:7.2f} ms ({worst[0]})")
    if args.no_limits:
        for shape, payload in shapes(m.SharedStateSync.TAG, 16 << 20).items():
            t = cost(functools.partial(m.decode, payload), 1)
            print(f"{'no limits, 16 MiB ' + shape:36s} {t * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
