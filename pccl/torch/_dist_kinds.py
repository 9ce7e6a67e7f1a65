"""The collectives of the torch.distributed backend over an async pccl communicator, in torch-rank terms.

Every function here returns *new* tensors and never writes the caller's: the process group copies the
results into the caller's tensors only once every step succeeded, so a failed call leaves them as
they were. A peer lost, or a group that no longer has the configured size, is :class:`PeerLostError`.

``reduce`` and ``all_to_all`` run on the communicator's native kinds. An ``all_to_all`` whose chunks are
not all of one size on every rank (uneven splits, which the native kind cannot express) falls back to
:func:`padded_all_to_all`; every rank learns which case it is from one small all-gather of the split sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import InvalidArgumentError, RankConnectionLostError, TooFewPeersError
from .._types import ReduceInfo, ReduceOp
from ..peer.communicator import Communicator
from ._dist_plan import NEW_PEER_OFFSET, assign_ranks, chunk_bounds
from ._dist_work import PeerLostError

__all__ = ["Configuration", "Kinds", "exchange_ranks"]


@dataclasses.dataclass(frozen=True)
class Configuration:
    """Who is who: the torch rank of each ring position, as agreed by a rank exchange."""

    rank: int
    rank_of_pos: tuple[int, ...]
    peer_ids: tuple[int, ...]
    newcomers: int

    @property
    def size(self) -> int:
        return len(self.rank_of_pos)

    def pos_of(self, rank: int) -> int:
        """The ring position of torch rank ``rank``."""
        return self.rank_of_pos.index(rank)


def _lost(call: str, exc: BaseException | None = None) -> PeerLostError:
    why = f" ({exc})" if exc is not None else ""
    return PeerLostError(f"{call}: a peer of the pccl group was lost{why}; the buffers are as they were")


async def exchange_ranks(comm: Communicator, hint: int, tag: int) -> Configuration:
    """Agree on torch ranks with every peer of the group (an all-gather of ``(hint, peer id)``).

    Args:
        hint: the rank this peer holds, or ``NEW_PEER_OFFSET + requested`` (see ``assign_ranks``).

    Raises:
        PeerLostError: a peer was lost during the exchange (every peer then retries it).
    """
    mine = torch.tensor([hint, comm.peer_id], dtype=torch.int64)
    n = len(comm.group_ring)
    if n == 1:
        table = mine.clone()
    else:
        table = torch.zeros(2 * n, dtype=torch.int64)
        try:
            info = await comm.all_gather(mine, table, tag=tag)
        except (RankConnectionLostError, TooFewPeersError, InvalidArgumentError) as exc:
            if isinstance(exc, InvalidArgumentError) and len(comm.group_ring) == n:
                raise
            raise _lost("rank exchange", exc) from exc
        if info.local_world_size != n:
            raise _lost("rank exchange")
    pairs = table.reshape(-1, 2).tolist()
    hints = [int(h) for h, _ in pairs]
    ids = tuple(int(p) for _, p in pairs)
    ranks = assign_ranks(hints)
    return Configuration(rank=ranks[ids.index(comm.peer_id)], rank_of_pos=tuple(ranks), peer_ids=ids,
                         newcomers=sum(1 for h in hints if h >= NEW_PEER_OFFSET - 1))


class Scratch:
    """Reusable receive buffers by (shape, dtype, device): a call's result lands in one of these and is
    copied into the caller's tensor only after the call succeeded. Reusing them spares a fresh allocation
    (and its page faults) per call. Used from the trio thread only."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        free = self._free.get((like.shape, like.dtype, like.device))
        return free.pop() if free else torch.empty_like(like, memory_format=torch.contiguous_format)

    def give(self, buf: torch.Tensor) -> None:
        self._free.setdefault((buf.shape, buf.dtype, buf.device), []).append(buf)


class Kinds:
    """The collectives on ``comm`` for one configuration of the group."""

    def __init__(self, comm: Communicator, config: Configuration, scratch: Scratch | None = None) -> None:
        self.comm = comm
        self.config = config
        self.scratch = scratch if scratch is not None else Scratch()

    @property
    def n(self) -> int:
        return self.config.size

    def _check(self, info: ReduceInfo, call: str) -> None:
        if info.local_world_size != self.n:
            raise PeerLostError(f"{call}: the pccl group has {info.local_world_size} peers, configured for "
                                f"{self.n}; nothing was committed")

    async def _run(self, call: str, kind: str, send: Any, recv: Any, **kw: Any) -> Any:
        try:
            if kind == "all_reduce":
                result: Any = await self.comm.all_reduce(send, recv, **kw)
            elif kind == "all_gather":
                result = await self.comm.all_gather(send, recv, **kw)
            elif kind == "broadcast":
                result = await self.comm.broadcast(recv, **kw)
            elif kind == "reduce":
                result = await self.comm.reduce(send, recv, **kw)
            elif kind == "all_to_all":
                result = await self.comm.all_to_all(send, recv, **kw)
            else:
                result = await self.comm.reduce_scatter(send, recv, **kw)
        except (RankConnectionLostError, TooFewPeersError) as exc:
            raise _lost(call, exc) from exc
        except InvalidArgumentError as exc:
            if len(self.comm.group_ring) != self.n:
                raise _lost(call, exc) from exc
            raise
        self._check(result[0] if isinstance(result, tuple) else result, call)
        return result

    async def all_reduce(self, call: str, send: torch.Tensor, op: ReduceOp, tag: int) -> torch.Tensor:
        """The reduction of every peer's ``send`` (contiguous)."""
        out = torch.empty_like(send)
        if self.n == 1:
            return out.copy_(send)
        await self._run(call, "all_reduce", send, out, op=op, tag=tag)
        return out

    async def all_reduce_into(self, call: str, tensor: torch.Tensor, op: ReduceOp, tag: int) -> None:
        """All-reduce ``tensor`` (contiguous) in place: written only once the call succeeded."""
        if self.n == 1:
            return
        out = self.scratch.take(tensor)
        try:
            await self._run(call, "all_reduce", tensor, out, op=op, tag=tag)
            tensor.copy_(out)
        finally:
            self.scratch.give(out)

    async def all_gather(self, call: str, send: torch.Tensor, tag: int) -> torch.Tensor:
        """Every peer's flat ``send`` (all of one size), concatenated in torch-rank order."""
        flat = send.reshape(-1)
        if self.n == 1:
            return flat.clone()
        ring = torch.empty(self.n * flat.numel(), dtype=flat.dtype, device=flat.device)
        await self._run(call, "all_gather", flat, ring, tag=tag)
        if self.config.rank_of_pos == tuple(range(self.n)):
            return ring
        parts = ring.reshape(self.n, -1)
        return torch.cat([parts[self.config.pos_of(r)] for r in range(self.n)])

    async def broadcast(self, call: str, tensor: torch.Tensor, root: int, tag: int) -> torch.Tensor:
        """Rank ``root``'s ``tensor`` (contiguous)."""
        self._root_ok(call, root)
        out = tensor.clone()
        if self.n == 1:
            return out
        await self._run(call, "broadcast", out, out, root=self.config.pos_of(root), tag=tag)
        return out

    async def reduce_scatter(self, call: str, send: torch.Tensor, op: ReduceOp, tag: int) -> torch.Tensor:
        """This rank's chunk of the reduction of ``send`` (flat, ``n`` equal chunks in torch-rank order)."""
        flat = send.reshape(-1)
        m = flat.numel() // self.n
        if self.n == 1:
            return flat.clone()
        # pccl gives ring position p the p-th chunk: lay the chunks out in ring order.
        if self.config.rank_of_pos != tuple(range(self.n)):
            parts = flat.reshape(self.n, m)
            flat = torch.cat([parts[r] for r in self.config.rank_of_pos])
        out = torch.empty_like(flat)
        _, chunk = await self._run(call, "reduce_scatter", flat, out, op=op, tag=tag)
        pos = self.config.pos_of(self.config.rank)
        start, stop = chunk_bounds(flat.numel(), self.n, pos)
        assert (chunk.start, chunk.stop) == (start, stop), (chunk, start, stop)
        return out[start:stop].clone()

    def _root_ok(self, call: str, root: int) -> None:
        if not 0 <= root < self.n:
            raise InvalidArgumentError(f"{call}: root rank {root} is not in the group of {self.n}")

    async def reduce(self, call: str, send: torch.Tensor, op: ReduceOp, root: int, tag: int,
                     ) -> torch.Tensor | None:
        """``reduce``: the reduction of every rank's ``send`` (contiguous) on rank ``root``, None elsewhere
        (the communicator's native reduce: only the root receives it)."""
        self._root_ok(call, root)
        out = torch.empty_like(send)
        if self.n == 1:
            return out.copy_(send)
        await self._run(call, "reduce", send, out, root=self.config.pos_of(root), op=op, tag=tag)
        return out if self.config.rank == root else None

    async def all_to_all(self, call: str, chunks: Sequence[torch.Tensor], tag: int) -> list[torch.Tensor]:
        """``all_to_all``: ``chunks[r]`` goes to rank r; returns what each rank sent here, by rank (flat).

        One small all-gather of every rank's chunk sizes first: if every chunk of every rank has one size,
        the communicator's native all-to-all moves them (chunks laid out in ring order); otherwise
        :func:`padded_all_to_all`.
        """
        n = self.n
        if len(chunks) != n:
            raise InvalidArgumentError(f"{call}: {len(chunks)} chunks for a group of {n}")
        flat = [c.reshape(-1) for c in chunks]
        if n == 1:
            return [flat[0].clone()]
        sizes = torch.tensor([c.numel() for c in flat], dtype=torch.int64)
        table = (await self.all_gather(call, sizes, tag)).reshape(n, n)  # table[src rank][dst rank]
        if bool((table != table[0, 0]).any()):
            return await padded_all_to_all(self, call, flat, table, tag)
        if int(table[0, 0]) == 0:
            return [c.clone() for c in flat]
        send = torch.cat([flat[r] for r in self.config.rank_of_pos])  # block p goes to ring position p
        recv = torch.empty_like(send)
        await self._run(call, "all_to_all", send, recv, tag=tag)
        blocks = recv.reshape(n, -1)  # block p came from ring position p
        return [blocks[self.config.pos_of(r)].clone() for r in range(n)]


async def padded_all_to_all(kinds: Kinds, call: str, flat: Sequence[torch.Tensor], table: torch.Tensor,
                            tag: int) -> list[torch.Tensor]:
    """``all_to_all`` with uneven chunks, which the native kind (``n`` equal blocks) cannot carry: an
    all-gather of every rank's chunks, padded to the largest rank's total, each rank keeping the chunks
    addressed to it (n times the traffic of a native all-to-all).

    Args:
        flat: this rank's chunks (flat), by destination rank.
        table: ``table[src][dst]``, the element count rank ``src`` sends rank ``dst`` (every rank's, as
            gathered).
    """
    n = kinds.n
    width = int(table.sum(dim=1).max())
    mine = torch.cat(list(flat))
    padded = torch.zeros(width, dtype=mine.dtype, device=mine.device)
    padded[: mine.numel()] = mine
    everything = (await kinds.all_gather(call, padded, tag)).reshape(n, width)
    me = kinds.config.rank
    out = []
    for src in range(n):
        start = int(table[src, :me].sum())
        out.append(everything[src, start:start + int(table[src, me])].clone())
    return out
