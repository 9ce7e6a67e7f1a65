"""The documentation's code runs (docs/recipe.md) and docs/api.md covers the API."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import numpy as np
import trio

import pccl
import pccl.blocking
from pccl.blocking import MasterNode

from ._helpers import run_threads

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _recipe(marker: str) -> dict[str, Any]:
    """Execute the ```python block of docs/recipe.md that starts with ``# recipe: <marker>``."""
    text = (DOCS / "recipe.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    found = [b for b in blocks if b.startswith(f"# recipe: {marker}\n")]
    assert len(found) == 1, f"expected one '# recipe: {marker}' block in docs/recipe.md"
    namespace: dict[str, Any] = {"__name__": f"recipe_{marker}"}
    exec(compile(found[0], f"docs/recipe.md[{marker}]", "exec"), namespace)
    return namespace


def _loss(weights: np.ndarray) -> float:
    rng = np.random.default_rng(0)  # the recipes' dataset
    x = rng.standard_normal((512, 16)).astype(np.float32)
    y = x @ rng.standard_normal(16).astype(np.float32)
    return float(np.mean((x @ weights - y) ** 2))


def test_blocking_recipe_trains_two_peers_to_identical_weights(master: MasterNode) -> None:
    train = _recipe("blocking")["train_blocking"]
    results = run_threads([lambda s=s: train(master.address, steps=30, seed=s) for s in (1, 2)])
    assert results[0].tobytes() == results[1].tobytes()
    assert _loss(results[0]) < 0.5 * _loss(np.zeros(16, dtype=np.float32))


async def test_async_recipe_trains_two_peers_to_identical_weights() -> None:
    train = _recipe("async")["train_async"]
    results: dict[int, np.ndarray] = {}
    async with pccl.open_master("127.0.0.1:0") as master:

        async def peer(seed: int) -> None:
            results[seed] = await train(master.connect_address, steps=30, seed=seed)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for seed in (1, 2):
                    nursery.start_soon(peer, seed)
    assert results[1].tobytes() == results[2].tobytes()
    assert _loss(results[1]) < 0.5 * _loss(np.zeros(16, dtype=np.float32))


def test_api_page_covers_the_blocking_face() -> None:
    text = (DOCS / "api.md").read_text()
    missing = [name for name in pccl.blocking.__all__ if f"`{name}" not in text]
    for cls in (pccl.blocking.Communicator, pccl.blocking.MasterNode, pccl.blocking.AsyncReduceHandle):
        for name, member in vars(cls).items():
            if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                if f"{name}(" not in text and f".{name}`" not in text and f"`{name}`" not in text:
                    missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"docs/api.md does not mention {missing}"


def test_api_page_covers_the_async_face() -> None:
    text = (DOCS / "api.md").read_text()
    comm = pccl.AsyncCommunicator
    public = [n for n, v in vars(comm).items() if not n.startswith("_") and
              (inspect.iscoroutinefunction(v) or inspect.isfunction(v) or isinstance(v, property))]
    missing = [n for n in public if f"{n}(" not in text and f"`{n}`" not in text]
    missing += [n for n in ("open_communicator", "open_master", "serve_master") if f"{n}(" not in text]
    assert not missing, f"docs/api.md does not mention {missing}"
