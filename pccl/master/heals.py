"""Live heals (issue 35 item 4): the group keeps running while a newcomer fetches the shared state.

Pure: no trio, sockets or clocks. :class:`~pccl.master.state.MasterState` asks this book at a few hooks.

When a sync vote elects a content and some participants (the *fetchers*) must fetch part of it, an
ordinary sync holds every participant until they have. A live heal instead:

* sends the *holders* (participants with nothing to fetch) their plan with the keys to **pin** and
  their success result at once: each copies those keys' bytes at the elected revision and serves the
  copy under the heal's ``sync_seq`` until a ``SharedStateRelease``; their call returns at once;
* sends each fetcher a *live* plan; while it fetches (**healing**) the master leaves it out of its
  group's collective and sync votes (the group's reservations are revoked when the heal starts; the
  members' first commence names their ring, and the numbers reserved from then on are for it: their
  collectives start speculatively again), so no member's call waits on it or fails with it;
* when the fetcher's ``SharedStateDone(success)`` comes (and its group runs no sync): a ``catch_up``
  result; the fetcher applies the healed revision (complete and verified) and votes again in the same
  call (**behind**: still out of collective votes, but in sync votes). So it joins at the group's next
  sync, where the members' loop has them (sync, then collectives), and that sync plans what changed
  since the healed revision, if anything: nothing (an ordinary round, everyone returns together,
  current), or some chunks (a live round again, up to ``max_live_rounds`` in a row; after that an
  ordinary, blocking round, which bounds the catch-up when the state changes faster than it can be
  fetched: data-parallel training changes every byte at every step);
* a fetcher lost, or failing, costs the members nothing: its pins are released; its own call fails;
* a fetcher that *observes* (its vote said so: :mod:`pccl.master.observers`) counts in its group's
  collective votes from the heal's start, gets its plain result when fetched, and joins by its next vote.

Pins are released when the last fetcher of a heal is done, failed or lost (a donor lost meanwhile costs
the fetcher its chunks in flight only, :mod:`pccl.peer.heal`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import Result
from ..wire import messages as m
from .effects import Effect, Event, Send
from .observers import Observers
from .transfers import SwarmCounts, SyncProgress


@dataclass
class Heal:
    """One live heal round: who fetches which revision from whom."""

    seq: int
    group: int
    revision: int
    fetchers: set[int]
    donors: set[int]
    results: dict[int, m.SharedStateResult] = field(default_factory=dict)  # fetchers' results held back
    progress: SyncProgress | None = None  # the fetchers' reports, for the status page


class HealBook:
    """The live heals of the run, and the peers out of their group's votes meanwhile.

    Args:
        max_live_rounds: live rounds one peer may run in a row (0: live heals off, every sync holds
            its participants until the fetchers have everything, as before issue 35 item 4).
    """

    def __init__(self, max_live_rounds: int = 0) -> None:
        if max_live_rounds < 0:
            raise ValueError(f"max_live_rounds must be >= 0, not {max_live_rounds}")
        self.max_live_rounds = max_live_rounds
        self.heals: dict[int, Heal] = {}  # seq -> heal
        self.healing: dict[int, int] = {}  # fetcher -> the seq of the heal it runs
        self.behind: dict[int, int] = {}  # fetcher -> its group, between a catch_up result and its next sync
        self.rounds: dict[int, int] = {}  # fetcher -> live rounds run in a row
        self.groups: dict[int, int] = {}  # fetcher -> group
        # fetcher -> (its result, final): reported, the result held until its group can take it back
        self.held: dict[int, tuple[m.SharedStateResult, bool]] = {}
        # Fetchers whose group voted (a collective or a sync, without them) since their heal began: they
        # must join at the group's next sync; the others are where the members are (right after the
        # heal's sync) and are answered current at once.
        self.moved: set[int] = set()
        self.contents: dict[int, dict[str, int]] = {}  # group -> {key: hash} its last vote elected
        self.ran: dict[int, frozenset[int]] = {}  # group -> the participants of its last collective
        self.kept_ordinary = 0  # syncs with fetchers kept ordinary: every key fetched had just changed
        self.observers = Observers()  # fetchers that replay the rounds they miss (observers.py)
        self.started = 0
        self.fetched = 0
        self.failed = 0
        self.rejoined = 0
        self.lost_fetchers = 0

    # -- who is out of which vote ------------------------------------------------------------

    def out_of_ops(self, group: int) -> frozenset[int]:
        """Peers of ``group`` that no collective vote waits on (healing, or behind)."""
        if not self.groups:
            return frozenset()
        active = self.observers.active
        return frozenset(p for p, g in self.groups.items() if g == group and p not in active)

    def out_of_syncs(self, group: int) -> frozenset[int]:
        """Peers of ``group`` that no sync vote waits on (healing, or an observer that has not voted to
        join yet)."""
        joining = self.observers.joining
        if not self.healing and not joining:
            return frozenset()
        return frozenset(p for p in (*self.healing, *joining) if self.groups.get(p) == group)

    def group_voted(self, group: int) -> None:
        """A vote of ``group`` went on without its healing peers: they can no longer rejoin where they
        left (the members are past the heal's sync), only at the group's next sync."""
        self.moved.update(p for p in self.healing if self.groups.get(p) == group)

    def collective_started(self, group: int, voters: list[int]) -> None:
        """A collective of ``group`` starts with ``voters``: they train together, in that world."""
        self.ran[group] = frozenset(voters)

    def is_healing(self, peer_id: int) -> bool:
        """True while ``peer_id`` fetches a live heal."""
        return peer_id in self.healing

    def may_go_live(self, rows_of: dict[int, list[list[Any]]], group: int = 0,
                    content: dict[str, int] | None = None, started: bool = True) -> bool:
        """Whether a sync of ``group`` whose participants fetch ``rows_of`` runs as a live heal: live heals
        are on, someone fetches, someone holds, no fetcher has run ``max_live_rounds`` live rounds in a
        row, the group has ``started`` (a sync of it committed before: its first sync is the start of the
        run, where everyone starts together), the group's last collective ran with exactly the holders
        (they train together without the fetchers: newcomers join a running group), and the group's
        state is not one that changes entirely between syncs (:meth:`all_changed`).

        ``content`` (``{key: hash}``, the vote's elected content) is remembered as the group's latest
        (None: not known, nothing remembered)."""
        fetchers = [p for p, rows in rows_of.items() if rows]
        before = self.contents.get(group)
        if content:
            self.contents[group] = dict(content)
        if not (self.max_live_rounds > 0 and bool(fetchers) and len(fetchers) < len(rows_of)
                and all(self.rounds.get(p, 0) < self.max_live_rounds for p in fetchers)):
            return False
        holders = frozenset(p for p, rows in rows_of.items() if not rows)
        if not started or self.ran.get(group) != holders:
            # The holders have not been training together without the fetchers (the group's first sync:
            # the run starts here; or their last collective had others in it: a lone peer waiting for a
            # second, a group that lost one). Everyone leaves together: a live round would let the holders
            # train in a world their loop has not accepted (a driver waiting for ``min_world_size`` peers
            # would wait for the fetchers while they wait for its next sync: a deadlock).
            return False
        if self.observers.all_willing(fetchers):
            return True  # they replay the rounds they miss: nothing to catch up at the join
        if before is not None and content and self.all_changed(before, content, rows_of):
            self.kept_ordinary += 1
            return False
        return True

    @staticmethod
    def all_changed(before: dict[str, int], content: dict[str, int],
                    rows_of: dict[int, list[list[Any]]]) -> bool:
        """Whether every key fetched in ``rows_of`` changed between the group's previous elected content
        ``before`` and this one: then a live round cannot help. The fetchers learn the content they
        need only at the sync they join, and if the state changes entirely between two syncs (data-parallel
        training synced every step, DiLoCo's outer step before each sync) that sync moves the whole state
        again while the members wait, as long as an ordinary sync now would have, after the donors sent
        it once for nothing (docs/concepts.md "Live heals"). A key new since ``before`` counts as
        unchanged (no evidence)."""
        keys = {str(row[0]) for rows in rows_of.values() for row in rows}
        return bool(keys) and all(k in before and before[k] != content.get(k) for k in keys)

    def joined(self, peer_id: int) -> None:
        """``peer_id`` ended an ordinary sync successfully: it is current and counts everywhere."""
        if self.behind.get(peer_id) is not None:
            self.rejoined += 1
        self.rounds.pop(peer_id, None)
        self.behind.pop(peer_id, None)
        self.groups.pop(peer_id, None)
        self.observers.forget(peer_id)

    # -- transitions -----------------------------------------------------------------------

    def start(self, seq: int, group: int, revision: int, fetchers: list[int], donors: list[int]) -> None:
        """A live round ``seq`` of ``group`` at ``revision`` begins."""
        self.heals[seq] = Heal(seq=seq, group=group, revision=revision, fetchers=set(fetchers),
                               donors=set(donors))
        for p in fetchers:
            self.healing[p] = seq
            self.behind.pop(p, None)
            self.groups[p] = group
            self.rounds[p] = self.rounds.get(p, 0) + 1
            self.moved.discard(p)
            if p in self.observers.willing:
                self.observers.began(p)
        self.started += 1

    def go_live(self, seq: int, group: int, revision: int, rows_of: dict[int, list[list[Any]]],
                table: list[m.PeerRow], note: str, progress: SyncProgress | None = None) -> list[Effect]:
        """Run sync ``seq`` (elected ``revision``) as a live heal: ``rows_of`` is each participant's fetch
        rows (``[key, hash, holder ids]``; empty for a holder). Each holder gets its plan naming the keys
        it pins (those it is a donor of) and its success result; each fetcher its live plan."""
        fetchers = sorted(p for p, rows in rows_of.items() if rows)
        pins: dict[int, set[str]] = {}
        for p in fetchers:
            for key, _, holders in rows_of[p]:
                for h in holders:
                    pins.setdefault(int(h), set()).add(str(key))
        self.start(seq, group, revision, fetchers, sorted(pins))
        self.heals[seq].progress = progress
        effects: list[Effect] = []
        for p, rows in sorted(rows_of.items()):
            if rows:
                effects.append(Send(p, m.SharedStatePlan(sync_seq=seq, revision=revision, fetch=rows,
                                                         peers=table, live=True)))
                continue
            effects.append(Send(p, m.SharedStatePlan(sync_seq=seq, revision=revision, fetch=[], peers=table,
                                                     pin=sorted(pins.get(p, ())), live=True)))
            effects.append(Send(p, m.SharedStateResult(sync_seq=seq, success=True, revision=revision,
                                                       reason=note)))
        effects.append(Event(f"shared-state sync {seq} of group {group} (revision {revision}) runs as a live "
                             f"heal: peer(s) {fetchers} fetch from {sorted(pins)} while the others go on"))
        return effects

    def done(self, peer_id: int, msg: m.SharedStateDone) -> list[Effect]:
        """The healing ``peer_id`` reports ``msg``. Its result is held (:meth:`flush` sends it: not while
        its group runs a sync, which its catch-up vote could not join); the pins are released when it was
        the last fetcher."""
        seq = self.healing.get(peer_id)
        if seq is None or msg.sync_seq != seq or peer_id in self.held:
            return []
        heal = self.heals[seq]
        heal.fetchers.discard(peer_id)
        if not msg.success:
            result = m.SharedStateResult(sync_seq=seq, success=False, revision=heal.revision,
                                         reason=f"peer {peer_id}: {msg.reason}",
                                         code=int(Result.SHARED_STATE_SYNC_FAILED))
            self.held[peer_id] = (result, True)
        elif peer_id in self.observers.active:
            # An observer: its result now (it replays the rounds it kept and joins by its next vote, in
            # no sync vote until then; still in the group's collectives, as it was while it fetched).
            del self.healing[peer_id]
            self.moved.discard(peer_id)
            self.rounds.pop(peer_id, None)
            self.observers.fetched(peer_id)
            self.fetched += 1
            result = m.SharedStateResult(sync_seq=seq, success=True, revision=heal.revision)
            return [Send(peer_id, result), *self._release_if_unused(heal)]
        else:
            # Always a catch-up: the healed peer joins its group at the group's next sync (where the members'
            # loop has them: sync, then collectives), fetching there what changed since, if anything.
            result = m.SharedStateResult(sync_seq=seq, success=True, revision=heal.revision, catch_up=True)
            self.held[peer_id] = (result, False)
        return self._release_if_unused(heal)

    def flush(self, busy: Callable[[int, bool], bool]) -> list[Effect]:
        """Send the held results whose group is not ``busy(group, final)`` (a running sync; for a final
        result, also a running collective): the receiver leaves the heal (counted again in votes, or,
        behind, in sync votes only until its catch-up ends)."""
        if not self.held:
            return []
        effects: list[Effect] = []
        for p, (result, final) in list(self.held.items()):
            group = self.groups[p]
            current = result.catch_up and p not in self.moved  # its group did nothing since: current now
            if busy(group, final or current):
                continue
            del self.held[p]
            del self.healing[p]
            self.moved.discard(p)
            if current:
                result = m.SharedStateResult(sync_seq=result.sync_seq, success=True, revision=result.revision)
                self.groups.pop(p, None)
                self.rounds.pop(p, None)
                self.fetched += 1
            elif result.catch_up:
                self.behind[p] = group
                self.fetched += 1
            else:
                self.groups.pop(p, None)
                self.rounds.pop(p, None)
                self.observers.forget(p)
                self.failed += 1
            effects.append(Send(p, result))
        return effects

    def report(self, peer_id: int, msg: m.SharedStateProgress, now: float) -> str | None:
        """The healing ``peer_id``'s progress report: recorded (for the status page), or why it is
        illegal (the caller kicks it). One for another sync than its heal is dropped."""
        heal = self.heals.get(self.healing.get(peer_id, -1))
        if heal is None or msg.sync_seq != heal.seq or heal.progress is None:
            return None
        if peer_id in self.held:
            return "SharedStateProgress after its SharedStateDone"
        return heal.progress.report(peer_id, msg.rx_bytes, msg.total_bytes, now, SwarmCounts.of(msg))

    def transfer_progress(self, now: float) -> list[dict[str, Any]]:
        """Each live heal's fetchers still at work, as :meth:`SyncProgress.rows` (``live``: True)."""
        out = []
        for seq, heal in sorted(self.heals.items()):
            if heal.progress is None:
                continue
            rows = [r for r in heal.progress.rows(now) if r["peer"] in heal.fetchers]
            if rows:
                out.append({"group": heal.group, "sync_seq": seq, "receivers": rows, "live": True})
        return out

    def peer_lost(self, peer_id: int) -> list[Effect]:
        """``peer_id`` left: a fetcher's heal ends for it (the members are not in any call with it);
        a donor is dropped from the heals it pins for (its fetchers already ask the others)."""
        effects: list[Effect] = []
        self.behind.pop(peer_id, None)
        self.groups.pop(peer_id, None)
        self.rounds.pop(peer_id, None)
        seq = self.healing.pop(peer_id, None)
        self.held.pop(peer_id, None)
        self.moved.discard(peer_id)
        self.observers.lost(peer_id)
        if seq is not None:
            heal = self.heals.get(seq)
            if heal is not None:
                heal.fetchers.discard(peer_id)
            self.lost_fetchers += 1
            effects.append(Event(f"peer {peer_id} was lost while it healed (live sync {seq}); "
                                 "the members go on"))
            if heal is not None:
                effects += self._release_if_unused(heal)
        for heal in self.heals.values():
            heal.donors.discard(peer_id)
        return effects

    def _release_if_unused(self, heal: Heal) -> list[Effect]:
        if heal.fetchers:
            return []
        del self.heals[heal.seq]
        return [Send(d, m.SharedStateRelease(sync_seq=heal.seq)) for d in sorted(heal.donors)]

    def statistics(self) -> dict[str, int]:
        """Counters for the master's statistics: live rounds ``started``, ``fetched`` (the fetcher then voted
        again), ``failed``; peers ``rejoined`` (behind, then current at an ordinary sync),
        ``lost_fetchers``; syncs ``kept_ordinary`` (every key fetched had changed since the group's
        previous sync: :meth:`all_changed`); and ``healing`` / ``behind`` now."""
        return {"started": self.started, "fetched": self.fetched, "failed": self.failed,
                "kept_ordinary": self.kept_ordinary,
                "rejoined": self.rejoined, "lost_fetchers": self.lost_fetchers, "healing": len(self.healing),
                "behind": len(self.behind), **self.observers.statistics()}


__all__ = ["Heal", "HealBook"]
