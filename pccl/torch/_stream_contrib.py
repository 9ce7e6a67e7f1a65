"""Streaming DiLoCo's exchanges averaged over contributors only (issue 35 item 4; docs/concepts.md
"Replaying the rounds missed", streaming).

Pure (tensors in, tensors out). A peer that takes part in an exchange without contributing (a newcomer
observing the members' rounds while it fetches the shared state) must not pull the average towards zero,
and every peer must compute the same average on the same bits. So every contribution carries a
*contributor flag* in the same operation, and every averager divides by the flags' sum:

* uncompressed (a ring all-reduce): the send buffer holds one more element, 1 or 0, summed (SUM, never
  quantized) with the pseudo-gradient; every peer divides the sums by it (the ring gives every peer the
  same bits, so the same quotient);
* compressed: each payload (with 2 peers, the whole payload of the all-gather; with 3 or more, each
  chunk's payload of the all-to-all) is followed by one flag byte; the averager (every peer with 2, each
  chunk's owner with 3 or more) decodes and sums in rank order the payloads flagged 1 only and divides by
  their count. The two-stage exchange's second stage (the owners' encoded chunk averages) has no flag:
  every owner sends its chunk's average, a non-contributing owner too (it computed it from the same bytes,
  with its own chunk residual, exactly as a contributing owner would).

A non-contributor's payload is the encoding of zeros, without its error-feedback residual (it keeps none
for rounds it does not contribute to); its bytes are ignored by every averager.
"""

from __future__ import annotations

import torch

from .._errors import InvalidArgumentError
from ._codec import Codec

__all__ = ["contributors_average", "counted_average", "flagged"]


def flagged(payload: torch.Tensor, parts: int, flag: bool) -> torch.Tensor:
    """``payload`` (uint8) cut into ``parts`` equal rows, each followed by the flag byte (1: contributes)."""
    if payload.dtype != torch.uint8 or parts < 1 or payload.numel() % parts:
        raise InvalidArgumentError(f"a payload of {payload.numel()} bytes does not cut into {parts} rows")
    rows = payload.reshape(parts, -1)
    column = torch.full((parts, 1), 1 if flag else 0, dtype=torch.uint8)
    return torch.cat([rows, column], dim=1).reshape(-1)


def contributors_average(codec: Codec, gathered: torch.Tensor, world_size: int,
                         numel: int) -> torch.Tensor | None:
    """The average of the flagged payloads of ``world_size`` peers laid end to end in ``gathered`` (rank
    order, each ``codec.payload_bytes(numel)`` bytes and its flag), over those flagged 1 only: decoded,
    summed in rank order, divided by their count (float32; the same bits on every peer that holds the same
    bytes). None when no peer contributed.

    Raises:
        InvalidArgumentError: ``gathered`` of the wrong size, or a flag other than 0 or 1.
    """
    size = codec.payload_bytes(numel)
    if gathered.dtype != torch.uint8 or gathered.numel() != world_size * (size + 1):
        raise InvalidArgumentError(f"expected {world_size} flagged payloads of {size} + 1 bytes, "
                                   f"got {gathered.numel()}")
    rows = gathered.reshape(world_size, size + 1)
    flags = [int(v) for v in rows[:, size].tolist()]
    if any(v not in (0, 1) for v in flags):
        raise InvalidArgumentError(f"contributor flags must be 0 or 1, not {flags}")
    acc: torch.Tensor | None = None
    count = 0
    for r, contributes in enumerate(flags):
        if not contributes:
            continue
        decoded = codec.decode(rows[r, :size].contiguous(), numel)
        if acc is None:
            acc = decoded
        else:
            acc += decoded
        count += 1
    return None if acc is None else acc / count


def counted_average(summed: torch.Tensor, numel: int) -> torch.Tensor | None:
    """The average from an all-reduce (SUM) of ``numel`` elements and a contributor flag after them: the
    sums divided by the flags' sum (a new tensor); None when no peer contributed.

    Raises:
        InvalidArgumentError: a count that is not a whole number in ``[0, 2**24]``.
    """
    if summed.numel() != numel + 1:
        raise InvalidArgumentError(f"expected {numel} sums and a count, got {summed.numel()} elements")
    count = float(summed[numel])
    if not count.is_integer() or not 0 <= count <= 2 ** 24:
        raise InvalidArgumentError(f"a contributor count of {count:g}")
    if count == 0:
        return None
    return summed[:numel].div(summed[numel])
