"""ProcessGroupPCCL: a torch.distributed process group whose collectives run on a pccl communicator.

The communicator lives in a background trio thread; each torch call takes the next tag, starts its
collective there and returns a :class:`PCCLWork` at once (torch's ``async_op``); synchronous calls are
that plus ``wait()``. Calls are made in the same order on every rank (torch's contract), so each has the
same tag everywhere, and calls may overlap (DDP's buckets do).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._config import PeerConfig
from .._errors import InvalidArgumentError
from .._types import ReduceOp
from ..peer.communicator import Communicator
from ._dist_kinds import Configuration, Kinds
from ._dist_link import GroupLink
from ._dist_plan import UnsupportedOperationError, pccl_reduce_op
from ._dist_work import PCCLWork, PeerLostError

__all__ = ["ProcessGroupPCCL"]


def _one(tensors: Sequence[torch.Tensor], call: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise UnsupportedOperationError(
            f"{call}: the pccl backend takes one tensor per call (one device per process), "
            f"got {len(tensors)}")
    return tensors[0]


def _sync_cuda(tensors: Sequence[torch.Tensor]) -> None:
    # The collective runs in another thread, whose current CUDA stream is not the caller's: finish the work
    # queued to produce the inputs first (as the blocking API does).
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


class ProcessGroupPCCL(dist.ProcessGroup):
    """A torch.distributed process group over pccl (registered as the backend ``"pccl"``).

    Connecting waits until ``world_size`` peers are in the pccl group (admitting them as they come),
    then the peers agree on torch ranks (see :func:`~pccl.torch._dist_plan.assign_ranks`): the rank
    each asked for when the asked ranks are ``0..world_size-1``. A peer that connects to a group already
    running (a newcomer admitted by a :class:`~pccl.torch.distributed.Manager`) is given the next free
    rank and :attr:`joined_running_group` is True.

    Args:
        master_address: the pccl master's ``"HOST:PORT"``.
        rank: the rank asked for (-1: any).
        world_size: how many peers to wait for before the first collective.
        timeout: bound on that wait.
        peer_group, config: as for a pccl communicator.
        connect_attempts: attempts to reach the master (50 ms back-off, doubling up to 1 s).
        poll_interval: how often a waiting peer asks whether others are pending.

    Raises:
        MasterConnectionError: the master cannot be reached.
        InvalidArgumentError: two peers asked for the same rank, or more than ``world_size`` peers came.
        TimeoutError: fewer than ``world_size`` peers within ``timeout``.
    """

    def __init__(self, master_address: str, *, rank: int = -1, world_size: int,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=30), peer_group: int = 0,
                 config: PeerConfig | None = None, connect_attempts: int = 10,
                 poll_interval: float = 0.05) -> None:
        if world_size < 1:
            raise InvalidArgumentError(f"world_size must be at least 1, not {world_size}")
        super().__init__(max(rank, 0), world_size)  # type: ignore[call-arg]
        self._broken: str | None = None
        self._coalesced: list[PCCLWork] | None = None
        self._link = GroupLink(master_address, rank=rank, world_size=world_size,
                               timeout=timeout.total_seconds(), peer_group=peer_group, config=config,
                               connect_attempts=connect_attempts, poll_interval=poll_interval)
        self.comm: Communicator = self._link.comm
        self.joined_running_group = self._link.joined_running_group

    # ------------------------------------------------------------------------------------------------
    # membership (the Manager's side)

    def reconfigure(self) -> Configuration:
        """Agree on ranks again with the peers now in the pccl group (every peer calls it together).

        Survivors keep their relative order, renumbered from 0; newcomers follow. Clears :attr:`broken`.
        Call it with no call of this group running (their tags would be reused).

        Raises:
            PeerLostError: a peer was lost meanwhile (call it again).
        """
        config = self._link.reconfigure()
        self._broken = None
        return config

    def run(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``await afn(*args)`` in the communicator's trio thread (for membership calls)."""
        return self._link.run(afn, *args)

    @property
    def configuration(self) -> Configuration:
        """The current agreement on ranks."""
        return self._link.config

    @property
    def broken(self) -> bool:
        """True after a collective lost a peer, until :meth:`reconfigure`."""
        return self._broken is not None

    def close(self) -> None:
        """Leave the pccl run (the others see this peer as lost) and stop the background thread
        (idempotent; ``dist.destroy_process_group()`` calls it through :meth:`shutdown`)."""
        self._link.close()

    def shutdown(self) -> None:
        """torch's name for :meth:`close`."""
        self.close()

    def abort(self) -> None:
        """torch's name for :meth:`close` (running operations fail on every peer)."""
        self.close()

    # ------------------------------------------------------------------------------------------------
    # torch's ProcessGroup interface

    def rank(self) -> int:
        return self._link.config.rank

    def size(self) -> int:
        return self._link.config.size

    def getBackendName(self) -> str:
        return "pccl"

    @property
    def name(self) -> str:  # type: ignore[override]
        return "pccl"

    # torch keeps a group's name in its backends, which a Python group has none of: keep it here (DeviceMesh
    # reads it).
    _group_name = ""

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _launch(self, call: str, result: Any, inputs: Sequence[torch.Tensor],
                body: Callable[[Kinds, int], Awaitable[None]]) -> PCCLWork:
        _sync_cuda(inputs)
        cuda = [t for t in _tensors(result) if t.is_cuda]
        work = PCCLWork(call, result)
        tag = self._link.next_tag()
        kinds = self._link.kinds

        async def task() -> None:
            error: BaseException | None = None
            try:
                await body(kinds, tag)
            except PeerLostError as exc:
                self._broken = call
                error = exc
            except Exception as exc:  # reported by wait(); never allowed to take the trio thread down
                error = exc
            if error is None and cuda:
                _sync_cuda(cuda)  # the results were copied on this thread's stream
            work.finish(error)

        self._link.start(task)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _op(self, opts: Any, call: str) -> ReduceOp:
        return pccl_reduce_op(opts.reduceOp, call)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PCCLWork:  # type: ignore[override]
        call = "all_reduce"
        t = _one(tensors, call)
        op = self._op(opts or dist.AllreduceOptions(), call)

        async def body(k: Kinds, tag: int) -> None:
            if t.is_contiguous():
                await k.all_reduce_into(call, t, op, tag)
            else:
                t.copy_(await k.all_reduce(call, t.contiguous(), op, tag))

        return self._launch(call, tensors, tensors, body)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> PCCLWork:
        call = "all_reduce_coalesced"
        op = self._op(opts or dist.AllreduceCoalescedOptions(), call)

        async def body(k: Kinds, tag: int) -> None:
            results = []
            for dtype in dict.fromkeys(t.dtype for t in tensors):  # one flat reduce per dtype, in order
                group = [t for t in tensors if t.dtype == dtype]
                flat = torch.cat([t.reshape(-1) for t in group])
                results.append((group, await k.all_reduce(call, flat, op, tag)))
            for group, flat in results:
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

        return self._launch(call, tensors, tensors, body)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> PCCLWork:  # type: ignore[override]
        call = "broadcast"
        t = _one(tensors, call)
        root = (opts or dist.BroadcastOptions()).rootRank

        async def body(k: Kinds, tag: int) -> None:
            t.copy_(await k.broadcast(call, t.contiguous(), root, tag))

        return self._launch(call, tensors, tensors, body)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> PCCLWork:
        call = "all_gather"
        t = _one(input_tensors, call)
        outs = _one(output_tensors, call)  # type: ignore[arg-type]

        async def body(k: Kinds, tag: int) -> None:
            if len(outs) != k.n:
                raise InvalidArgumentError(f"{call}: {len(outs)} output tensors for a group of {k.n}")
            parts = (await k.all_gather(call, t.contiguous(), tag)).reshape(k.n, -1)
            for out, part in zip(outs, parts, strict=True):
                out.copy_(part.view_as(out))

        return self._launch(call, output_tensors, input_tensors, body)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PCCLWork:
        call = "all_gather_into_tensor"

        async def body(k: Kinds, tag: int) -> None:
            if output.numel() != k.n * input.numel():
                raise InvalidArgumentError(f"{call}: output has {output.numel()} elements, expected "
                                           f"{k.n} x {input.numel()}")
            output.copy_((await k.all_gather(call, input.contiguous(), tag)).view_as(output))

        return self._launch(call, [output], [input], body)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> PCCLWork:
        call = "all_gather_into_tensor_coalesced"

        async def body(k: Kinds, tag: int) -> None:
            results = [await k.all_gather(call, i.contiguous(), tag) for i in inputs]
            for out, r in zip(outputs, results, strict=True):
                out.copy_(r.view_as(out))

        return self._launch(call, outputs, inputs, body)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> PCCLWork:
        call = "reduce_scatter"
        out = _one(output_tensors, call)
        ins = _one(input_tensors, call)  # type: ignore[arg-type]
        op = self._op(opts or dist.ReduceScatterOptions(), call)

        async def body(k: Kinds, tag: int) -> None:
            if len(ins) != k.n or any(i.numel() != out.numel() for i in ins):
                raise InvalidArgumentError(f"{call}: expected {k.n} inputs of {out.numel()} elements")
            flat = torch.cat([i.reshape(-1) for i in ins])
            out.copy_((await k.reduce_scatter(call, flat, op, tag)).view_as(out))

        return self._launch(call, output_tensors, list(ins), body)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PCCLWork:
        call = "reduce_scatter_tensor"
        op = self._op(opts or dist.ReduceScatterOptions(), call)

        async def body(k: Kinds, tag: int) -> None:
            if input.numel() != k.n * output.numel():
                raise InvalidArgumentError(f"{call}: input has {input.numel()} elements, expected "
                                           f"{k.n} x {output.numel()}")
            output.copy_((await k.reduce_scatter(call, input.contiguous(), op, tag)).view_as(output))

        return self._launch(call, [output], [input], body)

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> PCCLWork:
        call = "reduce_scatter_tensor_coalesced"
        op = self._op(opts or dist.ReduceScatterOptions(), call)

        async def body(k: Kinds, tag: int) -> None:
            results = [await k.reduce_scatter(call, i.contiguous(), op, tag) for i in inputs]
            for out, r in zip(outputs, results, strict=True):
                out.copy_(r.view_as(out))

        return self._launch(call, outputs, inputs, body)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PCCLWork:  # type: ignore[override]
        call = "reduce"
        t = _one(tensors, call)
        opts = opts or dist.ReduceOptions()
        op, root = self._op(opts, call), opts.rootRank

        async def body(k: Kinds, tag: int) -> None:
            result = await k.reduce(call, t.contiguous(), op, root, tag)
            if result is not None:
                t.copy_(result)

        return self._launch(call, tensors, tensors, body)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> PCCLWork:
        call = "all_to_all"

        async def body(k: Kinds, tag: int) -> None:
            if len(output_tensors) != k.n:
                raise InvalidArgumentError(f"{call}: {len(output_tensors)} outputs for a group of {k.n}")
            got = await k.all_to_all(call, [i.contiguous() for i in input_tensors], tag)
            _check_sizes(call, output_tensors, got)
            for out, r in zip(output_tensors, got, strict=True):
                out.copy_(r.view_as(out))

        return self._launch(call, output_tensors, input_tensors, body)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> PCCLWork:
        call = "all_to_all_single"

        async def body(k: Kinds, tag: int) -> None:
            rows_in = list(input_split_sizes) or _even(call, input.shape[0], k.n)
            rows_out = list(output_split_sizes) or _even(call, output.shape[0], k.n)
            got = await k.all_to_all(call, list(input.contiguous().split(rows_in)), tag)
            outs = list(output.split(rows_out))
            _check_sizes(call, outs, got)
            output.copy_(torch.cat([g.view_as(o) for o, g in zip(outs, got, strict=True)]))

        return self._launch(call, [output], [input], body)

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> PCCLWork:
        call = "barrier"
        token = torch.zeros(1, dtype=torch.uint8)

        async def body(k: Kinds, tag: int) -> None:
            await k.all_reduce(call, token, ReduceOp.MAX, tag)

        return self._launch(call, [token], [], body)

    def _start_coalescing(self, device: Any = None) -> None:
        # Calls run as they are made; _end_coalescing returns one Work for those made meanwhile.
        self._coalesced = []

    def _end_coalescing(self, device: Any = None) -> PCCLWork:
        works, self._coalesced = self._coalesced or [], None
        return _all_of(works)

    # unsupported calls: pccl has collectives, no point-to-point messages
    def _unsupported(self, call: str, why: str) -> Any:
        raise UnsupportedOperationError(f"{call}: not supported by the pccl backend ({why})")

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("send", "pccl has no point-to-point messages, only collectives")

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv", "pccl has no point-to-point messages, only collectives")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv_anysource", "pccl has no point-to-point messages, only collectives")

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> PCCLWork:
        """Emulated: an all-gather whose result only the root keeps."""
        call = "gather"
        t = _one(input_tensors, call)
        root = (opts or dist.GatherOptions()).rootRank

        async def body(k: Kinds, tag: int) -> None:
            parts = (await k.all_gather(call, t.contiguous(), tag)).reshape(k.n, -1)
            if k.config.rank == root:
                outs = _one(output_tensors, call)  # type: ignore[arg-type]
                for out, part in zip(outs, parts, strict=True):
                    out.copy_(part.view_as(out))

        return self._launch(call, output_tensors, input_tensors, body)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any = None) -> PCCLWork:
        """Emulated: a broadcast of the root's whole list, of which each rank keeps its part."""
        call = "scatter"
        out = _one(output_tensors, call)
        root = (opts or dist.ScatterOptions()).rootRank

        async def body(k: Kinds, tag: int) -> None:
            if k.config.rank == root:
                whole = torch.cat([i.reshape(-1) for i in _one(input_tensors, call)])  # type: ignore[arg-type]
            else:
                whole = torch.empty(k.n * out.numel(), dtype=out.dtype, device=out.device)
            got = await k.broadcast(call, whole, root, tag)
            out.copy_(got.reshape(k.n, -1)[k.config.rank].view_as(out))

        return self._launch(call, output_tensors, [], body)

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("all_gather_coalesced", "deprecated by torch; use all_gather_into_tensor")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("monitored_barrier", "Gloo only; use barrier")

    def __repr__(self) -> str:
        return f"<ProcessGroupPCCL rank {self.rank()} of {self.size()}>"


def _tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in result for t in _tensors(item)]


def _even(call: str, rows: int, n: int) -> list[int]:
    if rows % n:
        raise InvalidArgumentError(f"{call}: {rows} rows do not split evenly among {n} ranks")
    return [rows // n] * n


def _check_sizes(call: str, outs: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> None:
    for r, (o, g) in enumerate(zip(outs, got, strict=True)):
        if o.numel() != g.numel():
            raise InvalidArgumentError(f"{call}: rank {r} sent {g.numel()} elements, the output has room "
                                       f"for {o.numel()}")


def _all_of(works: list[PCCLWork]) -> PCCLWork:
    """A Work that finishes when ``works`` have (with the first error)."""
    combined = PCCLWork("coalesced", [w.result() for w in works])
    if not works:
        combined.finish(None)
        return combined
    remaining = [len(works)]
    lock = threading.Lock()

    def one(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            errors = [w.exception() for w in works if w.exception() is not None]
            combined.finish(errors[0] if errors else None)

    for w in works:
        w.get_future().add_done_callback(one)
    return combined
