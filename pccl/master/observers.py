"""Fetchers that replay (issue 35 item 4): a live heal's fetcher that takes part in its group's collectives
as a participant contributing nothing, and replays the rounds it missed (docs/concepts.md "Replaying the
rounds missed").

Pure: no trio, sockets or clocks. :class:`~pccl.master.heals.HealBook` owns one :class:`Observers` and asks
it at its hooks. A peer's sync vote says whether it would observe (``SharedStateSync.observe``, a
``pccl.torch`` DiLoCo with ``replay_heals``). When every fetcher of a sync would, the heal may run live
although every key it fetches changes at every sync (the rule that keeps such syncs ordinary,
:meth:`HealBook.all_changed`, is for fetchers that catch up by fetching again). Its fetchers then

* **observe**: from the heal's start they count in their group's collective votes (the members' rounds
  reach them: they keep each round's reduced result) and in no sync vote;
* **join** once fetched: their call returns the healed revision at once (no catch-up round), they replay
  the rounds they kept, and vote again at the group's revision; until that vote they count in no sync
  vote (the members' next sync must not wait for a peer that waits for their next round), and until the
  sync they join ends in none of the group's ``are_peers_pending`` votes either.

The join vote: while the group's sync runs (its round is past its vote) it waits for the run's end; then,
if the group's last committed sync is at the vote's revision, the joiner is answered at once when its
content is the content that sync elected (it replayed exactly: bit-identical) and refused otherwise
(it would wait for a sync the members can only reach through a round that waits for it); a vote at
another revision goes to the group's next sync as any vote does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .. import _errors
from . import election as _election


@dataclass(frozen=True)
class JoinAnswer:
    """What to do with a joiner's vote: ``"vote"`` (count it in the group's sync as any ballot),
    ``"wait"`` (the group's sync runs: keep it until the run ends), ``"current"`` (answer it success at
    ``revision`` now, nothing to move) or ``"refuse"`` (answer it failed with ``reason``)."""

    action: Literal["vote", "wait", "current", "refuse"]
    revision: int = 0
    reason: str = ""
    code: int = int(_errors.Result.SUCCESS)


@dataclass
class Observers:
    """Who would observe, who observes now, who must vote to join, and the join votes kept meanwhile."""

    willing: set[int] = field(default_factory=set)  # peers whose last sync vote said ``observe``
    active: set[int] = field(default_factory=set)  # fetchers of live heals, in their group's collectives
    joining: set[int] = field(default_factory=set)  # fetched: in no sync vote until they vote themselves
    waiting: dict[int, tuple[int, _election.SyncVote]] = field(default_factory=dict)  # peer -> (group, vote)
    joined_current = 0  # join votes answered current at once
    joined_in_sync = 0  # join votes counted in the group's sync
    refused = 0  # join votes refused (content other than the group's)

    def voted(self, peer_id: int, observe: bool) -> None:
        """``peer_id`` cast a sync vote; ``observe``: it would observe should it fetch live."""
        if observe:
            self.willing.add(peer_id)
        else:
            self.willing.discard(peer_id)

    def all_willing(self, fetchers: list[int]) -> bool:
        """Whether every one of ``fetchers`` (non-empty) would observe."""
        return bool(fetchers) and all(p in self.willing for p in fetchers)

    def began(self, peer_id: int) -> None:
        """``peer_id`` fetches a live heal as an observer."""
        self.active.add(peer_id)
        self.joining.discard(peer_id)

    def fetched(self, peer_id: int) -> None:
        """The observer ``peer_id`` has the healed revision: it joins by its next sync vote."""
        self.joining.add(peer_id)

    def answer(self, peer_id: int, vote: _election.SyncVote, running: bool, last_revision: int | None,
               content: dict[str, int] | None) -> JoinAnswer:
        """The joiner ``peer_id``'s sync ``vote``: see the module docstring. ``running``: the group's sync
        runs; ``last_revision`` / ``content``: the group's last committed revision and elected content."""
        if running:
            return JoinAnswer("wait")
        self.joining.discard(peer_id)
        if last_revision is None or vote.revision != last_revision:
            self.joined_in_sync += 1
            return JoinAnswer("vote")
        mine = {e.key: e.hash for e in vote.entries if not e.allow_content_inequality}
        theirs = {k: h for k, h in (content or {}).items() if k in mine}
        if content is not None and mine == theirs and set(mine) <= set(content):
            self.joined_current += 1
            return JoinAnswer("current", revision=vote.revision)
        self.refused += 1
        differ = sorted(k for k in mine if (content or {}).get(k) != mine[k])
        return JoinAnswer("refuse", revision=vote.revision,
                          reason=f"replayed to revision {vote.revision}, the group's, with other content "
                                 f"(keys {differ[:8]}): the replay diverged",
                          code=int(_errors.Result.SHARED_STATE_SYNC_FAILED))

    def forget(self, peer_id: int) -> None:
        """``peer_id`` joined (its sync ended), failed its heal, or left."""
        self.active.discard(peer_id)
        self.joining.discard(peer_id)
        self.waiting.pop(peer_id, None)

    def lost(self, peer_id: int) -> None:
        """``peer_id`` left: forgotten everywhere."""
        self.forget(peer_id)
        self.willing.discard(peer_id)

    def statistics(self) -> dict[str, int]:
        """Counters: observers ``observing`` and ``joining`` now; join votes ``joined_current`` (answered at
        once), ``joined_in_sync``, ``join_refused``."""
        return {"observing": len(self.active - self.joining), "joining": len(self.joining),
                "joined_current": self.joined_current, "joined_in_sync": self.joined_in_sync,
                "join_refused": self.refused}


__all__ = ["JoinAnswer", "Observers"]
