"""The master's clock interface: every deadline of the master core behind ``next_deadline()`` and
``tick(now)``, so the server's monitor is one loop that sleeps until the next deadline and ticks, with
no branch per timer.

The timers, each a pair of the core (:class:`~pccl.master.state.MasterState`'s ``*_deadline`` and
``*_overdue``), in the order a tick runs them:

* heartbeat silence (``heartbeat_timeout``) and, when ``straggler_timeout`` is set, stragglers (hung peers
  the others wait on): evicted (:class:`~pccl.master.effects.Drop`: a hung peer reads no goodbye);
* the P2P setup of a topology round (``p2p_setup_timeout``);
* operations and rounds in doubt after a master's loss (a heartbeat timeout; pccl/master/ops_in_doubt.py);
* the holds of members whose connection broke (``rejoin_grace``), and the credential rows owed to the
  holders of a set (``credentials_batch_delay``);
* vote timeouts (``vote_timeout``), newcomers that hold votes up (``admission_grace``) and the quorum
  hold (``quorum_hold_timeout``);
* deadlocks whose grace ran out (:class:`~pccl.master.deadlock.DeadlockWatch`).

The master's own stalls (its monitor woke later than it planned: an overloaded host) are not held against
the peers' silence for a heartbeat timeout after them (:class:`~pccl._stalls.StallCredit`): their
heartbeats of that time wait unread in the socket buffers, and the master evicted every peer at once.

Pure: times are passed in. A tick yields its effects in batches, one per step, so that the server
executes (and the deadlock watch sees) each step's effects before the next step runs, as the monitor
did timer by timer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .._errors import Result
from .._stalls import StallCredit
from . import held_ops
from .deadlock import DeadlockWatch
from .effects import Drop, Effect
from .state import MasterState


@dataclass(frozen=True)
class TimerConfig:
    """The timeouts of :class:`MasterTimers` (the server passes :class:`~pccl.MasterConfig`'s)."""

    heartbeat_interval: float
    heartbeat_timeout: float
    p2p_setup_timeout: float
    straggler_timeout: float | None = None
    vote_timeout: float | None = None
    quorum_hold_timeout: float | None = None
    admission_grace: float | None = None


class MasterTimers:
    """Every deadline of one master core (see the module docstring).

    Args:
        state: the master's state machine.
        config: the timeouts.
        deadlocks: the deadlock watch (None: deadlocks are not declared).
    """

    def __init__(
        self, state: MasterState, config: TimerConfig, deadlocks: DeadlockWatch | None = None
    ) -> None:
        self.state = state
        self.config = config
        self.deadlocks = deadlocks
        self._ticked: float | None = None
        self.stalls = StallCredit(config.heartbeat_timeout)

    def tick(self, now: float) -> Iterator[list[Effect]]:
        """Run every timer due at ``now``: yields the effects of each step (execute each batch before
        taking the next: later steps read the state the earlier ones left)."""
        st, cfg = self.state, self.config
        timeout, straggler = cfg.heartbeat_timeout, cfg.straggler_timeout
        self.stalls.woke(now)
        judged = now - self.stalls.credit(now)  # silence is judged without the master's own stall
        silent_msg = f"evicted: silent for more than {timeout:g}s"
        lost = dict.fromkeys(st.expired(judged, timeout), silent_msg)
        if straggler is not None:
            for pid, silent in st.stragglers(judged, straggler, timeout):
                lost.setdefault(pid, f"evicted: silent for {silent:.2f}s while its group waited on it "
                                     f"(straggler timeout {straggler:g}s)")
        for pid, reason in lost.items():
            yield [*st.peer_lost(pid, reason, now), Drop(pid)]
        yield st.setup_overdue(now, cfg.p2p_setup_timeout)
        yield st.doubts_overdue(now, timeout)
        yield st.rejoin_overdue(now)
        yield st.credentials_overdue(now)
        # Each timer's deadline is taken right after its own step (the steps after it may move it, a
        # later tick sees that), as the monitor always did: the traces of a seeded run stay the same.
        ends = self._fixed_deadlines(now)
        if cfg.vote_timeout is not None:
            yield st.vote_overdue(now, cfg.vote_timeout)
            ends.append(st.vote_deadline(cfg.vote_timeout))
            yield from self._held(now, cfg.vote_timeout)
            ends.append(self._held_deadline(cfg.vote_timeout))
        if cfg.admission_grace is not None:
            yield st.admission_overdue(now, cfg.admission_grace)
            ends.append(st.admission_deadline(cfg.admission_grace))
        if cfg.quorum_hold_timeout is not None:
            yield st.hold_overdue(now, cfg.quorum_hold_timeout)
            ends.append(st.hold_deadline(cfg.quorum_hold_timeout))
        if cfg.straggler_timeout is not None:
            ends.append(self._credited(st.straggler_deadline(cfg.straggler_timeout, timeout), now))
        if self.deadlocks is not None:
            # Checked on this clock, not after each message (issue 33 item 3): at most every `every`s.
            yield self.deadlocks.poll(st, now)
            ends.append(self.deadlocks.deadline())
        self._ticked = min((e for e in ends if e is not None), default=None)

    def _held(self, now: float, timeout: float) -> Iterator[list[Effect]]:
        """A running collective that one participant has held alone too long: it is removed
        (pccl/master/held_ops.py), remembered as evicted for liveness."""
        st = self.state
        if not st.resumed:
            return  # held (rebuilding, short of its quorum): the operations wait for members
        for pid, reason in held_ops.overdue(list(st.collectives.ops.values()), now, timeout,
                                            st.offenders.grace):
            if pid in st.peers:
                yield st.evict_for_liveness(pid, reason, Result.KICKED, now)

    def _held_deadline(self, timeout: float) -> float | None:
        st = self.state
        return held_ops.deadline(st.collectives.ops.values(), timeout, st.offenders.grace) \
            if st.resumed else None

    def _credited(self, deadline: float | None, now: float) -> float | None:
        """A silence deadline moved by the stall credit held at ``now``."""
        return None if deadline is None else deadline + self.stalls.credit(now)

    def _fixed_deadlines(self, now: float | None = None) -> list[float | None]:
        st, cfg = self.state, self.config
        seen = min((p.last_seen for p in st.peers.values()), default=None)
        silence = None if seen is None else seen + cfg.heartbeat_timeout
        ends = [silence, st.rejoin_deadline(), st.credentials_deadline(),
                st.doubt_deadline(cfg.heartbeat_timeout), st.setup_deadline(cfg.p2p_setup_timeout)]
        if now is not None and self.stalls.credit(now) > 0:
            # While a stall is credited silence is due that much later, and judged in full again
            # when the credit ends.
            ends[0] = self._credited(silence, now)
            ends.append(self.stalls.until(now))
        return ends

    def deadline_after_tick(self) -> float | None:
        """The earliest deadline as the last :meth:`tick` saw it, each timer's taken right after its own
        step (what the monitor sleeps until; :meth:`next_deadline` is the same taken now)."""
        return self._ticked

    def next_deadline(self, now: float | None = None) -> float | None:
        """The earliest time a timer is due (None: none is armed); ``now`` (optional) counts the
        master's stall credited then."""
        st, cfg = self.state, self.config
        timeout = cfg.heartbeat_timeout
        ends = self._fixed_deadlines(now)
        if cfg.vote_timeout is not None:
            ends.append(st.vote_deadline(cfg.vote_timeout))
        if cfg.admission_grace is not None:
            ends.append(st.admission_deadline(cfg.admission_grace))
        if cfg.quorum_hold_timeout is not None:
            ends.append(st.hold_deadline(cfg.quorum_hold_timeout))
        if cfg.straggler_timeout is not None:
            deadline = st.straggler_deadline(cfg.straggler_timeout, timeout)
            ends.append(deadline if now is None else self._credited(deadline, now))
        if self.deadlocks is not None:
            ends.append(self.deadlocks.deadline())
        return min((e for e in ends if e is not None), default=None)

    def wake_at(self, now: float) -> float:
        """When the monitor, having ticked at ``now``, wakes next: just after the deadline the tick
        left, or at the re-check. Noted: a later tick that finds itself late by more than
        :data:`~pccl._stalls.MIN_STALL` credits the master's stall (the module docstring)."""
        deadline = self._ticked
        recheck = self.recheck_at(now)
        wake = recheck if deadline is None else min(deadline + 0.001, recheck)
        self.stalls.plan(wake, now)
        return wake

    def recheck_at(self, now: float) -> float:
        """The latest time to tick again whatever the deadlines say: new peers, clock skew, and (with a
        straggler timeout) who is waited on changes with every message, so every quarter of it."""
        wake = now + self.config.heartbeat_interval
        if self.config.straggler_timeout is not None:
            wake = min(wake, now + self.config.straggler_timeout / 4)
        return wake

    def urgent(self) -> tuple[float | None, ...]:
        """The deadlines a message can move earlier than the monitor sleeps (a member's hold starting,
        credential rows owed, a candidate deadlock): the server wakes the monitor when one changes."""
        dd = self.deadlocks.deadline() if self.deadlocks is not None else None
        return (dd, self.state.rejoin_deadline(), self.state.credentials_deadline())


__all__ = ["MasterTimers", "TimerConfig"]
