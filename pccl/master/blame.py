"""Members that stop reading their P2P connections (pure: no trio, no sockets; time passed in).

Issue 33 finding 7: a member that stops reading stalled every operation for ``p2p_stall_timeout`` and
stayed a member (it heartbeats), so it could do it at every operation. A peer whose data plane stalls while
its frames to one partner were not taken reports that partner (``CollectiveDone.stalled_on``). The master
cannot check the report: a link cut one way looks the same, and a member may lie. So :class:`StallBlame`
removes **both** the accused and its accuser once the same accuser has reported the same partner in
:data:`STRIKES` operations within :data:`WINDOW` seconds:

* a member that does not read stalls at most :data:`STRIKES` operations (each ended by the peers' stall
  watch after ``p2p_stall_timeout``), then it is out and cannot do it again;
* a false report costs its maker its own place: a lying member can remove at most one honest member, once;
* the honest accuser, and the two ends of a link that is cut one way, leave too (they may join again); a
  link that stalls every operation left the run failing them all until then.

A report is either a ``stalled_on`` (the accuser's send to the accused stayed under way) or a pair found
in the bytes both ends testified for a stalled operation (pccl/master/testimony.py: the frames fit the
socket buffers). Both are remembered as evicted for liveness (pccl/master/penalties.py): a rejoin is
refused for a back-off, and once back one report naming it is enough (``repeat``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

#: Reports of the same (accuser, accused) pair that remove both.
STRIKES = 2
#: Seconds within which the reports must fall.
WINDOW = 600.0


@dataclass
class StallBlame:
    """The stalled-partner reports of the run (see the module docstring)."""

    strikes: int = STRIKES
    window: float = WINDOW
    _reports: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    _holds: dict[int, list[float]] = field(default_factory=dict)
    removed_total: int = 0
    struck_total: int = 0  # strikes given by :meth:`hold`

    def hold(self, holder: int, now: float, members: set[int],
             repeat: Callable[[int], bool] | None = None, why: str = "") -> list[tuple[int, str]]:
        """By its own testimony and its partners', ``holder`` held back frames its plan released in a
        stalled operation (pccl/master/plan_rule.py): the evidence names it alone, so it alone is struck;
        :attr:`strikes` within :attr:`window` (one for a ``repeat`` offender) remove it.

        ``why``: another self-contradicting testimony that strikes it alone the same way (the reason
        given when it is removed; default: it held back released frames).

        Returns:
            ``[(holder, reason)]`` when it is to be removed now, else empty.
        """
        if holder not in members:
            return []
        self.struck_total += 1
        times = [t for t in self._holds.get(holder, []) if now - t <= self.window]
        times.append(now)
        self._holds[holder] = times
        if len(times) < (1 if repeat is not None and repeat(holder) else self.strikes):
            return []
        self.forget(holder)
        self.removed_total += 1
        n = len(times)
        ops = f"{n} operation{'s' if n > 1 else ''}"
        why = why or ("it testified taking frames whose sends its plan then releases, and its partners "
                      "never got them")
        return [(holder, f"evicted: its testimony contradicted itself in {ops} within {self.window:g}s "
                         f"({why})")]

    def report(self, accuser: int, accused: int, now: float, members: set[int],
               repeat: Callable[[int], bool] | None = None) -> list[tuple[int, str]]:
        """Peer ``accuser`` reports that its frames to ``accused`` were not taken for ``p2p_stall_timeout``.

        Args:
            members: the accepted members now (a report naming anything else is ignored).
            repeat: True for a peer registered under an identity evicted for liveness before
                (pccl/master/penalties.py): one report naming it is enough.

        Returns:
            ``(peer, reason)`` for each peer to remove now (empty: none yet).
        """
        if accused == accuser or accused not in members or accuser not in members:
            return []
        times = [t for t in self._reports.get((accuser, accused), []) if now - t <= self.window]
        times.append(now)
        self._reports[(accuser, accused)] = times
        if len(times) < (1 if repeat is not None and repeat(accused) else self.strikes):
            return []
        self.forget(accuser)
        self.forget(accused)
        self.removed_total += 2
        n = len(times)
        ops = f"{n} operation{'s' if n > 1 else ''}"
        return [
            (accused, f"evicted: peer {accuser}'s frames to it were not taken in {ops} within "
                      f"{self.window:g}s (it does not read its P2P connections, or their link is cut)"),
            (accuser, f"evicted: it reported peer {accused} not reading in {ops}; a report cannot "
                      "be checked, so accuser and accused leave together"),
        ]

    def forget(self, peer: int) -> None:
        """Drop every report by or about ``peer`` (it left)."""
        for key in [k for k in self._reports if peer in k]:
            del self._reports[key]
        self._holds.pop(peer, None)


__all__ = ["STRIKES", "WINDOW", "StallBlame"]
