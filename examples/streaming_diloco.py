"""Streaming DiLoCo with pccl.torch: fragments synced on a staggered schedule, 4-bit outer gradients with
error feedback, the exchange overlapped with the next inner steps.

Run it (the master and the peers are all started by this one command)::

    python examples/streaming_diloco.py              # 3 peers, 30 cycles of 10 inner steps
    python examples/streaming_diloco.py --short      # 6 cycles (what CI runs)
    python examples/streaming_diloco.py --codec int8 --fragments 3 --overlap 2

Every peer trains its own copy of a small MLP on scikit-learn's handwritten digits (nothing is
downloaded) with AdamW (the inner optimizer, local). :class:`pccl.torch.StreamingDiLoCo` splits the
parameters into ``--fragments`` fragments; once every cycle of H = ``--inner-steps`` steps, fragment p
is sent at inner step ``p * H // P``: its pseudo-gradient ``outer - inner`` is compressed to 4 bits
(``--codec``), the part the compression lost is kept by the peer and added to its next one (error
feedback), and the peers' contributions are averaged (on 3 or more peers in two stages: each peer
averages one chunk, compresses it again and all of them gather the chunks) while the next inner
steps run (``--overlap``: by default until the exchange is found done, or a fixed count of steps).
The outer SGD (Nesterov) then steps that fragment's outer parameters and
the inner ones are merged with them (``--mixing``). The outer parameters, the outer optimizer's state
and the cycle count are the pccl shared state: identical on every peer, which the example checks.

It prints, per peer, the held-out loss and accuracy of the outer model and the bytes it sent, compares
those with what fp32 DiLoCo (a ring all-reduce of the whole model every H steps) would have sent, and
ends with ``streaming DiLoCo: OK`` when every check passed.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing as mp
import os
import sys
from typing import Any

import numpy as np
from _support import collect, load_digits_split  # examples/_support.py


def peer_main(address: str, index: int, args: argparse.Namespace, data: tuple[np.ndarray, ...],
              results: Any) -> None:
    """One peer: train to the end, evaluate the outer model, report (index, losses, accuracy, bytes,
    state digest)."""
    import torch
    from torch import nn

    from pccl.torch import StreamingDiLoCo

    logging.basicConfig(level=logging.WARNING, format=f"peer {index}: %(levelname)s %(message)s")
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in data)
    torch.manual_seed(index)  # different on purpose: the first sync makes the outer state identical
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, weight_decay=0.01)

    def outer_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=args.outer_lr, momentum=0.5, nesterov=True)

    def backward(step: Any) -> float:
        idx = torch.from_numpy(step.shard(args.batch_size * args.peers, len(x_train)))
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        return float(loss.detach())

    def evaluate(net: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            logits = net(x_test)
            loss = float(nn.functional.cross_entropy(logits, y_test))
            return loss, float((logits.argmax(1) == y_test).double().mean())

    sent = 0
    with StreamingDiLoCo(address, model, inner, outer_optimizer=outer_sgd, inner_steps=args.inner_steps,
                         fragments=args.fragments, overlap=args.overlap, mixing=args.mixing, codec=args.codec,
                         total_outer_steps=args.cycles, min_world_size=args.peers,
                         min_world_size_timeout=args.timeout) as run:
        start = evaluate(run.outer_model)
        while (r := run.step(backward)) is not None:
            if r.index == 0:
                start = evaluate(run.outer_model)  # after the first sync: the group's initial parameters
            sent += r.reduce_tx_bytes
        final = evaluate(run.outer_model)  # the model now holds the final outer parameters too
        digest = hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes()
                                         for t in run.shared.tensors().values())).hexdigest()
        stats = run.statistics()["fragments"]
    numel = sum(p.numel() for p in model.parameters())
    results.put((index, start[0], final[0], final[1], sent, numel, [f["lost"] for f in stats], digest))


def check(args: argparse.Namespace, done: list[tuple[Any, ...]]) -> bool:
    """Print the reports; True when every peer reported, the states agree, the loss fell and the bytes
    are what the compression promises."""
    from pccl.torch._codec import codec_from_spec, wire_bytes

    for index, start, final, acc, sent, _, lost, digest in sorted(done):
        print(f"peer {index}: held-out loss {start:.4f} -> {final:.4f}, accuracy {acc:.3f}, "
              f"{sent / 1e3:.1f} kB sent in {args.cycles} cycles, rounds lost {lost}, "
              f"outer state {digest[:12]}")
    if len(done) != args.peers:
        print(f"FAILED: {args.peers - len(done)} peers did not report", file=sys.stderr)
        return False
    if len({d[7] for d in done}) != 1:
        print("FAILED: the peers ended with different outer states", file=sys.stderr)
        return False
    _, start, final, acc, sent, numel, _, _ = min(done)
    fp32 = wire_bytes(None, numel, 4, args.peers) * args.cycles
    print(f"fp32 DiLoCo would have sent {fp32 / 1e3:.1f} kB per peer (ring all-reduce every "
          f"{args.inner_steps} steps): {fp32 / max(sent, 1):.1f}x more")
    if not final < start or acc < args.min_accuracy:
        print(f"FAILED: loss {start:.4f} -> {final:.4f}, accuracy {acc:.3f} (want >= {args.min_accuracy})",
              file=sys.stderr)
        return False
    codec = codec_from_spec(args.codec)
    if codec is not None and sent >= fp32:
        print("FAILED: the compressed run sent no fewer bytes than fp32 DiLoCo", file=sys.stderr)
        return False
    print("streaming DiLoCo: OK")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=30, help="cycles of H inner steps (default 30)")
    parser.add_argument("--inner-steps", type=int, default=10, help="H (default 10)")
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--overlap", type=lambda t: t if t == "auto" else int(t), default="auto",
                        help='inner steps an exchange overlaps, or "auto" (default): applied at the first '
                             'inner step that finds it done')
    parser.add_argument("--mixing", type=float, default=0.5)
    parser.add_argument("--codec", default="int4", help="fp32, int8, int4, topk:F or topk:F:int4")
    parser.add_argument("--batch-size", type=int, default=32, help="per peer")
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--min-accuracy", type=float, default=0.85)
    parser.add_argument("--short", action="store_true", help="6 cycles, accuracy >= 0.5 (for CI)")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    if os.environ.get("PCCL_MASTER", "").strip():
        print(f"note: PCCL_MASTER is set, but {os.path.basename(__file__)} starts its own master and "
              "peers: run it directly, not under pccl run", file=sys.stderr)
    if args.short:
        args.cycles, args.min_accuracy = 6, 0.5
    logging.basicConfig(level=logging.WARNING)
    data = load_digits_split()

    from pccl.blocking import MasterNode

    with MasterNode("127.0.0.1:0") as master:
        master.run()
        ctx = mp.get_context("spawn")  # not fork: the parent runs pccl's background thread
        results = ctx.Queue()
        procs = [ctx.Process(target=peer_main, args=(master.address, i, args, data, results),
                             name=f"peer-{i}") for i in range(args.peers)]
        for p in procs:
            p.start()
        try:
            done = collect(procs, results, args.peers, args.timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
    return 0 if check(args, done) and all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
