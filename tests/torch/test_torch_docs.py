"""docs/recipe.md's torch loop runs; docs/api.md covers pccl.torch."""

from __future__ import annotations

import inspect
import re
import threading
from pathlib import Path
from typing import Any

import torch

import pccl.torch
from pccl.blocking import MasterNode
from pccl.testing import tensor_bytes

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_torch_recipe_trains_two_peers_to_identical_weights() -> None:
    text = (DOCS / "recipe.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
              if b.startswith("# recipe: torch\n")]
    assert len(blocks) == 1
    namespace: dict[str, Any] = {"__name__": "recipe_torch"}
    exec(compile(blocks[0], "docs/recipe.md[torch]", "exec"), namespace)
    models: dict[int, Any] = {}
    with MasterNode("127.0.0.1:0") as master:
        master.run()
        threads = []
        for i in range(2):
            def body(i: int = i) -> None:
                torch.manual_seed(i)  # different initial weights: the first sync unifies them
                models[i] = namespace["train_torch"](master.address, steps=30)
            threads.append(threading.Thread(target=body))
            threads[-1].start()
        for t in threads:
            t.join(60)
    assert len(models) == 2
    a, b = (list(models[i].parameters()) for i in (0, 1))
    assert [tensor_bytes(p) for p in a] == [tensor_bytes(p) for p in b]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    with torch.no_grad():
        assert float(torch.nn.functional.mse_loss(models[0](x), y)) < 0.2 * float((y ** 2).mean())


def test_api_page_covers_pccl_torch() -> None:
    text = (DOCS / "api.md").read_text() + (DOCS / "torch.md").read_text()
    missing = [name for name in pccl.torch.__all__ if f"`{name}" not in text]
    for cls in (pccl.torch.SharedModel, pccl.torch.TrainingRun, pccl.torch.AsyncTrainingRun,
                pccl.torch.DiLoCo, pccl.torch.AsyncDiLoCo, pccl.torch.Step, pccl.torch.StepResult):
        for klass in cls.__mro__:
            if klass.__module__.startswith("pccl.torch"):
                for name, member in vars(klass).items():
                    method = inspect.isfunction(member) or isinstance(member, property)
                    mentioned = f"{name}(" in text or f"`{name}`" in text
                    if not name.startswith("_") and method and not mentioned:
                        missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"docs/api.md and docs/torch.md do not mention {missing}"
