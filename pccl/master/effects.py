"""What the master's pure cores ask the server to do: the effects :class:`~pccl.master.state.MasterState`
and :class:`~pccl.master.timers.MasterTimers` return (the server executes them, in order)."""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import Result
from ..wire import messages as m


@dataclass(frozen=True)
class Send:
    """Send ``message`` to ``peer_id``."""

    peer_id: int
    message: m.Message


@dataclass(frozen=True)
class Kick:
    """Send ``Refused(reason)`` to ``peer_id`` and close its connection (state already forgot it)."""

    peer_id: int
    reason: str
    code: int = int(Result.INVALID_USAGE)


@dataclass(frozen=True)
class Drop:
    """Close ``peer_id``'s connection at once, without a goodbye (an evicted, hung peer reads none;
    the state already forgot it)."""

    peer_id: int


@dataclass(frozen=True)
class Event:
    """A membership change worth one log line."""

    text: str


@dataclass(frozen=True)
class FastStart:
    """Collective ``tag`` of ``group`` runs under its speculative ``op_seq``: every participant voted
    with the number the master reserved, so no ``CollectiveCommence`` is sent (nothing to execute; the
    status metrics count it as started)."""

    group: int
    tag: int
    op_seq: int


Effect = Send | Kick | Drop | Event | FastStart

__all__ = ["Drop", "Effect", "Event", "FastStart", "Kick", "Send"]
