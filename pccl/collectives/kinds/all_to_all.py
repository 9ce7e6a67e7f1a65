"""All-to-all: each rank's input is ``n`` equal blocks, block ``j`` for rank ``j``; rank ``r``'s output
block ``i`` is rank ``i``'s block ``r`` (input and output ``n * c`` elements).

One plan, the pairwise exchange ordered by the ring: at step ``t = 1 .. n-1`` rank ``r`` sends its
block for ring index ``r + t`` there and receives the block of ``r - t``; its own block is copied
locally. Every send is independent of every receive, so all of them go at once and each link carries
exactly its block. Nothing is forwarded, so there is nothing for halving-doubling or a tree to save:
those requests run this plan (counted as the ring's).
"""

from __future__ import annotations

from ..linkmodel import LinkModel
from ..plan import SRC_SEND, Plan, RecvFrame, SendFrame, block_ranges, finish
from .base import Kind


class AllToAll(Kind):
    name = "all_to_all"
    sized_by_group = True
    schedules = ("ring",)
    fallback = {"hd": "ring", "tree": "ring"}

    def size_problem(self, n: int, send_count: int, recv_count: int) -> str | None:
        if recv_count != send_count:
            return f"all_to_all: send has {send_count} elements but recv has {recv_count}"
        if send_count % n:
            return f"all_to_all: {send_count} elements are not {n} equal blocks (one per peer of the group)"
        return None

    def plannable_count(self, n: int, count: int) -> int:
        return count - count % n

    def ring_plan(self, n: int, rank: int, count: int, block_elems: int, root: int) -> Plan:
        if count % n:
            raise ValueError(f"all_to_all: {count} elements are not {n} equal blocks")
        c = count // n
        blocks = block_ranges(0, c, block_elems)
        nb = len(blocks)
        sends: list[SendFrame] = []
        recvs: list[RecvFrame] = []
        for t in range(1, n):
            to, frm = (rank + t) % n, (rank - t) % n
            for b, (a, e) in enumerate(blocks):
                sends.append(SendFrame(len(sends), SRC_SEND, to * c + a, to * c + e, -1, b, t - 1, to))
            # the sender lists its frames to this rank at its step t: after (t - 1) * nb others
            for b, (a, e) in enumerate(blocks):
                recvs.append(RecvFrame((t - 1) * nb + b, frm * c + a, frm * c + e, False, peer=frm))
        local_copy = (rank * c, (rank + 1) * c, rank * c) if c else None
        return finish(sends, recvs, local_copy, (0, count))

    def ring_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        # every send goes at once: the busiest sender's latency plus its bytes over its links
        part = s / n
        return max(
            max(lm.alpha(r, (r + t) % n) for t in range(1, n))
            + sum(part / lm.beta(r, (r + t) % n) for t in range(1, n))
            for r in range(n)
        )


KIND = AllToAll()
