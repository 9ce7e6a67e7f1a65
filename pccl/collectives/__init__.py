"""Ring collectives over the P2P pool: schedules (pure) and their execution."""

from .ring import DEFAULT_BLOCK_BYTES, owned_range, run_collective
from .schedule import chunk_bounds, chunk_range, plan_ring

__all__ = ["DEFAULT_BLOCK_BYTES", "chunk_bounds", "chunk_range", "owned_range", "plan_ring", "run_collective"]
