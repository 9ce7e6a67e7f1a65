"""Reduce: the root ends with the reduction of every rank's input; no other rank's output is written.

Ring: a pipelined chain towards the root, ``root+1 -> root+2 -> ... -> root``: each rank reduces
every block it receives with its own input and forwards the partial as soon as it is complete, so
every link carries the buffer once and the reductions of consecutive blocks overlap. Tree: the
binomial tree rooted at the root, reduced up (the all-reduce's first half, rooted anywhere).
Halving-doubling has no plan for a reduce to one rank: a request for it runs the tree.
"""

from __future__ import annotations

from ..linkmodel import LinkModel, pipelined_chain_cost, tree_steady, tree_up
from ..plan import SRC_OUT, SRC_SEND, Builder, Plan, RecvFrame, SendFrame, block_ranges, finish, tree_reduce
from .base import Kind, root_rows


class Reduce(Kind):
    name = "reduce"
    reducing = True
    rooted = True
    schedules = ("ring", "tree")
    fallback = {"hd": "tree"}

    def ring_plan(self, n: int, rank: int, count: int, block_elems: int, root: int) -> Plan:
        if not 0 <= root < n:
            raise ValueError(f"reduce root {root} out of range for n={n}")
        pos = (rank - root - 1) % n  # position along the chain: 0 starts it, n-1 is the root
        blocks = block_ranges(0, count, block_elems)
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        if pos == 0:
            sends = [SendFrame(i, SRC_SEND, a, e, -1, i, peer=nxt) for i, (a, e) in enumerate(blocks)]
            return finish(sends, [], None, (0, 0))
        # out[block] = received partial, then out op= this rank's input
        recvs = [RecvFrame(i, a, e, True, peer=prv) for i, (a, e) in enumerate(blocks)]
        if pos == n - 1:
            return finish([], recvs, None, (0, count))
        sends = [SendFrame(i, SRC_OUT, a, e, i, i, 1, nxt) for i, (a, e) in enumerate(blocks)]
        return finish(sends, recvs, None, (0, 0))

    def tree_plans(self, n: int, count: int, block_elems: int, root: int) -> tuple[Plan, ...]:
        b = Builder(n, block_elems)
        tree_reduce(b, n, count, 0, rank_of=root_rows(n, root))
        owned = [(0, count) if r == root else (0, 0) for r in range(n)]
        return b.plans([None] * n, owned, "tree")

    def ring_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        # the chain root+1 -> ... -> root, pipelined in blocks (the edge out of root is not used)
        return pipelined_chain_cost(lm, n, root + 1, s, block_bytes)

    def tree_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        def rank(v: int) -> int:
            return (v + root) % n

        k = min(s, float(block_bytes))
        return tree_up(n, lm, rank, lambda c: k) + tree_steady(n, lm, rank, s - k, down=False, up=True)

    def result_range(self, out_count: int, n: int, rank: int, root: int) -> tuple[int, int] | None:
        return (0, out_count) if rank == root else None


KIND = Reduce()
