"""What the master's pure core asked for: the effects tests look for, and the votes they feed it
(shared by tests/master)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

from pccl.master.state import Kick, Send
from pccl.wire import messages as m


def sends(effects: list[Any], cls: type | None = None) -> list[tuple[int, Any]]:
    """``(peer_id, message)`` of every Send among ``effects`` (only messages of ``cls`` when given)."""
    return [(e.peer_id, e.message) for e in effects
            if isinstance(e, Send) and (cls is None or isinstance(e.message, cls))]


def kicks(effects: list[Any]) -> list[Kick]:
    """Every Kick among ``effects``."""
    return [e for e in effects if isinstance(e, Kick)]


def opaque_descriptor(*fields: object) -> m.CollectiveDescriptor:
    """A vote's descriptor made of arbitrary fields (too few, or not a real operation's). The decoder
    refuses such a one from a peer, but the state machine only compares the votes and shows their
    fields, so its tests vote with any sequence: a list, typed as the descriptor it stands in for."""
    return cast(m.CollectiveDescriptor, list(fields))


def member_reregister(st: Any, **fields: Any) -> m.Reregister:
    """A ``Reregister`` with ``fields``, carrying the member token ``st`` gave (or, at a restarted
    master, a former master gave) peer ``peer_id`` at ``generation``: what a genuine member sends."""
    msg = m.Reregister(**fields)
    return replace(msg, token=st.tokens.issue(msg.generation, msg.peer_id))
