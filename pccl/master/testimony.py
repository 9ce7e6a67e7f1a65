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

A member that lies about what it took (claiming the bytes it did not read) is not found by the pairs.
In a ring all-reduce it is found by the schedule's own rule (:func:`ring_holders`): a ring peer takes
only from its predecessor and sends only to its successor, and every frame it takes, except the last
step's, releases one frame of the same block (the same bytes) to its successor; its first step's send
needs nothing. So at a standstill an honest peer whose sends all completed has passed on at least what
it took, less the last step's chunk: ``took - passed <= max chunk bytes``. A peer that testifies it took
more than that beyond what its successor testifies it took from it, while the successor is not behind
on its frames (it took at least what the peer says it sent) and no send of the predecessor to it or of
it to the successor was under way (``CollectiveDone.blocked``: such frames are released but not sent),
holds the ring: it alone is blamed (pccl/master/blame.py ``hold``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Iterable, Mapping, Sequence

from .op_plans import OpPlans

#: Operations whose testimonies are kept (the oldest forgotten first).
KEEP = 16
#: Estimated frames (every participant's plans together, pccl/master/plan_rule.py ``estimated_frames``)
#: up to which the reporters that testified before an operation's plans were known are all judged at
#: once when they are; above it, one more per later report (pccl/master/plan_rule.py ``MAX_FRAMES``).
JUDGE_ALL_FRAMES = 4096
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
        # the descriptor, participants and reported schedule of each stalled operation (op_plans.py)
        self.plans = OpPlans(keep)
        # op_seq -> testifier -> partners whose send was under way
        self._blocked: dict[int, dict[int, frozenset[int]]] = {}
        # op_seq -> testifiers that took a partner's frames out of its release order (``early``): their
        # bytes do not say which receives completed, so they are not judged as holders
        self._early: dict[int, set[int]] = {}
        # op_seq -> reporters that testified while the operation's plans were not known (its schedule
        # not yet agreed): judged once they are (:meth:`holders`)
        self._waiting: OrderedDict[int, list[int]] = OrderedDict()

    def holders(self, op_seq: int, reporter: int | None = None) -> list[tuple[int, int, int, int]]:
        """``(holder, successor, owed, passed)`` of operation ``op_seq``, each holder once per operation:
        by the plan rule (:func:`~pccl.master.plan_rule.plan_holders`, among the peers a testimony of
        ``reporter`` can change, and those of reporters that testified before the plans were known:
        all of them while the operation's plans together fit :data:`JUDGE_ALL_FRAMES`, else one more per
        report; ``reporter`` None: every participant) if its plans are known (:class:`OpPlans`), else
        by :func:`ring_holders` if it is a ring all-reduce too large to rebuild; else empty. A
        reporter whose operation's plans are not known yet (an ``"auto"`` schedule most participants
        have not reported) waits to be judged."""
        op = self._ops.get(op_seq)
        if op is None:
            return []
        blocked = self._blocked.get(op_seq, {})
        frames = self.plans.frames(op_seq)
        if frames is not None:
            from .plan_rule import affected, plan_holders  # loaded with the plans (op_plans.py)

            who: set[int] | None = None
            if reporter is not None:
                # only the peers a testimony can change (its maker and its partners), and those of the
                # reporters that testified before the plans were known: all at once while every plan of
                # the operation fits MAX_FRAMES, else one more per report (each report's work bounded)
                who = affected(frames, reporter)
                waiting = self._waiting.get(op_seq)
                if waiting:
                    take = len(waiting) if frames.estimate <= JUDGE_ALL_FRAMES else 1
                    for early in waiting[:take]:
                        who |= affected(frames, early)
                    del waiting[:take]
            found = plan_holders(frames, op, blocked, who)
        elif (facts := self.plans.ring(op_seq)) is not None:
            found = ring_holders(facts[0], facts[1], op, blocked)
        else:
            if reporter is not None and self.plans.known(op_seq) and self.plans.schedule(op_seq) is None:
                waiting = self._waiting.setdefault(op_seq, [])  # judged once most report the schedule
                if reporter not in waiting:
                    waiting.append(reporter)
                while len(self._waiting) > self.keep:
                    self._waiting.popitem(last=False)
            return []
        exempt = self._early.get(op_seq, ())
        return [h for h in found if h[0] not in exempt and self.first(op_seq, h[0], h[0])]

    def _rows(self, rows: Iterable[tuple[int, int, int]]) -> dict[int, tuple[int, int]]:
        """A testimony's ``(partner, sent, taken)`` rows as ``{partner: (sent, taken)}``, at most
        ``max_rows`` of them (the rest ignored, as :meth:`add` keeps them)."""
        mine: dict[int, tuple[int, int]] = {}
        for partner, sent, taken in rows:
            if len(mine) >= self.max_rows:
                break
            mine[partner] = (sent, taken)
        return mine

    def false_blocks(self, op_seq: int, reporter: int, rows: Iterable[tuple[int, int, int]],
                     named: Iterable[int], schedule: str = "") -> list[int]:
        """The peers of ``named`` whose sends ``reporter`` says were under way although by its own
        testimony ``rows`` and plan it had nothing left to send them
        (:func:`~pccl.master.plan_rule.false_blocks`), under the operation's schedule or, while most
        participants have not reported it, the ``schedule`` the reporter says it ran; empty unless
        the operation is recorded."""
        frames = self.plans.frames(op_seq, schedule)
        if frames is None:
            return []
        from .plan_rule import false_blocks  # loaded with the plans (op_plans.py)

        mine = self._rows(rows)
        return false_blocks(frames, reporter, mine, named)

    def false_early(self, op_seq: int, reporter: int, rows: Iterable[tuple[int, int, int]],
                    named: Iterable[int], schedule: str = "") -> list[int]:
        """The peers of ``named`` that ``reporter`` says sent it frames out of order although by its own
        testimony ``rows`` and plan no frame of theirs can show it
        (:func:`~pccl.master.plan_rule.false_early`), under the operation's schedule or, while most
        participants have not reported it, the ``schedule`` the reporter says it ran; empty unless the
        operation is recorded."""
        frames = self.plans.frames(op_seq, schedule)
        if frames is None:
            return []
        from .plan_rule import false_early  # loaded with the plans (op_plans.py)

        mine = self._rows(rows)
        return false_early(frames, reporter, mine, named)

    def last_holder(self, op_seq: int, reporter: int, rows: Iterable[tuple[int, int, int]],
                    complete: Collection[int], schedule: str = "") -> tuple[bool, list[tuple[int, int, int]]]:
        """Judge ``reporter``'s stall testimony ``rows`` for operation ``op_seq`` against its own plan and
        against the participants that reported their part ``complete`` (pccl/master/plan_rule.py
        ``finished`` and ``undelivered``): whether by its own testimony it took every frame its plan
        receives (under the operation's schedule or, while most participants have not reported it, the
        ``schedule`` it says it ran: judged by its own account), and the complete partners whose plans
        sent it more than it says it took (under the operation's schedule only: a claim of one member
        never makes another's figures). Both empty unless the operation is recorded and plannable."""
        frames = self.plans.frames(op_seq, schedule)
        if frames is None:
            return False, []
        from .plan_rule import finished, undelivered  # loaded with the plans (op_plans.py)

        mine = self._rows(rows)
        done = finished(frames, reporter, mine)
        if self.plans.schedule(op_seq) is None:
            return done, []
        return done, undelivered(frames, reporter, mine, complete)

    def add(self, op_seq: int, peer: int, rows: Iterable[tuple[int, int, int]],
            members: Container[int] | None = None,
            blocked: Iterable[int] = (), schedule: str = "",
            early: Iterable[int] = ()) -> list[tuple[int, int, int, int]]:
        """``peer`` testifies ``rows`` (``(partner, sent, taken)``) for operation ``op_seq``; rows
        naming no member (``members``, None: any) are ignored. ``blocked``: the partners its sends to
        were under way then (:meth:`holders` reads them). ``schedule``: the one it says it ran
        (:meth:`OpPlans.claim`). ``early``: the partners it says sent a frame out of their release order
        (pccl/peer/early_frames.py): any, and it is not judged as a holder in this operation.

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
        self._blocked.setdefault(op_seq, {})[peer] = frozenset(p for p in blocked if p in mine)
        self.plans.claim(op_seq, peer, schedule)
        if any(p in mine for p in early):
            self._early.setdefault(op_seq, set()).add(peer)
        while len(self._ops) > 1 and (len(self._ops) > self.keep or self.rows > self.max_rows):
            old, gone = self._ops.popitem(last=False)
            self.rows -= sum(len(r) for r in gone.values())
            self._blocked.pop(old, None)
            self._early.pop(old, None)
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


def ring_holders(order: Sequence[int], slack: int, testimony: Mapping[int, Mapping[int, tuple[int, int]]],
                 blocked: Mapping[int, Container[int]]) -> list[tuple[int, int, int, int]]:
    """The peers of a stalled ring all-reduce over ``order`` that hold the ring (module docstring).

    Args:
        order: the ring order (predecessor of ``order[i]``: ``order[i - 1]``; at least 3 peers).
        slack: the most bytes an honest peer takes beyond what it passed on (the largest chunk).
        testimony: testifier -> partner -> ``(sent to it, taken from it)``.
        blocked: testifier -> partners its sends to were under way.

    Returns:
        ``(holder, successor, took from its predecessor, what the successor took from it)``, for each
        peer that, its predecessor and its successor all testified, no send between them under way,
        the successor not behind on the holder's frames, took more than ``slack`` beyond what it passed.
    """
    n = len(order)
    found: list[tuple[int, int, int, int]] = []
    if n < 3:
        return found
    for i, peer in enumerate(order):
        pred, succ = order[i - 1], order[(i + 1) % n]
        mine, theirs = testimony.get(peer), testimony.get(succ)
        if mine is None or theirs is None or pred not in testimony:
            continue
        if peer in blocked.get(pred, ()) or succ in blocked.get(peer, ()):
            continue  # released frames not written: the pair and stalled_on rules judge that link
        took = mine.get(pred, (0, 0))[1]
        sent = mine.get(succ, (0, 0))[0]
        passed = theirs.get(peer, (0, 0))[1]
        if passed < sent:
            continue  # the successor is behind on its frames: the pair rule judges them
        if took - passed > slack:
            found.append((peer, succ, took, passed))
    return found


__all__ = ["JUDGE_ALL_FRAMES", "KEEP", "MAX_ROWS", "StallTestimony", "ring_holders"]
