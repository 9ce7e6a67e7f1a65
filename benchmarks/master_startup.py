"""How long ``pccl-master`` takes from spawn to listening (what a restarted master adds to the restart delay).

Spawns ``python -m pccl master --host 127.0.0.1 --port 0`` with ``PYTHONPATH`` set to each given source
tree in turn (interleaved, so a busy host slows both alike), reads its stderr up to the "master listening"
line, kills it. Prints the median per tree and the ratio to the first.

usage: python benchmarks/master_startup.py [--runs 8] [TREE ...]   (default: this tree)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def once(root: str) -> float:
    """Seconds from spawn to the "master listening" line, with ``root`` first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=root)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pccl", "master", "--host", "127.0.0.1", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            if "master listening" in line:
                return time.monotonic() - t0
        raise RuntimeError(f"the master in {root} exited without listening (code {proc.wait()})")
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("trees", nargs="*", default=[str(Path(__file__).resolve().parent.parent)])
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {t: [] for t in args.trees}
    for _ in range(args.runs):
        for tree in args.trees:
            times[tree].append(once(tree))
    first = statistics.median(times[args.trees[0]])
    for tree, ts in times.items():
        med = statistics.median(ts)
        print(f"{tree}: median {med:.3f} s (ratio to the first {med / first:.2f}); "
              + " ".join(f"{t:.3f}" for t in ts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
