"""The cumulative lone-hold budget of each member (pure: no trio, no sockets; time passed in).

Issue 33 item 6, "the same member cannot stall the run again and again". A participant that held a
running operation alone (every other participant reported its part done) for ``held_ops.LONE`` seconds
or more and then fails it naming nobody is struck at once (pccl/master/held_ops.py ``lone_failure``). One
that fails each such operation a little sooner cost the others up to ``LONE`` seconds an operation and
was never counted. :class:`LoneHolds` keeps, per member, the time it held operations alone before failing
them naming nobody over the last :data:`~pccl.master.blame.WINDOW` seconds; once the sum reaches
``LONE``, that is one strike (the same as one hold of ``LONE``), and its ledger starts again. So a member
costs the others at most ``LONE`` seconds of such holds per strike, whatever it splits them into.

Holds are kept in buckets of :data:`BUCKET` seconds (a hold joins the member's newest bucket while that
began less than ``BUCKET`` seconds ago), and a bucket is dropped once it began more than the window ago:
a hold counts for between ``WINDOW - BUCKET`` and ``WINDOW`` seconds, and a member's ledger holds at most
``WINDOW / BUCKET + 1`` buckets however many operations it fails. A member's ledger is forgotten when it
leaves (:meth:`LoneHolds.retain`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from .blame import WINDOW
from .held_ops import LONE

#: Seconds of the ledger one bucket covers (see the module docstring).
BUCKET = 10.0


@dataclass
class _Bucket:
    start: float
    held: float
    count: int


@dataclass
class LoneHolds:
    """Per member, the seconds it held running operations alone and then failed them naming nobody."""

    lone: float = LONE
    window: float = WINDOW
    bucket: float = BUCKET
    _ledgers: dict[int, deque[_Bucket]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.lone > 0 and self.window > 0 and 0 < self.bucket <= self.window):
            raise ValueError(f"LoneHolds needs lone > 0 and 0 < bucket <= window (got lone={self.lone}, "
                             f"window={self.window}, bucket={self.bucket})")

    def __bool__(self) -> bool:
        return bool(self._ledgers)

    def add(self, peer: int, held: float, now: float) -> str | None:
        """``peer`` failed, naming nobody, a running operation it held alone for ``held`` seconds.

        Returns:
            The reason of a strike when this hold is :attr:`lone` or more, or brings the sum of its holds
            within :attr:`window` to :attr:`lone` (its ledger then starts again); else None.
        """
        held = max(0.0, held)
        if held >= self.lone:
            self._ledgers.pop(peer, None)
            return (f"it failed operations it held alone for {self.lone:g}s or more after every other "
                    "participant finished, naming nobody")
        ledger = self._ledgers.setdefault(peer, deque())
        while ledger and now - ledger[0].start > self.window:
            ledger.popleft()
        if ledger and now - ledger[-1].start < self.bucket:
            ledger[-1].held += held
            ledger[-1].count += 1
        else:
            ledger.append(_Bucket(now, held, 1))
        total = sum(b.held for b in ledger)
        if total < self.lone:
            return None
        count = sum(b.count for b in ledger)
        del self._ledgers[peer]
        return (f"it failed {count} operations it held alone after every other participant finished, "
                f"naming nobody: {total:.1f}s held alone in all within {self.window:g}s (budget "
                f"{self.lone:g}s)")

    def held(self, peer: int, now: float) -> tuple[float, int]:
        """``(seconds, operations)`` in ``peer``'s ledger that still count at ``now``."""
        live = [b for b in self._ledgers.get(peer, ()) if now - b.start <= self.window]
        return sum(b.held for b in live), sum(b.count for b in live)

    def entries(self, peer: int) -> int:
        """How many buckets ``peer``'s ledger keeps."""
        return len(self._ledgers.get(peer, ()))

    def forget(self, peer: int) -> None:
        """Drop ``peer``'s ledger (it left)."""
        self._ledgers.pop(peer, None)

    def retain(self, peers: Container[int]) -> None:
        """Forget the ledger of everyone not in ``peers`` (the master's records: a member away within
        its rejoin grace keeps its ledger). O(members with a ledger)."""
        for peer in [p for p in self._ledgers if p not in peers]:
            del self._ledgers[peer]


__all__ = ["BUCKET", "LoneHolds"]
