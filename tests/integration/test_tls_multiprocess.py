"""TLS across real OS processes: ``pccl-master --tls-cert --tls-ca`` as a subprocess, peers as separate Python
processes that take their TLS files from ``$PCCL_TLS_CERT`` / ``$PCCL_TLS_CA``; an exact all-reduce, and a
peer without TLS refused with MASTER_CONNECTION_FAILED while the run goes on; and ``pccl run`` handing the
same variables to its master and its peers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pccl.cli import main
from pccl.testing.tls import Certs

pytestmark = pytest.mark.slow

WAIT = 30.0

MASTER_CODE = "import sys; from pccl.cli import master_main; sys.exit(master_main())"

PEER_CODE = r"""
import json, sys, zlib, numpy as np, trio
from pccl import PCCLError, PeerConfig, UpdateTopologyFailedError
from pccl.peer.communicator import open_communicator

async def main(address, world):
    cfg = PeerConfig(p2p_listen_host="127.0.0.1", heartbeat_interval=0.2, heartbeat_timeout=2.0)
    try:
        async with open_communicator(address, config=cfg) as comm:
            while comm.world_size < world:
                try:
                    await comm.update_topology()
                except UpdateTopologyFailedError:
                    pass
                await trio.sleep(0.01)
            x = np.arange(1 << 16, dtype=np.float32) * (comm.peer_id + 1)
            await comm.all_reduce(x)
            print(json.dumps({"peer": comm.peer_id, "head": x[:8].tolist(), "crc": zlib.crc32(x.tobytes())}),
                  flush=True)
            await comm.all_reduce(np.zeros(1, np.float32), tag=1)  # leave together
    except PCCLError as exc:
        print(json.dumps({"error": exc.message, "result": exc.result.name}), flush=True)

trio.run(main, sys.argv[1], int(sys.argv[2]))
"""

_LISTEN = re.compile(r"master listening on 127\.0\.0\.1:(\d+)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PCCL_TLS_")}
    env.update(extra)
    return env


def test_tls_master_and_peer_processes(tmp_path: Path) -> None:
    certs = Certs(tmp_path)
    master_pem, peer_pem = certs.issue("master", "127.0.0.1"), certs.issue("peer", "pccl-peer")
    master = subprocess.Popen(
        [sys.executable, "-c", MASTER_CODE, "--host", "127.0.0.1", "--port", "0", "--log-level", "INFO",
         "--tls-cert", master_pem, "--tls-ca", certs.ca_file],
        stderr=subprocess.PIPE, text=True, env=_env())
    peers: list[subprocess.Popen[str]] = []
    try:
        assert master.stderr is not None
        port = None
        for line in master.stderr:
            found = _LISTEN.search(line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None
        # Keep reading the master's log so that it never blocks on a full pipe.
        threading.Thread(target=master.stderr.read, daemon=True).start()
        address = f"127.0.0.1:{port}"
        tls_env = _env(PCCL_TLS_CERT=peer_pem, PCCL_TLS_CA=certs.ca_file)
        peers = [subprocess.Popen([sys.executable, "-c", PEER_CODE, address, "2"], stdout=subprocess.PIPE,
                                  text=True, env=tls_env) for _ in range(2)]
        plain = subprocess.run([sys.executable, "-c", PEER_CODE, address, "1"], capture_output=True,
                               text=True, env=_env(), timeout=WAIT)
        refused = json.loads(plain.stdout.strip().splitlines()[-1])
        assert refused["result"] == "MASTER_CONNECTION_FAILED"
        assert "this peer needs PeerConfig.tls_cert" in refused["error"]
        results = []
        for p in peers:
            out, _ = p.communicate(timeout=WAIT)
            results.append(json.loads(out.strip().splitlines()[-1]))
        factor = sum(r["peer"] + 1 for r in results)
        assert all(r["head"] == [float(i * factor) for i in range(8)] for r in results)
        assert len({r["crc"] for r in results}) == 1  # bit-identical on both peers
    finally:
        for p in [*peers, master]:
            p.kill()
            p.wait(WAIT)


LAUNCHED = r"""
import os, numpy as np
from pccl import Attribute, Communicator, ReduceOp, _env
assert _env.peer_config(None).tls is not None  # TLS files from the launcher's environment
n = int(os.environ["PCCL_WORLD_SIZE"])
with Communicator() as comm:
    comm.connect()
    while comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) < n:
        if comm.are_peers_pending():
            comm.update_topology()
    x = np.full(4, int(os.environ["PCCL_RANK"]) + 1, np.float32)
    comm.all_reduce(x, x, op=ReduceOp.SUM)
    print("result", x[0], flush=True)
"""


def test_pccl_run_gives_master_and_peers_tls_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TLS peer succeeds only against a TLS master (and the reverse): the all-reduce proves both."""
    certs = Certs(tmp_path)
    pem = certs.issue("both", "127.0.0.1", "pccl-peer")
    monkeypatch.setenv("PCCL_TLS_CERT", pem)
    monkeypatch.setenv("PCCL_TLS_CA", certs.ca_file)
    monkeypatch.delenv("PCCL_TLS_KEY", raising=False)
    script = tmp_path / "ar.py"
    script.write_text(LAUNCHED)
    assert main(["run", "-n", "2", str(script)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "[peer 0] result 3.0" in out and "[peer 1] result 3.0" in out
