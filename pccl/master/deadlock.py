"""Deadlock detection over the master's state (pure; time is passed in).

A peer group is *deadlocked* when every accepted peer of it has voted for at least one call, none of
them takes part in a running round, and no pending vote can complete with the votes the group can
still give: the peers wait in different calls (``sync_shared_state`` against ``all_reduce``), or in the
same call with different tags. Nobody else could vote, so without help they would wait until killed.

The peers' calls are failed with one error that names each peer's call. Because a peer may run
several asynchronous operations and send their votes a moment apart, a deadlock must hold unchanged
for ``grace`` seconds before it is declared (0: at the next check, at most ``DeadlockWatch.every``
seconds later). A held master (rebuilding, or short of its
quorum: docs/concepts.md "Surviving the master") has no deadlocks: its votes wait for members.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import Result
from .describe import VoteWait, deadlock_reason
from .state import Effect, MasterState

_GLOBAL_VOTES = ("update_topology", "optimize_topology", "peers_pending")


@dataclass(frozen=True)
class Deadlock:
    """The accepted peers of ``group`` and the calls each waits in."""

    group: int
    waits: tuple[tuple[int, tuple[VoteWait, ...]], ...]

    @property
    def reason(self) -> str:
        """The error message the calls fail with."""
        return deadlock_reason(self.group, dict(self.waits))


def find_deadlocks(state: MasterState) -> list[Deadlock]:
    """Every peer group that is deadlocked right now (see the module docstring)."""
    # Runs on the timers' clock (DeadlockWatch.poll), at most every DeadlockWatch.every seconds while
    # messages come, so its cost no longer multiplies with the message rate. A deadlock needs at least
    # two accepted peers of one group that all have a vote in, which almost never holds while a run makes
    # progress. First a bound from the open votes' sizes (O(votes open + groups), so that a vote round of
    # n peers costs O(n), not O(n^2)), then the voters themselves, and only then the calls each waits in.
    if not state.resumed:
        return []  # held (rebuilding, no quorum, a roll call or an operation in doubt): votes wait
    candidates = state.deadlock_candidates()
    if not candidates:
        return []
    voting = state.voting_peers()
    if not any(voting.issuperset(state.accepted(group)) for group in candidates):
        return []
    waits = state.vote_waits()
    busy = state.busy_peers()
    ring = state.accepted()
    found: list[Deadlock] = []
    for group in sorted({state.peers[p].group for p in ring}):
        members = state.accepted(group)
        if len(members) < 2 or any(p in busy or p not in waits for p in members):
            continue
        mine = [w for p in members for w in waits[p]]
        if any(w.kind in _GLOBAL_VOTES for w in mine) and set(ring) != set(members):
            continue  # a ring-wide vote: peers of other groups can still vote in it
        if all(w.kind == "peers_pending" for w in mine):
            continue  # the query completes once everyone asks; nothing to fail
        found.append(Deadlock(group, tuple((p, tuple(waits[p])) for p in members)))
    return found


CHECK_EVERY = 0.25
"""Default of :class:`DeadlockWatch`'s ``every``: the longest a change waits to be checked."""


class DeadlockWatch:
    """Tracks candidate deadlocks over time and fails the ones that held for ``grace`` seconds.

    :meth:`check` walks the open votes (O(votes open), up to members x ``max_open_votes``), so the
    server does not run it after each message (issue 33 item 3: a member holding thousands of votes
    open made every message cost that walk). Each message only marks the state :meth:`changed` (O(1));
    the master's timers (pccl/master/timers.py) run :meth:`poll` at :meth:`deadline`, which checks at
    most once every ``every`` seconds. A deadlock found counts from the last change before the check
    (the state has not changed since), so with ``grace >= every`` it is declared when it would have
    been before, and with a smaller grace at most ``every`` seconds after it formed.
    """

    def __init__(self, grace: float, every: float = CHECK_EVERY) -> None:
        if every <= 0:
            raise ValueError(f"every ({every}) must be > 0")
        self.grace = grace
        self.every = every
        self._since: dict[Deadlock, float] = {}
        self._dirty: float | None = None  # the first change since the last check (None: none)
        self._last_change: float | None = None
        self.detected = 0
        self.checks = 0

    def changed(self, now: float) -> None:
        """The master's state may have changed at ``now`` (a message, a timer): check it by
        ``now + every`` at the latest. O(1)."""
        if self._dirty is None:
            self._dirty = now
        self._last_change = now

    def due(self) -> float | None:
        """When the next check of a changed state is due (None: nothing changed since the last)."""
        return None if self._dirty is None else self._dirty + self.every

    def poll(self, state: MasterState, now: float) -> list[Effect]:
        """The timer step: :meth:`check` if a change or a candidate's grace is due at ``now``."""
        due = self.deadline()
        return self.check(state, now) if due is not None and now >= due else []

    def check(self, state: MasterState, now: float) -> list[Effect]:
        """Fail every deadlock that has held unchanged for ``grace`` seconds; remember new ones.

        Returns:
            The effects that fail the deadlocked calls (and one log event per deadlock).
        """
        self.checks += 1
        # Found now, unchanged since the last change (never later than now).
        since = now if self._last_change is None else min(now, self._last_change)
        self._dirty = None
        current = find_deadlocks(state)
        self._since = {d: self._since.get(d, since) for d in current}
        effects: list[Effect] = []
        for d, t0 in list(self._since.items()):
            if now - t0 >= self.grace:
                del self._since[d]
                self.detected += 1
                effects += state.fail_votes({p for p, _ in d.waits}, d.reason, Result.INVALID_USAGE)
        return effects

    def deadline(self) -> float | None:
        """When to :meth:`poll` next: a changed state's check, or the earliest candidate deadlock's
        declaration if nothing changes."""
        return min((t for t in (self.due(), *(t0 + self.grace for t0 in self._since.values()))
                    if t is not None), default=None)


__all__ = ["CHECK_EVERY", "Deadlock", "DeadlockWatch", "find_deadlocks"]
