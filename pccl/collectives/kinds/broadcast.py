"""Broadcast: every rank's output becomes the root's input.

Ring: a pipelined chain ``root -> root+1 -> ... -> root-1``, each block forwarded as soon as it has
arrived. Tree: the root's input copied down the binomial tree rooted at the root. Halving-doubling has
nothing to halve in a broadcast: a request for it runs the tree.
"""

from __future__ import annotations

from ..linkmodel import LinkModel, pipelined_chain_cost, tree_down, tree_steady
from ..plan import SRC_OUT, SRC_SEND, Builder, Plan, RecvFrame, SendFrame, block_ranges, finish, tree_bcast
from .base import Kind, root_rows


class Broadcast(Kind):
    name = "broadcast"
    rooted = True
    schedules = ("ring", "tree")
    fallback = {"hd": "tree"}

    def ring_plan(self, n: int, rank: int, count: int, block_elems: int, root: int) -> Plan:
        if not 0 <= root < n:
            raise ValueError(f"broadcast root {root} out of range for n={n}")
        pos = (rank - root) % n  # distance from the root along the ring
        blocks = block_ranges(0, count, block_elems)
        sends: list[SendFrame] = []
        recvs: list[RecvFrame] = []
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        if pos == 0:
            sends = [SendFrame(i, SRC_SEND, a, e, -1, i, peer=nxt) for i, (a, e) in enumerate(blocks)]
            return finish(sends, [], (0, count, 0) if count else None, (0, count))
        recvs = [RecvFrame(i, a, e, False, peer=prv) for i, (a, e) in enumerate(blocks)]
        if pos < n - 1:
            # forward each block as soon as it has arrived: the chain is pipelined block by block
            sends = [SendFrame(i, SRC_OUT, a, e, i, i, 1, nxt) for i, (a, e) in enumerate(blocks)]
        return finish(sends, recvs, None, (0, count))

    def tree_plans(self, n: int, count: int, block_elems: int, root: int) -> tuple[Plan, ...]:
        b = Builder(n, block_elems)
        tree_bcast(b, n, root_rows(n, root), [(0, count, 0)], SRC_SEND, 0)
        local_copy: list[tuple[int, int, int] | None] = [None] * n
        if count:
            local_copy[root] = (0, count, 0)
        return b.plans(local_copy, [(0, count)] * n, "tree")

    def ring_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        # a chain from root, pipelined in blocks; the chain does not use the edge into root
        return pipelined_chain_cost(lm, n, root, s, block_bytes)

    def tree_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        def rank(v: int) -> int:
            return (v + root) % n

        k = min(s, float(block_bytes))
        return tree_down(n, lm, rank, lambda c: k) + tree_steady(n, lm, rank, s - k, down=True, up=False)


KIND = Broadcast()
