"""Deadlock detection over the master's state (pure; time is passed in).

A peer group is *deadlocked* when every accepted peer of it has voted for at least one call, none of
them takes part in a running round, and no pending vote can complete with the votes the group can
still give: the peers wait in different calls (``sync_shared_state`` against ``all_reduce``), or in the
same call with different tags. Nobody else could vote, so without help they would wait until killed.

The peers' calls are failed with one error that names each peer's call. Because a peer may run
several asynchronous operations and send their votes a moment apart, a deadlock must hold unchanged
for ``grace`` seconds before it is declared (0: at once). A held master (rebuilding, or short of its
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
    # Runs after every message: a deadlock needs at least two accepted peers of one group that all have a
    # vote in, which almost never holds while a run makes progress. First a bound from the open votes'
    # sizes (O(votes open + groups), so that a vote round of n peers costs O(n), not O(n^2)), then the
    # voters themselves, and only then the calls each waits in.
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


class DeadlockWatch:
    """Tracks candidate deadlocks over time and fails the ones that held for ``grace`` seconds."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._since: dict[Deadlock, float] = {}
        self.detected = 0

    def check(self, state: MasterState, now: float) -> list[Effect]:
        """Fail every deadlock that has held unchanged for ``grace`` seconds; remember new ones.

        Returns:
            The effects that fail the deadlocked calls (and one log event per deadlock).
        """
        current = find_deadlocks(state)
        self._since = {d: self._since.get(d, now) for d in current}
        effects: list[Effect] = []
        for d, t0 in list(self._since.items()):
            if now - t0 >= self.grace:
                del self._since[d]
                self.detected += 1
                effects += state.fail_votes({p for p, _ in d.waits}, d.reason, Result.INVALID_USAGE)
        return effects

    def deadline(self) -> float | None:
        """When the earliest candidate deadlock will be declared if nothing changes."""
        return min((t0 + self.grace for t0 in self._since.values()), default=None)


__all__ = ["Deadlock", "DeadlockWatch", "find_deadlocks"]
