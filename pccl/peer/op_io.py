"""Data bytes per operation and partner: what a member testifies when an operation stalls (issue 33
item 6; the master compares the two ends of each pair: pccl/master/testimony.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

#: Operations whose bytes per partner are kept (the oldest forgotten first).
KEEP = 16


class OpIo:
    """``[sent to it, taken from it, sends under way to it]`` by operation and partner, for the last
    :data:`KEEP` operations. Two dictionary lookups per data frame (:meth:`count`)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._ops: OrderedDict[int, dict[int, list[int]]] = OrderedDict()
        # op_seq -> the frames ``(peer, tag, seq)`` taken whole, as the operation ended (its inbox's record)
        self._arrived: OrderedDict[int, Collection[tuple[int, int, int]]] = OrderedDict()

    def count(self, op_seq: int, peer: int, which: int, n: int) -> None:
        """Add ``n`` bytes sent to (``which`` 0) or taken from (1) ``peer`` in operation ``op_seq``, or
        ``n`` sends begun (2; -1 when one ended: a send cut off stays counted as under way)."""
        self.row(op_seq, peer)[which] += n

    def row(self, op_seq: int, peer: int) -> list[int]:
        """The counters ``[sent, taken, under way]`` of ``peer`` in operation ``op_seq``, to update in
        place (a sender looks its row up once per frame instead of once per counter)."""
        io = self._ops.get(op_seq)
        if io is None:
            io = self._ops[op_seq] = {}
            if len(self._ops) > self.keep:
                self._ops.popitem(last=False)
        row = io.get(peer)
        if row is None:
            row = io[peer] = [0, 0, 0]
        return row

    def rows(self, op_seq: int) -> list[tuple[int, int, int]]:
        """``(peer, sent, taken)`` of operation ``op_seq`` (one of the last few), each partner once."""
        return [(p, row[0], row[1]) for p, row in sorted(self._ops.get(op_seq, {}).items())]

    def blocked(self, op_seq: int) -> list[int]:
        """The partners of operation ``op_seq`` whose send was under way when it ended (released frames
        not written, so not in ``sent``: the master's ring rule must not read them as held back)."""
        return [p for p, row in sorted(self._ops.get(op_seq, {}).items()) if row[2] > 0]

    def ended(self, op_seq: int, arrived: Collection[tuple[int, int, int]] | None) -> None:
        """Operation ``op_seq`` ended here with the frames ``arrived`` (``(peer, tag, seq)``) taken whole;
        kept for the last :data:`KEEP` operations (:meth:`arrived`). Once per operation, O(1): the
        inbox's own record is kept, not copied."""
        if arrived is None:
            return
        self._arrived[op_seq] = arrived
        if len(self._arrived) > self.keep:
            self._arrived.popitem(last=False)

    def arrived(self, op_seq: int) -> Collection[tuple[int, int, int]]:
        """The frames ``(peer, tag, seq)`` of operation ``op_seq`` (one of the last few) taken whole
        when it ended; empty if unknown."""
        return self._arrived.get(op_seq, ())


__all__ = ["KEEP", "OpIo"]
