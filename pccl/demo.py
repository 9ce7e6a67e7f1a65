"""``python -m pccl demo``: a master and peer processes on this machine training one model together.

What it shows, live, one row per training step:

* a master (in this process) and ``--peers`` peer processes train a small MLP regression (numpy, float32,
  deterministic synthetic data). Each step every peer computes gradients on its own batch; the gradients
  are all-reduced with AVG; every peer applies the same Adam update in place. Parameters and both Adam
  moments are the shared state, synchronized at the start of every step (a group vote: identical content
  moves zero bytes);
* mid-run one peer is SIGKILLed: the survivors' all-reduce fails with RankConnectionLostError, they retry
  with the smaller group and carry on;
* a new peer joins, is admitted by the survivors' ``update_topology()``, and catches up through shared
  state: it fetches the whole state once, from the group, and trains from there;
* at the end, every survivor holds bit-identical state (same hash).

The exit code is 0 only if the invariants hold: identical final hashes (and revision) on every survivor,
the newcomer received the full state exactly once, every other sync moved zero bytes, and the world size
went down after the kill and back up after the join.

The replacement peer process is started with the others, in standby, and told to join right after the
kill, so the demo does not wait a second for Python imports mid-run.

The peer side (:func:`peer_main`) is also the training peer of ``benchmarks/churn_soak.py``: it reports
JSON lines on stdout and takes commands (``join``, ``stop``) as JSON lines on stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import trio

from ._cliutil import Parser

if TYPE_CHECKING:
    from ._config import PeerConfig

F32 = npt.NDArray[np.float32]

# ----------------------------------------------------------------------------------------------
# the model: a 3-layer MLP regression on a fixed random "teacher", in plain numpy


def layer_shapes(in_dim: int, hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the model's parameters."""
    return [("w1", (in_dim, hidden)), ("b1", (hidden,)), ("w2", (hidden, hidden)), ("b2", (hidden,)),
            ("w3", (hidden, 1)), ("b3", (1,))]


class Model:
    """Parameters, gradients and Adam moments as views into three flat float32 buffers.

    The flat gradient buffer is what gets all-reduced (one collective per step); the per-layer views of
    parameters and moments are the shared state's tensors.
    """

    def __init__(self, in_dim: int, hidden: int, seed: int) -> None:
        self.shapes = layer_shapes(in_dim, hidden)
        sizes = [int(np.prod(s)) for _, s in self.shapes]
        self.size = sum(sizes)
        self.theta: F32 = np.zeros(self.size, np.float32)
        self.m: F32 = np.zeros(self.size, np.float32)
        self.v: F32 = np.zeros(self.size, np.float32)
        self.params: dict[str, F32] = {}
        self.moment1: dict[str, F32] = {}
        self.moment2: dict[str, F32] = {}
        off = 0
        for (name, shape), n in zip(self.shapes, sizes, strict=True):
            self.params[name] = self.theta[off:off + n].reshape(shape)
            self.moment1[name] = self.m[off:off + n].reshape(shape)
            self.moment2[name] = self.v[off:off + n].reshape(shape)
            off += n
        rng = np.random.default_rng(seed)
        for name, shape in self.shapes:
            if name.startswith("w"):
                self.params[name][...] = rng.normal(0.0, 1.0 / np.sqrt(shape[0]), shape).astype(np.float32)
        self._teacher_a = np.random.default_rng(10_000 + seed).normal(0, 1 / np.sqrt(in_dim), (in_dim, 8))
        self._teacher_b = np.random.default_rng(20_000 + seed).normal(0, 1, (8, 1))
        self.in_dim = in_dim

    def state_tensors(self) -> list[tuple[str, F32]]:
        """(name, contiguous view) of every tensor of the shared state."""
        out: list[tuple[str, F32]] = []
        for name, _ in self.shapes:
            out += [(name, self.params[name]), (f"{name}.adam_m", self.moment1[name]),
                    (f"{name}.adam_v", self.moment2[name])]
        return out

    @property
    def state_bytes(self) -> int:
        return int(self.theta.nbytes + self.m.nbytes + self.v.nbytes)

    def state_hash(self) -> str:
        """Short SHA-256 of all state bytes (independent of the library's own content hash)."""
        h = hashlib.sha256()
        for name, t in self.state_tensors():
            h.update(name.encode())
            h.update(t.tobytes())
        return h.hexdigest()[:10]

    def batch(self, seed: int, step: int, slot: int, size: int) -> tuple[F32, F32]:
        """Deterministic synthetic batch for (step, slot): inputs and teacher targets."""
        rng = np.random.default_rng([seed, step, slot])
        x = rng.normal(0.0, 1.0, (size, self.in_dim))
        y = np.tanh(x @ self._teacher_a) @ self._teacher_b + 0.1 * np.sin(3 * x[:, :1])
        return x.astype(np.float32), y.astype(np.float32)

    def loss_and_grad(self, x: F32, y: F32, grad: F32) -> float:
        """Mean squared error on (x, y); writes the flat gradient into ``grad``."""
        p = self.params
        h1 = np.tanh(x @ p["w1"] + p["b1"])
        h2 = np.tanh(h1 @ p["w2"] + p["b2"])
        out = h2 @ p["w3"] + p["b3"]
        diff = out - y
        loss = float(np.mean(diff * diff))
        d_out = (2.0 / x.shape[0]) * diff
        g: dict[str, F32] = {}
        g["w3"] = h2.T @ d_out
        g["b3"] = d_out.sum(axis=0)
        d2 = (d_out @ p["w3"].T) * (1.0 - h2 * h2)
        g["w2"] = h1.T @ d2
        g["b2"] = d2.sum(axis=0)
        d1 = (d2 @ p["w2"].T) * (1.0 - h1 * h1)
        g["w1"] = x.T @ d1
        g["b1"] = d1.sum(axis=0)
        off = 0
        for name, shape in self.shapes:
            n = int(np.prod(shape))
            grad[off:off + n] = g[name].reshape(-1)
            off += n
        return loss

    def adam_step(self, grad: F32, t: int, lr: float = 3e-3, b1: float = 0.9, b2: float = 0.999,
                  eps: float = 1e-8) -> None:
        """One in-place Adam update (elementwise: identical inputs give identical bits on every peer)."""
        g = grad[: self.size]
        self.m *= np.float32(b1)
        self.m += np.float32(1 - b1) * g
        self.v *= np.float32(b2)
        self.v += np.float32(1 - b2) * (g * g)
        mhat = self.m / np.float32(1 - b1**t)
        vhat = self.v / np.float32(1 - b2**t)
        self.theta -= np.float32(lr) * mhat / (np.sqrt(vhat) + np.float32(eps))


# ----------------------------------------------------------------------------------------------
# the peer process


@dataclass
class PeerOptions:
    """Options of one training peer (see :func:`peer_main`)."""

    master: str
    steps: int = 100
    min_world: int = 1
    step_delay: float = 0.0
    standby: bool = False
    seed: int = 0
    in_dim: int = 32
    hidden: int = 128
    batch: int = 64
    report_every: int = 1
    heartbeat_timeout: float | None = None
    heartbeat_interval: float | None = None
    p2p_stall_timeout: float | None = None


def emit(event: str, **fields: Any) -> None:
    """One JSON report line on stdout for the parent."""
    fields["event"] = event
    fields.setdefault("t", time.monotonic())
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


@dataclass
class _Commands:
    join: trio.Event = field(default_factory=trio.Event)
    stop: bool = False
    # where the training loop is (answered to {"cmd": "where"}: diagnosing stalls in the soak)
    phase: str = "starting"
    phase_since: float = field(default_factory=time.monotonic)
    comm: Any = None

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.phase_since = time.monotonic()


async def _read_commands(cmds: _Commands) -> None:
    """Commands from the parent, one JSON object per stdin line: {"cmd": "join"} or {"cmd": "stop"}.

    End of stdin means the parent is gone (its end of the pipe closed when it died): leave at once, so an
    interrupted or crashed parent leaves no orphan peers behind.
    """
    stream = trio.lowlevel.FdStream(os.dup(0))
    buf = b""
    async with stream:
        while True:
            data = await stream.receive_some(4096)
            if not data:
                os._exit(3)
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                cmd = json.loads(line).get("cmd")
                if cmd == "join":
                    cmds.join.set()
                elif cmd == "stop":
                    cmds.stop = True
                elif cmd == "where":
                    comm = cmds.comm
                    emit("where", phase=cmds.phase, for_s=round(time.monotonic() - cmds.phase_since, 3),
                         peer=getattr(comm, "peer_id", None),
                         stats=comm.statistics() if comm is not None else None)


async def _admit_pending(comm: Any) -> bool:
    """Membership step of the loop: admit waiting peers when there are any (all peers call this)."""
    from ._errors import RankConnectionLostError, UpdateTopologyFailedError

    while True:
        try:
            if not await comm.are_peers_pending():
                return False
            break
        except RankConnectionLostError:
            # The master was lost during the query: ask again (the call waits for the reconnection).
            # Not every peer's query failed: one that had not voted yet waits and asks the next master,
            # so skipping it would leave that peer in the query while this one syncs (a deadlock;
            # tests/integration/test_demo_master_loss.py).
            continue
    while True:
        try:
            await comm.update_topology()
            return True
        except UpdateTopologyFailedError:
            await trio.sleep(0.01)


async def run_peer(opts: PeerOptions) -> None:
    """The training loop of one peer (the fault-tolerant recipe).

    Loop: sync shared state -> compute gradients -> all-reduce AVG (retried while a peer is lost) ->
    Adam step in place -> revision + 1 -> admit pending peers. A peer that joins a running group starts
    at the sync, which is where the group goes right after admitting it.
    """
    from .peer.communicator import open_communicator
    from .peer.shared_state import SharedState, TensorInfo

    model = Model(opts.in_dim, opts.hidden, opts.seed)
    state = SharedState([TensorInfo(name, t) for name, t in model.state_tensors()], revision=0)
    cmds = _Commands()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_commands, cmds)
        if opts.standby:
            emit("standby")
            await cmds.join.wait()
        t_call = time.monotonic()
        async with open_communicator(opts.master, config=_peer_config(opts)) as comm:
            cmds.comm = comm
            emit("accepted", peer=comm.peer_id, world=comm.world_size, join_s=time.monotonic() - t_call,
                 state_bytes=model.state_bytes)
            while comm.world_size < opts.min_world:
                await _admit_pending(comm)
                await trio.sleep(0.005)
            await _train(opts, comm, model, state, cmds)
            emit("done", peer=comm.peer_id, revision=state.revision, hash=model.state_hash(),
                 world=comm.world_size)
        nursery.cancel_scope.cancel()


def _peer_config(opts: PeerOptions) -> PeerConfig:
    """The peer's PeerConfig: the demo's loopback listener and the timeouts ``opts`` sets."""
    from ._config import PeerConfig

    kw: dict[str, Any] = {"p2p_listen_host": "127.0.0.1"}
    if opts.heartbeat_timeout is not None:
        kw["heartbeat_timeout"] = opts.heartbeat_timeout
    if opts.heartbeat_interval is not None:
        kw["heartbeat_interval"] = opts.heartbeat_interval
    if opts.p2p_stall_timeout is not None:
        kw["p2p_stall_timeout"] = opts.p2p_stall_timeout
    return PeerConfig(**kw)


async def _train(opts: PeerOptions, comm: Any, model: Model, state: Any, cmds: _Commands) -> None:
    """The steps of :func:`run_peer`'s loop until the group reaches ``opts.steps`` or decides to stop."""
    # [gradient..., loss, stop flag]: the loss and the stop decision ride along in the same all-reduce,
    # so every peer sees the same global loss and stops at the same step.
    vec: F32 = np.zeros(model.size + 2, np.float32)
    syncs = 0
    stopping = False
    while True:
        # 1. shared state: identical content moves nothing; a newcomer or outdated peer fetches.
        cmds.enter("sync_shared_state")
        sync = await _sync(comm, state)
        syncs += 1
        emit("sync", peer=comm.peer_id, n=syncs, revision=state.revision, tx=sync.tx_bytes, rx=sync.rx_bytes)
        if state.revision >= opts.steps or stopping:
            return
        if comm.world_size < 2:
            await _admit_pending(comm)
            await trio.sleep(0.01)
            continue
        # 2. gradients on this peer's own batch.
        step = state.revision
        x, y = model.batch(opts.seed, step, comm.rank, opts.batch)
        vec[-2] = model.loss_and_grad(x, y, vec)
        vec[-1] = 1.0 if cmds.stop else 0.0
        # 3. all-reduce AVG; on a lost peer the buffer is unchanged: retry with the survivors.
        cmds.enter("all_reduce")
        info, retries = await _average(comm, vec)
        if info is None:
            continue  # alone now: back to the top, wait for company
        # 4. identical update everywhere; the revision counts optimizer steps.
        model.adam_step(vec, step + 1)
        state.revision += 1
        stopping = bool(vec[-1] > 0)
        if state.revision % opts.report_every == 0 or stopping or state.revision >= opts.steps:
            emit("step", peer=comm.peer_id, step=state.revision, world=info.local_world_size,
                 loss=float(vec[-2]), tx=info.tx_bytes + sync.tx_bytes,
                 rx=info.rx_bytes + sync.rx_bytes, retries=retries, hash=model.state_hash())
        else:
            emit("progress", peer=comm.peer_id, step=state.revision, world=info.local_world_size)
        # 5. membership (not once the group decided to stop: nobody new should be admitted).
        if not stopping:
            cmds.enter("admit")
            await _admit_pending(comm)
            if opts.step_delay > 0:
                await trio.sleep(opts.step_delay)


async def _sync(comm: Any, state: Any) -> Any:
    """Sync the shared state, asking again while a peer is lost during it; its info."""
    from ._errors import RankConnectionLostError

    while True:
        try:
            return await comm.sync_shared_state(state)
        except RankConnectionLostError:
            continue


async def _average(comm: Any, vec: F32) -> tuple[Any, int]:
    """All-reduce AVG ``vec`` in place, retried while a peer is lost (the buffer is then unchanged);
    ``(info, retries)``, info None when this peer is alone now."""
    from ._errors import RankConnectionLostError, TooFewPeersError
    from ._types import ReduceOp

    retries = 0
    while True:
        try:
            return await comm.all_reduce(vec, op=ReduceOp.AVG), retries
        except RankConnectionLostError:
            retries += 1
        except TooFewPeersError:
            return None, retries


def peer_main(argv: list[str] | None = None) -> int:
    """Entry point of a training peer process (used by the demo and by benchmarks/churn_soak.py)."""
    p = argparse.ArgumentParser(prog="pccl-demo-peer")
    p.add_argument("--master", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--min-world", type=int, default=1)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--standby", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--report-every", type=int, default=1)
    p.add_argument("--heartbeat-timeout", type=float, default=None)
    p.add_argument("--heartbeat-interval", type=float, default=None)
    p.add_argument("--p2p-stall-timeout", type=float, default=None)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    opts = PeerOptions(master=a.master, steps=a.steps, min_world=a.min_world, step_delay=a.step_delay,
                       standby=a.standby, seed=a.seed, hidden=a.hidden, report_every=a.report_every,
                       heartbeat_timeout=a.heartbeat_timeout, heartbeat_interval=a.heartbeat_interval,
                       p2p_stall_timeout=a.p2p_stall_timeout)
    try:
        trio.run(run_peer, opts)
    except Exception as exc:
        leaf: BaseException = exc
        while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:  # our own nursery wraps errors
            leaf = leaf.exceptions[0]
        emit("error", message=f"{type(leaf).__name__}: {leaf}")
        raise
    return 0


PEER_CODE = "import sys; from pccl.demo import peer_main; sys.exit(peer_main())"
"""``python -c PEER_CODE --master HOST:PORT ...`` runs a training peer."""


# ----------------------------------------------------------------------------------------------
# the parent: master, peer processes, live view, invariants


@dataclass
class _Peer:
    name: str
    proc: trio.Process
    log: Path
    role: str  # "initial" or "newcomer"
    peer_id: int = -1
    status: str = "starting"  # starting, standby, running, killed, done, exited
    syncs: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    exit_code: int | None = None
    steps: int = 0
    worlds: list[tuple[int, int]] = field(default_factory=list)  # (step, world size it trained with)
    join_s: float = float("nan")
    state_bytes: int = 0


class _View:
    """Collects step reports and prints one row per step once every participant reported it."""

    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.rows: dict[int, dict[int, dict[str, Any]]] = {}
        self.printed = 0
        self.header_done = False

    def header(self) -> None:
        self.out(f"{'step':>5} {'world':>5} {'loss':>9} {'tx KB':>9} {'rx KB':>9}  state hash per peer")

    def add(self, rep: dict[str, Any]) -> None:
        step = int(rep["step"])
        if step <= self.printed:
            return
        self.rows.setdefault(step, {})[int(rep["peer"])] = rep
        if len(self.rows[step]) >= int(rep["world"]):
            self.flush(step)

    def flush(self, upto: int | None = None) -> None:
        for step in sorted(self.rows):
            if upto is not None and step > upto:
                break
            reps = self.rows.pop(step)
            r0 = next(iter(reps.values()))
            tx = sum(int(r["tx"]) for r in reps.values()) / 1024
            rx = sum(int(r["rx"]) for r in reps.values()) / 1024
            hashes = " ".join(f"p{pid}:{r['hash'][:8]}" for pid, r in sorted(reps.items()))
            retries = sum(int(r.get("retries", 0)) for r in reps.values())
            note = f"  ({retries} all-reduce retries)" if retries else ""
            self.out(f"{step:>5} {int(r0['world']):>5} {float(r0['loss']):>9.5f} {tx:>9.1f} {rx:>9.1f}  "
                     f"{hashes}{note}")
            self.printed = max(self.printed, step)


class _MasterEvents(logging.Handler):
    def __init__(self, out: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "listening on" not in msg:
            self.out(f"      [master] {msg}")


@dataclass(frozen=True)
class DemoOptions:
    steps: int
    peers: int
    step_delay: float
    kill_at: int
    timeout: float
    seed: int
    hidden: int


async def _reader(peer: _Peer, send: trio.MemorySendChannel[tuple[_Peer, dict[str, Any]]]) -> None:
    assert peer.proc.stdout is not None
    buf = b""
    async with send:
        while True:
            try:
                data = await peer.proc.stdout.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                with contextlib.suppress(json.JSONDecodeError):
                    msg = json.loads(line)
                    if isinstance(msg, dict):
                        await send.send((peer, msg))
        peer.exit_code = await peer.proc.wait()
        await send.send((peer, {"event": "exit", "code": peer.exit_code}))


async def _send_cmd(peer: _Peer, cmd: str) -> None:
    assert peer.proc.stdin is not None
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await peer.proc.stdin.send_all((json.dumps({"cmd": cmd}) + "\n").encode())


class _Run:
    """The parent's side of one demo run: the peer processes and what their reports said so far."""

    def __init__(self, opts: DemoOptions, out: Callable[[str], None], logdir: Path) -> None:
        self.opts = opts
        self.out = out
        self.logdir = logdir
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.peers: list[_Peer] = []
        self.view = _View(out)
        self.newcomer: _Peer | None = None
        self.victim: _Peer | None = None
        self.join_sent = False
        self.ok = True

    async def spawn(
        self, nursery: trio.Nursery, master: str, send: trio.MemorySendChannel[tuple[_Peer, dict[str, Any]]],
        name: str, role: str, extra: list[str],
    ) -> _Peer:
        """Start a peer process whose reports go to ``send``."""
        opts = self.opts
        log = self.logdir / f"{name}.log"
        argv = [sys.executable, "-c", PEER_CODE, "--master", master,
                "--steps", str(opts.steps), "--step-delay", str(opts.step_delay),
                "--seed", str(opts.seed), "--hidden", str(opts.hidden), *extra]
        with log.open("w") as errf:
            proc = await trio.lowlevel.open_process(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errf, env=self.env)
        peer = _Peer(name=name, proc=proc, log=log, role=role)
        self.peers.append(peer)
        nursery.start_soon(_reader, peer, send.clone())
        return peer

    async def handle(self, peer: _Peer, msg: dict[str, Any]) -> bool:
        """Take one report of ``peer`` in; False once the run is over (nobody left, or a failure)."""
        newcomer = self.newcomer
        assert newcomer is not None
        ev = msg.get("event")
        if ev == "standby":
            peer.status = "standby"
        elif ev == "accepted":
            self._accepted(peer, msg)
        elif ev == "sync":
            peer.syncs.append(msg)
            if int(msg["rx"]) > 0:
                self.out(f"  << peer {peer.peer_id} received {int(msg['rx']) / 1024:.1f} KB of "
                         f"shared state (now at revision {msg['revision']})")
        elif ev in ("step", "progress"):
            await self._stepped(peer, msg)
        elif ev == "done":
            peer.done = msg
            peer.status = "done"
        elif ev == "error":
            self.out(f"  ** {peer.name} failed: {msg.get('message')}")
            self.ok = False
        elif ev == "exit" and peer.status not in ("killed", "done"):
            peer.status = "exited"
            if peer.role == "initial" or newcomer.status != "standby":
                self.out(f"  ** {peer.name} exited unexpectedly (code {msg.get('code')})")
                self.ok = False
        alive = [p for p in self.peers if p.status in ("running", "starting")]
        return self.ok and (bool(alive) or newcomer.status == "standby")

    def _accepted(self, peer: _Peer, msg: dict[str, Any]) -> None:
        peer.peer_id = int(msg["peer"])
        peer.status = "running"
        peer.join_s = float(msg.get("join_s", float("nan")))
        peer.state_bytes = int(msg["state_bytes"])
        if peer.role == "newcomer":
            self.out(f"  ++ {peer.name} is peer {peer.peer_id}: accepted into a world of "
                     f"{msg['world']}, {peer.join_s * 1e3:.1f} ms after calling open_communicator")
        elif not self.view.header_done and sum(p.status == "running" for p in self.peers) == self.opts.peers:
            self.view.header_done = True
            self.view.header()

    async def _stepped(self, peer: _Peer, msg: dict[str, Any]) -> None:
        """A step (or progress) report: the view, the replacement's join, the kill."""
        opts, newcomer = self.opts, self.newcomer
        assert newcomer is not None
        peer.steps = int(msg["step"])
        peer.worlds.append((int(msg["step"]), int(msg["world"])))
        if msg["event"] == "step":
            self.view.add(msg)
        # The replacement joins only once a survivor has trained a step without the
        # victim: told at the moment of the kill, it could be admitted in the very round
        # that drops the victim, and the world would never be seen shrinking.
        if (self.victim is not None and not self.join_sent and peer is not self.victim
                and int(msg["world"]) == opts.peers - 1):
            self.join_sent = True
            self.out(f"  ++ telling the replacement process to join (pid {newcomer.proc.pid})")
            await _send_cmd(newcomer, "join")
        if self.victim is None and int(msg["step"]) >= opts.kill_at:
            self.victim = next(p for p in self.peers if p.role == "initial" and p.status == "running"
                               and p is not peer) if opts.peers > 1 else None
            if self.victim is not None:
                os.kill(self.victim.proc.pid, signal.SIGKILL)
                self.victim.status = "killed"
                self.out(f"  !! SIGKILL peer {self.victim.peer_id} (pid {self.victim.proc.pid}) "
                         f"at step {msg['step']}")


async def _run_demo(opts: DemoOptions, out: Callable[[str], None]) -> bool:
    from ._config import MasterConfig
    from .master.server import open_master

    logdir = Path(tempfile.mkdtemp(prefix="pccl-demo-"))
    run = _Run(opts, out, logdir)
    t_start = time.monotonic()
    with _master_events_to(out):
        try:
            async with open_master("127.0.0.1:0", config=MasterConfig()) as master, \
                    trio.open_nursery() as nursery:
                out(f"master listening on {master.connect_address}")
                await _drive(run, nursery, master.connect_address)
                nursery.cancel_scope.cancel()
        finally:
            await _reap(run.peers)
    elapsed = time.monotonic() - t_start
    passed = _summary(run.peers, opts, out, elapsed) and run.ok
    if not passed:
        for p in run.peers:
            tail = p.log.read_text(errors="replace").strip().splitlines()[-15:] if p.log.exists() else []
            if tail:
                out(f"--- {p.name} stderr (last lines) ---")
                for line in tail:
                    out(line)
    for f in logdir.glob("*"):
        with contextlib.suppress(OSError):
            f.unlink()
    with contextlib.suppress(OSError):
        logdir.rmdir()
    return passed


async def _drive(run: _Run, nursery: trio.Nursery, master: str) -> None:
    """Start the peers and follow their reports until the run ends or times out."""
    opts, out = run.opts, run.out
    send, recv = trio.open_memory_channel[tuple[_Peer, dict[str, Any]]](10_000)
    for i in range(opts.peers):
        await run.spawn(nursery, master, send, f"peer{i}", "initial", ["--min-world", str(opts.peers)])
    run.newcomer = await run.spawn(nursery, master, send, "newcomer", "newcomer", ["--standby"])
    send.close()
    out(f"started {opts.peers} peer processes (+1 standby replacement); training {opts.steps} steps, "
        f"one peer SIGKILLed at step {opts.kill_at}")
    with trio.move_on_after(opts.timeout) as timeout_scope:
        async for peer, msg in recv:
            if not await run.handle(peer, msg):
                break
    run.view.flush()
    if timeout_scope.cancelled_caught:
        out(f"  ** timed out after {opts.timeout:g}s")
        run.ok = False


@contextlib.contextmanager
def _master_events_to(out: Callable[[str], None]) -> Iterator[None]:
    """The in-process master's INFO log goes to ``out`` (only there) while the block runs."""
    master_log = logging.getLogger("pccl.master")
    handler = _MasterEvents(out)
    old_level, old_propagate = master_log.level, master_log.propagate
    master_log.addHandler(handler)
    master_log.setLevel(logging.INFO)
    master_log.propagate = False
    try:
        yield
    finally:
        master_log.removeHandler(handler)
        master_log.setLevel(old_level)
        master_log.propagate = old_propagate


async def _reap(peers: list[_Peer]) -> None:
    """Let finished peers leave on their own for a moment, then kill what is left and wait for it."""
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        for p in peers:
            if p.status == "done":
                await p.proc.wait()
    for p in peers:
        if p.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.proc.pid, signal.SIGKILL)
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        for p in peers:
            await p.proc.wait()


def _summary(peers: list[_Peer], opts: DemoOptions, out: Callable[[str], None], elapsed: float) -> bool:
    survivors = [p for p in peers if p.status == "done"]
    newcomer = next((p for p in peers if p.role == "newcomer"), None)
    out("")
    out(f"{'peer':>5} {'role':<9} {'status':<8} {'steps':>5} {'revision':>8} {'state rx (1st sync)':>19} "
        f"{'later sync rx':>13}  hash")
    for p in peers:
        first = int(p.syncs[0]["rx"]) if p.syncs else 0
        later = sum(int(s["rx"]) for s in p.syncs[1:])
        rev = p.done["revision"] if p.done else "-"
        h = p.done["hash"] if p.done else "-"
        out(f"{p.peer_id:>5} {p.role:<9} {p.status:<8} {p.steps:>5} {rev!s:>8} {first:>19} {later:>13}  {h}")
    checks: list[tuple[str, bool]] = []
    hashes = {str(p.done["hash"]) for p in survivors if p.done}
    revisions = {int(p.done["revision"]) for p in survivors if p.done}
    checks.append((f"{opts.peers} survivors finished ({opts.peers - 1} initial peers and the newcomer)",
                   len(survivors) == opts.peers))
    checks.append((f"identical state on every survivor (hash {'/'.join(sorted(hashes))})", len(hashes) == 1))
    checks.append((f"every survivor at revision {opts.steps}", revisions == {opts.steps}))
    if newcomer is not None:
        first_rx = int(newcomer.syncs[0]["rx"]) if newcomer.syncs else 0
        whole = newcomer.state_bytes > 0 and first_rx == newcomer.state_bytes
        checks.append((f"the newcomer received the whole state once ({first_rx} of "
                       f"{newcomer.state_bytes} bytes)", whole))
        later = sum(int(s["rx"]) for s in newcomer.syncs[1:])
        n_later = max(len(newcomer.syncs) - 1, 0)
        checks.append((f"the newcomer's {n_later} later syncs moved zero bytes ({later} B)",
                       later == 0 and n_later > 0))
    others = sum(int(s["rx"]) for p in peers if p is not newcomer for s in p.syncs)
    checks.append((f"every other sync moved zero bytes ({others} B)", others == 0))
    killed = [p for p in peers if p.status == "killed"]
    checks.append(("a peer was killed mid-run", len(killed) == 1))
    kill_step = killed[0].steps if killed else 0
    after = [w for p in survivors for s, w in p.worlds if s > kill_step]
    checks.append((f"the world shrank to {opts.peers - 1} after the kill and grew back to {opts.peers}",
                   bool(after) and min(after) == opts.peers - 1 and after[-1] == opts.peers))
    for text, good in checks:
        out(f"  [{'PASS' if good else 'FAIL'}] {text}")
    passed = all(good for _, good in checks)
    out(f"demo {'PASSED' if passed else 'FAILED'} in {elapsed:.1f}s")
    return passed


def main(argv: list[str] | None = None) -> int:
    """``python -m pccl demo``: run the local demo; returns 0 if every invariant held.

    Args:
        argv: ``--steps N``, ``--peers N``, ``--quick`` (short run for CI), ``--step-delay S``,
            ``--kill-at STEP``, ``--timeout S``, ``--seed N``.

    Returns:
        0 on success, 1 if an invariant failed or the run timed out.

    Raises:
        CliError: a bad option (``pccl demo`` prints it as one line, like ``pccl run``'s).
    """
    p = Parser(prog="pccl demo", description=(
        "Local demo: a master and peers training together, one peer killed mid-run, a new one joining "
        "and catching up through shared state."))
    p.add_argument("--steps", type=int, default=None, help="training steps (default 100; 40 with --quick)")
    p.add_argument("--peers", type=int, default=3, help="peer processes at the start (default 3)")
    p.add_argument("--quick", action="store_true", help="a short run for CI")
    p.add_argument("--step-delay", type=float, default=None,
                   help="seconds of simulated compute per step (default 0.05; 0.01 with --quick)")
    p.add_argument("--kill-at", type=int, default=None,
                   help="step at which a peer is SIGKILLed (default steps/3)")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128, help="MLP width (state size grows with its square)")
    a = p.parse_args(argv)
    if a.peers < 2:
        p.error(f"--peers must be at least 2, got {a.peers}")
    if a.steps is not None and a.steps < 8:
        p.error(f"--steps must be at least 8 (a kill, then a few steps), got {a.steps}")
    if a.step_delay is not None and not a.step_delay >= 0:
        p.error(f"--step-delay must be 0 or more, got {a.step_delay}")
    if a.timeout is not None and not a.timeout > 0:
        p.error(f"--timeout must be more than 0, got {a.timeout}")
    if a.hidden < 1:
        p.error(f"--hidden must be at least 1, got {a.hidden}")
    steps = a.steps if a.steps is not None else (40 if a.quick else 100)
    delay = a.step_delay if a.step_delay is not None else (0.01 if a.quick else 0.05)
    kill_at = a.kill_at if a.kill_at is not None else max(1, steps // 3)
    if not 0 < kill_at < steps - 5:
        p.error("--kill-at must leave a few steps after it")
    timeout = a.timeout if a.timeout is not None else (30.0 if a.quick else 60.0 + steps * (delay + 0.05))
    opts = DemoOptions(steps=steps, peers=a.peers, step_delay=delay, kill_at=kill_at, timeout=timeout,
                       seed=a.seed, hidden=a.hidden)

    def out(line: str) -> None:
        print(line, flush=True)

    try:
        passed = trio.run(_run_demo, opts, out)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0 if passed else 1


__all__ = ["DemoOptions", "Model", "PeerOptions", "main", "peer_main", "run_peer"]
