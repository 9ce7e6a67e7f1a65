"""``pccl-master`` starts without the peer's modules: a restarted master listens sooner, which bounds the
run's gap across a master kill (docs/history/benchmarks-churn-soak.md "With master kills")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Modules only peers need; ``import pccl.cli`` (the ``pccl-master`` entry point) must load none of them.
PEER_ONLY = ["numpy", "pccl.blocking", "pccl.peer.communicator", "pccl.peer.shared_state", "pccl.collectives",
             "pccl.master.topology"]


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}; import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         timeout=60)
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_master_entry_point_imports_no_peer_module() -> None:
    # what ``pccl-master`` runs before it listens: the CLI, its parser and config, the master's server
    loaded = set(_loaded_after("import pccl.cli, pccl.master.server; pccl.cli._master_parser()"))
    assert "pccl.master.state" in loaded
    assert [m for m in PEER_ONLY if m in loaded] == []


def test_master_loads_its_deferred_modules_off_the_loop() -> None:
    # what the server runs once it listens: the modules kept out of its start-up, in a worker thread
    code = "import trio; from pccl.master import server; trio.run(server._load_deferred)"
    loaded = set(_loaded_after(code))
    assert {"pccl.master.plan_rule", "pccl.master.topology"} <= loaded


@pytest.mark.parametrize("name", ["Communicator", "AsyncCommunicator", "ReduceOp", "SharedState", "cuda",
                                  "open_master"])
def test_public_names_load_on_first_use(name: str) -> None:
    code = f"import pccl; assert {name!r} in dir(pccl); assert getattr(pccl, {name!r}) is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unknown_attribute_is_an_attribute_error() -> None:
    code = ("import pccl\ntry:\n    pccl.no_such_name\nexcept AttributeError as e:\n"
            "    print(json.dumps(str(e)))\nelse:\n    raise SystemExit('no AttributeError')")
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert "no_such_name" in json.loads(out.stdout)
