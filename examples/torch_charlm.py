"""A character-level transformer language model trained fault-tolerantly with pccl.torch.

Run it (the master, the peers and a single-process baseline are all started by this one command)::

    python examples/torch_charlm.py                  # TrainingRun and DiLoCo, 300 steps each, plot
    python examples/torch_charlm.py --mode ddp       # TrainingRun only
    python examples/torch_charlm.py --short          # 60 steps, no plot (for CI)

The text is the source code of Python's own standard library (``textwrap.py``, ``difflib.py``, ...: it
ships with every Python, nothing is downloaded). The model is a small GPT (token and position
embeddings, pre-norm transformer blocks with causal self-attention, a language-model head), sized for a
laptop CPU.

Each mode trains with three peer processes. Partway through, the parent kills one of them (SIGKILL,
mid-step) and later starts a fourth that joins the run: the survivors retry the step that was cut, the
newcomer receives the model and the optimizer state in its first sync, and training goes on. A
single-process run on the same global batches is the baseline:

* ``ddp`` (``TrainingRun``): every step averages the gradients of the step's global batch, split among
  whoever is there, so the loss curve is the baseline's, up to float32 rounding, whatever the peers do;
* ``diloco`` (``DiLoCo``): every peer takes 10 inner AdamW steps on its share of the data, then the
  pseudo-gradients are averaged and an outer Nesterov step is taken: 10x fewer all-reduces.

The parent checks that the surviving peers end with bit-identical shared state, that every
data-parallel step covered its whole global batch exactly once, and writes a plot of the loss curves
(``--plot``, default ``docs/torch_charlm.png``; needs matplotlib: ``pip install pccl[examples]``).

If a process fails or ``--timeout`` runs out, the parent stops waiting: it prints the master's statistics,
and every process still alive prints its threads and where its communicator stands
(``comm_statistics()``) before it ends.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing as mp
import os
import queue
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _support import dump_on_request, give_up  # examples/_support.py

MODULES = ["textwrap", "string", "difflib", "heapq", "bisect", "fractions", "calendar", "shlex", "glob",
           "fnmatch", "argparse"]
BLOCK = 64  # characters of context
GLOBAL_BATCH = 24  # sequences per step over all peers (divisible by 1, 2, 3 and 4)
VOCAB = 97  # printable ASCII, newline and one "other" token


def load_text() -> np.ndarray:
    """The modules' source, as token ids (uint8)."""
    import importlib.util

    chunks = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        chunks.append(Path(spec.origin).read_text(encoding="utf-8"))
    raw = np.frombuffer("\n".join(chunks).encode("ascii", "replace"), dtype=np.uint8)
    ids = np.where(raw == 10, 95, np.where((raw >= 32) & (raw < 127), raw - 32, 96))
    return ids.astype(np.uint8)


def build_model(seed: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.heads = heads

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            out: torch.Tensor = x + self.mlp(self.ln2(x))
            return out

    class CharGPT(nn.Module):
        def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, dim)
            self.pos = nn.Embedding(BLOCK, dim)
            self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
            self.ln = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, VOCAB)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            logits: torch.Tensor = self.head(self.ln(self.blocks(x)))
            return logits

    torch.manual_seed(seed)
    return CharGPT()


def batch(data: Any, starts: Any, idx: np.ndarray) -> tuple[Any, Any]:
    """Inputs and next-character targets of the sequences starting at ``starts[idx]``."""
    import torch

    rows = torch.from_numpy(starts[idx])[:, None] + torch.arange(BLOCK + 1)
    seq = data[rows].long()
    return seq[:, :-1], seq[:, 1:]


def peer_main(mode: str, address: str, index: int, args: argparse.Namespace, results: Any, go: Any,
              gate: Any) -> None:
    """One peer: waits for its gate (the late joiner) and trains until the run's last step."""
    import torch

    from pccl.torch import DiLoCo, SharedModel, TrainingRun

    logging.basicConfig(level=logging.ERROR, format=f"peer {index}: %(levelname)s %(message)s")
    driver: Any = None  # asked where it is (comm_statistics) when the parent gives up on the run
    dump_on_request(f"{mode} peer {index}", lambda: driver and (driver.revision, driver.comm_statistics()))
    torch.set_num_threads(1)
    data = torch.from_numpy(load_text())
    starts = np.arange(0, len(data) - BLOCK - 1, BLOCK // 2)
    # The late joiner starts from other weights on purpose: its first sync replaces them.
    model = build_model(seed=0 if gate is None else 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    results.put(("ready", mode, index))
    (go if gate is None else gate).wait()

    shard = {"loss": 0.0, "n": 0}

    def backward(step: Any) -> float:
        idx = step.shard(GLOBAL_BATCH, len(starts))
        x, y = batch(data, starts, idx)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        shard["loss"], shard["n"] = float(loss.detach()), len(idx)
        return shard["loss"]

    if mode == "ddp":
        driver = TrainingRun(address, SharedModel(model, optimizer), total_steps=args.steps)
    else:
        driver = DiLoCo(address, model, optimizer, inner_steps=args.inner_steps,
                        total_outer_steps=args.steps // args.inner_steps, delayed=mode == "diloco-delayed",
                        outer_optimizer=outer_optimizer(mode))
    with driver:
        while (r := driver.step(backward)) is not None:
            results.put(("step", mode, index, r.index, shard["loss"], shard["n"], r.world_size, r.attempts,
                         r.sync_rx_bytes))
        digest = hashlib.sha256(b"".join(t.tensor.detach().numpy().tobytes()
                                         for t in driver.shared.state.tensor_infos)).hexdigest()
    results.put(("done", mode, index, digest))


def outer_optimizer(mode: str) -> Any:
    import torch

    momentum = 0.5 if mode == "diloco-delayed" else 0.9  # delayed updates want less momentum

    def make(params: list[Any]) -> Any:
        return torch.optim.SGD(params, lr=0.7, momentum=momentum, nesterov=True)

    return make


def baseline_main(args: argparse.Namespace, results: Any) -> None:
    """Plain single-process torch on the same global batches."""
    import torch

    from pccl.torch import global_batch_indices

    dump_on_request("baseline")
    torch.set_num_threads(1)
    data = torch.from_numpy(load_text())
    starts = np.arange(0, len(data) - BLOCK - 1, BLOCK // 2)
    model = build_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    for s in range(args.steps):
        x, y = batch(data, starts, global_batch_indices(s, GLOBAL_BATCH, len(starts)))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        optimizer.step()
        results.put(("step", "baseline", 0, s, float(loss.detach()), GLOBAL_BATCH, 1, 1, 0))
    results.put(("done", "baseline", 0, ""))


class Run:
    """What the parent learns about one mode's run."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.steps: dict[int, list[tuple[int, float, int, int, int]]] = defaultdict(list)
        self.digests: dict[int, str] = {}
        self.events: list[tuple[int, str]] = []
        self.joiner_first: tuple[int, int] | None = None  # (step, bytes received by its first sync)

    def last_steps(self) -> dict[int, int]:
        """Each process's last reported step."""
        last: dict[int, int] = {}
        for step, rows in self.steps.items():
            for r in rows:
                last[r[0]] = max(last.get(r[0], -1), step)
        return dict(sorted(last.items()))

    def curve(self, *, whole_batches: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per step: the loss of the step's data (shard losses weighted by shard size) and world size.

        ``whole_batches``: only the steps whose reported shards cover the global batch (a peer killed
        right after a step's all-reduce never reports its shard of it, and the others' shards alone are not
        the global batch's loss).
        """
        xs = np.array(sorted(s for s in self.steps
                             if not whole_batches or sum(r[2] for r in self.steps[s]) == GLOBAL_BATCH))
        loss = np.array([sum(r[1] * r[2] for r in self.steps[s]) / sum(r[2] for r in self.steps[s])
                         for s in xs])
        world = np.array([max(r[3] for r in self.steps[s]) for s in xs])
        return xs, loss, world


def run_mode(mode: str, args: argparse.Namespace) -> Run:
    """Three peers, one killed at ``--kill-at``, one more joining at ``--join-at``, and the baseline
    (only with ``mode == "baseline"``)."""
    from pccl.blocking import MasterNode

    ctx = mp.get_context("spawn")  # not fork: the parent runs pccl's background thread
    results = ctx.Queue()
    run = Run(mode)
    if mode == "baseline":
        procs = [ctx.Process(target=baseline_main, args=(args, results), name="baseline")]
        expected = {0}
        master = None
    else:
        master = MasterNode("127.0.0.1:0")
        master.run()
        go, gate = ctx.Event(), ctx.Event()
        procs = [ctx.Process(target=peer_main, args=(mode, master.address, i, args, results, go,
                                                      gate if i == 3 else None), name=f"{mode}-peer-{i}")
                 for i in range(4)]
        expected = {0, 1, 3}  # peer 2 is killed
    for p in procs:
        p.start()
    ready: set[int] = set()
    killed = joined = False
    deadline = args.deadline
    try:
        while set(run.digests) != expected:
            if time.monotonic() >= deadline:
                print(f"[{mode}] timed out after {args.timeout:g} s; last steps reported: {run.last_steps()}",
                      file=sys.stderr)
                break
            try:
                msg = results.get(timeout=0.2)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for i, p in enumerate(procs)
                       if i != 2 or mode == "baseline"):
                    print(f"[{mode}] a process failed; last steps reported: {run.last_steps()}",
                          file=sys.stderr)
                    break
                continue
            kind, _, index, *rest = msg
            if kind == "ready":
                ready.add(index)
                if ready == {0, 1, 2, 3}:
                    go.set()
            elif kind == "done":
                run.digests[index] = rest[0]
            else:
                step, loss, n, world, attempts, rx = rest
                run.steps[step].append((index, loss, n, world, attempts))
                if index == 3 and run.joiner_first is None:
                    run.joiner_first = (step, rx)
                if attempts > 1:
                    run.events.append((step, f"peer {index}: step retried ({attempts} attempts)"))
                if mode != "baseline" and index == 0:
                    if not killed and step >= args.kill_at:
                        procs[2].kill()
                        killed = True
                        run.events.append((step, "peer 2 killed"))
                    if killed and not joined and step >= args.join_at:
                        gate.set()
                        joined = True
                        run.events.append((step, "peer 3 starts"))
                if index == 0 and step % max(1, args.steps // 10) == 0:
                    print(f"[{mode}] step {step:4d}  loss {loss:.3f}  peers {world}", flush=True)
        if set(run.digests) != expected:
            # Not waiting for the rest (a late joiner whose gate never opened waits for ever): each live
            # process prints where it is, and ends.
            if master is not None:
                print(f"[{mode}] master: {master.statistics()}", file=sys.stderr)
            give_up(procs)
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if master is not None:
            master.interrupt()
    return run


def check(run: Run, args: argparse.Namespace) -> bool:
    ok = True
    if run.mode != "baseline":
        survivors = {0, 1, 3}
        if set(run.digests) != survivors or len(set(run.digests.values())) != 1:
            print(f"[{run.mode}] FAILED: the survivors do not hold the same state: {run.digests}",
                  file=sys.stderr)
            ok = False
        if run.joiner_first is None or run.joiner_first[1] == 0:
            print(f"[{run.mode}] FAILED: the late joiner did not receive the state", file=sys.stderr)
            ok = False
        else:
            print(f"[{run.mode}] peer 3 joined at step {run.joiner_first[0]}, receiving "
                  f"{run.joiner_first[1]} bytes in its first sync")
    if run.mode == "ddp":
        # A step reported by every peer of its world must have covered the global batch exactly. The
        # killed peer's last report can be lost with it (it dies before its queue is flushed).
        full = {s: rows for s, rows in run.steps.items() if len(rows) == max(r[3] for r in rows)}
        short = [s for s, rows in full.items() if sum(r[2] for r in rows) != GLOBAL_BATCH]
        partial = sorted(set(run.steps) - set(full))
        kill_step = next((s for s, what in run.events if what == "peer 2 killed"), None)
        if kill_step is None or any(not kill_step - 2 <= s <= kill_step + 2 for s in partial):
            print(f"[ddp] FAILED: steps with missing reports away from the kill: {partial}", file=sys.stderr)
            ok = False
        if short:
            print(f"[ddp] FAILED: steps whose shards do not cover the global batch: {short[:10]}",
                  file=sys.stderr)
            ok = False
    steps = sorted(run.steps)
    expected = list(range(args.steps))
    if steps != expected:
        print(f"[{run.mode}] FAILED: steps missing", file=sys.stderr)
        return False
    _, loss, world = run.curve()
    first, last = float(np.mean(loss[:5])), float(np.mean(loss[-10:]))
    print(f"[{run.mode}] loss {first:.3f} -> {last:.3f}, world sizes {sorted(set(world.tolist()))}, "
          f"events: {run.events}")
    if not last < first:
        print(f"[{run.mode}] FAILED: the loss did not go down", file=sys.stderr)
        ok = False
    return ok


def smooth(y: np.ndarray, k: int = 9) -> np.ndarray:
    if len(y) < k:
        return y
    pad = np.pad(y, (k // 2, k // 2), mode="edge")
    return np.convolve(pad, np.ones(k) / k, mode="valid")


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    styles = {"baseline": ("single process (baseline)", "black", "-", 2.5),
              "ddp": ("TrainingRun, 3 peers: one killed, one joins", "tab:orange", "--", 1.5),
              "diloco": ("DiLoCo (H=10), same peers and faults", "tab:blue", "-", 1.5),
              "diloco-delayed": ("DiLoCo one-step-delayed (H=10)", "tab:green", "-", 1.5)}
    for run in runs:
        label, color, ls, lw = styles[run.mode]
        xs, loss, world = run.curve()
        ax.plot(xs, smooth(loss), color=color, ls=ls, lw=lw, label=label)
        if run.mode != "baseline":
            bx.step(xs, world, where="post", color=color, ls=ls, lw=lw, label=run.mode)
            for step, what in run.events:
                if what.startswith("peer 2 killed") or what.startswith("peer 3 starts"):
                    ax.axvline(step, color=color, alpha=0.3, lw=1)
                    ax.annotate(what, (step, 0), xycoords=("data", "axes fraction"),
                                xytext=(3, 4 + 12 * (run.mode != "ddp")), textcoords="offset points",
                                fontsize=7, color=color)
    ax.set_ylabel("training loss (nats/char, 9-step mean)")
    ax.set_title("char-level transformer on Python's stdlib sources, global batch 24 x 64 chars")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.set_ylabel("peers")
    bx.set_xlabel("step (DiLoCo: inner step)")
    bx.set_yticks([1, 2, 3])
    bx.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ddp", "diloco", "diloco-delayed", "both"], default="both",
                        help="which trainings to run (both: ddp and diloco)")
    parser.add_argument("--steps", type=int, default=300, help="steps (DiLoCo: inner steps) per run")
    parser.add_argument("--inner-steps", type=int, default=10, help="DiLoCo inner steps per outer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--short", action="store_true", help="60 steps, no plot (for CI)")
    parser.add_argument("--plot", type=Path,
                        default=Path(__file__).resolve().parents[1] / "docs" / "torch_charlm.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="give up after this many seconds (every process then prints where it is)")
    args = parser.parse_args(argv)
    if os.environ.get("PCCL_MASTER", "").strip():
        # Unlike hello_world.py and digits_ddp.py this example is no single peer (see its docstring).
        print(f"note: PCCL_MASTER is set, but {os.path.basename(__file__)} starts its own master and "
              "peers (it kills one and starts another itself): run it directly, not under pccl run",
              file=sys.stderr)
    if args.short:
        args.steps, args.no_plot = 60, True
    args.kill_at = int(args.steps * 0.3)
    args.join_at = int(args.steps * 0.55)
    logging.basicConfig(level=logging.ERROR)
    args.deadline = time.monotonic() + args.timeout  # for the whole command, baseline included
    text = load_text()
    print(f"text: {len(text)} characters of {', '.join(MODULES)}")
    modes = ["ddp", "diloco"] if args.mode == "both" else [args.mode]
    # The baseline runs beside the peers (its own process, its own queue): its time overlaps theirs, most
    # of which is starting (importing torch in four processes).
    with ThreadPoolExecutor(1) as pool:
        baseline = pool.submit(run_mode, "baseline", args)
        trained = [run_mode(m, args) for m in modes]
        runs = [baseline.result(), *trained]
    ok = all([check(r, args) for r in runs])
    if ok and "ddp" in modes:
        base_xs, base, _ = runs[0].curve()
        ddp_xs, ddp, _ = runs[1].curve(whole_batches=True)
        at = dict(zip(base_xs.tolist(), base.tolist(), strict=True))
        gap = max(abs(at[x] - loss) for x, loss in zip(ddp_xs.tolist(), ddp.tolist(), strict=True))
        print(f"[ddp] largest per-step loss difference from the baseline: {gap:.2e}")
        if gap > 1e-4:  # same global batches: only float32 summation order may differ
            print("[ddp] FAILED: the data-parallel run left the baseline's curve", file=sys.stderr)
            ok = False
    if ok and not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install pccl[examples])")
        else:
            plot(runs, args.plot)
    if ok:
        print("torch char-LM with kill and join: OK")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
