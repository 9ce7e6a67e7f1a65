#!/usr/bin/env python3
"""Where does the seeded chaos test's trace change between two commits?

``tests/testing/test_chaos.py SEED OUT.json`` writes one run's sorted trace (events and commits in virtual
time); the trace of a seed is deterministic (docs/testing.md, "Chaos testing"), so two commits whose traces
differ behave differently. This script runs seeds on commits and says where they part:

    # the first differing event of seeds 0-5 between two commits
    python scripts/chaos_bisect.py compare 46e0f8d main --seeds 0-5

    # every commit on the way from A to B where a seed's trace changes (B's first-parent chain back to the
    # merge that brought A in, then down A's branch), with the first differing event at each
    python scripts/chaos_bisect.py changes 46e0f8d main --seeds 0-5 --report /tmp/changes.json

    # a merge that changes a trace, split: the first parent merged with each commit of the merged branch
    python scripts/chaos_bisect.py split 8b3103b --seeds 5

Each tree is built with ``git archive TREEISH pccl | tar -x`` (no worktree) and run with PYTHONPATH pointing
at it, always with the same trace script (``--script``, by default this checkout's
tests/testing/test_chaos.py, copied once), so older commits whose test lacks ``fixed_scheduling`` are run
pinned too. Traces are cached by the blobs of the pccl files a chaos run can import (pccl/torch, the WAN
emulator and the CLI are left out: a commit that changes only those gives the same trace) plus the script's
bytes, so commits that change nothing the run imports cost nothing. Runs go under ``nice`` (``--nice``,
default 15), ``--jobs`` at a time (default 2). ``changes`` assumes that a seed whose trace is the same at two
commits is the same at every commit between them (a change undone later in the range is not seen).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

Trace = list[tuple[float, str]]

# Paths under pccl/ that a chaos run never imports (checked with sys.modules after the test's imports, and
# no imported module imports them inside a function): a commit that changes only these keeps every trace.
NOT_IMPORTED = (
    "pccl/torch/",
    "pccl/testing/wan/",
    "pccl/testing/pytest_plugin.py",
    "pccl/cli.py",
    "pccl/demo.py",
    "pccl/launcher.py",
    "pccl/_cliutil.py",
    "pccl/__main__.py",
)

REPO = Path(__file__).resolve().parent.parent

# Runs the trace script's run_chaos until virtual time UNTIL and writes the sorted entries at or before it
# (all of them: an entry is logged at its own virtual instant). Cheap when the traces part early.
PREFIX_RUNNER = """
import importlib.util, json, logging, sys
import trio, trio.testing
script, seed, out, until = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
spec = importlib.util.spec_from_file_location("chaos_trace_script", script)
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
made = []
init = mod.Chaos.__init__
def record(self, *args, **kwargs):
    init(self, *args, **kwargs)
    made.append(self)
mod.Chaos.__init__ = record
logging.disable(logging.CRITICAL)
async def main():
    with trio.move_on_after(until + 0.5):
        await mod.run_chaos(seed)
trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
assert len(made) == 1, made
trace = sorted(e for e in made[0].trace if e[0] <= until)
open(out, "w").write(json.dumps(trace))
"""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def is_ancestor(a: str, b: str) -> bool:
    return subprocess.run(["git", "merge-base", "--is-ancestor", a, b], cwd=REPO).returncode == 0


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            seeds.extend(range(int(lo), int(hi) + 1))
        elif part.strip():
            seeds.append(int(part))
    return seeds


@dataclass(frozen=True)
class Point:
    """A tree to run: a commit, or a synthetic merge (``tree`` a tree id, ``label`` says what it is)."""

    tree: str  # a tree-ish git archive accepts
    label: str

    @property
    def short(self) -> str:
        return self.label.split()[0][:12]


@dataclass
class Runner:
    script: Path
    prefix: str
    cache: Path
    nice: int
    jobs: int
    verbose: bool = True
    _slots: threading.Semaphore = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _futures: dict[tuple[str, int, float | None], concurrent.futures.Future[Trace]] = field(
        default_factory=dict
    )
    _keys: dict[str, str] = field(default_factory=dict)
    _built: dict[str, Path] = field(default_factory=dict)
    runs: int = 0

    def __post_init__(self) -> None:
        self._slots = threading.Semaphore(self.jobs)
        self.cache.mkdir(parents=True, exist_ok=True)
        self._script_hash = hashlib.sha1(self.script.read_bytes()).hexdigest()[:12]

    def key(self, point: Point) -> str:
        """The hash of the pccl files a chaos run can import, at ``point``, and of the trace script."""
        with self._lock:
            if point.tree in self._keys:
                return self._keys[point.tree]
        listing = git("ls-tree", "-r", point.tree, "--", "pccl")
        rows = [row for row in listing.splitlines() if not row.split("\t", 1)[1].startswith(NOT_IMPORTED)]
        digest = hashlib.sha1("\n".join(rows).encode()).hexdigest()[:16]
        key = f"{digest}-{self._script_hash}"
        with self._lock:
            self._keys[point.tree] = key
        return key

    def build(self, point: Point) -> Path:
        with self._lock:
            if point.tree in self._built:
                return self._built[point.tree]
            where = Path(f"{self.prefix}{point.short}")
            if not (where / "pccl" / "__init__.py").exists():
                shutil.rmtree(where, ignore_errors=True)
                where.mkdir(parents=True)
                archive = subprocess.run(
                    ["git", "archive", point.tree, "pccl"], cwd=REPO, check=True, capture_output=True
                ).stdout
                subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
            self._built[point.tree] = where
            return where

    def trace(self, point: Point, seed: int, until: float | None = None) -> Trace:
        """Seed ``seed``'s sorted trace at ``point`` (cached on disk, run at most once per process); with
        ``until``, only its entries at or before that virtual time (the run stops there)."""
        key = self.key(point)
        if until is not None:
            full = self.cache / f"{key}-s{seed}.json"
            if full.exists():
                return [e for e in self._load(full) if e[0] <= until]
        with self._lock:
            future = self._futures.get((key, seed, until))
            mine = future is None
            if mine:
                future = concurrent.futures.Future()
                self._futures[(key, seed, until)] = future
        assert future is not None
        if mine:
            try:
                future.set_result(self._run(point, key, seed, until))
            except BaseException as exc:
                future.set_exception(exc)
        return future.result()

    @staticmethod
    def _load(path: Path) -> Trace:
        return [(t, text) for t, text in json.loads(path.read_text())]

    def _run(self, point: Point, key: str, seed: int, until: float | None) -> Trace:
        out = self.cache / (f"{key}-s{seed}.json" if until is None else f"{key}-s{seed}-until{until!r}.json")
        if out.exists():
            return self._load(out)
        tree = self.build(point)
        if until is None:
            args = [str(self.script), str(seed)]
        else:
            runner = self.cache / "prefix_runner.py"
            with self._lock:
                if not runner.exists() or runner.read_text() != PREFIX_RUNNER:
                    runner.write_text(PREFIX_RUNNER)
            args = [str(runner), str(self.script), str(seed)]
        with self._slots:
            started = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="chaos-bisect-") as tmp:
                tmp_out = Path(tmp) / "trace.json"
                env = {**os.environ, "PYTHONPATH": str(tree)}
                env.pop("PCCL_CHAOS_SHUFFLE", None)  # creation order: comparable across commits
                done = subprocess.run(
                    ["nice", "-n", str(self.nice), sys.executable, *args, str(tmp_out),
                     *([] if until is None else [repr(until)])],
                    cwd=tmp, env=env, capture_output=True, text=True,
                )
                if done.returncode != 0:
                    raise RuntimeError(
                        f"seed {seed} at {point.label}: the chaos run failed (rc {done.returncode}):\n"
                        + (done.stdout + done.stderr)[-3000:]
                    )
                shutil.copyfile(tmp_out, out.with_suffix(".tmp"))
                os.replace(out.with_suffix(".tmp"), out)
            self.runs += 1
            if self.verbose:
                upto = "" if until is None else f" until t={until}"
                print(f"  ran seed {seed}{upto} at {point.label[:60]} ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)
        return self._load(out)


def first_difference(a: Trace, b: Trace) -> str | None:
    """None if the traces are equal, else where they part (index, virtual time, both entries)."""
    if a == b:
        return None
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"entry {k}/{len(a)}|{len(b)}: t={x[0]} {x[1]!r} vs t={y[0]} {y[1]!r}"
    k = min(len(a), len(b))
    longer = a if len(a) > len(b) else b
    return (
        f"entry {k}: one trace ends ({len(a)} vs {len(b)} entries), "
        f"the other has t={longer[k][0]} {longer[k][1]!r}"
    )


def commit_point(rev: str) -> Point:
    sha = git("rev-parse", f"{rev}^{{commit}}")
    return Point(sha, f"{sha[:7]} {git('log', '-1', '--format=%s', sha)[:80]}")


def path_commits(a: str, b: str) -> list[str]:
    """Commits from ``a`` to ``b``: b's first-parent chain, entering a merged branch where ``a`` came in."""
    a = git("rev-parse", f"{a}^{{commit}}")
    chain: list[str] = []
    c = git("rev-parse", f"{b}^{{commit}}")
    while c != a:
        chain.append(c)
        parents = git("rev-list", "--parents", "-n", "1", c).split()[1:]
        if not parents:
            raise SystemExit(f"{a[:7]} is not an ancestor of {b}")
        c = next((p for p in parents if is_ancestor(a, p)), "")
        if not c:
            raise SystemExit(f"{a[:7]} is not an ancestor of {b}")
    chain.append(a)
    return chain[::-1]


def dedupe(runner: Runner, points: list[Point]) -> list[Point]:
    """Consecutive points with the same key run the same code: keep the first of each stretch."""
    kept: list[Point] = []
    for p in points:
        if not kept or runner.key(kept[-1]) != runner.key(p):
            kept.append(p)
    return kept


def part_time(a: Trace, b: Trace) -> float:
    """The earliest virtual time at which two different traces differ: their entries up to it differ."""
    k = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if k < min(len(a), len(b)):
        return min(a[k][0], b[k][0])
    return (a if len(a) > len(b) else b)[k][0]


def both(first: Callable[[], object], second: Callable[[], object]) -> None:
    """Run two calls at once (each may wait for chaos runs; the runner bounds how many run)."""
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            first()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    thread = threading.Thread(target=guarded)
    thread.start()
    second()
    thread.join()
    if errors:
        raise errors[0]


def changes(
    runner: Runner, points: list[Point], seed: int, prefixes: bool = True, hints: frozenset[int] = frozenset()
) -> list[tuple[int, str]]:
    """Indexes i where seed's trace at points[i] differs from points[i-1] (and the first difference).

    Between two points whose full traces differ from virtual time t on, the change is found by bisection on
    the traces' entries up to t (runs stopped at t: cheap when t is early); then the full traces on both
    sides of it are run and both sides searched again, so a second change in either side is found too.
    ``prefixes=False`` bisects on full traces instead. ``hints``: indexes of likely changes (another seed's),
    tried first: the points just before and at one are run before any bisection step."""
    found: list[tuple[int, str]] = []
    lock = threading.Lock()

    def note(i: int, diff: str | None) -> None:
        assert diff is not None
        with lock:
            found.append((i, diff))

    def solve(lo: int, hi: int, t_lo: Trace, t_hi: Trace) -> None:
        diff = first_difference(t_lo, t_hi)
        if diff is None:
            return
        if hi == lo + 1:
            note(hi, diff)
            return
        if not prefixes:
            mid = (lo + hi) // 2
            t_mid = runner.trace(points[mid], seed)
            both(lambda: solve(lo, mid, t_lo, t_mid), lambda: solve(mid, hi, t_mid, t_hi))
            return
        until = part_time(t_lo, t_hi)
        start = [e for e in t_lo if e[0] <= until]
        a, b = lo, hi  # the prefix at a is t_lo's, at b it is not
        for h in sorted(hints):  # each run narrows (a, b] as a bisection step does
            if not a < h <= b or b - a == 1:
                continue
            if h - 1 > a:
                if runner.trace(points[h - 1], seed, until) != start:
                    b = h - 1
                    continue
                a = h - 1
            if h < b:
                if runner.trace(points[h], seed, until) != start:
                    b = h
                else:
                    a = h
        while b - a > 1:
            mid = (a + b) // 2
            if runner.trace(points[mid], seed, until) == start:
                a = mid
            else:
                b = mid
        full: dict[int, Trace] = {lo: t_lo, hi: t_hi}
        both(lambda: full.setdefault(a, runner.trace(points[a], seed)),
             lambda: full.setdefault(b, runner.trace(points[b], seed)))
        note(b, first_difference(full[a], full[b]))
        both(lambda: solve(lo, a, t_lo, full[a]), lambda: solve(b, hi, full[b], t_hi))

    ends: dict[int, Trace] = {}
    last = len(points) - 1
    both(lambda: ends.setdefault(0, runner.trace(points[0], seed)),
         lambda: ends.setdefault(last, runner.trace(points[last], seed)))
    solve(0, last, ends[0], ends[last])
    return sorted(found)


def split_points(merge: str, parent: int = 2) -> tuple[list[Point], list[str]]:
    """The merge's first parent, then the first parent merged with each commit of the merged branch (oldest
    first; ``git merge-tree --write-tree``), then the merge itself. Commits that conflict are skipped."""
    p1 = git("rev-parse", f"{merge}^1")
    p2 = git("rev-parse", f"{merge}^{parent}")
    base = git("merge-base", p1, p2)
    branch = git("rev-list", "--first-parent", "--reverse", f"{base}..{p2}").splitlines()
    points = [commit_point(p1)]
    skipped: list[str] = []
    for c in branch:
        done = subprocess.run(
            ["git", "merge-tree", "--write-tree", "--no-messages", p1, c],
            cwd=REPO, capture_output=True, text=True,
        )
        subject = git("log", "-1", "--format=%s", c)[:70]
        if done.returncode != 0:
            skipped.append(f"{c[:7]} {subject} (conflicts with {p1[:7]})")
            continue
        tree = done.stdout.split()[0]
        points.append(Point(tree, f"{c[:7]}+{p1[:7]} (merged) {subject}"))
    points.append(commit_point(merge))
    return points, skipped


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("compare", "changes", "split"))
    ap.add_argument("revs", nargs="+", help="compare/changes: A B; split: MERGE")
    ap.add_argument("--seeds", default="0-5", help="e.g. 0-5 or 1,3 (default 0-5)")
    ap.add_argument("--jobs", type=int, default=2, help="chaos runs at a time (default 2)")
    ap.add_argument("--nice", type=int, default=15)
    ap.add_argument("--script", type=Path, default=REPO / "tests" / "testing" / "test_chaos.py",
                    help="the trace script run at every commit (default: this checkout's test, copied)")
    ap.add_argument("--prefix", default="/tmp/chaos-bisect-", help="trees go to PREFIX<short commit>")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/chaos-bisect-cache"))
    ap.add_argument("--parent", type=int, default=2, help="split: which parent is the merged branch")
    ap.add_argument("--report", type=Path, help="write the result as JSON here")
    ap.add_argument("--hint", default="", help="changes: commits where a change is likely (another seed's), "
                    "tried before bisecting")
    ap.add_argument("--full-only", action="store_true",
                    help="changes/split: bisect on full traces (no runs stopped at the first difference)")
    args = ap.parse_args(argv)
    seeds = parse_seeds(args.seeds)

    args.cache.mkdir(parents=True, exist_ok=True)
    script = args.cache / "trace_script.py"
    source = args.script.read_bytes()
    if not script.exists() or script.read_bytes() != source:
        script.write_bytes(source)
    runner = Runner(script=script, prefix=args.prefix, cache=args.cache, nice=args.nice, jobs=args.jobs)
    report: dict[str, object] = {"command": args.command, "revs": args.revs, "seeds": seeds}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(seeds)))

    if args.command == "compare":
        if len(args.revs) != 2:
            ap.error("compare takes two revisions")
        a, b = commit_point(args.revs[0]), commit_point(args.revs[1])
        print(f"A = {a.label}\nB = {b.label}")

        def one(seed: int) -> str | None:
            return first_difference(runner.trace(a, seed), runner.trace(b, seed))

        results = dict(zip(seeds, pool.map(one, seeds), strict=True))
        for seed, diff in results.items():
            print(f"seed {seed}: {'same trace' if diff is None else 'differs at ' + diff}")
        report["results"] = {str(s): d for s, d in results.items()}
    else:
        if args.command == "changes":
            if len(args.revs) != 2:
                ap.error("changes takes two revisions")
            points = [commit_point(c) for c in path_commits(args.revs[0], args.revs[1])]
            skipped: list[str] = []
        else:
            if len(args.revs) != 1:
                ap.error("split takes one merge commit")
            points, skipped = split_points(args.revs[0], args.parent)
        total = len(points)
        points = dedupe(runner, points)
        print(f"{total} points, {len(points)} with distinct imported pccl files; first {points[0].label}, "
              f"last {points[-1].label}")
        for s in skipped:
            print(f"  skipped (not buildable): {s}")
        hinted = {runner.key(commit_point(h)) for h in args.hint.split(",") if h.strip()}
        hints = frozenset(i for i, p in enumerate(points) if runner.key(p) in hinted)
        per_seed = pool.map(lambda s: changes(runner, points, s, not args.full_only, hints), seeds)
        results_c = dict(zip(seeds, per_seed, strict=True))
        report["points"] = [p.label for p in points]
        report["skipped"] = skipped
        report["changes"] = {
            str(seed): [{"at": points[i].label, "after": points[i - 1].label, "first_difference": d}
                        for i, d in found]
            for seed, found in results_c.items()
        }
        for seed, found in results_c.items():
            print(f"seed {seed}: {len(found)} change(s)")
            for i, d in found:
                print(f"  at {points[i].label}\n     (after {points[i - 1].label[:60]})\n     {d}")
    print(f"({runner.runs} chaos runs, the rest from the cache {args.cache})")
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
