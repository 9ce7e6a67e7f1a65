"""Flat buckets of tensors for bucketed all-reduces."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._errors import InvalidArgumentError

__all__ = ["DEFAULT_BUCKET_BYTES", "Buckets"]

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
"""Default bucket size: large enough that per-operation costs (a vote, a few messages) are amortized,
small enough that several buckets are in flight at once on a model of a few tens of MB."""


class Buckets:
    """``tensors`` laid out in flat send/receive buffers of at most ``bucket_bytes`` each.

    Tensors are grouped by (dtype, device) in their order; a bucket holds consecutive tensors of one
    group (a tensor larger than ``bucket_bytes`` gets a bucket of its own). Every peer must build its
    buckets from the same tensors in the same order: the layout is then the same everywhere.

    Args:
        tensors: the tensors (parameters, usually) whose values or gradients are reduced.
        bucket_bytes: the size limit.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes < 1:
            raise InvalidArgumentError("bucket_bytes must be >= 1")
        self.tensors = list(tensors)
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(self.tensors):
            groups.setdefault((t.dtype, t.device), []).append(i)
        layout: list[tuple[torch.dtype, torch.device, list[int]]] = []
        for (dtype, device), idx in groups.items():
            current: list[int] = []
            size = 0
            for i in idx:
                nbytes = self.tensors[i].numel() * self.tensors[i].element_size()
                if current and size + nbytes > bucket_bytes:
                    layout.append((dtype, device, current))
                    current, size = [], 0
                current.append(i)
                size += nbytes
            if current:
                layout.append((dtype, device, current))
        self.slices: list[list[tuple[int, int, int]]] = []  # per bucket: (tensor index, offset, numel)
        self.send: list[torch.Tensor] = []
        self.recv: list[torch.Tensor] = []
        for dtype, device, idx in layout:
            off = 0
            rows = []
            for i in idx:
                n = self.tensors[i].numel()
                rows.append((i, off, n))
                off += n
            self.slices.append(rows)
            self.send.append(torch.zeros(off, dtype=dtype, device=device))
            self.recv.append(torch.zeros(off, dtype=dtype, device=device))

    def __len__(self) -> int:
        return len(self.send)

    @property
    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(send, recv)`` per bucket."""
        return list(zip(self.send, self.recv, strict=True))

    @property
    def nbytes(self) -> int:
        """Bytes of one set of buffers (send or recv)."""
        return sum(b.numel() * b.element_size() for b in self.send)

    def pack_grads(self) -> None:
        """Copy every tensor's ``.grad`` into the send buffers (zeros where there is none)."""
        with torch.no_grad():
            for send, rows in zip(self.send, self.slices, strict=True):
                for i, off, n in rows:
                    g = self.tensors[i].grad
                    if g is None:
                        send[off:off + n].zero_()
                    else:
                        send[off:off + n].copy_(g.reshape(-1))

    def unpack_grads(self) -> None:
        """Set every tensor's ``.grad`` to its slice of the receive buffers."""
        with torch.no_grad():
            for recv, rows in zip(self.recv, self.slices, strict=True):
                for i, off, n in rows:
                    t = self.tensors[i]
                    if t.grad is None:
                        t.grad = torch.empty_like(t)
                    t.grad.copy_(recv[off:off + n].view_as(t))

    def pack_difference(self, minuend: Sequence[torch.Tensor]) -> None:
        """Send buffers := ``minuend[i] - tensors[i]`` (DiLoCo's pseudo-gradient: outer minus inner)."""
        with torch.no_grad():
            for send, rows in zip(self.send, self.slices, strict=True):
                for i, off, n in rows:
                    torch.sub(minuend[i].reshape(-1), self.tensors[i].reshape(-1), out=send[off:off + n])

    def recv_views(self) -> list[torch.Tensor]:
        """Per tensor, its slice of the receive buffers, shaped like it."""
        out: list[torch.Tensor | None] = [None] * len(self.tensors)
        for recv, rows in zip(self.recv, self.slices, strict=True):
            for i, off, n in rows:
                out[i] = recv[off:off + n].view_as(self.tensors[i])
        return [v for v in out if v is not None]

    def copy_send_to_recv(self) -> None:
        """Receive buffers := send buffers (a reduce over a group of one)."""
        with torch.no_grad():
            for s, r in zip(self.send, self.recv, strict=True):
                r.copy_(s)
