"""Data-parallel training of a small MLP on scikit-learn's handwritten digits, fault-tolerant with pccl.

Run it (the master and the peers are all started by this one command)::

    python examples/digits_ddp.py                 # 2 peers, 300 steps
    python examples/digits_ddp.py --peers 3
    python examples/digits_ddp.py --short         # 40 steps, for CI
    pccl run -n 2 examples/digits_ddp.py --short  # one peer per process, under pccl run's master

The digits data (1,797 8x8 images) ships inside scikit-learn, so nothing is downloaded. The parent process
loads it once and hands each peer its copy.

Each peer follows the fault-tolerant training-loop recipe of docs/recipe.md:

1. admit pending peers (``are_peers_pending`` / ``update_topology``);
2. ``sync_shared_state`` the model parameters *and* the optimizer state; after a peer's first sync every
   sync moves zero bytes, because every peer applies the same averaged gradients to the same state with the
   same deterministic optimizer. The example asserts exactly that;
3. compute gradients on a local batch (each peer draws different batches);
4. average the gradients with ``all_reduce_multiple_with_retry`` (retried if a peer drops out);
5. step the optimizer.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing as mp
import queue
import sys
import time
from typing import Any

import numpy as np
from _support import collect, launched_peer, load_digits_split, one_report  # examples/_support.py

MIN_PEERS = 2


def peer_main(address: str | None, index: int, args: argparse.Namespace, data: tuple[np.ndarray, ...],
              results: Any) -> None:
    """One data-parallel worker."""
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

    # Different initial weights on purpose: the first shared-state sync makes every peer identical.
    torch.manual_seed(index)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    # One step with zero gradients creates Adam's state tensors (step, exp_avg, exp_avg_sq) without moving
    # the weights, so the optimizer state can be part of the shared state from the start.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()

    entries = []
    for name, p in model.named_parameters():
        entries.append(TensorInfo.from_torch(p.data, name))
        for key, value in optimizer.state[p].items():
            entries.append(TensorInfo.from_torch(value, f"{name}.{key}"))
    state = SharedState(entries)

    batch_rng = np.random.default_rng(1000 + index)  # each peer sees different batches
    loss_fn = nn.CrossEntropyLoss()
    syncs = 0
    first_sync_rx = 0

    with Communicator(address, peer_group=0) as comm:
        comm.connect(n_attempts=10)
        just_joined = comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) > 1
        while True:
            # 1. membership. A peer that was just admitted skips this once: the peers that admitted it
            #    are already on their way to step 2, which is where it must meet them.
            topology_changed = just_joined
            if not just_joined and comm.are_peers_pending():
                comm.update_topology()
                topology_changed = True
            just_joined = False
            if comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) < MIN_PEERS:
                time.sleep(0.02)  # alone: wait for someone to train with
                continue

            # 2. shared state: parameters and optimizer state, identical everywhere after this call.
            info = comm.sync_shared_state(state)
            syncs += 1
            if syncs == 1:
                first_sync_rx = info.rx_bytes
            else:
                assert info.rx_bytes == 0, f"sync {syncs} received {info.rx_bytes} bytes: the state drifted"
                if not topology_changed:
                    assert info.tx_bytes == 0, f"sync {syncs} sent {info.tx_bytes} bytes without a newcomer"
            if state.revision >= args.steps:
                break
            state.revision += 1

            # 3. local gradients
            batch = torch.from_numpy(batch_rng.choice(len(x_train), size=args.batch_size, replace=False))
            optimizer.zero_grad(set_to_none=False)
            loss = loss_fn(model(x_train[batch]), y_train[batch])
            loss.backward()

            # 4. average them across the peers (retried on peer loss)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            descriptors = [
                ReduceOpDescriptor.from_torch(
                    send=g, recv=g,
                    reduce_descriptor=ReduceDescriptor(
                        count=g.numel(), op=ReduceOp.AVG, tag=tag,
                        operand_descriptor=ReduceOperandDescriptor(DataType.FLOAT32)))
                for tag, g in enumerate(grads)
            ]
            comm.all_reduce_multiple_with_retry(descriptors, max_in_flight=len(descriptors))

            # 5. the same averaged gradients and the same state give the same new state on every peer
            optimizer.step()
            if index == 0 and state.revision % max(1, args.steps // 5) == 0:
                print(f"step {state.revision:4d}  loss {loss.item():.4f}  "
                      f"peers {comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE)}", flush=True)

    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    digest = hashlib.sha256(b"".join(t.tensor.numpy().tobytes() for t in state.tensor_infos)).hexdigest()
    results.put((index, accuracy, digest, syncs, first_sync_rx))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2, help="number of peer processes (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--short", action="store_true", help="40 steps (for CI)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-peer batch size (default 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="fail below this test accuracy (default 0.9, or 0.6 with --short)")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    if args.short:
        args.steps = 40
    if args.min_accuracy is None:
        args.min_accuracy = 0.6 if args.short else 0.9
    if args.peers < MIN_PEERS:
        parser.error(f"--peers must be at least {MIN_PEERS}")

    launched = launched_peer(args.peers)
    if launched is not None:  # one peer of a run started elsewhere: the address comes from PCCL_MASTER
        rank, args.peers = launched
        mine: queue.Queue[tuple[Any, ...]] = queue.Queue()
        peer_main(None, rank, args, load_digits_split(), mine)
        _, accuracy, digest, syncs, first_rx = one_report(mine)
        print(f"peer {rank}: test accuracy {accuracy:.3f}, {syncs} syncs (first received {first_rx} B), "
              f"state {digest[:12]}")
        if accuracy < args.min_accuracy:
            print(f"FAILED: accuracy below {args.min_accuracy}", file=sys.stderr)
            return 1
        print("digits data-parallel training: OK")
        return 0

    from pccl.blocking import MasterNode

    logging.basicConfig(level=logging.WARNING)
    data = load_digits_split()
    print(f"digits: {len(data[0])} training and {len(data[2])} test images")
    master = MasterNode("127.0.0.1:0")
    master.run()

    ctx = mp.get_context("spawn")  # not fork: the parent runs pccl's background thread
    results = ctx.Queue()
    procs = [ctx.Process(target=peer_main, args=(master.address, i, args, data, results), name=f"peer-{i}")
             for i in range(args.peers)]
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

    for index, accuracy, digest, syncs, first_rx in sorted(reports):
        print(f"peer {index}: test accuracy {accuracy:.3f}, {syncs} syncs "
              f"(first received {first_rx} B, then 0 B), state {digest[:12]}")
    failed = [p.name for p in procs if p.exitcode != 0]
    if failed or len(reports) != args.peers:
        print(f"FAILED: {failed or 'missing reports'}", file=sys.stderr)
        return 1
    if len({r[2] for r in reports}) != 1:
        print("FAILED: the peers ended with different parameters", file=sys.stderr)
        return 1
    if min(r[1] for r in reports) < args.min_accuracy:
        print(f"FAILED: accuracy below {args.min_accuracy}", file=sys.stderr)
        return 1
    print("digits data-parallel training: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
