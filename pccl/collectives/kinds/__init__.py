"""The registry of collective kinds: name -> :class:`~pccl.collectives.kinds.base.Kind`.

A kind is one module here defining a :class:`Kind` subclass (its schedules' plans, their costs, its
buffer sizes and its result) and one entry in :data:`REGISTRY`. Everything that used to compare kind
names (the schedules, the cost model, the executor, the peer's descriptor rules and commit) asks the
kind object instead (docs/concepts.md "Collective kinds").
"""

from __future__ import annotations

from . import all_gather, all_reduce, all_to_all, broadcast, reduce, reduce_scatter
from .base import Kind

REGISTRY: dict[str, Kind] = {
    k.name: k
    for k in (
        all_reduce.KIND,
        reduce_scatter.KIND,
        all_gather.KIND,
        broadcast.KIND,
        reduce.KIND,
        all_to_all.KIND,
    )
}

#: Every kind's name, in registration order.
KINDS: tuple[str, ...] = tuple(REGISTRY)


def get_kind(kind: str | Kind) -> Kind:
    """The kind named ``kind`` (a :class:`Kind` is returned as it is).

    Raises:
        ValueError: no kind of that name.
    """
    if isinstance(kind, Kind):
        return kind
    got = REGISTRY.get(kind) if isinstance(kind, str) else None
    if got is None:
        raise ValueError(f"unknown collective kind {kind!r} (expected one of {', '.join(KINDS)})")
    return got


__all__ = ["KINDS", "REGISTRY", "Kind", "get_kind"]
