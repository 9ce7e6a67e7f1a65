"""Training on slow links: data-parallel against DiLoCo (fp32, int8) and streaming DiLoCo (int4, error
feedback), loss against wall-clock.

    python benchmarks/slow_link_training.py                     # 3 peers, 50 ms RTT, 20 Mbit/s, plot
    python benchmarks/slow_link_training.py --rate-mbit 10 --dp-steps 300 --inner-steps 30

The model is the character-level transformer of examples/torch_charlm.py (116,705 parameters,
float32: 467 KB), on Python's standard-library sources, global batch 24 sequences of 64 characters
per step (8 per peer). Three peer processes, one thread each, and a master in this process.

**The link** (benchmarks/_shaped.py, at pccl's transport seam, since this kernel has no netem): every
peer's uplink sends at ``--rate-mbit`` and every byte reaches the other side ``--rtt-ms / 2`` later,
so each pair of peers sees the RTT and the rate each way (a peer's uplink is shared by all its
destinations); peer -> master messages get ``--rtt-ms`` of one-way delay and no rate limit (the
master's replies none: the master's RTT is ``--rtt-ms`` too). Underneath is loopback TCP.

Runs, one after the other (same master, same seeds):

* ``dp``: :class:`pccl.torch.TrainingRun`, ``--dp-steps`` steps;
* ``diloco-fp32``: :class:`pccl.torch.DiLoCo`, H = ``--inner-steps``, outer SGD lr 0.7 Nesterov 0.9;
* ``diloco-int8``: the same with the library's UINT8 min-max wire quantization;
* ``streaming-int4``: :class:`pccl.torch.StreamingDiLoCo`, same H, ``--fragments`` fragments, int4
  payloads with error feedback (``DeflateCodec(MinMaxCodec(4, block=--int4-block), bits=--int4-bits)``,
  what the codec spec ``"int4"`` means, one min/max pair per chunk: the 4-bit codes deflated into a
  fixed 3.6 bits per element; ``--int4-bits 0``: the plain 4-bit codes), overlap ``--overlap``
  (default ``auto``: each exchange applied at the first inner step that finds it done), mixing 0.5,
  membership every ``--sync-every`` cycles (with ``auto``: the vote in the background, a sync only to
  admit a newcomer and at the run's end; ``--check-every N``: a blocking sync every N cycles too).

Each DiLoCo run trains ``--diloco-steps`` inner steps. Peer 0 evaluates the (outer) model on 64
held-out sequences every ``--eval-every`` steps; the evaluation's time is left out of the clock.
Wall time starts when the three peers have finished their first step (connections made). The
"waiting" column is the time ``step()`` spent blocked on communication (``network_wait_s``) over the
wall time, per peer averaged (each peer's is printed too, with what peer 0 waited in, by request, and
each peer's wall time less its waiting: a peer that computed for less time than the slowest waits at
least the difference);
bytes are those of the gradient or pseudo-gradient exchanges that peer 0 sent, per 100 inner steps.
Prints a table and the targets, and writes ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import end_processes, wait_listening  # noqa: E402

MODES = ["dp", "diloco-fp32", "diloco-int8", "streaming-int4"]


def peer_main(mode: str, address: str, index: int, args: argparse.Namespace, results: Any) -> None:
    """One peer of one run; reports through ``results.put`` (an mp queue, or a JSON file writer)."""
    import torch
    import torch_charlm as lm  # examples/torch_charlm.py
    from _shaped import ShapedTransport

    import pccl
    from pccl.torch import DeflateCodec, DiLoCo, MinMaxCodec, SharedModel, StreamingDiLoCo, TrainingRun

    torch.set_num_threads(1)
    data = torch.from_numpy(lm.load_text())
    starts_all = np.arange(0, len(data) - lm.BLOCK - 1, lm.BLOCK // 2)
    held = len(starts_all) // 10
    starts, eval_starts = starts_all[:-held], starts_all[-held:]
    eval_x, eval_y = lm.batch(data, eval_starts, np.arange(0, held, max(1, held // 64))[:64])
    model = lm.build_model(seed=0)
    lr = args.lr if mode == "dp" or args.inner_lr is None else args.inner_lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    host, port = address.rsplit(":", 1)
    transport = None  # on the WAN emulator the kernel's TCP crosses the emulated links
    if args.link == "seam":
        # the master's side is unshaped: the peer -> master direction gets the whole RTT
        transport = ShapedTransport(rate=args.rate_mbit * 1e6 / 8, delay=args.rtt_ms / 2000,
                                    control={(host, int(port))}, control_delay=args.rtt_ms / 1000)
    outer = None

    def outer_sgd(params: list[Any]) -> Any:
        return torch.optim.SGD(params, lr=args.outer_lr, momentum=0.9, nesterov=True)

    def backward(step: Any) -> float:
        idx = step.shard(lm.GLOBAL_BATCH, len(starts))
        x, y = lm.batch(data, starts, idx)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, lm.VOCAB), y.reshape(-1))
        loss.backward()
        return float(loss.detach())

    common: dict[str, Any] = dict(min_world_size=args.peers)
    if transport is not None:
        common["transport"] = transport
    driver: Any
    if mode == "dp":
        driver = TrainingRun(address, SharedModel(model, optimizer), total_steps=args.dp_steps, **common)
        steps = args.dp_steps
    elif mode.startswith("diloco"):
        q = None
        if mode == "diloco-int8":
            q = pccl.QuantizationOptions(quantized_datatype=pccl.DataType.UINT8,
                                         algorithm=pccl.QuantizationAlgorithm.MIN_MAX)
        driver = DiLoCo(address, model, optimizer, inner_steps=args.inner_steps, outer_optimizer=outer_sgd,
                        quantization=q, total_outer_steps=args.diloco_steps // args.inner_steps, **common)
        steps = args.diloco_steps
        outer = driver.outer_model
    else:
        int4 = MinMaxCodec(4, block=args.int4_block)
        # one codec object per fragment, so each fragment's counters are its own
        codec = [DeflateCodec(int4, bits=args.int4_bits) if args.int4_bits else int4
                 for _ in range(args.fragments)]
        driver = StreamingDiLoCo(address, model, optimizer, inner_steps=args.inner_steps,
                                 outer_optimizer=outer_sgd, fragments=args.fragments, overlap=args.overlap,
                                 mixing=args.mixing, codec=codec,
                                 sync_every=args.sync_every, check_every=args.check_every or None,
                                 total_outer_steps=args.diloco_steps // args.inner_steps, **common)
        steps = args.diloco_steps
        outer = driver.outer_model
    evaluated = outer if outer is not None else model

    def evaluate() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(evaluated(eval_x).reshape(-1, lm.VOCAB),
                                                           eval_y.reshape(-1)))

    curve: list[tuple[float, int, float]] = []
    tx = 0
    t0 = wait0 = 0.0
    by_op0: dict[str, float] = {}
    eval_time = 0.0
    with driver:
        n = 0
        while (r := driver.step(backward)) is not None:
            n += 1
            if n == 1:  # the clock starts once everyone is connected and the first step is done
                t0, wait0 = time.perf_counter(), driver.network_wait_s
                by_op0 = dict(driver._blocking.wait_by_op)
                continue
            tx += r.reduce_tx_bytes
            done = r.index + 1
            if done % args.eval_every == 0 or done == steps:
                # every peer evaluates (only peer 0 records): each pauses alike, so no peer's wait on
                # the network includes another's evaluation
                e0 = time.perf_counter()
                at = e0 - t0 - eval_time
                loss = evaluate()
                eval_time += time.perf_counter() - e0
                if index == 0:
                    curve.append((at, done, loss))
        wall = time.perf_counter() - t0 - eval_time
        wait = driver.network_wait_s - wait0
        by_op = {k: v - by_op0.get(k, 0.0) for k, v in driver._blocking.wait_by_op.items()}
        stats = driver.statistics() if hasattr(driver, "statistics") else {}
    results.put((mode, index, {"curve": curve, "wall": wall, "wait": wait, "tx": tx, "steps": n - 1,
                               "by_op": by_op, "stats": stats}))


class _FileReport:
    """``put`` writes the peer's report as JSON to ``path`` (a peer on the WAN emulator's host)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def put(self, item: tuple[str, int, dict[str, Any]]) -> None:
        tmp = self.path + ".tmp"
        Path(tmp).write_text(json.dumps(item[2]))
        os.replace(tmp, self.path)


def as_peer(spec_path: str) -> int:
    """``--as-peer SPEC``: one peer process started on an emulated host by :func:`run_mode_wan`."""
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["args"])
    peer_main(spec["mode"], spec["address"], spec["index"], args, _FileReport(spec["out"]))
    return 0


def run_mode_wan(mode: str, args: argparse.Namespace, wan: Any, port: int) -> dict[int, dict[str, Any]]:
    """One run on the WAN emulator: peer ``i`` on host ``i``, the master on host ``peers``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    mhost = args.peers
    address = f"{wan.addresses[mhost]}:{port}"
    before = {(x["src"], x["dst"]): x["bytes"] for x in wan.stats()["links"]}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "master.log"
        with log.open("w") as f:
            master = wan.popen(mhost, [sys.executable, "-m", "pccl", "master", "--host", wan.addresses[mhost],
                                       "--port", str(port)], stdout=subprocess.DEVNULL, stderr=f, env=env)
        procs: list[subprocess.Popen[Any]] = []
        try:
            if not wait_listening(master, log):
                raise SystemExit(f"[{mode}] the master did not start:\n{log.read_text()[-2000:]}")
            plain = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
            outs = []
            for i in range(args.peers):
                out = Path(tmp) / f"peer{i}.json"
                spec = Path(tmp) / f"spec{i}.json"
                spec.write_text(json.dumps({"mode": mode, "address": address, "index": i, "out": str(out),
                                            "args": plain}))
                outs.append(out)
                procs.append(wan.popen(i, [sys.executable, str(Path(__file__).resolve()), "--as-peer",
                                           str(spec)], env=env))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.5)  # the peers run for minutes; their exit is what is waited for
            result = {i: json.loads(o.read_text()) for i, o in enumerate(outs) if o.exists()}
        finally:
            end_processes(procs, master)
    if len(result) < args.peers:
        raise SystemExit(f"[{mode}] FAILED: {args.peers - len(result)} peers did not report")
    after = {(x["src"], x["dst"]): x["bytes"] for x in wan.stats()["links"]}
    # what peer 0's host put on its links to the other peers (IP packets: headers, control and all),
    # over the whole run (connection set-up and the first step included)
    result[0]["wire"] = sum(after[(0, j)] - before.get((0, j), 0) for j in range(1, args.peers))
    return result


def run_mode(mode: str, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    from pccl.blocking import MasterNode

    master = MasterNode("127.0.0.1:0")
    master.run()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=peer_main, args=(mode, master.address, i, args, results), name=f"{mode}-{i}")
             for i in range(args.peers)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(out) < args.peers and time.monotonic() < deadline:
            try:
                _, i, rep = results.get(timeout=0.5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            out[i] = rep
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        master.interrupt()
    if len(out) < args.peers:
        raise SystemExit(f"[{mode}] FAILED: {args.peers - len(out)} peers did not report")
    return out


def time_to(curve: list[tuple[float, int, float]], target: float, column: int = 0) -> float | None:
    """Wall time (``column`` 0) or inner step (1) at which the curve first reaches ``target``
    (interpolated between evaluations)."""
    prev = (0.0, float("inf"))
    for point in curve:
        t, loss = point[column], point[2]
        if loss <= target:
            if prev[1] == float("inf"):
                return t
            return prev[0] + (t - prev[0]) * (prev[1] - target) / (prev[1] - loss)
        prev = (t, loss)
    return None


def plot(runs: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install pccl[examples])")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"dp": ("data-parallel TrainingRun", "black"), "diloco-fp32": ("DiLoCo fp32", "tab:blue"),
              "diloco-int8": ("DiLoCo int8 (wire)", "tab:orange"),
              "streaming-int4": ("streaming DiLoCo int4 + error feedback", "tab:green")}
    for mode, reps in runs.items():
        label, color = styles[mode]
        curve = reps[0]["curve"]
        ax.plot([c[0] for c in curve], [c[2] for c in curve], color=color, label=label)
    target = runs["dp"][0]["curve"][-1][2]
    ax.axhline(target, color="black", ls=":", lw=1)
    ax.set_xlabel("wall-clock seconds (evaluation excluded)")
    ax.set_ylabel("held-out loss (nats/char)")
    how = "pccl.testing.wan" if args.link == "wan" else "transport-seam emulation"
    ax.set_title(f"char-LM ({args.params:,} params), 3 peers, {args.rtt_ms:g} ms RTT, "
                 f"{args.rate_mbit:g} Mbit/s links ({how})", fontsize=10)
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def _overlap(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rtt-ms", type=float, default=50.0)
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="each peer's uplink (Mbit/s)")
    parser.add_argument("--dp-steps", type=int, default=300)
    parser.add_argument("--diloco-steps", type=int, default=600, help="inner steps of each DiLoCo run")
    parser.add_argument("--inner-steps", type=int, default=50, help="H")
    parser.add_argument("--fragments", type=int, default=3)
    parser.add_argument("--overlap", type=_overlap, default="auto",
                        help='inner steps an exchange overlaps, or "auto" (default: applied when done)')
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--check-every", type=int, default=20,
                        help="streaming, overlap auto: a blocking sync every N cycles too (0: only to admit "
                             "and at the run's end)")
    parser.add_argument("--mixing", type=float, default=0.5, help="streaming's inner merge factor")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--inner-lr", type=float, default=None,
                        help="the DiLoCo runs' AdamW lr (default: --lr)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "slow_link_training.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run")
    parser.add_argument("--link", choices=["auto", "wan", "seam"], default="auto",
                        help="wan: pccl.testing.wan (root); seam: benchmarks/_shaped.py; auto: wan if it can")
    parser.add_argument("--int4-block", type=int, default=16384,
                        help="elements per min/max pair of the int4 codec (one pair per chunk here)")
    parser.add_argument("--int4-bits", type=float, default=3.6,
                        help="the int4 codes' deflate budget, bits per element (0: plain 4-bit codes)")
    parser.add_argument("--json", type=Path, help="write every run's reports (curves, waits, bytes) here")
    parser.add_argument("--as-peer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_peer:
        return as_peer(args.as_peer)
    import torch_charlm as lm

    from pccl.testing.wan import unavailable_reason

    why = unavailable_reason()
    if args.link == "auto":
        args.link = "seam" if why else "wan"
        if why:
            print(f"the WAN emulator cannot run ({why}): the link is emulated at the transport seam")
    elif args.link == "wan" and why:
        raise SystemExit(f"--link wan: {why}")
    args.params = sum(p.numel() for p in lm.build_model(0).parameters())
    modes = args.modes.split(",")
    how = ("pccl.testing.wan: every pair of hosts on its own link, the master on a 4th host"
           if args.link == "wan" else "userspace-shaped at the transport seam, benchmarks/_shaped.py")
    print(f"model {args.params:,} parameters ({args.params * 4 / 1e3:.0f} KB fp32); {args.peers} peers; "
          f"link: {args.rtt_ms:g} ms RTT, {args.rate_mbit:g} Mbit/s ({how}); H={args.inner_steps}; "
          f"load average {os.getloadavg()[0]:.1f}")
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    wan: Any = None
    if args.link == "wan":
        from pccl.testing.wan import WanEmulator

        wan = WanEmulator(args.peers + 1).start()
        wan.set_all(rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit)
    try:
        for k, mode in enumerate(modes):
            runs[mode] = run_mode(mode, args) if wan is None else run_mode_wan(mode, args, wan, 29_500 + k)
            r0 = runs[mode][0]
            print(f"[{mode}] {r0['steps'] + 1} steps, {r0['wall']:.1f} s, "
                  f"final loss {r0['curve'][-1][2]:.4f}; "
                  "peer 0 waited in: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(r0["by_op"].items()))
                  + "; waiting per peer: " + ", ".join(f"{100 * r['wait'] / r['wall']:.1f}%"
                                                      for _, r in sorted(runs[mode].items()))
                  # what each peer computed (wall - waiting): a peer that computed less than the slowest
                  # waits at least the difference in any synchronous scheme (three trainers on a shared
                  # host do not get equal CPU)
                  + "; computing per peer: " + ", ".join(f"{r['wall'] - r['wait']:.2f} s"
                                                         for _, r in sorted(runs[mode].items())), flush=True)
            frags = r0.get("stats", {}).get("fragments", [])
            if any("encodes" in f for f in frags):
                enc = sum(f["encodes"] for f in frags)
                wide = sum(f["widened"] for f in frags)
                print(f"[{mode}] peer 0's deflated int4 encodings: {enc}, of which {wide} had their range "
                      f"widened to fit {args.int4_bits:g} bits per element", flush=True)
    finally:
        if wan is not None:
            wan.close()
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}))
    rows = []
    for mode, reps in runs.items():
        r0 = reps[0]
        per100 = r0["tx"] / max(1, r0["steps"]) * 100
        waiting = sum(r["wait"] / r["wall"] for r in reps.values()) / len(reps)
        wire = f"{r0['wire'] / (r0['steps'] + 1) * 100 / 1e6:.3f}" if "wire" in r0 else "-"
        rows.append((mode, r0["steps"] + 1, f"{r0['wall']:.1f}", f"{r0['curve'][-1][2]:.4f}",
                     f"{per100 / 1e6:.3f}", wire, f"{100 * waiting:.1f}"))
    widths = [max(len(str(c)) for c in col) for col in zip(*rows, strict=True)]
    heads = ["mode", "steps", "wall s", "final loss", "MB sent / 100 steps (peer 0)",
             "MB on its links / 100 steps", "waiting % of wall"]
    widths = [max(w, len(h)) for w, h in zip(widths, heads, strict=True)]
    print("  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    verdicts: list[str] = []
    if "dp" in runs:
        dp = runs["dp"][0]
        target = dp["curve"][-1][2]
        dp_wait = sum(r["wait"] / r["wall"] for r in runs["dp"].values()) / len(runs["dp"])
        print(f"data-parallel waits {100 * dp_wait:.1f}% of its wall time (want >= 70%); its loss at step "
              f"{dp['steps'] + 1}: {target:.4f} after {dp['wall']:.1f} s")
        verdicts.append(f"data-parallel waits >= 70%: {'yes' if dp_wait >= 0.7 else 'NO'}")
        for mode in modes[1:]:
            r0 = runs[mode][0]
            t = time_to(r0["curve"], target)
            at = time_to(r0["curve"], target, column=1)
            # what decides the wall time of a compute-bound run: its compute per inner step (the
            # machine's load), and the inner steps it needs (training, not the machine)
            compute = (r0["wall"] - r0["wait"]) / max(1, r0["steps"])
            print(f"[{mode}] reaches it after "
                  + (f"{t:.1f} s = 1/{dp['wall'] / t:.1f} of data-parallel's time, at inner step {at:.0f}"
                     if t and at else "(never)")
                  + f"; {1e3 * compute:.0f} ms of compute per inner step (peer 0)")
    if "diloco-fp32" in runs and "streaming-int4" in runs:
        fp = runs["diloco-fp32"][0]
        st = runs["streaming-int4"][0]
        ratio = (fp["tx"] / max(1, fp["steps"])) / max(1e-9, st["tx"] / max(1, st["steps"]))
        if "wire" in fp:
            wire_ratio = (fp["wire"] / (fp["steps"] + 1)) / max(1e-9, st["wire"] / (st["steps"] + 1))
            print(f"on the emulated links (IP packets, control traffic included): {wire_ratio:.2f}x")
        st_wait = sum(r["wait"] / r["wall"] for r in runs["streaming-int4"].values()) / args.peers
        print(f"streaming int4 sends {ratio:.2f}x fewer bytes than DiLoCo fp32 (target >= 8x); waits "
              f"{100 * st_wait:.1f}% of its wall time (target < 5%)")
        verdicts.append(f">= 8x fewer bytes: {'yes' if ratio >= 8 else 'NO'}")
        verdicts.append(f"waits < 5%: {'yes' if st_wait < 0.05 else 'NO'}")
        if "dp" in runs:
            t = time_to(st["curve"], runs["dp"][0]["curve"][-1][2])
            fast = t is not None and t <= runs["dp"][0]["wall"] / 5
            verdicts.append(f"data-parallel's loss in <= 1/5 of its time: {'yes' if fast else 'NO'}")
    if not args.no_plot:
        plot(runs, args, args.plot)
    print("targets: " + "; ".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
