"""The vote timeout and the failing of open votes: who is blamed when a vote waits too long, and the
calls failed for a deadlock.

Pure (no trio, sockets or clocks). :class:`VoteTimeouts` finds the earliest open vote without building a
row per vote (the timers ask at every tick; issue 33 item 3), acts on the votes overdue
(``MasterConfig.vote_timeout``: the stragglers kicked, or, for a call the others never made, the vote
failed for its voters; issue 33 item 4), and fails the calls of given peers in every open vote (a
deadlock, pccl/master/deadlock.py). It works on the dispatcher through :class:`VoteTimeoutsCore`; the
walks over the open rounds (``_open_rounds``, ``_open_votes``) stay there.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from .._errors import Result
from ..wire import messages as m
from .effects import Effect, Event, Send
from .membership import Membership
from .rounds.base import Round, VoteKey
from .rounds.collective import CollectiveRound, CollectiveVotes
from .rounds.sync import SyncVotes
from .rounds.topology import TopologyRound


class VoteTimeoutsCore(Protocol):
    """What :class:`VoteTimeouts` uses of the master's dispatcher
    (:class:`~pccl.master.state.MasterState`)."""

    members: Membership
    ring: list[int]
    epoch: int
    collectives: CollectiveVotes
    syncs: SyncVotes
    _ops: dict[tuple[int, int], CollectiveRound]
    _topology: TopologyRound | None
    _now: float

    @property
    def resumed(self) -> bool: ...

    def kick(self, peer_id: int, reason: str, code: Result = Result.INVALID_USAGE) -> list[Effect]: ...

    def table(self, ids: list[int]) -> list[m.PeerRow]: ...

    def accepted(self, group: int | None = None) -> list[int]: ...

    def _open_rounds(self, ordered: bool = True, with_ops: bool = True) -> list[Round]: ...

    def _open_votes(self, with_ops: bool = True) -> list[tuple[str, float, set[int], list[int], VoteKey]]: ...


class VoteTimeouts:
    """The vote timeout and the failing of ``core``'s open votes (see the module docstring)."""

    def __init__(self, core: VoteTimeoutsCore) -> None:
        self.core = core

    def deadline(self, timeout: float) -> float | None:
        """When the earliest open vote (one others joined) runs out of time for its missing voters."""
        first = self.earliest()
        return None if first is None else first + timeout

    def earliest(self) -> float | None:
        """When the oldest vote :meth:`MasterState._open_votes` lists opened, without building its rows.

        The timers ask this at every tick and :meth:`overdue` before any row is built: collective
        votes (up to members x max_open_votes open) cost a few comparisons each, their sizes against the
        group's (issue 33 item 3); the few other votes go through :meth:`MasterState._open_votes`.
        """
        core = self.core
        if not core.resumed:
            return None
        best = min((v[1] for v in core._open_votes(with_ops=False)), default=None)
        sizes = core.members.sizes_by_group()
        for (group, _), op in core._ops.items():
            if op.running or not op.votes or (best is not None and op.opened >= best):
                continue
            votes = op.votes
            # Voters are accepted peers of the group (a lost one's ballot is withdrawn): fewer of them
            # than members means someone is missing; otherwise check the members themselves.
            if len(votes) < sizes.get(group, 0) or any(p not in votes for p in core.accepted(group)):
                best = op.opened
        return best

    def overdue(self, now: float, timeout: float) -> list[Effect]:
        """Act on every vote its first ballot opened more than ``timeout`` seconds ago
        (MasterConfig.vote_timeout) and that still misses accepted peers of its group.

        The clock starts at the vote's first ballot, not at the peer's last message: a peer that
        heartbeats but never votes is caught, and a peer computing between collectives is only
        ever measured against the others that already wait for it. Who is blamed (issue 33 item 4):

        * the voters are at least as many as the missing peers: the missing ones are stragglers the
          others wait on: kicked (then the vote completes without them);
        * the voters are fewer (a call that most members never made: another tag, a sync or a
          topology call nobody else makes): the vote fails for its voters (``INVALID_USAGE``, "no other
          member joined ..."), and nobody is evicted. are_peers_pending votes have no failure reply:
          their missing peers are kicked as before.

        Args:
            now: the current time (same clock as ``handle``).
            timeout: seconds the others may wait.

        Returns:
            The effects to execute (the failed votes, the kicks, then whatever the votes do without
            the kicked peers).
        """
        core = self.core
        core._now = now
        first = self.earliest()
        if first is None or now <= first + timeout:
            return []  # nothing overdue: no row built (this runs at every tick)
        late: dict[int, str] = {}
        alone: list[tuple[str, list[int], VoteKey]] = []
        for what, opened, missing, voted, key in core._open_votes():
            if now > opened + timeout:
                if len(voted) < len(missing) and key[0] != "pending":
                    alone.append((what, voted, key))
                    continue
                for p in sorted(missing):
                    late.setdefault(p, f"did not join the {what} within {timeout:g}s while {voted} waited")
        effects: list[Effect] = []
        for what, voted, key in alone:
            reason = (f"no other member joined the {what} within {timeout:g}s (voted: {voted}): every "
                      "member of a group must make the same calls")
            effects += self.fail_round(key, voted, reason)
            effects.append(Event(f"vote timeout: {reason}"))
        for p, reason in late.items():
            effects += core.kick(p, reason)
        return effects

    def fail_votes(
        self, peer_ids: set[int], reason: str, code: Result = Result.INVALID_USAGE
    ) -> list[Effect]:
        """Withdraw the votes of ``peer_ids`` from every vote that has not completed and fail each of
        those calls with ``reason`` (a deadlock). are_peers_pending votes have no failure reply and stay."""
        core = self.core
        effects: list[Effect] = []
        rounds = core._open_rounds()
        # (the ring-wide topology vote last, as it always was)
        for rnd in [r for r in rounds if r.group is not None] + [r for r in rounds if r.key[0] == "topology"]:
            effects += self.fail_round(rnd.key, peer_ids, reason, code)
        if effects:
            effects.append(Event(reason))
        return effects

    def fail_round(self, key: VoteKey, voters: Collection[int], reason: str,
                    code: Result = Result.INVALID_USAGE) -> list[Effect]:
        """Fail the calls of ``voters`` in the open vote ``key`` (it stays unanswered otherwise);
        are_peers_pending votes have no failure reply."""
        core = self.core
        kind, which = key
        if kind == "op":
            assert isinstance(which, tuple)
            return core.collectives.withdraw(which, voters, reason, code)
        if kind == "sync":
            assert isinstance(which, int)
            return core.syncs.withdraw(which, voters, reason, code)
        if kind == "topology":
            return self.withdraw_topology(voters, reason, code)
        return []

    def withdraw_topology(self, peer_ids: Collection[int], reason: str, code: Result) -> list[Effect]:
        """Fail the votes of ``peer_ids`` in the open topology vote; drop it when none is left."""
        core = self.core
        rnd = core._topology
        if rnd is None or not rnd.voting:
            return []
        table = core.table(core.ring)
        effects: list[Effect] = [Send(p, m.TopologyResult(success=False, epoch=core.epoch, peers=table,
                                                          reason=reason, code=int(code)))
                                 for p in rnd.withdraw(peer_ids)]
        if not rnd.votes:
            core._topology = None
        return effects
