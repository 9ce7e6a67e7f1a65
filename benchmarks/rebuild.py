#!/usr/bin/env python3
"""A restarted master's rebuild at many peers, on the virtual network: the whole stack, in one process.

usage: python benchmarks/rebuild.py [--peers 16,64,128,256] [--repeats 1]

For each world size ``n`` it forms a run of ``n`` peers (``pccl.testing.open_test_cluster`` on a
:class:`~pccl.testing.VirtualNetwork`, 0.5 ms links, ``trio.testing.MockClock``), then restarts the
master (:meth:`~pccl.testing.TestCluster.restart_master`: a fresh one, empty, on the same address) and
waits until it holds all ``n`` members again and its votes resume. Printed per size:

* ``wall s`` / ``CPU s``: real seconds of the rebuild (from the restart to the votes resuming) and the
  CPU this process used meanwhile: the master *and* the ``n`` peers (their reconnects, hellos,
  re-registrations and the credential messages they install), since they all share the process;
* ``virtual ms``: the virtual time it took (the links' latency, the reconnect backoff);
* ``master sent``: the messages the master handed its connections meanwhile, by type (counted at
  ``MasterServer._enqueue``, where every message to a peer passes): ``Reregistered`` and
  ``P2PCredentials`` (each member's table, plus the rows of the members back to those holding the set:
  one message per holder per batch, ``MasterConfig.credentials_batch_delay``; before batching one per
  holder per return, ``n (n - 1) / 2`` in all).

Run it against another source tree with ``PYTHONPATH=TREE python benchmarks/rebuild.py`` (the counting
hook needs only ``MasterServer._enqueue``), interleaved with this one: timings on a busy 2-core VM move
by tens of percent between runs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import time
from typing import Any

import trio
import trio.testing

from pccl.master import server as _server
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster

CONFIG = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=30.0)  # peers keep reconnecting

_sent: collections.Counter[str] = collections.Counter()
_enqueue = _server.MasterServer._enqueue


def _counting_enqueue(self: _server.MasterServer, conn: Any, item: Any) -> None:
    _sent[type(item).__name__] += 1
    _enqueue(self, conn, item)


async def _one(n: int) -> tuple[float, float, float, dict[str, int]]:
    async with open_test_cluster(n, network=VirtualNetwork(latency=0.0005), config=CONFIG) as cluster:
        _sent.clear()
        t0, c0, v0 = time.perf_counter(), time.process_time(), trio.current_time()
        await cluster.restart_master()
        while True:
            s = cluster.master.statistics()
            if s["accepted"] == n and not s["rebuilding"] and not s.get("held", False) and not s["in_doubt"]:
                break
            await trio.sleep(0.0005)
        wall, cpu, virtual = time.perf_counter() - t0, time.process_time() - c0, trio.current_time() - v0
        sent = {k: v for k, v in _sent.items() if k in ("Reregistered", "P2PCredentials")}
        return wall, cpu, virtual, sent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="16,64,128,256")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    # Every peer logs its lost master and its reconnect, the killed master its listener (ERROR).
    logging.disable(logging.ERROR)
    _server.MasterServer._enqueue = _counting_enqueue  # type: ignore[method-assign]
    print(f"{'peers':>6} {'wall s':>7} {'CPU s':>7} {'virtual ms':>10} {'Reregistered':>12} "
          f"{'P2PCredentials':>14}")
    for n in (int(x) for x in args.peers.split(",")):
        for _ in range(args.repeats):
            wall, cpu, virtual, sent = trio.run(_one, n, clock=trio.testing.MockClock(autojump_threshold=0))
            print(f"{n:>6} {wall:>7.2f} {cpu:>7.2f} {virtual * 1e3:>10.1f} {sent.get('Reregistered', 0):>12} "
                  f"{sent.get('P2PCredentials', 0):>14}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
