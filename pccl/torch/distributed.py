"""pccl as a torch.distributed backend (docs/torch.md, "torch.distributed backend").

Importing ``pccl.torch`` registers the backend name ``"pccl"`` and the ``pccl://`` init method::

    import torch.distributed as dist
    import pccl.torch  # noqa: F401  (registers "pccl")

    dist.init_process_group("pccl", init_method="pccl://10.0.0.1:48148", rank=rank, world_size=3)

``init_method="pccl://"`` (no address) reads ``PCCL_MASTER``; rank and world size default to
``PCCL_RANK`` / ``RANK`` and ``PCCL_WORLD_SIZE`` / ``WORLD_SIZE`` (``pccl run`` sets them). With
``init_method="env://"`` (torchrun's), the master is ``PCCL_MASTER``.

* :class:`ProcessGroupPCCL`: the process group (also usable directly, e.g. ``DistributedDataParallel(model,
  process_group=pg)``).
* :class:`Manager`: discard a step that lost a peer, reconfigure with the survivors, admit newcomers and
  heal their state (torchft-style ``start_step`` / ``should_commit``).
* :class:`PeerLostError` (from ``Work.wait()``: a peer was lost, the buffers are as they were),
  :class:`ProcessGroupBrokenError` (its base), :class:`UnsupportedOperationError`.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from .._errors import InvalidArgumentError
from ._dist_group import ProcessGroupPCCL
from ._dist_manager import Manager
from ._dist_plan import UnsupportedOperationError
from ._dist_work import PCCLWork, PeerLostError, ProcessGroupBrokenError

__all__ = [
    "BACKEND_NAME",
    "Manager",
    "PCCLWork",
    "PeerLostError",
    "ProcessGroupBrokenError",
    "ProcessGroupPCCL",
    "UnsupportedOperationError",
    "register",
]

BACKEND_NAME = "pccl"

_lock = threading.Lock()
_formed: list[ProcessGroupPCCL] = []  # made by the pccl:// rendezvous, handed to the backend creator
_registered = False


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)  # type: ignore[arg-type]
            except ValueError:
                raise InvalidArgumentError(f"{name}={value!r} is not an integer") from None
    return None


def _master_from_env() -> str:
    address = os.environ.get("PCCL_MASTER")
    if not address:
        raise InvalidArgumentError("pccl backend: no master address (init_method='pccl://HOST:PORT', or set "
                                   "PCCL_MASTER)")
    return address


def _rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's rendezvous handler for ``pccl://[HOST:PORT][?rank=R&world_size=N]``: connects to the pccl
    master, waits for the group to form and yields (a process-local store, rank, world size)."""
    parsed = urllib.parse.urlparse(url)
    query = dict(urllib.parse.parse_qsl(parsed.query))
    address = parsed.netloc or _master_from_env()
    rank = int(query["rank"]) if "rank" in query else _env_int("PCCL_RANK", "RANK")
    world = int(query["world_size"]) if "world_size" in query else _env_int("PCCL_WORLD_SIZE", "WORLD_SIZE")
    if world is None or world < 1:
        raise InvalidArgumentError("pccl backend: world_size is required (argument, PCCL_WORLD_SIZE or "
                                   "WORLD_SIZE): the group forms once that many peers are there")
    pg = ProcessGroupPCCL(address, rank=-1 if rank is None else rank, world_size=world, timeout=timeout)
    with _lock:
        _formed.append(pg)
    # The store is this process's own: pccl needs none, and torch only hands it to the backend.
    yield dist.HashStore(), pg.rank(), pg.size()  # type: ignore[attr-defined]
    raise RuntimeError("pccl rendezvous: the group was formed already")


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupPCCL:
    """The backend creator torch calls from ``init_process_group`` / ``new_group``."""
    with _lock:
        formed = _formed.pop() if _formed else None
    if formed is None and dist.is_initialized():
        raise UnsupportedOperationError(
            "new_group: subgroups are not supported by the pccl backend (one pccl group per process)")
    if formed is not None:
        if (formed.rank(), formed.size()) != (rank, size):
            formed.close()
            raise UnsupportedOperationError(
                f"pccl backend: torch asked for rank {rank} of {size}, the group formed as rank "
                f"{formed.rank()} of {formed.size()}")
        return formed
    # init_method="env://" (torchrun): torch's store did the rendezvous; the group forms on pccl's master.
    return ProcessGroupPCCL(_master_from_env(), rank=rank, world_size=size, timeout=timeout)


def register() -> None:
    """Register the ``"pccl"`` backend and the ``pccl://`` init method (done when ``pccl.torch`` is
    imported; calling it again does nothing)."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    # torch.distributed.rendezvous is shadowed by the function of that name on the package.
    rendezvous_module = sys.modules["torch.distributed.rendezvous"]
    rendezvous_module.register_rendezvous_handler("pccl", _rendezvous)
