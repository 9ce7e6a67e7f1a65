"""Pure helpers of the torch.distributed backend: ranks under churn, reduce ops, layouts.

No trio, no sockets, no clocks: the process group (``_dist_group.py``) calls these to decide what to
send and where results go; the tests drive them directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._types import ReduceOp

__all__ = [
    "NEW_PEER_OFFSET",
    "UnsupportedOperationError",
    "assign_ranks",
    "chunk_bounds",
    "pccl_reduce_op",
]

# A peer that holds no torch rank yet (at the first configuration, or a newcomer) sends its requested
# rank plus this offset in the rank exchange, so that every peer that already holds a rank sorts first.
NEW_PEER_OFFSET = 1 << 32


class UnsupportedOperationError(NotImplementedError):
    """The pccl backend does not implement this torch.distributed call (the message names it and why)."""


def assign_ranks(hints: Sequence[int]) -> list[int]:
    """The torch rank of each ring position, from the hints every peer sent in ring order.

    A hint is the rank a peer holds (survivors of the previous configuration), or ``NEW_PEER_OFFSET +
    requested`` for a peer without one (``requested`` is the rank it asked for, -1 for none). Peers are
    numbered densely from 0 in the order of their hints, ties broken by ring position: survivors keep
    their relative order, newcomers follow in the order of the ranks they asked for. On a first
    configuration where the requested ranks are ``0..n-1`` every peer gets the rank it asked for.

    Returns:
        ``ranks[p]``: the rank of the peer at ring position ``p``.
    """
    order = sorted(range(len(hints)), key=lambda p: (hints[p], p))
    ranks = [0] * len(hints)
    for rank, pos in enumerate(order):
        ranks[pos] = rank
    return ranks


def chunk_bounds(count: int, n: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` of ``count`` elements in ``n`` chunks, as pccl's reduce-scatter
    splits them (``count // n`` each, one more for the first ``count % n``)."""
    base, extra = divmod(count, n)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def pccl_reduce_op(torch_op: Any, call: str) -> ReduceOp:
    """pccl's ReduceOp for a torch ``ReduceOp`` (SUM, AVG, PRODUCT, MIN, MAX).

    Raises:
        UnsupportedOperationError: BAND, BOR, BXOR, PREMUL_SUM (named, with the call).
    """
    import torch.distributed as dist

    table = {
        dist.ReduceOp.SUM: ReduceOp.SUM,
        dist.ReduceOp.AVG: ReduceOp.AVG,
        dist.ReduceOp.PRODUCT: ReduceOp.PROD,
        dist.ReduceOp.MIN: ReduceOp.MIN,
        dist.ReduceOp.MAX: ReduceOp.MAX,
    }
    for key, value in table.items():
        if torch_op == key:
            return value
    name = getattr(getattr(torch_op, "op", torch_op), "name", repr(torch_op))
    raise UnsupportedOperationError(
        f"{call}: the pccl backend supports ReduceOp SUM, AVG, PRODUCT, MIN and MAX, not {name} "
        "(bitwise ops and PREMUL_SUM have no pccl kernel)")
