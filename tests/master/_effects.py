"""What the master's pure core asked for: the effects tests look for (shared by tests/master)."""

from __future__ import annotations

from typing import Any

from pccl.master.state import Kick, Send


def sends(effects: list[Any], cls: type | None = None) -> list[tuple[int, Any]]:
    """``(peer_id, message)`` of every Send among ``effects`` (only messages of ``cls`` when given)."""
    return [(e.peer_id, e.message) for e in effects
            if isinstance(e, Send) and (cls is None or isinstance(e.message, cls))]


def kicks(effects: list[Any]) -> list[Kick]:
    """Every Kick among ``effects``."""
    return [e for e in effects if isinstance(e, Kick)]
