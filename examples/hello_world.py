"""Hello world: a master and two peers on this machine, one all-reduce and one shared-state sync.

Run it (the master and the peers are all started by this one command)::

    python examples/hello_world.py            # two peers
    python examples/hello_world.py --peers 3

The master runs in this process (``MasterNode`` on a port the system picks); every peer is a separate OS
process that uses the blocking API exactly like a peer on another machine would.

With ``PCCL_MASTER`` set (``pccl run -n 2 examples/hello_world.py``, or two ``pccl run --master``
invocations on two machines, docs/cli.md) this process is one peer of that master's run instead: rank
``PCCL_RANK`` of ``PCCL_WORLD_SIZE``.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import queue
import sys
import time
from typing import Any

import numpy as np
from _support import collect, launched_peer, one_report  # examples/_support.py


def peer_main(address: str | None, index: int, n_peers: int, count: int, results: Any) -> None:
    """One peer: join, all-reduce, sync a shared state, report to the parent."""
    from pccl.blocking import (
        Attribute,
        Communicator,
        ReduceOp,
        SharedState,
        SharedStateSyncStrategy,
        TensorInfo,
    )

    logging.basicConfig(level=logging.WARNING, format=f"peer {index}: %(levelname)s %(message)s")
    with Communicator(address, peer_group=0) as comm:
        comm.connect(n_attempts=10)

        # Admit the others: every accepted peer asks (a collective vote) whether someone waits to join,
        # and if so all of them vote to update the topology.
        while comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) < n_peers:
            if comm.are_peers_pending():
                comm.update_topology()
            else:
                time.sleep(0.01)

        # One all-reduce: peer i contributes i + 1 everywhere, so every element sums to n (n + 1) / 2.
        data = np.full(count, index + 1, dtype=np.float32)
        info = comm.all_reduce(data, data, op=ReduceOp.SUM)
        expected = n_peers * (n_peers + 1) / 2
        assert np.all(data == expected), f"all-reduce gave {data[:4]}..., expected {expected}"
        assert info.local_world_size == n_peers

        # One shared state: peer 0 holds the "real" weights and says so (SEND_ONLY); the others declare
        # their content wrong (RECEIVE_ONLY) and receive it.
        weights = np.arange(count, dtype=np.float32) if index == 0 else np.zeros(count, dtype=np.float32)
        state = SharedState([TensorInfo.from_numpy(weights, "weights")])
        strategy = SharedStateSyncStrategy.SEND_ONLY if index == 0 else SharedStateSyncStrategy.RECEIVE_ONLY
        first = comm.sync_shared_state(state, strategy)
        assert np.array_equal(weights, np.arange(count, dtype=np.float32))
        if index != 0:
            assert first.rx_bytes == weights.nbytes, first

        # Next revision: everyone is identical now, so the sync moves zero bytes.
        state.revision += 1
        second = comm.sync_shared_state(state)
        assert second.tx_bytes == 0 and second.rx_bytes == 0, second

        results.put((index, float(data[0]), info.tx_bytes, info.rx_bytes, first.tx_bytes, first.rx_bytes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2, help="number of peer processes (default 2)")
    parser.add_argument("--count", type=int, default=1 << 16, help="elements per tensor (default 65536)")
    parser.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    if args.peers < 2:
        parser.error("--peers must be at least 2")

    launched = launched_peer(args.peers)
    if launched is not None:  # one peer of a run started elsewhere: the address comes from PCCL_MASTER
        rank, world = launched
        mine: queue.Queue[tuple[int, float, int, int, int, int]] = queue.Queue()
        peer_main(None, rank, world, args.count, mine)
        _, value, tx, rx, sync_tx, sync_rx = one_report(mine)
        print(f"peer {rank}: all-reduce -> {value:g} everywhere (sent {tx} B, received {rx} B); "
              f"shared state: sent {sync_tx} B, received {sync_rx} B")
        print("hello world: OK")
        return 0

    from pccl.blocking import MasterNode

    logging.basicConfig(level=logging.WARNING)
    master = MasterNode("127.0.0.1:0")
    master.run()
    print(f"master listening on {master.address}")

    # spawn, not fork: the parent runs pccl's background thread, which a forked child would not have.
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=peer_main, args=(master.address, i, args.peers, args.count, results),
                         name=f"peer-{i}") for i in range(args.peers)]
    for p in procs:
        p.start()
    try:
        reports = collect(procs, results, args.peers, args.timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        master.interrupt()

    for index, value, tx, rx, sync_tx, sync_rx in sorted(reports):
        print(f"peer {index}: all-reduce -> {value:g} everywhere (sent {tx} B, received {rx} B); "
              f"shared state: sent {sync_tx} B, received {sync_rx} B")
    failed = [p.name for p in procs if p.exitcode != 0]
    if failed or len(reports) != args.peers:
        print(f"FAILED: {failed or 'missing reports'}", file=sys.stderr)
        return 1
    print("hello world: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
