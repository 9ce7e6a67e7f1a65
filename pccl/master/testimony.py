"""Stalled operations: what each end of a pair says it sent and took (pure: no trio, no sockets).

Issue 33 item 6, a member that stops reading. When its unread frames overflow the socket buffers, the
sender's send stays under way and the sender names it (``CollectiveDone.stalled_on``). When they fit,
every send completes and the members only wait on receives: in a ring each one waits on its predecessor,
so the member waited on is no evidence (the reports would name every member once). The evidence is in
the bytes: a member whose operation stood still for at least half ``p2p_stall_timeout`` reports, with its
failure or after the master's abort, the data bytes it sent to and took from each partner in that
operation (``CollectiveDone.io``). Nothing of a stalled operation is in flight at an honest receiver: it
waits on its receives, so it takes whatever arrives. So when ``a`` says it sent ``b`` more bytes than
``b`` says it took from ``a``, and both stood still, ``b`` did not read them (or the link between them
holds them: a link cut one way). :class:`StallTestimony` finds such pairs, once per operation and pair;
the master then counts them like a ``stalled_on`` report (pccl/master/blame.py: the second report of a
pair within the window removes both, so a false testimony costs its maker its place).

A member that lies about what it took (claiming the bytes it did not read) is not found this way; it
then stalls operations as before this check (each ended after ``p2p_stall_timeout``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable

#: Operations whose testimonies are kept (the oldest forgotten first).
KEEP = 16
#: Rows kept in all (the oldest operations forgotten first): a member that testifies for operations
#: that never stalled, with a row for every member, holds at most this many (a few MiB).
MAX_ROWS = 65536


class StallTestimony:
    """The testimonies of the last :data:`KEEP` stalled operations (see the module docstring)."""

    def __init__(self, keep: int = KEEP, max_rows: int = MAX_ROWS) -> None:
        self.keep = keep
        self.max_rows = max_rows
        self.rows = 0  # rows held now
        # op_seq -> testifier -> partner -> (sent to it, taken from it)
        self._ops: OrderedDict[int, dict[int, dict[int, tuple[int, int]]]] = OrderedDict()
        self._judged: OrderedDict[tuple[int, int, int], None] = OrderedDict()

    def add(self, op_seq: int, peer: int, rows: Iterable[tuple[int, int, int]],
            members: Container[int] | None = None) -> list[tuple[int, int, int, int]]:
        """``peer`` testifies ``rows`` (``(partner, sent, taken)``) for operation ``op_seq``; rows
        naming no member (``members``, None: any) are ignored.

        Returns:
            ``(sender, receiver, sent, taken)`` for each pair newly found where the sender says it sent
            more than the receiver says it took (both testified).
        """
        op = self._ops.get(op_seq)
        if op is None:
            op = self._ops[op_seq] = {}
        mine: dict[int, tuple[int, int]] = {}
        for partner, sent, taken in rows:
            if len(mine) >= self.max_rows:
                break
            if partner != peer and (members is None or partner in members):
                mine[partner] = (sent, taken)
        self.rows += len(mine) - len(op.get(peer, ()))
        op[peer] = mine
        while len(self._ops) > 1 and (len(self._ops) > self.keep or self.rows > self.max_rows):
            _, gone = self._ops.popitem(last=False)
            self.rows -= sum(len(r) for r in gone.values())
        if op_seq not in self._ops:
            return []
        found: list[tuple[int, int, int, int]] = []
        for partner, (sent, taken) in mine.items():
            theirs = op.get(partner)
            if theirs is None:
                continue
            their_sent, their_taken = theirs.get(peer, (0, 0))
            if sent > their_taken:
                found.append((peer, partner, sent, their_taken))
            if their_sent > taken:
                found.append((partner, peer, their_sent, taken))
        return found

    def first(self, op_seq: int, accuser: int, accused: int) -> bool:
        """True the first time ``accuser`` accuses ``accused`` over operation ``op_seq`` (by either
        report): an operation counts once per pair."""
        key = (op_seq, accuser, accused)
        if key in self._judged:
            return False
        self._judged[key] = None
        while len(self._judged) > 64 * self.keep:
            self._judged.popitem(last=False)
        return True


__all__ = ["KEEP", "MAX_ROWS", "StallTestimony"]
