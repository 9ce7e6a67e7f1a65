"""A running shared-state transfer on the master's status page, as a headless-Chromium screenshot.

Four peers on the virtual network (:mod:`pccl.testing`, virtual time: nothing waits for real), the links
from the two holders to the two receivers limited to 10 MB/s; the receivers fetch 64 MB each. Mid-transfer
(both receivers between 20% and 80%, as their ``SharedStateProgress`` reports tell the master) the status
page (:func:`pccl.master.status.render_html` of the master's snapshot, as ``/`` serves it) is written to
HTML, its text form (``pccl status``) printed, and Chromium takes the picture.

    python scripts/status_progress_screenshot.py [--out status_progress.png] [--chromium chromium]

Exit code 0 when the PNG was written.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import trio
import trio.testing

from pccl import SharedStateSyncStrategy
from pccl.master.status import build_status, render_html, render_text
from pccl.peer.communicator import Communicator
from pccl.peer.shared_state import SharedState, TensorInfo
from pccl.testing import VirtualNetwork, open_test_cluster

MB = 1_000_000


def _state(value: float) -> SharedState:
    return SharedState([TensorInfo.from_numpy(np.full(MB, value, np.float32), f"layer{k}.weight")
                        for k in range(16)], revision=1)  # 16 tensors of 4 MB


async def capture() -> dict[str, Any]:
    """The master's status snapshot in the middle of the transfer."""
    net = VirtualNetwork(latency=0.001)
    async with open_test_cluster(4, network=net) as cl:
        for holder in (0, 1):
            for receiver in (2, 3):
                net.set_link(cl.host(holder), cl.host(receiver), bandwidth=10 * MB, oneway=True)
        states = [_state(1.0), _state(1.0), _state(7.0), _state(9.0)]
        got: list[dict[str, Any]] = []

        async def watch() -> None:
            while not got:
                await trio.sleep(0.25)
                now = trio.current_time()
                snap = build_status(cl.master.state, [], now, address="127.0.0.1:48148", uptime=now)
                rows = [r for t in snap["receiving"] for r in t["receivers"]]
                if rows and all(0.2 * r["total"] < r["bytes"] < 0.8 * r["total"] for r in rows):
                    got.append(snap)

        async def sync(i: int, comm: Communicator) -> object:
            return await comm.sync_shared_state(states[i], SharedStateSyncStrategy.ENFORCE_POPULAR)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await cl.run_all(sync)
            nursery.cancel_scope.cancel()
    if not got:
        raise RuntimeError("the transfer ended before the page showed it in progress")
    return got[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("status_progress.png"))
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
    p.add_argument("--chromium", default=browser)
    p.add_argument("--width", type=int, default=1100)
    p.add_argument("--height", type=int, default=900)
    args = p.parse_args()
    snap = trio.run(capture, clock=trio.testing.MockClock(autojump_threshold=0))
    print(render_text(snap))
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "status.html"
        page.write_text(render_html(snap))
        cmd = [args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--window-size={args.width},{args.height}", f"--screenshot={args.out.resolve()}",
               page.as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not args.out.exists():
        print(f"chromium failed (exit {proc.returncode}): {proc.stderr[-500:]}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
