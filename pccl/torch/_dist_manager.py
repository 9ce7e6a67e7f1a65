"""Manager: keeps a torch.distributed (DDP) training loop on pccl going while peers come and go.

In the spirit of torchft's Manager: each step starts with :meth:`Manager.start_step` (admit newcomers,
agree on ranks again, heal newcomers' state), gradients are averaged through the manager's DDP comm
hook, which never fails the backward pass but records a lost peer, and :meth:`Manager.should_commit`
says whether every peer may apply the step (a vote: all or none do).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from .._errors import PCCLError, RankConnectionLostError, TooFewPeersError, UpdateTopologyFailedError
from ..peer.shared_state import SharedState, TensorInfo
from ._dist_group import ProcessGroupPCCL
from ._dist_work import PCCLWork, PeerLostError
from ._model import SharedModel

__all__ = ["Manager"]

# Errors after which start_step simply tries again with whoever is there.
_RETRY = (PeerLostError, RankConnectionLostError, TooFewPeersError, UpdateTopologyFailedError)


class Manager:
    """Fault-tolerant steps for a DDP loop on a pccl process group.

    Args:
        shared: the model and optimizer (:class:`~pccl.torch.SharedModel`) whose state newcomers receive
            (and whose copies the peers keep identical); None: nothing is healed.
        process_group: the :class:`ProcessGroupPCCL` (default: the default group, which must be pccl's).
        min_world_size: :meth:`start_step` waits (polling) while fewer peers are in the group.
        poll_interval: seconds between polls.
        max_attempts: how many membership rounds one :meth:`start_step` may take when peers keep failing.

    Typical use (every peer runs the same loop; ``ddp`` made with ``init_sync=False`` and the hook
    registered by :meth:`register_comm_hook`)::

        while manager.step < total:
            manager.start_step()
            optimizer.zero_grad()
            loss_fn(ddp(x[manager.shard()]), y).backward()
            if manager.should_commit():
                optimizer.step()
    """

    def __init__(self, shared: SharedModel | None = None, *, process_group: ProcessGroupPCCL | None = None,
                 min_world_size: int = 1, poll_interval: float = 0.05, max_attempts: int = 100) -> None:
        pg = process_group if process_group is not None else dist.group.WORLD
        if not isinstance(pg, ProcessGroupPCCL):
            raise TypeError(f"Manager needs a pccl process group, not {type(pg).__name__}")
        self.pg = pg
        self.shared = shared
        self.min_world_size = min_world_size
        self.poll_interval = poll_interval
        self.max_attempts = max_attempts
        self._step = torch.zeros(1, dtype=torch.int64)  # committed steps, shared with newcomers
        infos = list(shared.state.tensor_infos) if shared is not None else []
        self._state = SharedState([*infos, TensorInfo.from_torch(self._step, "manager/step")])
        self._first = True
        self._errors: list[BaseException] = []
        self.reconfigurations = 0
        self.last_sync_rx_bytes = 0

    @property
    def step(self) -> int:
        """Steps committed by the group (a newcomer receives it with the state)."""
        return int(self._step[0])

    @property
    def rank(self) -> int:
        return self.pg.rank()

    @property
    def world_size(self) -> int:
        return self.pg.size()

    def errors(self) -> list[BaseException]:
        """The errors recorded during the current step (a lost peer in a bucket's all-reduce)."""
        return list(self._errors)

    def start_step(self) -> None:
        """Begin a step: admit pending peers, agree on ranks, give newcomers the state.

        Every peer calls it at the top of each step. Afterwards :attr:`rank` and :attr:`world_size`
        describe this step's group.

        Raises:
            MasterConnectionError: this peer lost the master.
            PeerLostError: peers kept failing for ``max_attempts`` rounds.
        """
        self._errors.clear()
        comm = self.pg.comm
        size_before = self.pg.size()
        # A newcomer was admitted and agreed on its rank in init_process_group: the peers that admitted
        # it are now at the state sync, so its first step goes straight there.
        skip_membership = self._first and self.pg.joined_running_group
        need_sync = self._first
        self._first = False
        failures: list[BaseException] = []
        while len(failures) < self.max_attempts:
            try:
                if not skip_membership:
                    if self.pg.run(comm.are_peers_pending):
                        self.pg.run(comm.update_topology)
                    config = self.pg.reconfigure()
                    self.reconfigurations += 1
                    if config.newcomers or config.size != size_before:
                        need_sync = True
                    if config.size < self.min_world_size:
                        time.sleep(self.poll_interval)  # poll: the next round admits whoever came
                        continue
                skip_membership = False
                if need_sync:
                    info = self.pg.run(comm.sync_shared_state, self._state)
                    self._state.revision += 1
                    self.last_sync_rx_bytes = info.rx_bytes
                    if self.shared is not None:
                        self.shared.revision = self._state.revision
                return
            except _RETRY as exc:
                failures.append(exc)
                need_sync = True  # whoever is left re-syncs (a failed sync fails for everyone)
        raise PeerLostError(f"start_step: peers kept failing for {self.max_attempts} rounds ({failures[-1]})")

    def allreduce(self, tensor: torch.Tensor, op: Any = None) -> torch.futures.Future[torch.Tensor]:
        """All-reduce ``tensor`` in place (AVG by default); the future completes with ``tensor`` even when a
        peer was lost (then ``tensor`` is unchanged and the step will not commit)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op if op is not None else dist.ReduceOp.AVG  # type: ignore[assignment]
        try:
            work = self.pg.allreduce([tensor], opts)
        except Exception as exc:  # refused at launch (the group closed...): recorded, as a failure
            self._errors.append(exc)
            done_now: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done_now.set_result(tensor)
            return done_now

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                fut.value()
            except Exception as exc:  # recorded; should_commit says no
                self._errors.append(exc)
            return tensor

        return work.get_future().then(done)

    def comm_hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook: averages the bucket over the current group (whatever its size)."""
        return self.allreduce(bucket.buffer())

    def register_comm_hook(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """``ddp.register_comm_hook`` with :meth:`comm_hook`."""
        ddp.register_comm_hook(None, lambda state, bucket: self.comm_hook(state, bucket))

    def wrap(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
        """``DistributedDataParallel(module)`` whose gradients are averaged by this manager.

        DDP itself is given a one-process placeholder group (as torchft does): its own collectives (the
        parameter broadcast at construction, the bucket order it broadcasts after its first backward,
        buffer broadcasts) are about this process only, since a newcomer makes them at other times than
        the peers already running, and its state comes from the manager's sync instead. The gradients go
        through :meth:`comm_hook`, over the pccl group as it is at each step.

        ``find_unused_parameters`` is True: DDP then keeps the bucket layout it starts with (its default
        rebuilds the buckets in gradient order after a process's first backward, so a newcomer's first
        step would pair other gradients' elements than the running peers' buckets).

        Raises:
            ValueError: ``find_unused_parameters=False`` or ``static_graph=True`` (both rebuild the buckets).
        """
        if not ddp_kwargs.setdefault("find_unused_parameters", True) or ddp_kwargs.get("static_graph"):
            raise ValueError("Manager.wrap: DDP must keep its bucket layout (find_unused_parameters=True, "
                             "static_graph=False) so that a newcomer's buckets match the running peers'")
        ddp = torch.nn.parallel.DistributedDataParallel(module, process_group=_LocalGroup(), **ddp_kwargs)
        self.register_comm_hook(ddp)
        return ddp

    def should_commit(self) -> bool:
        """Whether every peer of the step succeeded: a vote (all-reduce MIN), so all or none commit.

        True: apply the step (``optimizer.step()``); the step counter moves on. False: discard it (the
        next :meth:`start_step` reconfigures the group with whoever is left).
        """
        ok = torch.tensor([0 if self._errors else 1], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        try:
            self.pg.allreduce([ok], opts).wait()
        except (PCCLError, PeerLostError) as exc:
            self._errors.append(exc)
            return False
        if int(ok[0]) != 1:
            return False
        self._step += 1
        return True


class _LocalGroup(dist.ProcessGroup):
    """A process group of this process alone: every collective is complete at once (what a group of one
    computes). It soaks up the collectives DDP makes for itself under a :class:`Manager`."""

    def __init__(self) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]

    def _done(self, call: str, result: Any) -> PCCLWork:
        work = PCCLWork(call, result)
        work.finish(None)
        return work

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PCCLWork:  # type: ignore[override]
        return self._done("all_reduce", tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> PCCLWork:  # type: ignore[override]
        return self._done("broadcast", tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> PCCLWork:
        for out, t in zip(output_tensors, input_tensors, strict=True):
            out[0].copy_(t)
        return self._done("all_gather", output_tensors)

    def barrier(self, opts: Any = None) -> PCCLWork:
        return self._done("barrier", [])

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def getBackendName(self) -> str:
        return "pccl-local"
