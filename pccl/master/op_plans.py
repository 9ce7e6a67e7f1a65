"""Which plans a stalled operation ran, without one member's word (pure: no trio, no sockets, no clock).

The plan rule (pccl/master/plan_rule.py) judges a stalled operation by every participant's plan, so the
master must know the schedule the participants ran. A schedule requested by name ("ring", "hd", "tree")
is in the descriptor the master checked: every voter sent the same. ``"auto"`` (the default) each peer
resolves when the operation commences, from data equal on every participant (the descriptor, the
operation's table, the link summary the master sent: docs/topology.md "Who chooses"), so every honest
participant picks the same schedule; each reports it with its testimony (``CollectiveDone.schedule``).
The master takes the schedule that more than half of the operation's participants report, so one member
(or any minority) that reports another cannot choose the plans it is judged by; until such a majority
has reported, the operation is not judged by its plans.

The module keeps, for the last :data:`KEEP` stalled operations, the descriptor and participants recorded
while the operation ran and the schedule each participant reported, and builds the plans (lazily, once
per operation and schedule). It imports the collectives' planner only when it builds plans: the master
starts without it (tests/cli/test_master_imports.py), and its server loads it in a worker thread once it
listens (pccl/master/server.py ``_load_deferred``), so that this import does not stall the trio loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._types import DataType, QuantizationAlgorithm
from ..wire.messages import CollectiveDescriptor

if TYPE_CHECKING:
    from .plan_rule import OpFrames

#: Operations whose plans are kept (the oldest forgotten first).
KEEP = 16
#: The schedules a report may name: pccl.collectives.plan.SCHEDULES, spelled out here because the master
#: starts without the collectives (tests/security/test_plan_holder.py checks they agree).
SCHEDULES = ("ring", "hd", "tree")


class OpPlans:
    """The descriptors, participants and reported schedules of the last :data:`KEEP` stalled operations
    (see the module docstring)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        # op_seq -> (descriptor, participants in ring order)
        self._ops: OrderedDict[int, tuple[CollectiveDescriptor, tuple[int, ...]]] = OrderedDict()
        self._claims: dict[int, dict[int, str]] = {}  # op_seq -> participant -> schedule it reported
        self._frames: dict[tuple[int, str], OpFrames | None] = {}  # (op_seq, schedule) -> its plans

    def note(self, op_seq: int, descriptor: CollectiveDescriptor, participants: Sequence[int]) -> None:
        """Operation ``op_seq`` runs ``descriptor`` over ``participants`` (ring order); the first record
        counts."""
        if op_seq in self._ops:
            return
        self._ops[op_seq] = (descriptor, tuple(participants))
        while len(self._ops) > self.keep:
            old, _ = self._ops.popitem(last=False)
            self._claims.pop(old, None)
            for key in [k for k in self._frames if k[0] == old]:
                del self._frames[key]

    def known(self, op_seq: int) -> bool:
        """Whether operation ``op_seq`` is recorded."""
        return op_seq in self._ops

    def claim(self, op_seq: int, peer: int, schedule: str) -> None:
        """Participant ``peer`` reports it ran ``schedule`` in operation ``op_seq`` (its first report
        counts; a name that is no schedule, or a peer that is no participant, counts for nothing)."""
        got = self._ops.get(op_seq)
        if got is None or schedule not in SCHEDULES or peer not in got[1]:
            return
        self._claims.setdefault(op_seq, {}).setdefault(peer, schedule)

    def schedule(self, op_seq: int) -> str | None:
        """The schedule operation ``op_seq`` ran: the descriptor's when it names one, else the one more
        than half of its participants reported; None while it is not known."""
        got = self._ops.get(op_seq)
        if got is None:
            return None
        d, participants = got
        if d.schedule in SCHEDULES:
            return d.schedule
        counts: dict[str, int] = {}
        for s in self._claims.get(op_seq, {}).values():
            counts[s] = counts.get(s, 0) + 1
        return next((s for s, c in counts.items() if 2 * c > len(participants)), None)

    def frames(self, op_seq: int, fallback: str = "") -> OpFrames | None:
        """Every participant's plan of operation ``op_seq`` under :meth:`schedule` or, while that is not
        known, under ``fallback`` (a reporter's own claim, to judge that reporter by its own account),
        built on first use; None when neither is known, or the plans cannot or should not be rebuilt
        (pccl/master/plan_rule.py ``op_frames``)."""
        schedule = self.schedule(op_seq)
        if schedule is None:
            if fallback not in SCHEDULES or op_seq not in self._ops:
                return None
            schedule = fallback
        key = (op_seq, schedule)
        if key in self._frames:
            return self._frames[key]
        from .plan_rule import op_frames  # the collectives' planner (loaded by the server once it listens)

        d, participants = self._ops[op_seq]
        frames = self._frames[key] = op_frames(d._replace(schedule=schedule), participants)
        return frames

    def ring(self, op_seq: int) -> tuple[tuple[int, ...], int] | None:
        """``(ring order, largest chunk bytes)`` of operation ``op_seq`` when it is an unquantized ring
        all-reduce of 3 or more participants (the coarse ring rule's facts: pccl/master/testimony.py
        ``ring_holders``), else None."""
        got = self._ops.get(op_seq)
        if got is None or self.schedule(op_seq) != "ring":
            return None
        d, participants = got
        n = len(participants)
        if d.kind != "all_reduce" or d.quantization != int(QuantizationAlgorithm.NONE) or n < 3:
            return None
        try:
            itemsize = DataType(d.dtype).itemsize
        except ValueError:
            return None
        return participants, -(-d.element_count // n) * itemsize


__all__ = ["KEEP", "SCHEDULES", "OpPlans"]
