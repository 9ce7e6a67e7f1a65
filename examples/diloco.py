"""DiLoCo with pccl: inner AdamW steps on each peer, an outer Nesterov SGD step on averaged pseudo-gradients.

Run it (the master and the peers are all started by this one command)::

    python examples/diloco.py                    # sync mode, 2 peers + 1 late joiner
    python examples/diloco.py --mode async       # one-step-delayed outer updates
    python examples/diloco.py --mode both             # both, one after the other
    python examples/diloco.py --mode both --short     # 6 outer steps of 5 inner steps (what CI runs)

DiLoCo (Douillard et al., 2023): every peer keeps the *outer* parameters (the same on all peers) and an
*inner* copy of the model. Each outer step, the inner copy trains for H local AdamW steps starting from the
outer parameters; the pseudo-gradient ``outer - inner`` is averaged over the peers with an all-reduce, and an
outer SGD optimizer (Nesterov momentum) applies it to the outer parameters. Communication happens once every
H steps instead of every step.

The outer parameters, the outer optimizer's momentum and an outer-step counter are the pccl shared state, so
a peer that joins late receives all of them in its first sync and trains in lockstep from then on. After a
peer's first sync, every sync moves zero bytes (asserted), because every peer applies the same averaged
pseudo-gradients with the same optimizer.

Modes:

* ``sync``: all-reduce the pseudo-gradients, then apply them, then continue.
* ``async``: the all-reduce of step t runs in a background thread while step t+1's inner steps compute; its
  result is applied at the end of step t+1 (one step late). Shared state is synced only while no all-reduce
  runs (pccl refuses it otherwise). When a peer is waiting to join, the peers first finish the running
  all-reduce and apply it, then admit the newcomer, which receives the up-to-date outer state; the pipeline
  restarts from there.

The data is scikit-learn's handwritten digits (shipped inside scikit-learn; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from typing import Any

import numpy as np
from _support import dump_on_request, give_up, load_digits_split  # examples/_support.py

MIN_PEERS = 2
JOIN_STEP = 2  # peers wait for the late joiners at this outer step (they may arrive earlier)


class Background:
    """A blocking call run in a thread; ``join()`` returns its result or re-raises its error."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._result: Any = None
        self._error: BaseException | None = None

        def body() -> None:
            try:
                self._result = fn(*args)
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=body, daemon=True)
        self._thread.start()

    def join(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def peer_main(addresses: dict[str, str], index: int, args: argparse.Namespace,
              data: tuple[np.ndarray, ...], results: Any, gates: dict[str, Any]) -> None:
    """One DiLoCo worker; it trains once per mode (one master per mode), in the order of ``addresses``.

    A late joiner waits for the mode's gate (set once that run is under way) before it connects.
    """
    dump_on_request(f"peer {index}")  # its threads, when the parent gives up on the run
    import torch
    from torch import nn

    from pccl.blocking import (
        Attribute,
        Communicator,
        DataType,
        ReduceDescriptor,
        ReduceOp,
        ReduceOpDescriptor,
        ReduceOperandDescriptor,
        SharedState,
        TensorInfo,
    )

    logging.basicConfig(level=logging.WARNING, format=f"peer {index}: %(levelname)s %(message)s")
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in data)
    loss_fn = nn.CrossEntropyLoss()

    def make_model() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def train(mode: str, address: str, gate: Any) -> tuple[float, float, str, int]:
        """One DiLoCo training; returns (first-sync loss, final loss, state digest, syncs)."""
        batch_rng = np.random.default_rng(2000 + index)  # each peer trains on different batches
        torch.manual_seed(index)  # different on purpose: the first sync makes the outer state identical
        inner = make_model()
        inner_opt = torch.optim.AdamW(inner.parameters(), lr=args.inner_lr, weight_decay=0.01)
        outer = [nn.Parameter(p.detach().clone()) for p in inner.parameters()]
        # Delayed (async) updates are applied one outer step late: Nesterov 0.9 then overshoots and the
        # loss diverges; 0.5 converges (docs/torch.md).
        outer_momentum = args.outer_momentum
        if outer_momentum is None:
            outer_momentum = 0.9 if mode == "sync" else 0.5
        outer_opt = torch.optim.SGD(outer, lr=args.outer_lr, momentum=outer_momentum, nesterov=True)
        # A step with zero gradients creates the momentum buffers (zeros) without moving the parameters, so
        # they can be shared state from the first sync on.
        for p in outer:
            p.grad = torch.zeros_like(p)
        outer_opt.step()
        outer_step = torch.zeros(1, dtype=torch.int64)

        entries = [TensorInfo.from_torch(outer_step, "outer_step")]
        for i, p in enumerate(outer):
            entries.append(TensorInfo.from_torch(p.data, f"outer.{i}"))
            momentum = outer_opt.state[p]["momentum_buffer"]
            entries.append(TensorInfo.from_torch(momentum, f"outer.{i}.momentum"))
        state = SharedState(entries)

        def evaluate() -> float:
            with torch.no_grad():
                model = make_model()
                for dst, src in zip(model.parameters(), outer, strict=True):
                    dst.copy_(src)
                return float(loss_fn(model(x_test), y_test))

        def reset_inner() -> None:
            with torch.no_grad():
                for p, o in zip(inner.parameters(), outer, strict=True):
                    p.copy_(o)

        def inner_steps() -> None:
            for _ in range(args.inner_steps):
                batch = torch.from_numpy(batch_rng.choice(len(x_train), size=args.batch_size, replace=False))
                inner_opt.zero_grad()
                loss_fn(inner(x_train[batch]), y_train[batch]).backward()
                inner_opt.step()

        def pseudo_gradients() -> list[torch.Tensor]:
            with torch.no_grad():
                return [o.detach() - p.detach() for o, p in zip(outer, inner.parameters(), strict=True)]

        def average(grads: list[torch.Tensor]) -> list[torch.Tensor]:
            descriptors = [
                ReduceOpDescriptor.from_torch(g, g, ReduceDescriptor(
                    count=g.numel(), op=ReduceOp.AVG, tag=tag,
                    operand_descriptor=ReduceOperandDescriptor(DataType.FLOAT32)))
                for tag, g in enumerate(grads)
            ]
            comm.all_reduce_multiple_with_retry(descriptors, max_in_flight=len(descriptors))
            return grads

        def apply(grads: list[torch.Tensor]) -> None:
            for p, g in zip(outer, grads, strict=True):
                p.grad = g
            outer_opt.step()

        syncs = 0
        start_loss = float("nan")

        def sync(topology_changed: bool) -> None:
            nonlocal syncs, start_loss
            info = comm.sync_shared_state(state)
            syncs += 1
            if syncs == 1:
                start_loss = evaluate()  # the group's outer parameters as this peer first sees them
            else:
                assert info.rx_bytes == 0, f"sync {syncs} received {info.rx_bytes} B: the outer state drifted"
                if not topology_changed:
                    assert info.tx_bytes == 0, f"sync {syncs} sent {info.tx_bytes} bytes without a newcomer"
            state.revision += 1

        n_total = args.peers + args.late_joiners
        running: Background | None = None  # async mode: the all-reduce of the previous outer step

        if index >= args.peers and not gate.wait(args.timeout):
            raise TimeoutError("the run never got under way")
        with Communicator(address, peer_group=0) as comm:
            comm.connect(n_attempts=10)
            just_joined = comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) > 1
            while True:
                # 1. membership. A newly admitted peer skips this once: the peers that admitted it are already
                #    on their way to the sync, where it must meet them.
                topology_changed = just_joined
                if not just_joined:
                    wanted = n_total if int(outer_step) >= JOIN_STEP else MIN_PEERS
                    deadline = time.monotonic() + args.timeout
                    while True:
                        if comm.are_peers_pending():  # allowed while the async all-reduce runs
                            if running is not None:
                                # drain the pipeline: finish and apply the running all-reduce, so the
                                # newcomer receives outer parameters that include it
                                apply(running.join())
                                running = None
                            comm.update_topology()
                            topology_changed = True
                        if comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) >= wanted:
                            break
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"waited {args.timeout:g}s for {wanted} peers")
                        time.sleep(0.02)
                just_joined = False

                # 2. sync the outer state whenever no all-reduce runs (every step in sync mode), and start the
                #    inner model from it
                if running is None:
                    sync(topology_changed)
                    reset_inner()
                if int(outer_step) >= args.outer_steps:
                    break

                # 3. inner steps
                inner_steps()
                grads = pseudo_gradients()

                # 4. outer step (sync mode: the next iteration's sync checks the result)
                if mode == "sync":
                    apply(average(grads))
                else:
                    if running is not None:
                        apply(running.join())  # the previous step's average, one step late
                        sync(False)
                    running = Background(average, grads)
                reset_inner()
                outer_step += 1
                if index == 0:
                    print(f"[{mode}] outer step {int(outer_step):3d}  test loss {evaluate():.4f}  "
                          f"peers {comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE)}", flush=True)
                results.put(("progress", mode, index, int(outer_step)))

            if running is not None:  # async: apply the last average, then check everyone agrees
                apply(running.join())
                sync(False)

        digest = hashlib.sha256(b"".join(t.tensor.detach().numpy().tobytes()
                                         for t in state.tensor_infos)).hexdigest()
        return start_loss, evaluate(), digest, syncs

    for mode, address in addresses.items():
        results.put(("done", mode, index, *train(mode, address, gates[mode])))


def check(mode: str, args: argparse.Namespace, done: list[tuple[Any, ...]]) -> bool:
    """Print one mode's reports; True when every peer reported the same outer state and the loss fell."""
    for index, start_loss, final_loss, digest, syncs in sorted(done):
        kind = "late joiner" if index >= args.peers else "initial peer"
        print(f"[{mode}] peer {index} ({kind}): test loss {start_loss:.4f} at its first sync -> "
              f"{final_loss:.4f}, {syncs} syncs, outer state {digest[:12]}")
    if len(done) != args.peers + args.late_joiners:
        print(f"[{mode}] FAILED: missing reports", file=sys.stderr)
        return False
    if len({d[3] for d in done}) != 1:
        print(f"[{mode}] FAILED: the peers ended with different outer states", file=sys.stderr)
        return False
    first = min(done)
    if not first[2] < first[1]:
        print(f"[{mode}] FAILED: the test loss did not go down", file=sys.stderr)
        return False
    print(f"[{mode}] DiLoCo: OK")
    return True


def run(modes: list[str], args: argparse.Namespace, data: tuple[np.ndarray, ...]) -> bool:
    """Run the trainings (a master per mode, peers and late joiners); True when every check passed."""
    from pccl.blocking import MasterNode

    masters = {mode: MasterNode("127.0.0.1:0") for mode in modes}
    for m in masters.values():
        m.run()
    n = args.peers + args.late_joiners
    ctx = mp.get_context("spawn")  # not fork: the parent runs pccl's background thread
    results = ctx.Queue()
    gates = {mode: ctx.Event() for mode in modes}  # set once that run is under way: late joiners come then
    # Every process starts now (importing torch takes a while); the late joiners wait for their gate.
    procs = [ctx.Process(target=peer_main, args=({k: m.address for k, m in masters.items()}, i, args, data,
                                                 results, gates), name=f"peer-{i}") for i in range(n)]
    for p in procs:
        p.start()
    done: dict[str, list[tuple[Any, ...]]] = {mode: [] for mode in modes}
    deadline = time.monotonic() + args.timeout
    try:
        while sum(map(len, done.values())) < n * len(modes) and time.monotonic() < deadline:
            try:
                msg = results.get(timeout=0.2)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    print("a peer failed; stopping", file=sys.stderr)
                    break
                continue
            if msg[0] == "done":
                done[msg[1]].append(msg[2:])
            elif msg[3] >= 1:
                gates[msg[1]].set()
        if sum(map(len, done.values())) < n * len(modes):
            if time.monotonic() >= deadline:
                print(f"timed out after {args.timeout:g}s", file=sys.stderr)
            give_up(procs)  # not waiting for the rest: a late joiner waits for its gate until its timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        for m in masters.values():
            m.interrupt()
    ok = all([check(mode, args, done[mode]) for mode in modes])
    failed = [p.name for p in procs if p.exitcode != 0]
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
    return ok and not failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async", "both"], default="sync")
    parser.add_argument("--peers", type=int, default=2, help="peers at the start (default 2)")
    parser.add_argument("--late-joiners", type=int, default=1, help="peers that join later (default 1)")
    parser.add_argument("--outer-steps", type=int, default=30, help="outer steps (default 30)")
    parser.add_argument("--inner-steps", type=int, default=10, help="inner AdamW steps per outer step")
    parser.add_argument("--short", action="store_true", help="6 outer steps of 5 inner steps (for CI)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="outer Nesterov momentum (default 0.9 in sync mode, 0.5 in async mode: delayed "
                             "updates diverge with 0.9)")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    if os.environ.get("PCCL_MASTER", "").strip():
        # Unlike hello_world.py and digits_ddp.py this example is no single peer (see its docstring).
        print(f"note: PCCL_MASTER is set, but {os.path.basename(__file__)} starts its own master and "
              "peers (it starts late joiners itself): run it directly, not under pccl run", file=sys.stderr)
    if args.short:
        args.outer_steps, args.inner_steps = 6, 5
    if args.peers < MIN_PEERS:
        parser.error(f"--peers must be at least {MIN_PEERS}")
    if args.late_joiners and args.outer_steps <= JOIN_STEP:
        parser.error(f"--outer-steps must exceed {JOIN_STEP} when peers join late")

    logging.basicConfig(level=logging.WARNING)
    data = load_digits_split()
    modes = ["sync", "async"] if args.mode == "both" else [args.mode]
    return 0 if run(modes, args, data) else 1


if __name__ == "__main__":
    sys.exit(main())
