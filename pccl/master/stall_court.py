"""Judging a member's stalled-operation report (issue 33): who is struck alone, which pairs count, who is
removed (pure: no trio, no sockets; time passed in).

A member whose collective stalled reports it (``CollectiveDone`` with ``success=False``): the partner that
did not take its frames (``stalled_on``), its sends under way (``blocked``), partners that sent out of
release order (``early``) and its bytes per partner (``io``). :class:`StallCourt` weighs that against the
operation's plans and the other testimonies (pccl/master/testimony.py, plan_rule.py), strikes a reporter
whose own testimony contradicts itself, counts accusations as pairs (pccl/master/blame.py), adds lone holds
(pccl/master/lone_holds.py), and evicts through :meth:`MasterState.evict_for_liveness`, returning the
effects for the server to execute. docs/security.md "Members: the insider threat model".
"""

from __future__ import annotations

import logging

from .._errors import Result
from ..wire import messages as m
from . import held_ops
from .blame import StallBlame
from .effects import Effect
from .lone_holds import LoneHolds
from .state import MasterState
from .testimony import StallTestimony

log = logging.getLogger("pccl.master")


class StallCourt:
    """The master's judgement of stall reports: the strikes (:class:`StallBlame`), the lone-hold ledgers
    (:class:`LoneHolds`) and the testimonies (:class:`StallTestimony`) of one master."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        self.blame = StallBlame()  # members that stop reading (pccl/master/blame.py)
        self.lone_holds = LoneHolds()  # members that fail what they hold alone (pccl/master/lone_holds.py)
        self.testimony = StallTestimony()  # ... found by the bytes of a stalled operation (testimony.py)
        self._out: list[Effect] = []  # the evictions of the report being judged

    def retain(self) -> None:
        """Forget the lone-hold ledgers of members no longer in the master's records."""
        if self.lone_holds:
            self.lone_holds.retain(self.state.peers)

    def report(self, reporter: int, msg: m.CollectiveDone, now: float) -> list[Effect]:
        """A member's operation stalled: it names the partner that did not take its frames
        (``stalled_on``), or testifies its bytes per partner (``io``: pccl/master/testimony.py). Each
        pair found counts once per operation; the second within the window removes both
        (pccl/master/blame.py)."""
        self._out = []
        pairs: list[tuple[int, int]] = []
        struck = self.blame.struck_total
        rec = self.state.peers.get(reporter)
        op = self.state.collectives.ops.get((rec.group, msg.tag)) if rec is not None else None
        if op is not None and msg.op_seq not in (-1, op.op_seq):
            op = None  # a replaced speculative attempt's report: the operation does not fail by it
        if msg.op_seq >= 0:
            self._note_plan(msg.op_seq)
        # a send under way that its own testimony leaves no frame for: the accuser alone is struck
        named = [*([msg.stalled_on] if msg.stalled_on >= 0 else []), *msg.blocked]
        false = set(self.testimony.false_blocks(msg.op_seq, reporter, msg.io, named, msg.schedule)) \
            if msg.io else set()
        if false and self.testimony.first(msg.op_seq, reporter, reporter):
            log.warning("operation %d stalled: peer %d says its sends to %s were under way, but by what it "
                        "says it took and sent its plan left it nothing to send them", msg.op_seq, reporter,
                        sorted(false))
            self._strike(reporter, now, f"it said its sends to {sorted(false)} were under way with none "
                                        "left to send them")
        # frames out of order that its own testimony shows none of: the accuser alone is struck
        false_early = set(self.testimony.false_early(msg.op_seq, reporter, msg.io, msg.early, msg.schedule)) \
            if msg.io and msg.early else set()
        early = [b for b in msg.early if b not in false_early]
        if false_early and self.testimony.first(msg.op_seq, reporter, reporter):
            log.warning("operation %d stalled: peer %d says %s sent it frames out of order, but by its plan "
                        "and what it says it took no frame of theirs shows it", msg.op_seq, reporter,
                        sorted(false_early))
            self._strike(reporter, now, f"it said {sorted(false_early)} sent it frames out of order with no "
                                        "frame of theirs taken")
        if msg.stalled_on >= 0 and msg.stalled_on not in false:
            log.warning("peer %d reports that peer %d did not take its frames for p2p_stall_timeout",
                        reporter, msg.stalled_on)
            pairs.append((reporter, msg.stalled_on))
        if msg.io and msg.op_seq >= 0:
            members = set(self.state.ring)
            for a, b, sent, taken in self.testimony.add(msg.op_seq, reporter, msg.io, members, msg.blocked,
                                                        msg.schedule, early):
                log.warning("operation %d stalled: peer %d sent peer %d %d bytes, peer %d took %d of them",
                            msg.op_seq, a, b, sent, b, taken)
                pairs.append((a, b))
            # a send under way is the sender's word that the partner does not take its frames
            pairs.extend((reporter, b) for b in msg.blocked
                         if b in members and b != msg.stalled_on and b not in false)
            # a frame taken while an earlier one from the same partner never came: the receiver's word
            # that the partner sent out of its release order (pccl/peer/early_frames.py)
            for b in early:
                if b in members and b != reporter and b != msg.stalled_on and b not in msg.blocked:
                    log.warning("operation %d stalled: peer %d took a frame of peer %d filled while an "
                                "earlier one from peer %d stayed open", msg.op_seq, reporter, b, b)
                    pairs.append((reporter, b))
            for holder, succ, owed, passed in self.testimony.holders(msg.op_seq, reporter):
                log.warning("operation %d stalled: by what peer %d says it took, its plan released %d bytes "
                            "to peer %d, which took only %d from it", msg.op_seq, holder, owed, succ, passed)
                self._strike(holder, now)
            pairs += self._last_holder(reporter, msg, now)
        held = held_ops.lone_hold(op, reporter, now)
        if held is not None and not pairs and self.blame.struck_total == struck:
            # it held the operation alone and fails it naming nobody: the failure is its own; holds
            # shorter than LONE add up (pccl/master/lone_holds.py)
            why = self.lone_holds.add(reporter, held, now)
            log.log(logging.WARNING if why else logging.INFO,
                    "operation %d failed by peer %d, which held it alone for %.1fs after every other "
                    "participant finished, with no testimony naming another%s", op.op_seq if op else -1,
                    reporter, held, f" ({why})" if why else "")
            if why:
                self._strike(reporter, now, why)
        for accuser, accused in pairs:
            if not self.testimony.first(msg.op_seq, accuser, accused):
                continue
            for pid, reason in self.blame.report(accuser, accused, now, set(self.state.ring),
                                                 repeat=self.state.offenders.repeat):
                log.warning("peer %d %s", pid, reason)
                # remembered: a rejoin is refused for a back-off (pccl/master/penalties.py)
                self._out.extend(self.state.evict_for_liveness(pid, reason, Result.KICKED, now))
        return self._out

    def _last_holder(self, reporter: int, msg: m.CollectiveDone, now: float) -> list[tuple[int, int]]:
        """The member that stops where it owes nothing (pccl/master/plan_rule.py ``finished`` and
        ``undelivered``): a stall testimony that by its own plan took every frame it receives, with no
        send under way, strikes its maker alone; a partner that reported its part complete although
        the reporter says it took less of its frames is a pair (returned), as if both had testified."""
        op = next((o for o in self.state.collectives.ops.values()
                   if o.running and o.op_seq == msg.op_seq), None)
        complete = frozenset(op.done) if op is not None else frozenset()
        done, short = self.testimony.last_holder(msg.op_seq, reporter, msg.io, complete, msg.schedule)
        if done and not msg.blocked and not msg.early and msg.stalled_on < 0 \
                and self.testimony.first(msg.op_seq, reporter, reporter):
            log.warning("operation %d stalled: peer %d reports it stalled, but by what it says it took its "
                        "plan had no receive left and no send of it was under way", msg.op_seq, reporter)
            self._strike(reporter, now, "it reported operations stalled although it says it took every frame "
                                        "its plan receives and had no send under way")
        for partner, owed, taken in short:
            log.warning("operation %d stalled: peer %d reported its part complete (its plan sent peer %d %d "
                        "bytes), peer %d says it took %d of them", msg.op_seq, partner, reporter, owed,
                        reporter, taken)
        return [(partner, reporter) for partner, _, _ in short]

    def _strike(self, peer: int, now: float, why: str = "") -> None:
        """``peer``'s own testimony contradicts itself: struck alone (pccl/master/blame.py ``hold``)."""
        for pid, reason in self.blame.hold(peer, now, set(self.state.ring),
                                           repeat=self.state.offenders.repeat, why=why):
            log.warning("peer %d %s", pid, reason)
            self._out.extend(self.state.evict_for_liveness(pid, reason, Result.KICKED, now))

    def _note_plan(self, op_seq: int) -> None:
        """Record a running operation's descriptor (the one the master checked) and participants for the
        plan rule (pccl/master/op_plans.py): the first failure report comes while it runs."""
        if self.testimony.plans.known(op_seq):
            return
        op = next((o for o in self.state.collectives
                   if o.running and o.op_seq == op_seq and o.participants), None)
        d = None if op is None else op.votes.get(op.participants[0])
        if op is not None and d is not None:
            self.testimony.plans.note(op_seq, d, op.participants)
            for peer, schedule in op.schedules.items():  # those that reported their part complete
                self.testimony.plans.claim(op_seq, peer, schedule)

