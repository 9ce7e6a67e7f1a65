"""Words for what the master sees: a peer's call, a mismatch between descriptors, a missing peer.

Pure string helpers (no state, no I/O): the master's error messages are built here so that each one
names what a person can act on (the calls by name, the fields and dtypes by name, who is missing).

A collective descriptor travels as ``[kind, dtype, count, op, root_id, quantization, quantized_dtype,
schedule]``
(see :meth:`pccl.peer.communicator.Communicator` collectives); :data:`DESCRIPTOR_FIELDS` names them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._types import DataType, QuantizationAlgorithm, ReduceOp

#: Names of a collective descriptor's fields, in wire order.
DESCRIPTOR_FIELDS = (
    "operation", "dtype", "count", "reduce op", "root peer", "quantization", "quantized dtype", "schedule",
)


@dataclass(frozen=True)
class VoteWait:
    """One call a peer has voted for and is waiting on (the vote has not completed yet).

    Attributes:
        kind: ``"collective"``, ``"sync"``, ``"update_topology"``, ``"optimize_topology"`` or
            ``"peers_pending"``.
        tag: the collective's tag (collectives only, else -1).
        descriptor: the collective's descriptor as voted (collectives only).
    """

    kind: str
    tag: int = -1
    descriptor: tuple[Any, ...] = ()


def _enum_name(cls: type[enum.IntEnum], value: Any) -> str:
    try:
        return cls(value).name.lower()
    except (ValueError, TypeError):
        return repr(value)


def format_field(index: int, value: Any) -> str:
    """One descriptor field's value in words (dtypes, ops and quantization by name)."""
    if index in (1, 6):
        return _enum_name(DataType, value)
    if index == 3:
        return _enum_name(ReduceOp, value)
    if index == 4:
        return "none" if value == -1 else f"peer {value}"
    if index == 5:
        return _enum_name(QuantizationAlgorithm, value)
    return str(value)


def describe_call(wait: VoteWait) -> str:
    """A peer's call as a person wrote it: ``"all_reduce tag 0"``, ``"sync_shared_state"``."""
    if wait.kind == "collective":
        kind = wait.descriptor[0] if wait.descriptor else "a collective"
        return f"{kind} tag {wait.tag}"
    if wait.kind == "sync":
        return "sync_shared_state"
    if wait.kind == "peers_pending":
        return "are_peers_pending"
    return wait.kind


def describe_waits(waits: Mapping[int, Sequence[VoteWait]]) -> str:
    """``"peer 1 waits in sync_shared_state; peer 2 in all_reduce tag 0"`` (peers in id order)."""
    parts = []
    for i, pid in enumerate(sorted(waits)):
        calls = " and ".join(describe_call(w) for w in waits[pid])
        parts.append(f"peer {pid} {'waits in' if i == 0 else 'in'} {calls}")
    return "; ".join(parts)


def deadlock_reason(group: int, waits: Mapping[int, Sequence[VoteWait]]) -> str:
    """The error every call of a deadlocked group fails with."""
    return (
        f"deadlock in peer group {group}: {describe_waits(waits)}. These calls can never complete each "
        "other: every accepted peer of a group must make the same call (same tag and arguments)"
    )


def _peers(ids: Sequence[int]) -> str:
    return f"peer {ids[0]}" if len(ids) == 1 else "peers " + ", ".join(str(p) for p in ids)


def describe_mismatch(tag: int, votes: Mapping[int, Sequence[Any]]) -> str:
    """Which fields the peers' descriptors disagree on, by name, with each value and who voted it.

    ``"peers disagree on the operation with tag 0: count: 11 on peer 1, 10 on peer 2"``.
    """
    width = max((len(d) for d in votes.values()), default=0)
    diffs = []
    for i in range(width):
        by_value: dict[str, list[int]] = {}
        for pid in sorted(votes):
            d = votes[pid]
            shown = format_field(i, d[i]) if i < len(d) else "missing"
            by_value.setdefault(shown, []).append(pid)
        if len(by_value) > 1:
            name = DESCRIPTOR_FIELDS[i] if i < len(DESCRIPTOR_FIELDS) else f"field {i}"
            diffs.append(f"{name}: " + ", ".join(f"{v} on {_peers(ids)}" for v, ids in by_value.items()))
    return f"peers disagree on the operation with tag {tag}: " + "; ".join(diffs)


def too_few_peers_reason(group: int, waiting: Sequence[int]) -> str:
    """TOO_FEW_PEERS for a collective voted by a peer alone in its group, saying what the run needs."""
    head = f"a collective needs at least 2 accepted peers in peer group {group}, it has 1"
    if not waiting:
        return head + "; no peer is waiting to be accepted (start more peers)"
    verb = "is" if len(waiting) == 1 else "are"
    who = _peers(list(waiting))
    return f"{head}; {who} {verb} waiting to be accepted: accepted peers call update_topology()"


__all__ = [
    "DESCRIPTOR_FIELDS",
    "VoteWait",
    "deadlock_reason",
    "describe_call",
    "describe_mismatch",
    "describe_waits",
    "format_field",
    "too_few_peers_reason",
]
