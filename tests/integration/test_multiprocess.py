"""Real OS processes: ``pccl.cli.master_main`` as a subprocess and peers as separate Python processes.

The peers run the membership part of the training-loop recipe (``update_topology()`` in a loop) and print
one JSON line whenever their world size changes. Every wait is bounded by ``trio.fail_after``; processes
are SIGKILLed in ``finally`` whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import pytest
import trio

pytestmark = pytest.mark.slow

WAIT = 15.0  # bound on any single wait; the whole file normally runs in a few seconds


class EventTest(Protocol):
    """A test of one JSON event line: also ``lambda e, n=n: ...`` (a default binding a loop value, which
    mypy cannot infer against ``Callable[[dict[str, Any]], bool]``)."""

    def __call__(self, event: dict[str, Any], /) -> bool: ...


MASTER_CODE = "import sys; from pccl.cli import master_main; sys.exit(master_main())"

# A peer: membership loop of the recipe; reports world-size changes; exits 0 when the master goes away.
PEER_CODE = r"""
import json, sys, trio
from pccl import MasterConnectionError, PeerConfig, UpdateTopologyFailedError
from pccl.peer.communicator import open_communicator

def say(**kw):
    print(json.dumps(kw), flush=True)

async def main(address):
    # reconnect_window=0: the master's end (SIGTERM) ends the run for these peers.
    cfg = PeerConfig(p2p_listen_host="127.0.0.1", heartbeat_interval=0.2, heartbeat_timeout=2.0,
                     reconnect_window=0)
    try:
        async with open_communicator(address, config=cfg) as comm:
            last = None
            while True:
                if comm.world_size != last:
                    last = comm.world_size
                    say(event="world", peer=comm.peer_id, world=last)
                try:
                    await comm.update_topology()
                except UpdateTopologyFailedError:
                    pass
                await trio.sleep(0.01)  # pacing, like a training step
    except MasterConnectionError as exc:
        say(event="master_lost", reason=str(exc))

trio.run(main, sys.argv[1])
"""

_LISTEN = re.compile(r"master listening on 127\.0\.0\.1:(\d+)")


class Proc:
    """A child process whose output lines (stdout or stderr) are collected as they arrive."""

    def __init__(self, proc: trio.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []
        self._changed = trio.Event()

    async def pump(self, stream: Any) -> None:
        buf = b""
        while True:
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self.lines.append(line.decode(errors="replace"))
                self._changed.set()
                self._changed = trio.Event()
        self._changed.set()

    async def wait_line(self, pred: Callable[[str], bool], what: str, start: int = 0) -> str:
        """Wait (bounded) for a line satisfying ``pred`` at index >= ``start``."""
        try:
            with trio.fail_after(WAIT):
                i = start
                while True:
                    while i < len(self.lines):
                        if pred(self.lines[i]):
                            return self.lines[i]
                        i += 1
                    if self.proc.returncode is not None and i >= len(self.lines):
                        await trio.sleep(0)  # let a pump finish its last lines
                        if i >= len(self.lines):
                            raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before {what}")
                    await self._changed.wait()
        except trio.TooSlowError:
            tail = "\n".join(self.lines[-30:])
            raise AssertionError(f"{self.name}: timed out waiting for {what}; last output:\n{tail}") from None

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(ln) for ln in self.lines if ln.startswith("{")]

    async def wait_event(self, pred: EventTest, what: str) -> dict[str, Any]:
        line = await self.wait_line(lambda ln: ln.startswith("{") and pred(json.loads(ln)), what)
        return dict(json.loads(line))


class Procs:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.all: list[Proc] = []

    async def start(self, name: str, argv: list[str], *, read: str) -> Proc:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL,
            # Peers: stderr joins stdout, so a failure message shows the peer's traceback too.
            stdout=subprocess.PIPE if read == "stdout" else subprocess.DEVNULL,
            stderr=subprocess.PIPE if read == "stderr" else subprocess.STDOUT, env=env)
        p = Proc(proc, name)
        self.all.append(p)
        self.nursery.start_soon(p.pump, proc.stdout if read == "stdout" else proc.stderr)
        return p

    async def start_master(self, *extra: str) -> tuple[Proc, str]:
        master = await self.start("master", [sys.executable, "-c", MASTER_CODE, "--host", "127.0.0.1",
                                             "--port", "0", *extra], read="stderr")
        line = await master.wait_line(lambda ln: _LISTEN.search(ln) is not None, "the listening line")
        m = _LISTEN.search(line)
        assert m is not None
        return master, f"127.0.0.1:{m.group(1)}"

    async def start_peer(self, name: str, address: str) -> Proc:
        return await self.start(name, [sys.executable, "-c", PEER_CODE, address], read="stdout")


@contextlib.asynccontextmanager
async def open_procs() -> AsyncIterator[Procs]:
    async with trio.open_nursery() as nursery:
        procs = Procs(nursery)
        try:
            yield procs
        finally:
            for p in procs.all:
                if p.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.proc.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True), trio.move_on_after(WAIT):
                for p in procs.all:
                    await p.proc.wait()
            nursery.cancel_scope.cancel()


def _count(lines: list[str], pattern: str) -> int:
    rx = re.compile(pattern)
    return sum(1 for ln in lines if rx.search(ln))


async def _exit_code(proc: Proc) -> int:
    with trio.fail_after(WAIT):
        return await proc.proc.wait()


async def test_three_peer_processes_one_killed_and_master_sigterm() -> None:
    async with open_procs() as procs:
        master, address = await procs.start_master("--heartbeat-timeout", "2.0")

        # Three peers join one after the other; each join is admitted by the running peers' loops.
        peers: list[Proc] = []
        for i in range(3):
            p = await procs.start_peer(f"peer{i}", address)
            peers.append(p)
            for q in peers:
                await q.wait_event(lambda e, n=i + 1: e.get("event") == "world" and e["world"] == n,
                                   f"{q.name} to see world size {i + 1}")
        ids = [p.events()[0]["peer"] for p in peers]
        assert len(set(ids)) == 3

        # SIGKILL the middle one: the other two see world size 2 after their next update_topology().
        mark = [len(p.lines) for p in peers]
        os.kill(peers[1].proc.pid, signal.SIGKILL)
        for p, start in ((peers[0], mark[0]), (peers[2], mark[2])):
            await p.wait_line(lambda ln: ln.startswith("{") and json.loads(ln).get("world") == 2,
                              f"{p.name} to see world size 2", start=start)
        await master.wait_line(lambda ln: f"peer {ids[1]} " in ln and " left " in ln, "the left line")

        # One master log line per membership change.
        lines = list(master.lines)
        for pid in ids:
            assert _count(lines, rf"pccl\.master INFO peer {pid} joined from ") == 1, lines
            assert _count(lines, rf"pccl\.master INFO peer {pid} accepted \(world size \d+\)") == 1, lines
        assert _count(lines, rf"peer {ids[1]} \(127\.0\.0\.1\) left") == 1, lines
        assert _count(lines, r" (left|evicted|kicked)") == 1, lines
        assert _count(lines, r"accepted \(world size 1\)") == 1
        assert _count(lines, r"accepted \(world size 2\)") == 1
        assert _count(lines, r"accepted \(world size 3\)") == 1

        # SIGTERM: the master shuts down cleanly (exit code 0) and says so; the peers notice and exit.
        master.proc.send_signal(signal.SIGTERM)
        assert await _exit_code(master) == 0, "\n".join(master.lines[-20:])
        assert any("received SIGTERM, shutting down" in ln for ln in master.lines)
        assert not any("Traceback" in ln for ln in master.lines), "\n".join(master.lines)
        for p in (peers[0], peers[2]):
            await p.wait_event(lambda e: e.get("event") == "master_lost", f"{p.name} to lose the master")
            assert await _exit_code(p) == 0


async def test_hung_peer_process_is_evicted() -> None:
    async with open_procs() as procs:
        master, address = await procs.start_master("--heartbeat-timeout", "1.0")
        a = await procs.start_peer("a", address)
        await a.wait_event(lambda e: e.get("world") == 1, "a alone")
        b = await procs.start_peer("b", address)
        for p in (a, b):
            await p.wait_event(lambda e: e.get("world") == 2, f"{p.name} to see world size 2")
        b_id = b.events()[0]["peer"]
        os.kill(b.proc.pid, signal.SIGSTOP)  # hangs: its socket stays open, only heartbeats tell
        await a.wait_event(lambda e: e.get("world") == 1, "a to see world size 1 after the eviction")
        await master.wait_line(lambda ln: f"peer {b_id} " in ln and "evicted" in ln, "the eviction line")
        assert _count(master.lines, r" (left|evicted|kicked)") == 1, master.lines
        master.proc.send_signal(signal.SIGINT)
        assert await _exit_code(master) == 0


# A peer that trains a small linear model: per step the recipe's admission check, a shared-state sync
# and an AVG all-reduce of its gradient (each retried on RANK_CONNECTION_LOST), with the default
# reconnect behaviour (a window, here 20 s): it survives its master being SIGKILLed and restarted.
TRAIN_CODE = r"""
import hashlib, json, sys, numpy as np, trio
from pccl import (PeerConfig, RankConnectionLostError, ReduceOp, SharedState, TensorInfo,
                  UpdateTopologyFailedError)
from pccl.peer.communicator import open_communicator

STEPS, WORLD = int(sys.argv[3]), 3

def say(**kw):
    print(json.dumps(kw), flush=True)

async def retry(fn, *args, **kw):
    while True:
        try:
            return await fn(*args, **kw)
        except RankConnectionLostError:
            say(event="retry", call=fn.__name__)

async def main(address, rank):
    cfg = PeerConfig(p2p_listen_host="127.0.0.1", heartbeat_interval=0.2, heartbeat_timeout=2.0,
                     reconnect_window=20.0)
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = (x @ np.arange(16, dtype=np.float32) + rng.standard_normal(64).astype(np.float32)).astype(np.float32)
    w = np.zeros(16, np.float32)
    state = SharedState([TensorInfo.from_numpy(w, "w")], revision=0)
    async with open_communicator(address, config=cfg) as comm:
        say(event="joined", peer=comm.peer_id)
        # A newcomer was admitted by the others' update_topology(), after which they go on to the
        # step: so does it (the recipe, docs/recipe.md).
        skip_check = comm.world_size > 1
        while state.revision < STEPS:
            try:
                if not skip_check and await comm.are_peers_pending():
                    await comm.update_topology()
            except (RankConnectionLostError, UpdateTopologyFailedError):
                continue
            skip_check = False
            if comm.world_size < WORLD:
                await trio.sleep(0.01)
                continue
            await retry(comm.sync_shared_state, state)
            say(event="synced", revision=state.revision, w=hashlib.sha256(w.tobytes()).hexdigest())
            g = (x.T @ (x @ w - y) / len(y)).astype(np.float32)
            await retry(comm.all_reduce, g, g, op=ReduceOp.AVG)
            w -= 0.05 * g
            state.revision += 1
            await trio.sleep(0.02)  # pacing, like a training step's compute
        say(event="done", revision=state.revision, w=hashlib.sha256(w.tobytes()).hexdigest(),
            generation=comm.statistics()["generation"])

trio.run(main, sys.argv[1], int(sys.argv[2]))
"""


async def test_pccl_master_sigkilled_and_restarted_while_three_peer_processes_train() -> None:
    """Issue 18's must-show: the peers keep training across a SIGKILLed `pccl-master` restarted on the
    same port with no extra flags, and finish with identical states and no lost revision."""
    steps = 60
    async with open_procs() as procs:
        master, address = await procs.start_master("--heartbeat-timeout", "2.0")
        port = address.rsplit(":", 1)[1]
        argv = [sys.executable, "-c", TRAIN_CODE, address]
        peers = [await procs.start(f"peer{i}", [*argv, str(i), str(steps)], read="stdout") for i in range(3)]
        for p in peers:  # well into training
            await p.wait_event(lambda e: e.get("event") == "synced" and e["revision"] >= 10,
                               f"{p.name} at step 10")
        os.kill(master.proc.pid, signal.SIGKILL)
        assert await _exit_code(master) == -signal.SIGKILL
        await trio.sleep(0.5)  # the restart delay
        # The same command on the same port, no extra flags: it rebuilds the run from the peers.
        restarted = await procs.start("master2", [sys.executable, "-c", MASTER_CODE, "--host", "127.0.0.1",
                                                  "--port", port, "--heartbeat-timeout", "2.0"],
                                      read="stderr")
        await restarted.wait_line(lambda ln: f"master listening on 127.0.0.1:{port}" in ln,
                                  "the restarted master")
        done = [await p.wait_event(lambda e: e.get("event") == "done", f"{p.name} to finish") for p in peers]
        for p in peers:
            assert await _exit_code(p) == 0, "\n".join(p.lines[-20:])
        # Identical states, and every revision 0..steps-1 synced exactly once on every peer, with the
        # same bytes everywhere.
        assert len({d["w"] for d in done}) == 1, done
        assert all(d["revision"] == steps and d["generation"] == 2 for d in done), done
        synced = [[(e["revision"], e["w"]) for e in p.events() if e.get("event") == "synced"] for p in peers]
        for s in synced:
            assert [r for r, _ in s] == list(range(steps)), s
        assert synced[0] == synced[1] == synced[2]
        assert any("rebuilding the run from re-registrations" in ln for ln in restarted.lines), \
            restarted.lines
