"""A running collective that one participant holds alone (pure: no trio, no sockets; time passed in).

Issue 33 item 6. A member that takes part in an operation and then never reports its part, neither done
nor failed, while it heartbeats, held the operation open for ever: every other participant, its data
plane complete, waited for the master's verdict, and no timer covered a running operation (the vote
deadline covers votes, the straggler rule silence, the peers' stall watches their own data planes). Once
every participant but one reported its part done, that one is all the operation waits on: an honest one
either finishes (what is left of its data plane is what its partners already wrote) or its stall watch
fails it after ``PeerConfig.p2p_stall_timeout`` and it reports that (a blocked event loop stops its
heartbeats too: ``heartbeat_timeout``). So the master removes the holder once it has held the operation
alone for ``MasterConfig.vote_timeout`` (the same lag behind the others that evicts a straggler a vote
waits on), halved per strike of a repeat offender (pccl/master/penalties.py ``grace``), and remembers it
as evicted for liveness. The others' calls then fail (the operation lost a participant), and the run goes
on without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

#: Seconds a participant may hold a running operation alone and then fail it without a testimony that
#: names anyone (pccl/master/testimony.py, plan_rule.py) before the failure counts against it
#: (:func:`lone_failure`). An honest participant that fails after holding alone either testifies (its
#: data plane stood still for half ``p2p_stall_timeout``) or fails at once (a local error): what is left
#: of its data plane is what its partners already wrote.
LONE = 5.0


class HeldRound(Protocol):
    """What this module reads of a :class:`~pccl.master.rounds.collective.CollectiveRound`."""

    group: int
    tag: int
    op_seq: int
    running: bool
    participants: list[int]
    done: set[int]
    alone_since: float | None


def holder(op: HeldRound) -> int | None:
    """The one participant of running ``op`` that has not reported its part done, when every other one
    has (and since when is ``op.alone_since``); else None."""
    if not op.running or op.alone_since is None or len(op.done) + 1 != len(op.participants):
        return None
    return next((p for p in op.participants if p not in op.done), None)


def deadline(ops: Iterable[HeldRound], timeout: float, scale: Callable[[int, float], float]) -> float | None:
    """When the earliest holder's time runs out (``scale(peer, timeout)``: its timeout, shorter for a
    repeat offender). O(running operations)."""
    best: float | None = None
    for op in ops:
        p = holder(op)
        if p is not None and op.alone_since is not None:
            end = op.alone_since + scale(p, timeout)
            best = end if best is None or end < best else best
    return best


def overdue(ops: Iterable[HeldRound], now: float, timeout: float,
            scale: Callable[[int, float], float]) -> list[tuple[int, str]]:
    """``(holder, reason)`` for each running operation held alone past its holder's timeout."""
    out: list[tuple[int, str]] = []
    for op in ops:
        p = holder(op)
        if p is None or op.alone_since is None:
            continue
        limit = scale(p, timeout)
        if now - op.alone_since > limit:
            out.append((p, f"evicted: held the running collective tag {op.tag} (group {op.group}, op "
                           f"{op.op_seq}) alone for {now - op.alone_since:.1f}s after every other "
                           f"participant {sorted(op.done)} finished its part (limit {limit:g}s: "
                           "vote_timeout, halved per earlier eviction for liveness)"))
    return out


def lone_hold(op: HeldRound | None, peer: int, now: float) -> float | None:
    """How long ``peer`` held running ``op`` alone before failing it now, when it was the holder (any
    time: shorter holds add up, pccl/master/lone_holds.py); else None."""
    if op is None or holder(op) != peer or op.alone_since is None:
        return None
    return max(0.0, now - op.alone_since)


def lone_failure(op: HeldRound | None, peer: int, now: float, lone: float = LONE) -> float | None:
    """How long ``peer`` held running ``op`` alone before failing it now, when it was the holder for
    at least ``lone`` seconds (see :data:`LONE`); else None."""
    held = lone_hold(op, peer, now)
    return held if held is not None and held >= lone else None


__all__ = ["LONE", "HeldRound", "deadline", "holder", "lone_failure", "lone_hold", "overdue"]
