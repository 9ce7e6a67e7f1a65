"""Per-step cost of pccl.torch's TrainingRun against a hand-written blocking loop on the same model.

    python benchmarks/torch_step.py                       # 2 peers, MLP 4 x 512, 40 timed steps, 3 rounds
    python benchmarks/torch_step.py --peers 3 --width 1024

Every peer is its own process. Each round runs both variants one after the other (A/B interleaved, on a
fresh master each), on the same model and data:

* ``hand``: the loop of docs/recipe.md with pccl.blocking, as examples/digits_ddp.py writes it:
  ``are_peers_pending`` / ``update_topology``, ``sync_shared_state`` of the parameters and the optimizer
  state, backward, ``all_reduce_multiple_with_retry`` of one descriptor per parameter (AVG, all in flight),
  ``optimizer.step()``;
* ``driver``: ``TrainingRun.step(backward)`` with its defaults (4 MiB buckets, 4 in flight).

Also timed: ``local``, the same step with no communication at all (forward, backward, optimizer step).
Prints, per variant, the median step time of peer 0 over each round's timed steps, the median over the
rounds, and the driver's overhead against the hand-written loop.

On a busy machine the network part of a step varies far more than the driver's own cost, so
``--micro`` measures that cost alone, in one process: the gradient packing and unpacking of one step
(the copies into and out of the buckets), the round trip of one request from the caller's thread to
the driver's trio thread and back (a step makes five: pending, members, sync, all-reduce, plus
update_topology when someone joins), and a whole driver step whose requests are answered at once in
the caller's thread (the all-reduce copies send to recv: the result of a group of one), against the
local step.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any


def make(width: int, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 64, generator=g)
    y = torch.randint(0, 10, (4096,), generator=g)
    return model, optimizer, x, y


def hand_loop(address: str, args: argparse.Namespace) -> list[float]:
    import torch

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

    model, optimizer, x, y = make(args.width)
    for p in model.parameters():  # create Adam's state (the zero-gradient trick of digits_ddp.py)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    entries = []
    for name, p in model.named_parameters():
        entries.append(TensorInfo.from_torch(p.data, name))
        for key, value in optimizer.state[p].items():
            entries.append(TensorInfo.from_torch(value, f"{name}.{key}"))
    state = SharedState(entries)
    times: list[float] = []
    with Communicator(address) as comm:
        comm.connect(n_attempts=20)
        just_joined = comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) > 1
        while True:
            t0 = time.perf_counter()
            if not just_joined and comm.are_peers_pending():
                comm.update_topology()
            just_joined = False
            if comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) < args.peers:
                time.sleep(0.01)
                continue
            comm.sync_shared_state(state)
            if state.revision >= args.warmup + args.steps:
                return times
            step = state.revision
            state.revision += 1
            rows = slice(step * args.batch % 4096, step * args.batch % 4096 + args.batch)
            optimizer.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            grads = [p.grad for p in model.parameters()]
            comm.all_reduce_multiple_with_retry([
                ReduceOpDescriptor.from_torch(g, g, ReduceDescriptor(
                    count=g.numel(), op=ReduceOp.AVG, tag=tag,
                    operand_descriptor=ReduceOperandDescriptor(DataType.FLOAT32)))
                for tag, g in enumerate(grads)], max_in_flight=len(grads))
            optimizer.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)


def driver_loop(address: str, args: argparse.Namespace) -> list[float]:
    import torch

    from pccl.torch import SharedModel, TrainingRun

    model, optimizer, x, y = make(args.width)

    def backward(step: Any) -> None:
        rows = slice(step.index * args.batch % 4096, step.index * args.batch % 4096 + args.batch)
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()

    times: list[float] = []
    with TrainingRun(address, SharedModel(model, optimizer), total_steps=args.warmup + args.steps,
                     min_world_size=args.peers, poll_interval=0.01, connect_attempts=20) as run:
        while True:
            t0 = time.perf_counter()
            r = run.step(backward)
            if r is None:
                return times
            if r.index >= args.warmup:
                times.append(time.perf_counter() - t0)


def local_loop(args: argparse.Namespace) -> list[float]:
    import torch

    model, optimizer, x, y = make(args.width)
    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        rows = slice(step * args.batch % 4096, step * args.batch % 4096 + args.batch)
        optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def peer_main(index: int, schedule: list[tuple[str, str]], args: argparse.Namespace, out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    for variant, address in schedule:
        times = hand_loop(address, args) if variant == "hand" else driver_loop(address, args)
        if index == 0:
            out.put((variant, statistics.median(times)))
        if index == 0 and variant == "driver":
            out.put(("local", statistics.median(local_loop(args))))


def micro(args: argparse.Namespace) -> None:
    """The driver's own cost per step, without a network (see the module docstring)."""
    import torch

    from pccl import ReduceInfo, SharedStateSyncInfo
    from pccl.torch import SharedModel
    from pccl.torch._exec import BackgroundThread
    from pccl.torch._ops import AllReduce, Members, PeersPending, Sync, drive
    from pccl.torch._train import TrainCore

    torch.set_num_threads(1)
    model, optimizer, x, y = make(args.width)
    shared = SharedModel(model, optimizer)
    core = TrainCore(shared, just_joined=False, total_steps=None, bucket_bytes=4 * 2**20, max_in_flight=4,
                     min_world_size=1, poll_interval=0.01)

    def answer(op: Any) -> Any:
        if isinstance(op, PeersPending):
            return False
        if isinstance(op, Members):
            return 0, 2
        if isinstance(op, Sync):
            return SharedStateSyncInfo(tx_bytes=0, rx_bytes=0)
        if isinstance(op, AllReduce):
            for send, recv in op.pairs:
                recv.copy_(send)
            return ReduceInfo(local_world_size=2, tx_bytes=0, rx_bytes=0)
        raise TypeError(op)

    def backward(step: Any) -> None:
        rows = slice(step.index * args.batch % 4096, step.index * args.batch % 4096 + args.batch)
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()

    def timed(fn: Any, n: int) -> float:
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    for p in model.parameters():
        p.grad = torch.randn_like(p)
    def pack_and_unpack() -> None:
        core.buckets.pack_grads()
        core.buckets.unpack_grads()

    pack = timed(pack_and_unpack, 200)
    thread = BackgroundThread()

    async def nothing() -> None:
        return None

    hop = timed(lambda: thread.call(nothing), 2000)
    thread.close()
    rounds = []
    for _ in range(args.rounds):
        local = statistics.median(local_loop(args))
        step = timed(lambda: drive(core.step(backward), answer), args.steps)
        rounds.append((local, step))
    local = statistics.median(r[0] for r in rounds)
    step = statistics.median(r[1] for r in rounds)
    print(f"MLP width {args.width}: {core.buckets.nbytes / 2**20:.1f} MiB of gradients in "
          f"{len(core.buckets)} bucket(s)")
    print(f"  pack + unpack of one step's gradients: {1e3 * pack:.3f} ms")
    print(f"  one request's round trip to the driver's trio thread: {1e6 * hop:.1f} us "
          f"(x5 per step: {5e3 * hop:.3f} ms)")
    print(f"  driver step, requests answered at once: {1e3 * step:.3f} ms; local step: {1e3 * local:.3f} ms; "
          f"difference {1e3 * (step - local):+.3f} ms (rounds: "
          + ", ".join(f"{1e3 * (s - lo):+.3f}" for lo, s in rounds) + ")")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP (default 512)")
    parser.add_argument("--batch", type=int, default=64, help="per-peer batch (default 64)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro", action="store_true", help="the driver's own cost only (one process)")
    args = parser.parse_args(argv)
    if args.micro:
        micro(args)
        return 0

    from pccl.blocking import MasterNode

    masters = []
    schedule: list[tuple[str, str]] = []
    for r in range(args.rounds):
        for variant in (("hand", "driver") if r % 2 == 0 else ("driver", "hand")):
            m = MasterNode("127.0.0.1:0")
            m.run()
            masters.append(m)
            schedule.append((variant, m.address))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=peer_main, args=(i, schedule, args, out)) for i in range(args.peers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    for m in masters:
        m.interrupt()
    if any(p.exitcode != 0 for p in procs):
        print("a peer failed", file=sys.stderr)
        return 1
    results: dict[str, list[float]] = {}
    while not out.empty():
        variant, t = out.get()
        results.setdefault(variant, []).append(t)
    n_params = sum(p.numel() for p in make(args.width)[0].parameters())
    print(f"{args.peers} peers, MLP width {args.width} ({n_params:,} parameters, "
          f"{4 * n_params / 2**20:.1f} MiB of gradients), batch {args.batch} per peer, "
          f"{args.steps} timed steps x {args.rounds} rounds")
    for variant in ("local", "hand", "driver"):
        rounds = ", ".join(f"{1e3 * t:.2f}" for t in results[variant])
        median = statistics.median(results[variant])
        print(f"  {variant:7s} median step {1e3 * median:7.2f} ms  (rounds: {rounds})")
    hand, driver = statistics.median(results["hand"]), statistics.median(results["driver"])
    ratios = [d / h for d, h in zip(results["driver"], results["hand"], strict=True)]
    print(f"  driver / hand: {driver / hand:.3f} (per round: {', '.join(f'{r:.3f}' for r in ratios)}); "
          f"driver - hand: {1e3 * (driver - hand):+.2f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
