"""All-gather: ``count`` elements per rank in, ``n * count`` out; slot ``i`` holds rank ``i``'s input.

Ring: ``n-1`` steps; at step ``t`` rank ``r`` sends slot ``(r - t) mod n`` (step 0: its own input)
and receives slot ``(r - t - 1) mod n``. Halving-doubling: the doubling rounds over slots ``v`` and
``p + v``. Tree: gather up (each subtree's slots are contiguous), then every node sends each child
all slots outside the child's subtree.
"""

from __future__ import annotations

from ..linkmodel import LinkModel, chain_time, hd_folded, hd_time, tree_down, tree_up
from ..plan import (
    COPY,
    SRC_OUT,
    SRC_SEND,
    Builder,
    Plan,
    Step,
    finish,
    hd_gather,
    ring_plan,
    same,
    tree_children,
    tree_subtree,
)
from .base import Kind


def ring_steps(n: int, rank: int) -> list[Step]:
    """The ring steps of an all-gather for ``rank``."""
    return [Step((rank - t) % n, (rank - t - 1) % n, False) for t in range(n - 1)]


class AllGather(Kind):
    name = "all_gather"
    sized_by_group = True

    def output_count(self, n: int, count: int) -> int:
        return n * count

    def size_problem(self, n: int, send_count: int, recv_count: int) -> str | None:
        if recv_count != n * send_count:
            return f"all_gather: recv has {recv_count} elements, expected {n} x {send_count}"
        return None

    def ring_plan(self, n: int, rank: int, count: int, block_elems: int, root: int) -> Plan:
        bounds = [(c * count, (c + 1) * count) for c in range(n)]
        sends, recvs = ring_plan(ring_steps(n, rank), bounds, n, rank, block_elems, own_slot=True)
        return finish(sends, recvs, (0, count, rank * count) if count else None, (0, n * count))

    def hd_plans(self, n: int, count: int, block_elems: int) -> tuple[Plan, ...]:
        return hd_gather(n, count, block_elems)

    def tree_plans(self, n: int, count: int, block_elems: int, root: int) -> tuple[Plan, ...]:
        b = Builder(n, block_elems)
        for v in range(n - 1, -1, -1):
            for c in tree_children(v, n):
                first, end = tree_subtree(c, n)
                leaf = not tree_children(c, n)
                pieces = [(0, count, c * count)] if leaf else same([(first * count, end * count)])
                b.transfer(c, v, pieces, SRC_SEND if leaf else SRC_OUT, COPY, 0)
        for v in range(n):
            for c in reversed(tree_children(v, n)):
                first, end = tree_subtree(c, n)
                b.transfer(v, c, same([(0, first * count), (end * count, n * count)]), SRC_OUT, COPY, 1)
        local_copy: list[tuple[int, int, int] | None] = [
            (0, count, r * count) if count else None for r in range(n)
        ]
        return b.plans(local_copy, [(0, n * count)] * n, "tree")

    def ring_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        a, spb = chain_time(lm, [(i, (i + 1) % n) for i in range(n)])
        return (n - 1) * (a + s * spb)

    def hd_cost(self, n: int, s: float, lm: LinkModel) -> float:
        return hd_time(n, s, lm, hd_folded(n, [s] * n), halving=False, doubling=True, back=(n - 1) * s)

    def tree_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        def rank(v: int) -> int:
            return v

        def below(c: int) -> float:
            first, end = tree_subtree(c, n)
            return s * (end - first)

        return tree_up(n, lm, rank, below) + tree_down(n, lm, rank, lambda c: s * n - below(c))


KIND = AllGather()
