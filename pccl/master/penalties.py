"""Repeat offenders: members and newcomers evicted for liveness, remembered (pure: times passed in).

Issue 33 item 6 says "the same member cannot stall the run again and again". Two evictions stall the
honest members before they happen: a newcomer that never takes part (``admission_grace``,
:meth:`~pccl.master.state.MasterState.admission_overdue`) and a member that does not read its P2P
connections (two stalled operations, pccl/master/blame.py). Without a memory, the evicted peer could
register again at once and cost the same again. :class:`RepeatOffenders` remembers each such eviction
under the identities the master has of a peer: its **source address** (what an attacker cannot change at
will) and its **P2P public key** (what an honest peer keeps for the life of its communicator). A peer
matching a record (either identity; the worse record counts) with ``s`` strikes:

* is refused at ``Register`` for ``backoff(s) = min(cap, base * 2**(s-1))`` seconds after its last
  eviction, with the reason and the time left ("retry in 118s");
* after that is admitted with ``admission_grace * 2**-s`` instead of the full grace, and, as a member,
  is removed at the first stall report naming it instead of the second (:meth:`repeat`);
* with ``max_strikes`` strikes is refused until the record expires.

A record is forgotten ``memory`` seconds after its last strike; the table holds at most ``size`` records
(the oldest strike forgotten first).

Bound (per identity, while its record is held): the newcomer stalls the honest members at most
``admission_grace * (1 + 1/2 + ... + 2**-(max_strikes-1)) < 2 * admission_grace`` in all (plus one
monitor tick per admission), then it is refused; a member that does not read stalls at most
``STRIKES + max_strikes - 1`` operations. Trade-off: an honest newcomer from the same source address
(the same host, or behind the same NAT) is refused for the same back-off (``base`` after one eviction)
and then gets the shorter grace, which a peer that calls its first collective promptly meets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

#: Seconds a peer evicted once is refused (doubling with each strike up to :data:`CAP`).
BASE = 60.0
#: The longest back-off, and how long a record is kept after its last strike.
CAP = 3600.0
#: Strikes after which an identity is refused until its record expires.
MAX_STRIKES = 6
#: Records kept (the oldest strike is forgotten first).
SIZE = 4096


@dataclass
class _Record:
    strikes: int
    last: float
    why: str


def identities(host: str, public_key: bytes) -> list[str]:
    """The identities the master remembers a peer by: its source address and, if it sent one, its P2P
    public key."""
    out = [f"host {host}"]
    if public_key:
        out.append(f"key {public_key.hex()[:16]}")
    return out


class RepeatOffenders:
    """The master's memory of peers evicted for liveness (see the module docstring)."""

    def __init__(self, base: float = BASE, cap: float = CAP, max_strikes: int = MAX_STRIKES,
                 size: int = SIZE) -> None:
        if base <= 0 or cap < base or max_strikes < 1 or size < 1:
            raise ValueError("RepeatOffenders: need 0 < base <= cap, max_strikes >= 1, size >= 1")
        self.base, self.cap, self.max_strikes, self.size = base, cap, max_strikes, size
        self._records: OrderedDict[str, _Record] = OrderedDict()  # by last strike, oldest first
        self._strikes_of: dict[int, int] = {}  # peers registered with a record: their strikes then
        self.refused_total = 0
        self.struck_total = 0

    def __len__(self) -> int:
        return len(self._records)

    def backoff(self, strikes: int) -> float:
        """Seconds an identity with ``strikes`` is refused after its last strike."""
        if strikes >= self.max_strikes:
            return self.cap
        return min(self.cap, self.base * 2.0 ** (strikes - 1))

    def _live(self, keys: Iterable[str], now: float) -> _Record | None:
        worst: _Record | None = None
        for k in keys:
            rec = self._records.get(k)
            if rec is not None and now - rec.last >= self.cap:
                del self._records[k]  # forgotten
                rec = None
            if rec is not None and (worst is None or rec.strikes > worst.strikes):
                worst = rec
        return worst

    def strike(self, keys: Iterable[str], now: float, why: str) -> int:
        """Record an eviction for liveness of the peer known by ``keys``; its strikes now."""
        keys = list(keys)
        prev = self._live(keys, now)
        strikes = (prev.strikes if prev is not None else 0) + 1
        for k in keys:
            self._records.pop(k, None)
            self._records[k] = _Record(strikes, now, why)
        while len(self._records) > self.size:
            self._records.popitem(last=False)
        self.struck_total += 1
        return strikes

    def refusal_of(self, peer_id: int, host: str, public_key: bytes, now: float) -> str | None:
        """:meth:`refusal` of a peer registering from ``host`` with ``public_key``; its identities are
        built only when someone was evicted lately (asked at every Register)."""
        if not self._records:
            return None
        return self.refusal(peer_id, identities(host, public_key), now)

    def refusal(self, peer_id: int, keys: Iterable[str], now: float) -> str | None:
        """Why a peer registering now under ``keys`` is refused (None: admitted; then its strikes are
        kept for :meth:`grace` and :meth:`repeat` until :meth:`forget`)."""
        if not self._records:  # the usual case: nobody was evicted for liveness lately
            return None
        keys = list(keys)
        rec = self._live(keys, now)
        if rec is None:
            return None
        wait = rec.last + self.backoff(rec.strikes) - now
        if wait > 0:
            self.refused_total += 1
            which = next(k for k in keys if self._records.get(k) is rec)
            return (f"refused: a peer of the same {which} was evicted {rec.strikes} time(s) for liveness "
                    f"within {self.cap:g}s ({rec.why}): retry in {wait:.0f}s")
        self._strikes_of[peer_id] = rec.strikes
        return None

    def grace(self, peer_id: int, grace: float) -> float:
        """The admission grace of ``peer_id``: halved per strike of a repeat offender."""
        return grace * 2.0 ** -self._strikes_of.get(peer_id, 0)

    def repeat(self, peer_id: int) -> bool:
        """True when ``peer_id`` registered under an identity evicted for liveness before."""
        return peer_id in self._strikes_of

    def forget(self, peer_id: int) -> None:
        """``peer_id`` left (its identities' records stay)."""
        self._strikes_of.pop(peer_id, None)


__all__ = ["BASE", "CAP", "MAX_STRIKES", "SIZE", "RepeatOffenders", "identities"]
