"""Operations lost with the master: one failure for every member (pure, no trio, no clock).

At a master's loss a collective (or shared-state sync) in flight fails at the members that had joined it
(they voted: ``RANK_CONNECTION_LOST``, buffers untouched), while a member that had not voted yet simply
votes for it at the master it reconnects to. If the failed members then do something else first (say
``update_topology()`` before the retry), the group waits in different calls: a deadlock, which the
master's deadlock watch ends with ``INVALID_USAGE``, fatal to a training loop.

So a rebuilt master fails, once per member, every member's vote for an operation another member reported
failed at the loss (``Reregister.ops_abandoned`` / ``sync_abandoned``), and the retry of any kind goes
through: every member's call of that operation failed the same way (docs/concepts.md "Operations lost
with the master"). :class:`LostBook` keeps those operations and who already failed them:

* a member that reported the operation abandoned, or in doubt on it (its decision, an abort, fails it),
  owes nothing (one in doubt on the operation before it owes the failure of the lost one), also a
  newcomer that voted for its first sync and never committed one, whichever member comes back first;
* a member that re-registered and whose last committed sequence number of that tag (``ops_committed``,
  ``sync_committed``) is below the lost one (or, for one that was voted but never commenced, sequence -1,
  at most the reporter's last committed one) votes for that very operation: its vote is failed, once;
* a newcomer (it never re-registered) or a member that has gone past it owes nothing;
* the operation's next completion at this master (the retry went through) ends it.

The same holds at a *live* master, for a member whose own connection broke (docs/concepts.md "A
member's link breaks"): the others never left, so they did not re-register, and each of them still
connected when the report arrives owes one failure of the operation (``live``: they are where the
reporter was, or the reporter, behind, would have been refused), unless that call ended for everybody
at this master meanwhile (``kept``: the master aborted it for every participant, or a later round of
the same key ended: they failed it, or went past it already).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..wire import messages as m
from .ops_in_doubt import Key

#: The reason every member's failed vote carries.
REASON = "failed at the master's loss on other members; retry"

#: ``sync_abandoned`` of a peer whose sync vote was out but not planned when the master was lost.
SYNC_VOTED = m.SYNC_ABANDONED_VOTED


@dataclass
class _Lost:
    seq: int  # the lost op_seq / sync_seq (-1: only voted, never commenced)
    base: int  # the reporter's last committed sequence number of the key (-1: none)
    failed: set[int] = field(default_factory=set)  # members whose call of it failed already
    live: set[int] = field(default_factory=set)  # members that never left this master (they owe it)


@dataclass
class _Seen:
    committed: dict[Key, int]  # the last committed sequence number per key, as re-registered
    in_doubt: dict[Key, int]  # the seq it reported in doubt per key (that doubt's decision ends its call)


class LostBook:
    """The operations members reported failed at the master's loss, and who still owes a failure."""

    def __init__(self) -> None:
        self._lost: dict[Key, _Lost] = {}
        self._seen: dict[int, _Seen] = {}

    def lost(self, key: Key) -> tuple[int, frozenset[int]] | None:
        """``(seq, members that failed it)`` of ``key``'s lost operation, if one is open (tests, status)."""
        rec = self._lost.get(key)
        return None if rec is None else (rec.seq, frozenset(rec.failed))

    def report(self, peer_id: int, group: int, msg: m.Reregister,
               outcome: Callable[[Key], tuple[int, bool] | None], *,
               live: Callable[[], Iterable[int]] = tuple,
               kept: Callable[[Key], bool | None] | None = None) -> list[Key]:
        """Member ``peer_id`` of ``group`` re-registered with ``msg``.

        Args:
            outcome: the last settled ``(seq, committed)`` of a key (``DoubtBook.outcome``): a lost
                operation that the group went on past (a later one committed) is not lost any more.
            live: the members of ``group`` connected to this master (called only when this report
                names something lost: most reports of a rebuild do not); those, besides the
                reporter, that never re-registered here owe the failure of what it names lost.
            kept: ``kept(key)`` is False when the call of ``key`` the reporter abandoned ended for
                everybody at this (live) master (nothing is lost: they all failed it, or went past
                it); None or True: it is lost.

        Returns:
            The keys this report names lost: the votes already waiting for them must be re-checked
            with :meth:`owes`.
        """
        committed: dict[Key, int] = {("op", group, r[0]): r[1] for r in msg.ops_committed if len(r) == 2}
        if msg.sync_committed >= 0:
            committed[("sync", group, -1)] = msg.sync_committed
        in_doubt = {("op", group, r[0]): r[1] for r in msg.ops_in_doubt
                    if len(r) == 3 and isinstance(r[0], int) and isinstance(r[1], int)}
        if len(msg.sync_in_doubt) == 3 and isinstance(msg.sync_in_doubt[0], int):
            in_doubt[("sync", group, -1)] = msg.sync_in_doubt[0]
        self._seen[peer_id] = _Seen(committed, in_doubt)
        rows: list[tuple[Key, int]] = [(("op", group, r[0]), r[1]) for r in msg.ops_abandoned if len(r) == 2]
        if msg.sync_abandoned >= 0 or msg.sync_abandoned == SYNC_VOTED:
            rows.append((("sync", group, -1), max(msg.sync_abandoned, -1)))
        if not rows:
            return []
        keys: list[Key] = []
        stayed = {p for p in live() if p != peer_id and p not in self._seen}
        for key, seq in rows:
            base = committed.get(key, -1)
            out = outcome(key)
            if out is not None and out[1] and out[0] > max(seq, base) and (seq >= 0 or base >= 0):
                continue  # the group committed a later one of this key here: it went on past it
            # (Voted and never committed one, a newcomer: its vote was for the group's next one, whatever
            # the group committed before it came. Skipped, it was failed again at its retry when it came
            # back after a member, while the members' retries waited for it.)
            if kept is not None and kept(key) is False:
                continue  # it ended here for everybody: every member's call failed (or went past) it
            rec = self._lost.get(key)
            if rec is None:
                rec = self._lost[key] = _Lost(seq, base)
            else:
                rec.seq, rec.base = max(rec.seq, seq), max(rec.base, base)
            rec.failed.add(peer_id)
            rec.live |= stayed - rec.failed
            keys.append(key)
        return keys

    def owes(self, peer_id: int, key: Key) -> bool:
        """True when ``peer_id``'s vote for ``key`` is its vote for the lost operation and must fail (then
        it is counted as failed: each member's call fails once)."""
        rec = self._lost.get(key)
        if rec is None or peer_id in rec.failed:
            return False
        seen = self._seen.get(peer_id)
        if seen is None:
            if peer_id not in rec.live:
                return False  # a newcomer: it never was in that operation
            rec.failed.add(peer_id)
            return True
        doubt = seen.in_doubt.get(key)
        if doubt is not None and (doubt == rec.seq if rec.seq >= 0 else doubt > rec.base):
            return False  # in doubt on that very operation: its abort ends the call
        # (In doubt on the one before it: that one commits, the reporter went past it, and its next
        # vote is for the lost one.)
        mine = seen.committed.get(key, -1)
        if not (mine < rec.seq if rec.seq >= 0 else mine <= rec.base):
            return False  # it went past it: this vote is for a later operation
        rec.failed.add(peer_id)
        return True

    def settled(self, key: Key) -> None:
        """An operation of ``key`` completed at this master: the retry went through."""
        self._lost.pop(key, None)

    def peer_lost(self, peer_id: int) -> None:
        """``peer_id`` left this master (back, it re-registers and reports again)."""
        self._seen.pop(peer_id, None)
        for rec in self._lost.values():
            rec.live.discard(peer_id)


__all__ = ["REASON", "SYNC_VOTED", "Key", "LostBook"]
