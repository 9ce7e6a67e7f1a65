"""Reduce-scatter: rank ``r`` ends with the reduction of chunk ``r`` (``chunk_range(count, n, r)``);
the rest of its output is not written.

Ring: the all-reduce's first ``n-1`` steps. Halving-doubling: the halving rounds (the folded ranks
get their chunk in one last step). Tree: reduce up to rank 0, then each child gets the chunks of its
subtree and forwards its own children's parts.
"""

from __future__ import annotations

from ..linkmodel import LinkModel, chain_time, fractions, hd_folded, hd_time, tree_down, tree_steady, tree_up
from ..plan import (
    COPY,
    SRC_OUT,
    Builder,
    Plan,
    Step,
    chunk_bounds,
    chunk_range,
    finish,
    hd_reduce,
    ring_plan,
    same,
    tree_children,
    tree_reduce,
    tree_subtree,
)
from .base import Kind


def ring_steps(n: int, rank: int) -> list[Step]:
    """The ring steps of a reduce-scatter for ``rank``."""
    return [Step((rank - t - 1) % n, (rank - t - 2) % n, True) for t in range(n - 1)]


class ReduceScatter(Kind):
    name = "reduce_scatter"
    reducing = True
    quantizable = True

    def ring_plan(self, n: int, rank: int, count: int, block_elems: int, root: int) -> Plan:
        bounds = chunk_bounds(count, n)
        sends, recvs = ring_plan(ring_steps(n, rank), bounds, n, rank, block_elems)
        # n >= 2 means at least one reduce step, whose last receive + reduce writes chunk ``rank``
        return finish(sends, recvs, None, bounds[rank])

    def hd_plans(self, n: int, count: int, block_elems: int) -> tuple[Plan, ...]:
        return hd_reduce(n, count, block_elems, scatter=True)

    def tree_plans(self, n: int, count: int, block_elems: int, root: int) -> tuple[Plan, ...]:
        b = Builder(n, block_elems)
        tree_reduce(b, n, count, 0)
        for v in range(n):
            for c in reversed(tree_children(v, n)):
                first, end = tree_subtree(c, n)
                a, e = chunk_range(count, n, first)[0], chunk_range(count, n, end - 1)[1]
                b.transfer(v, c, same([(a, e)]), SRC_OUT, COPY, 1)
        return b.plans([None] * n, [chunk_range(count, n, r) for r in range(n)], "tree")

    def ring_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        a, spb = chain_time(lm, [(i, (i + 1) % n) for i in range(n)])
        return (n - 1) * a + (n - 1) / n * s * spb

    def hd_cost(self, n: int, s: float, lm: LinkModel) -> float:
        p = 1 << (n.bit_length() - 1)
        real = [s * c for c in fractions(n)]
        back = max((s * c for c in fractions(n)[p:]), default=0.0)
        return hd_time(n, s, lm, hd_folded(n, real), halving=True, doubling=False, back=back)

    def tree_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        k = min(s, float(block_bytes))
        frac = fractions(n)

        def rank(v: int) -> int:
            return v

        up = tree_up(n, lm, rank, lambda c: k) + tree_steady(n, lm, rank, s - k, down=False, up=True)

        def share(c: int) -> float:
            first, end = tree_subtree(c, n)
            return s * sum(frac[first:end])

        return up + tree_down(n, lm, rank, share)

    def result_range(self, out_count: int, n: int, rank: int, root: int) -> tuple[int, int] | None:
        return chunk_range(out_count, n, rank)


KIND = ReduceScatter()
