"""Collectives over the P2P pool: the kinds (:mod:`.kinds`), their schedules (pure) and their execution."""

from .executor import Attempt, run_collective
from .kinds import KINDS, Kind, get_kind
from .ring import DEFAULT_BLOCK_BYTES, owned_range
from .schedule import chunk_bounds, chunk_range, plan_ring

__all__ = [
    "DEFAULT_BLOCK_BYTES", "KINDS", "Attempt", "Kind", "chunk_bounds", "chunk_range", "get_kind",
    "owned_range", "plan_ring", "run_collective",
]
