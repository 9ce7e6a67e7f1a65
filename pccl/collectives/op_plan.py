"""The plan one operation runs on each rank, and the byte length of each of its frames (pure: no trio,
no I/O). :func:`build_plan` is what :func:`pccl.collectives.ring.plan_for` (the executor's one planner)
runs, so a rank's executor and anyone who recomputes the plan from the descriptor (the master judging a
stalled operation: pccl/master/plan_rule.py) get the same frames; :func:`frame_bytes` gives each frame's
length on the wire (payload only, what the pool counts per operation: quantized frames carry their
metadata and the quantized values).
"""

from __future__ import annotations

from .kinds import Kind, get_kind
from .plan import SCHEDULES, Plan
from .schedule import cached_plan, plan_schedule

# Default pipelining block. Every frame costs a few scheduler trips and wake-ups of the peer
# process, which dominated at 1 MiB on loopback; 4 MiB measured best for 2-4 peers and 16-64 MB
# (smaller chunks are sent whole anyway).
DEFAULT_BLOCK_BYTES = 4 << 20

# All-reduces between two peers of at most this many bytes use the one-step exchange plan
# (schedule.plan_exchange): one arrival to wait for instead of the ring's two dependent ones.
# Measured on loopback (2 cores, interleaved runs, medians): 64 KB 1.69 -> 1.45 ms, 256 KB
# 1.76 -> 1.56, 512 KB 1.83 -> 1.70; at 1 MB the exchange was slower (2.08 -> 2.24 ms): each
# peer reduces the whole buffer instead of half, and nothing overlaps the one big frame.
EXCHANGE_MAX_BYTES = 512 << 10

# An exchange of more than SMALL_FRAME_BYTES and at most SMALL_SPLIT_MAX_BYTES goes out in frames of
# SMALL_FRAME_BYTES (header included, two TCP segments at MTU 1500), which the pool deals out over the
# partner's connections (lane i on connection i): a small frame then leaves in one burst. A frame of
# more segments on a connection whose congestion control has seen little traffic does not: bbr
# paces it at the rate it estimated from that traffic, in bursts of two segments. Measured on the
# WAN emulator (2 peers, 50 ms, 3 connections each way): one 4 KB frame's last segment arrived
# 1.8 ms after its first, and a 4 KB all-reduce took 54.1 ms on the slower peer, a 2 KB one 52.6
# (ping 50.6). A plan depends on the sizes only (both ranks, and the master's plan_rule, build the
# same frames), so the split applies on any link; on loopback it costs one more frame per 2 KB.
SMALL_FRAME_BYTES = 2048
SMALL_SPLIT_MAX_BYTES = 8 << 10

# Quantized operations cut blocks of ``block_bytes / QUANTIZED_BLOCK_DIVISOR`` input bytes, so
# their frames (a quarter of that for uint8 from float32) are about as many per operation as
# before quantization made them shorter. Measured on a tc-shaped 1 Gbit/s veth pair (64 MB
# float32, 2 peers): 1 MiB input blocks finish ~10 ms sooner than 4 MiB ones, because the
# first frame leaves sooner and the last one is dequantized sooner; on loopback, where
# per-frame costs dominate, they cost a little (quantization does not pay there anyway).
QUANTIZED_BLOCK_DIVISOR = 4


def build_plan(
    kind: str | Kind, n: int, rank: int, count: int, itemsize: int, *, schedule: str = "ring", root: int = 0,
    block_bytes: int = DEFAULT_BLOCK_BYTES, quantized: bool = False,
) -> Plan:
    """Rank ``rank``'s plan (see :func:`pccl.collectives.ring.plan_for`, which wraps it).

    Raises:
        ValueError: an unknown schedule or kind, a schedule without a plan for ``kind``, bad sizes.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (expected one of {', '.join(SCHEDULES)})")
    k = get_kind(kind)
    block_elems = max(1, block_bytes // itemsize)
    if quantized:
        block_elems = max(1, block_elems // QUANTIZED_BLOCK_DIVISOR)
        schedule = "ring"
    if schedule == "ring":
        nbytes = count * itemsize
        exchange = k.exchange and n == 2 and not quantized and nbytes <= EXCHANGE_MAX_BYTES
        if exchange and SMALL_FRAME_BYTES < nbytes <= SMALL_SPLIT_MAX_BYTES:
            block_elems = min(block_elems, max(1, SMALL_FRAME_BYTES // itemsize))
        return cached_plan(k, n, rank, count, block_elems, root, exchange=exchange)
    return plan_schedule(schedule, k.name, n, rank, count, block_elems, root)


def frame_bytes(plan: Plan, itemsize: int, quantized: tuple[int, int] | None = None,
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(bytes of each send, bytes of each receive)`` of ``plan`` on the wire.

    Args:
        itemsize: bytes per element.
        quantized: ``(metadata bytes, bytes per quantized value)`` of a quantized operation, else None.
    """
    if quantized is None:
        return (tuple((f.end - f.start) * itemsize for f in plan.sends),
                tuple((f.end - f.start) * itemsize for f in plan.recvs))
    meta, q = quantized
    return (tuple(meta + (f.end - f.start) * q for f in plan.sends),
            tuple(meta + (f.end - f.start) * q for f in plan.recvs))


__all__ = [
    "DEFAULT_BLOCK_BYTES", "EXCHANGE_MAX_BYTES", "QUANTIZED_BLOCK_DIVISOR", "SMALL_FRAME_BYTES",
    "SMALL_SPLIT_MAX_BYTES", "build_plan", "frame_bytes",
]
