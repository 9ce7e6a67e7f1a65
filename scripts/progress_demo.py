"""Show the progress display of a join's shared-state transfer (issue 37 item 5).

A master (``pccl master``, another process) and a peer holding ``--mib`` MiB of state; a second peer
joins, is admitted and fetches the state: its transfer shows a bar on a terminal (tqdm), else progress
lines on stderr. Loopback TCP.

    python scripts/progress_demo.py [--mib 256]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import numpy as np
import trio

from pccl import PeerConfig, SharedState, TensorInfo
from pccl.peer.communicator import Communicator, open_communicator

# Hashing a large state takes both cores of a small machine for seconds: generous heartbeats.
PEER = PeerConfig(p2p_listen_host="127.0.0.1", heartbeat_timeout=30.0)


async def run(mib: int, address: str) -> int:
    words = mib << 18  # float32
    pending = trio.Event()
    async with open_communicator(address, config=PEER) as first:
        held = SharedState([TensorInfo.from_numpy(np.arange(words, dtype=np.float32), "weights")])
        await first.sync_shared_state(held)
        print(f"peer {first.peer_id} holds {mib} MiB of shared state; a second peer joins", flush=True)

        async def admit(comm: Communicator) -> None:
            while not await comm.are_peers_pending():
                await trio.sleep(0.05)
            pending.set()
            await comm.update_topology()
            await comm.sync_shared_state(held)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(admit, first)
            async with open_communicator(address, config=PEER) as second:
                fresh = SharedState([TensorInfo.from_numpy(np.zeros(words, dtype=np.float32), "weights")])
                info = await second.sync_shared_state(fresh)
                ok = np.array_equal(fresh.tensor_infos[0].tensor, held.tensor_infos[0].tensor)
                print(f"peer {second.peer_id} joined and received {info.rx_bytes} bytes; identical: {ok}",
                      flush=True)
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of shared state (default 256)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = subprocess.Popen([sys.executable, "-m", "pccl", "master", "--host", "127.0.0.1", "--port",
                               str(port), "--log-level", "WARNING", "--heartbeat-timeout", "30"])
    try:
        for _ in range(300):  # until the master listens (at most 30 s)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        return trio.run(run, args.mib, f"127.0.0.1:{port}")
    finally:
        master.terminate()
        master.wait(10)


if __name__ == "__main__":
    sys.exit(main())
