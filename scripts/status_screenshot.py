"""Start a small run with a status page and take a headless-Chromium screenshot of ``/``.

The run: a master with ``status_port``, three peers that optimize their ring (so the bandwidth matrix
is filled) and train for ``--seconds`` (each step an all-reduce and a shared-state sync; every few
steps one peer's 32 MiB state is reset, so that it fetches it: the activity plot and the transfers
table have something to show), a fourth peer waiting to be accepted, and peers 1 and 2 waiting in an
all-reduce that peer 3 has not joined yet (so the page shows who is waited on). While it is in that
state, Chromium loads the page and writes a PNG.

    python scripts/status_screenshot.py [--out status.png] [--chromium chromium] [--width 1280 --height 1100]

Needs a Chromium binary (Debian: ``apt-get install chromium``). Exit code 0 when the PNG was written.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
from pathlib import Path

import numpy as np
import trio

from pccl import MasterConfig, PeerConfig, SharedState, TensorInfo
from pccl.master.server import open_master
from pccl.peer.communicator import Communicator, open_communicator

PEER = PeerConfig(p2p_listen_host="127.0.0.1")


async def _peer(address: str, box: list[Communicator], ready: trio.Event, done: trio.Event) -> None:
    async with open_communicator(address, config=PEER) as comm:
        box.append(comm)
        ready.set()
        await done.wait()


async def _train(comms: list[Communicator], seconds: float) -> None:
    """Steps of an all-reduce and a sync on every peer for ``seconds``; peer 2's state is reset every
    tenth step, so that it fetches the state from the others."""
    words = 8 << 20  # 32 MiB of float32
    states = [SharedState([TensorInfo.from_numpy(np.ones(words, np.float32), "w")]) for _ in comms]
    grads = [np.full(1 << 18, i, np.float32) for i in range(len(comms))]
    end = trio.current_time() + seconds
    step = 0
    while trio.current_time() < end:
        if step % 10 == 5:
            states[2].tensor_infos[0].tensor[:] = 0  # type: ignore[index]
        async with trio.open_nursery() as n:
            for c, x in zip(comms, grads, strict=True):
                n.start_soon(functools.partial(c.all_reduce, x, tag=step % 4))
        async with trio.open_nursery() as n:
            for c, st in zip(comms, states, strict=True):
                n.start_soon(c.sync_shared_state, st)
        for st in states:
            st.revision += 1
        step += 1
        await trio.sleep(0.05)


async def run(out: Path, chromium: str, width: int, height: int, seconds: float = 12.0) -> int:
    config = MasterConfig(status_port=0, deadlock_grace=None)
    async with open_master(config=config) as master, trio.open_nursery() as nursery:
        done = trio.Event()
        comms: list[Communicator] = []
        for i in range(3):
            ready = trio.Event()
            nursery.start_soon(_peer, master.connect_address, comms, ready, done)
            if i > 0:
                while not master.state.registered():
                    await trio.sleep(0.01)
                async with trio.open_nursery() as n:
                    for c in comms:
                        n.start_soon(c.update_topology)
            await ready.wait()
        async with trio.open_nursery() as n:
            for c in comms:
                n.start_soon(c.optimize_topology)
        await _train(comms, seconds)
        # A newcomer waiting to be accepted, and two peers waiting on the third.
        nursery.start_soon(_peer, master.connect_address, [], trio.Event(), done)
        while not master.state.registered():
            await trio.sleep(0.01)
        for c in comms[:2]:
            nursery.start_soon(functools.partial(c.all_reduce, np.ones(16, np.float32), tag=99))
        while not master.state.waited_on():
            await trio.sleep(0.01)
        await trio.sleep(0.5)
        url = master.status_url
        assert url is not None
        print(f"status page: {url}")
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--window-size={width},{height}", f"--screenshot={out}", url]
        proc = await trio.run_process(cmd, check=False, capture_stdout=True, capture_stderr=True)
        await comms[2].all_reduce(np.ones(16, np.float32), tag=99)  # let the waiting all-reduce finish
        done.set()
        nursery.cancel_scope.cancel()
    if proc.returncode != 0 or not out.exists():
        print(proc.stderr.decode(errors="replace")[-2000:], file=sys.stderr)
        print(f"chromium failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("status.png"))
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
    p.add_argument("--chromium", default=browser)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1500)
    p.add_argument("--seconds", type=float, default=12.0, help="seconds of training before the screenshot")
    args = p.parse_args()
    return trio.run(run, args.out.resolve(), args.chromium, args.width, args.height, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
