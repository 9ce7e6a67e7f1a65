"""The import graph of ``pccl``: no cycles between modules or between subpackages, and pure modules stay
pure (no trio, no socket, no clock).

Every ``import`` statement counts: module level, inside functions, under ``TYPE_CHECKING``; a
function-local import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pccl

ROOT = Path(pccl.__file__).resolve().parent

# The pure cores: the wire schema and framing, the master's state machine, election and topology, the
# ring schedules and the peer's state machine. They take time as an argument and do no I/O.
PURE_MODULES = [
    "pccl._address",
    "pccl._waits",
    "pccl._stalls",
    "pccl.master.series",
    "pccl.wire.messages",
    "pccl.wire.framing",
    "pccl.wire.data",
    "pccl.wire.hello",
    "pccl.wire.credentials",
    "pccl.master.state",
    "pccl.master.effects",
    "pccl.master.timers",
    "pccl.master.tokens",
    "pccl.master.votes",
    "pccl.master.rounds",
    "pccl.master.rounds.base",
    "pccl.master.rounds.collective",
    "pccl.master.rounds.topology",
    "pccl.master.rounds.sync",
    "pccl.master.ops_in_doubt",
    "pccl.master.election",
    "pccl.master.topology",
    "pccl.collectives.schedule",
    "pccl.peer.state",
    "pccl.wire.admission",
    "pccl.master.budget",
    "pccl.master.blame",
    "pccl.master.lone_holds",
    "pccl.master.stall_court",
]
IMPURE = {"trio", "socket", "time", "selectors", "asyncio", "threading"}


def _modules() -> dict[str, tuple[Path, bool]]:
    mods: dict[str, tuple[Path, bool]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _imported_names(path: Path, module: str, is_pkg: bool, known: frozenset[str] = frozenset()) -> set[str]:
    """Absolute names of everything ``path`` imports.

    ``from a import b`` yields ``a.b`` when that is one of the ``known`` modules, else ``a``.
    """
    package = module if is_pkg else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                names.add(full if full in known else source)
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = frozenset(mods)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, (path, is_pkg) in mods.items():
        for name in _imported_names(path, module, is_pkg, known):
            target = resolve(name)
            if target is not None and target != module:
                edges[module].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _package_of(module: str) -> str:
    """``pccl.peer.pool`` -> ``pccl.peer``; top-level modules (``pccl._errors``) stand for themselves."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_function_local_imports_count(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from .other import thing\n    from . import sub\n    import trio\n")
    names = _imported_names(src, "pkg.mod", False, frozenset({"pkg", "pkg.other", "pkg.sub"}))
    assert names == {"pkg.other", "pkg.sub", "trio"}


def test_no_module_imports_itself_back() -> None:
    edges = _graph()
    assert len(edges) > 30  # the walk found the package
    assert _cycles(edges) == []


def test_no_subpackage_imports_itself_back() -> None:
    """E.g. the collectives may not import the peer side while the peer side imports the collectives."""
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        if module == "pccl":
            continue  # the package's __init__ re-exports everything by design
        src = _package_of(module)
        packages.setdefault(src, set())
        packages[src].update(_package_of(t) for t in targets if t != "pccl" and _package_of(t) != src)
    assert _cycles(packages) == []


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_import_no_trio_socket_or_clock(module: str) -> None:
    mods = _modules()
    assert module in mods
    path, is_pkg = mods[module]
    top_level = {name.split(".")[0] for name in _imported_names(path, module, is_pkg)}
    assert top_level & IMPURE == set()
    # and nothing of pccl they import is impure either (the whole closure stays pure)
    edges = _graph()
    seen, todo = set(), [module]
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        cpath, cpkg = mods[cur]
        leaked = {n.split(".")[0] for n in _imported_names(cpath, cur, cpkg)} & IMPURE
        assert leaked == set(), f"{module} reaches {cur}, which imports {sorted(leaked)}"
        todo.extend(t for t in edges[cur] if t != "pccl")
