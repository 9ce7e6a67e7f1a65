"""Streaming DiLoCo's fragments: how the parameters are split, and one fragment's state."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import InvalidArgumentError
from ._codec import Codec, ErrorFeedback, choose_codec, codec_from_spec

__all__ = ["CodecSpec", "Fragment", "build_fragments", "choose_codecs", "split_fragments"]

CodecSpec = str | Codec | None


def split_fragments(named: Sequence[tuple[str, torch.nn.Parameter]], fragments: int | Sequence[Sequence[str]]
                    ) -> list[list[int]]:
    """Indices into ``named`` of each fragment.

    ``fragments`` is a count (contiguous runs of parameters in model order, of about equal size,
    never splitting a parameter; fewer when the model has fewer parameters) or lists of parameter
    names (every trainable parameter in exactly one).

    Raises:
        InvalidArgumentError: a count below 1, an unknown or repeated name, a parameter left out.
    """
    if isinstance(fragments, int):
        if fragments < 1:
            raise InvalidArgumentError("fragments must be >= 1")
        total = sum(p.numel() for _, p in named)
        count = min(fragments, len(named))
        out: list[list[int]] = [[]]
        done = 0
        for i, (_, p) in enumerate(named):
            # open the next fragment once this parameter's middle passes the current one's share of the
            # elements, or when every parameter left is needed to give each fragment left one
            left_over = len(named) - i <= count - len(out)
            past_share = done + p.numel() / 2 >= len(out) * total / count
            if out[-1] and len(out) < count and (left_over or past_share):
                out.append([])
            out[-1].append(i)
            done += p.numel()
        return out
    index = {name: i for i, (name, _) in enumerate(named)}
    seen: set[str] = set()
    result: list[list[int]] = []
    for names in fragments:
        frag = []
        for name in names:
            if name not in index or name in seen:
                raise InvalidArgumentError(f"fragment parameter {name!r} is unknown or listed twice")
            seen.add(name)
            frag.append(index[name])
        if frag:
            result.append(frag)
    missing = [name for name, _ in named if name not in seen]
    if missing:
        raise InvalidArgumentError(f"parameters in no fragment: {missing}")
    return result


@dataclasses.dataclass(eq=False)
class Fragment:
    """One fragment: its parameters, schedule, codec and the exchange in flight."""

    index: int
    names: list[str]
    inner: list[torch.nn.Parameter]
    outer: list[torch.nn.Parameter]
    offset: int  # the inner step of the cycle at which it is sent
    spec: CodecSpec  # "auto", a codec name, a codec, or None (fp32)
    # with overlap "auto": the inner step at which it is sent in the run's last cycle
    early_offset: int = 0
    # with overlap "auto": its round in flight is applied only after the next membership point's sync
    deferred: bool = False
    codec: Codec | None = None
    feedback: ErrorFeedback | None = None
    handle: Any = None
    world: int = 1
    rank: int = 0
    stage: int = 0  # 0: one collective (all-reduce, all-gather); 1, 2: the two-stage exchange's stages
    round_tx: int = 0  # bytes the round's first stage sent
    server_residual: torch.Tensor | None = None  # the two-stage exchange's residual of this peer's chunk
    server_key: tuple[int, int] = (0, 0)  # (world, rank) that residual belongs to
    server_proposed: torch.Tensor | None = None
    done: Any = None  # the info of an exchange already complete (restarted as a 2-peer all-gather)
    local: torch.Tensor | None = None  # alone: the pseudo-gradient, applied as it is
    payload: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    send: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))
    recv: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))
    rounds: int = 0
    lost: int = 0
    tx_bytes: int = 0
    overlap_steps: int = 0  # inner steps from send to application, summed over the rounds
    sent_at: int = -1  # the run's inner step (cycle * H + step) of the round in flight's send

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.inner)

    @property
    def in_flight(self) -> bool:
        return self.handle is not None or self.local is not None or self.done is not None


def build_fragments(named: Sequence[tuple[str, torch.nn.Parameter]],
                    outer_named: dict[str, torch.nn.Parameter], fragments: int | Sequence[Sequence[str]],
                    codec: CodecSpec | Sequence[CodecSpec], *, inner_steps: int, error_feedback: bool,
                    flagged: bool) -> tuple[list[Fragment], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The fragments of a streaming run (:func:`split_fragments` of the inner model's ``named``
    parameters, each paired with its ``outer_named`` copy), their send offsets in a cycle of
    ``inner_steps`` (``p * H // P``; in the run's last cycle with overlap "auto" ``p * H // (P + 1)``),
    codecs (``codec``: one for all or one per fragment; ``"auto"`` chosen later, :func:`choose_codecs`)
    and error feedback. ``flagged`` (``replay_heals``): each uncompressed exchange's buffers carry one
    element more, the contributor flag; returned per fragment index as ``(send, recv)`` wires whose first
    ``numel`` elements are the fragment's ``send`` / ``recv``.

    Raises:
        InvalidArgumentError: a codec count other than the fragments', a fragment of mixed or non-float
            dtypes (and what :func:`split_fragments` raises).
    """
    groups = split_fragments(named, fragments)
    specs: list[CodecSpec]
    if isinstance(codec, (list, tuple)):
        if len(codec) != len(groups):
            raise InvalidArgumentError(f"{len(codec)} codecs for {len(groups)} fragments")
        specs = list(codec)
    else:
        specs = [codec] * len(groups)  # type: ignore[list-item]
    out: list[Fragment] = []
    wires: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for p_index, (idx, spec) in enumerate(zip(groups, specs, strict=True)):
        inner = [named[i][1] for i in idx]
        dtypes = {t.dtype for t in inner}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise InvalidArgumentError(f"fragment {p_index}: its parameters must share one float dtype")
        frag = Fragment(p_index, [named[i][0] for i in idx], inner,
                        [outer_named[named[i][0]] for i in idx],
                        offset=p_index * inner_steps // len(groups), spec=spec,
                        early_offset=p_index * inner_steps // (len(groups) + 1))
        if spec != "auto":
            frag.codec = codec_from_spec(spec)
        n = frag.numel
        frag.send = torch.zeros(n, dtype=inner[0].dtype)
        frag.recv = torch.zeros(n, dtype=inner[0].dtype)
        if flagged:  # the uncompressed exchange's buffers: the pseudo-gradient, then the flag
            wire = (torch.zeros(n + 1, dtype=inner[0].dtype), torch.zeros(n + 1, dtype=inner[0].dtype))
            wires[p_index] = wire
            frag.send, frag.recv = wire[0][:n], wire[1][:n]
        if frag.codec is not None and error_feedback:
            frag.feedback = ErrorFeedback(frag.codec, n)
        out.append(frag)
    return out, wires


def choose_codecs(fragments: Sequence[Fragment], budget_bytes: int | None, world_size: int,
                  error_feedback: bool) -> None:
    """Codec ``"auto"``: each such fragment's codec for a group of ``world_size`` peers (at a sync), its
    share of ``budget_bytes`` (bytes one peer may send per cycle for the whole model; None: no fragment
    is "auto", nothing to choose) by size; its error feedback follows the codec chosen."""
    if budget_bytes is None:
        return
    total = sum(f.numel for f in fragments)
    for f in fragments:
        if f.spec == "auto":
            share = budget_bytes * f.numel // max(total, 1)
            f.codec = choose_codec(f.numel, f.send.element_size(), world_size, share)
            if f.codec is not None and error_feedback:
                if f.feedback is None:
                    f.feedback = ErrorFeedback(f.codec, f.numel)
                f.feedback.codec = f.codec
