"""Two hosts for real: two network namespaces joined by a veth pair (needs root and iproute2). The master
and two peers on host A, one peer on host B. The peers of host A reach the master and each other at A's
address over the same-host shortcut (their listeners are wildcard ones); every connection to or from B
is TCP; the master records each peer's real host; the all-reduces are exact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs Linux, root and iproute2 for network namespaces"),
]

ROOT = Path(__file__).resolve().parents[2]

_PEER = """
import json, sys
import numpy as np
import trio
from pccl import PeerConfig, ReduceOp
from pccl.peer.communicator import open_communicator
from pccl.transport import TcpStream


async def main():
    async with open_communicator(sys.argv[1], config=PeerConfig()) as comm:
        while comm.world_size < 3:
            if await comm.are_peers_pending():
                await comm.update_topology()
            else:
                await trio.sleep(0.01)
        exact = True
        for i in range(20):
            x = np.full(1 << 16, float(comm.peer_id + i), dtype=np.float32)
            await comm.all_reduce(x, op=ReduceOp.SUM)
            exact &= bool((x == sum(r.peer_id + i for r in comm.table)).all())
        link = comm._sending_link().stream
        out = {str(p): [c.stream.same_host for c in conns if isinstance(c.stream, TcpStream)]
               for p, conns in comm.pool.links.conns.items()}
        hosts = {str(r.peer_id): r.host for r in comm.table}
        print(json.dumps({"peer": comm.peer_id, "exact": exact, "hosts": hosts,
                          "master_same_host": isinstance(link, TcpStream) and link.same_host, "out": out}),
              flush=True)
        await comm.all_reduce(np.zeros(1, np.float32))  # nobody leaves before everybody printed


trio.run(main)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    """Namespaces A (10.78.0.1) and B (10.78.0.2), joined by a veth pair; removed afterwards."""
    tag = os.getpid() % 100000
    a, b = f"pccl-a{tag}", f"pccl-b{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", f"pa{tag}", "type", "veth", "peer", "name", f"pb{tag}")
    except subprocess.CalledProcessError as exc:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {exc.stderr!r}")
    try:
        for ns, dev, addr in ((a, f"pa{tag}", "10.78.0.1/24"), (b, f"pb{tag}", "10.78.0.2/24")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_peers_on_two_hosts_take_the_shortcut_only_within_a_host(two_hosts: tuple[str, str]) -> None:
    a, b = two_hosts
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PCCL_LOG_LEVEL": "INFO"}
    master = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-m", "pccl", "master", "--host",
                               "0.0.0.0", "--port", "0"], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, text=True, env=env)
    peers: list[subprocess.Popen[str]] = []
    try:
        assert master.stderr is not None
        port = None
        for line in master.stderr:  # the master says where it listens once it does
            if "master listening on" in line:
                port = int(line.rsplit(":", 1)[1])
                break
        assert port is not None, "the master did not start"
        for ns in (a, a, b):
            peers.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _PEER,
                                           f"10.78.0.1:{port}"], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
        reports = []
        for p in peers:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-2000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in [*peers, master]:
            p.kill()
            p.wait()
    on_a = {r["peer"] for r in reports[:2]}
    on_b = reports[2]["peer"]
    for r in reports:
        assert r["exact"]
        assert r["out"], r  # every peer sends to someone in a ring of 3
        assert r["hosts"] == {**{str(p): "10.78.0.1" for p in on_a}, str(on_b): "10.78.0.2"}
        assert r["master_same_host"] == (r["peer"] in on_a)
        for partner, ways in r["out"].items():
            # within host A over the shortcut, between the hosts over TCP
            assert ways == [r["peer"] in on_a and int(partner) in on_a], (r, partner)
