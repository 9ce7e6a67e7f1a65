"""All-reduce: every rank ends with the reduction of every rank's input, bit-identical everywhere.

Ring: ``2(n-1)`` steps; at step ``t`` rank ``r`` sends chunk ``(r - t - 1) mod n`` and receives chunk
``(r - t - 2) mod n``. Steps ``0 .. n-2`` reduce (the reduce-scatter half: after it rank ``r`` holds
the final bits of chunk ``r``), steps ``n-1 .. 2n-3`` forward the owners' final bits unchanged (the
all-gather half). Two ranks' small operations may run the one-step exchange instead
(:func:`pccl.collectives.plan.plan_exchange`). Halving-doubling: halving then doubling. Tree: reduce
up to rank 0, then its result broadcast down.
"""

from __future__ import annotations

from ..linkmodel import LinkModel, chain_time, fractions, hd_time, tree_down, tree_steady, tree_up
from ..plan import (
    SRC_OUT,
    Builder,
    Plan,
    Step,
    chunk_bounds,
    finish,
    hd_reduce,
    ring_plan,
    tree_bcast,
    tree_reduce,
)
from .base import Kind


def ring_steps(n: int, rank: int) -> list[Step]:
    """The ring steps of an all-reduce for ``rank``."""
    return [Step((rank - t - 1) % n, (rank - t - 2) % n, t <= n - 2) for t in range(2 * (n - 1))]


class AllReduce(Kind):
    name = "all_reduce"
    reducing = True
    quantizable = True
    exchange = True

    def ring_plan(self, n: int, rank: int, count: int, block_elems: int, root: int) -> Plan:
        sends, recvs = ring_plan(ring_steps(n, rank), chunk_bounds(count, n), n, rank, block_elems)
        return finish(sends, recvs, None, (0, count))

    def hd_plans(self, n: int, count: int, block_elems: int) -> tuple[Plan, ...]:
        return hd_reduce(n, count, block_elems, scatter=False)

    def tree_plans(self, n: int, count: int, block_elems: int, root: int) -> tuple[Plan, ...]:
        b = Builder(n, block_elems)
        tree_reduce(b, n, count, 0)
        tree_bcast(b, n, list(range(n)), [(0, count, 0)], SRC_OUT, 1)
        return b.plans([None] * n, [(0, count)] * n, "tree")

    def ring_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        a, spb = chain_time(lm, [(i, (i + 1) % n) for i in range(n)])
        return 2 * (n - 1) * a + 2 * (n - 1) / n * s * spb

    def hd_cost(self, n: int, s: float, lm: LinkModel) -> float:
        p = 1 << (n.bit_length() - 1)
        return hd_time(n, s, lm, [s * c for c in fractions(p)], halving=True, doubling=True, back=s)

    def tree_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        k = min(s, float(block_bytes))

        def rank(v: int) -> int:
            return v

        # blocks go down while later blocks still go up: a node's interface carries both
        steady = tree_steady(n, lm, rank, s - k, down=True, up=True)
        return tree_up(n, lm, rank, lambda c: k) + tree_down(n, lm, rank, lambda c: k) + steady


KIND = AllReduce()
