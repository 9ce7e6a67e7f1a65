"""The streaming DiLoCo drivers: :class:`AsyncStreamingDiLoCo` (trio) and :class:`StreamingDiLoCo`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import trio

from .._config import PeerConfig
from .._errors import InvalidArgumentError
from ..peer.communicator import Communicator
from ..transport import Transport
from ._diloco import default_outer_optimizer
from ._drivers import DEFAULT_POLL_INTERVAL, OuterOptimizerFactory, _Blocking, _RunInfo
from ._exec import Executor
from ._ops import drive, drive_async
from ._streaming import CodecSpec, StreamingCore, check_schedule
from ._train import Backward, StepResult

__all__ = ["AsyncStreamingDiLoCo", "StreamingDiLoCo"]


def _core(model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, joined: bool,
          options: dict[str, Any]) -> StreamingCore:
    return StreamingCore(model, inner_optimizer, just_joined=joined,
                         outer_optimizer=options.pop("outer_optimizer") or default_outer_optimizer, **options)


class AsyncStreamingDiLoCo(_RunInfo):
    """Streaming DiLoCo for trio programs: fragments synced on a staggered schedule, overlapped with
    the inner steps, optionally compressed with error feedback (see ``pccl/torch/_streaming.py``).

    Each :meth:`step` is one inner step. Fragment ``p`` of ``P`` is sent at inner step ``p * H // P``
    of every cycle of ``H = inner_steps`` steps and applied ``overlap`` steps later (its outer step,
    then ``inner := mixing * inner + (1 - mixing) * outer``). Newcomers are admitted and the outer
    state synced at a cycle's start, when no fragment is in flight (``sync_every``, ``check_every``;
    with ``"auto"`` the run's final sync comes in its last cycle, where its last round lands).

    Args:
        comm: an accepted async communicator.
        model, inner_optimizer: the inner model and its optimizer (local).
        nursery: where the background exchanges run.
        outer_optimizer: ``factory(outer_params) -> optimizer``; default SGD(lr=0.7, Nesterov 0.9).
        inner_steps: H.
        fragments: a count (contiguous, about equal sizes) or lists of parameter names.
        overlap: inner steps an exchange overlaps, or ``"auto"`` (the default): applied at the first
            inner step that finds it complete, asked without waiting (the cycle's end at the latest).
        mixing: the inner merge factor (default 0.5, the paper's; 0: inner := outer).
        codec: ``None``/``"fp32"``, ``"int8"``, ``"int4"``, ``"topk:F"``, ``"topk:F:int4"``, a codec
            object, ``"auto"``, or one per fragment.
        error_feedback: keep compression residuals (default True).
        budget_bytes: for ``"auto"``: bytes one peer may send per cycle (whole model).
        total_outer_steps: :meth:`step` returns None after this many cycles.
        min_world_size, min_world_size_timeout, poll_interval, just_joined: membership (a
            ``min_world_size_timeout`` in seconds raises TooFewPeersError when exceeded).
        sync_every: ask for newcomers at every ``sync_every``-th cycle only (default 1: every one); with
            an integer ``overlap`` a blocking membership phase and sync there; with ``"auto"`` the vote
            runs in the background, a newcomer is admitted (and the state synced) at the next cycle's
            start, and nothing blocks when nobody waits.
        check_every: with ``"auto"``: a blocking sync of the outer state (repairing a divergence left by
            a round some peers lost) every ``check_every`` cycles too (default 20: a long run checks
            every 20 cycles; None: at admissions and at the run's end only).
        replay_heals: a newcomer that heals live does not make the members wait for its transfer: it
            takes part in their exchanges without contributing while it fetches, replays their rounds and
            joins at their next sync, bit-identical (docs/torch.md); every exchange then carries a
            contributor flag and is averaged over the contributors only: every peer of a run must set it
            alike. Integer ``overlap`` only.

    Raises:
        InvalidArgumentError: bad sizes, ``overlap >= inner_steps``, ``mixing`` outside [0, 1), a
            fragment of mixed dtypes, an unknown codec, ``"auto"`` without a budget.
    """

    def __init__(self, comm: Communicator, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 nursery: trio.Nursery, outer_optimizer: OuterOptimizerFactory | None = None,
                 inner_steps: int = 50, fragments: int | Sequence[Sequence[str]] = 4,
                 overlap: int | Literal["auto"] = "auto", mixing: float = 0.5,
                 codec: CodecSpec | Sequence[CodecSpec] = None,
                 error_feedback: bool = True, budget_bytes: int | None = None,
                 total_outer_steps: int | None = None, min_world_size: int = 1,
                 min_world_size_timeout: float | None = None, poll_interval: float = DEFAULT_POLL_INTERVAL,
                 sync_every: int = 1, check_every: int | None = 20,
                 just_joined: bool | None = None, replay_heals: bool = False) -> None:
        if nursery is None:
            raise InvalidArgumentError("streaming DiLoCo needs a nursery for the background exchanges")
        joined = comm.world_size > 1 if just_joined is None else just_joined
        self.core = _core(model, inner_optimizer, joined, dict(
            outer_optimizer=outer_optimizer, inner_steps=inner_steps, fragments=fragments, overlap=overlap,
            mixing=mixing, codec=codec, error_feedback=error_feedback, budget_bytes=budget_bytes,
            total_outer_steps=total_outer_steps, min_world_size=min_world_size,
            min_world_size_timeout=min_world_size_timeout, poll_interval=poll_interval,
            sync_every=sync_every, check_every=check_every,
            replay_heals=replay_heals))
        self.comm = comm
        self.shared = self.core.shared
        self._members = self.core
        self._execute = Executor(comm, nursery)

    @property
    def outer_model(self) -> torch.nn.Module:
        """The outer parameters (identical on every peer after each cycle's sync)."""
        return self.core.outer_model

    @property
    def cycles(self) -> int:
        """Cycles done (``inner_steps`` inner steps each; the shared state's revision counts syncs)."""
        return self.core.cycle

    async def step(self, backward: Backward) -> StepResult | None:
        """One inner step; None once ``total_outer_steps`` cycles were done."""
        return await drive_async(self.core.step(backward), self._execute)

    def statistics(self) -> dict[str, Any]:
        """Per fragment: size, codec, rounds, rounds lost, bytes sent."""
        return self.core.statistics()


class StreamingDiLoCo(_RunInfo):
    """:class:`AsyncStreamingDiLoCo` for ordinary programs; connects like :class:`~pccl.torch.TrainingRun`
    and runs the exchanges in its background thread. :attr:`network_wait_s` is the time ``step`` spent
    blocked on communication.

    Args:
        master_address, peer_group, config, connect_attempts, transport: as in
            :class:`~pccl.torch.TrainingRun`.
        others: as in :class:`AsyncStreamingDiLoCo`.
    """

    def __init__(self, master_address: str, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 outer_optimizer: OuterOptimizerFactory | None = None, inner_steps: int = 50,
                 fragments: int | Sequence[Sequence[str]] = 4, overlap: int | Literal["auto"] = "auto",
                 mixing: float = 0.5,
                 codec: CodecSpec | Sequence[CodecSpec] = None, error_feedback: bool = True,
                 budget_bytes: int | None = None, total_outer_steps: int | None = None,
                 min_world_size: int = 1, min_world_size_timeout: float | None = None,
                 poll_interval: float = DEFAULT_POLL_INTERVAL, sync_every: int = 1,
                 check_every: int | None = 20, peer_group: int = 0,
                 config: PeerConfig | None = None, connect_attempts: int = 10,
                 just_joined: bool | None = None, transport: Transport | None = None,
                 replay_heals: bool = False) -> None:
        # the schedule's arguments refused before connecting (the core checks them again)
        check_schedule(inner_steps, min_world_size, sync_every, check_every, mixing, overlap,
                       replay_heals=replay_heals)
        self._blocking = _Blocking(master_address, peer_group=peer_group, config=config,
                                   connect_attempts=connect_attempts, transport=transport)
        try:
            comm = self._blocking.comm
            joined = comm.world_size > 1 if just_joined is None else just_joined
            self.core = _core(model, inner_optimizer, joined, dict(
                outer_optimizer=outer_optimizer, inner_steps=inner_steps, fragments=fragments,
                overlap=overlap, mixing=mixing, codec=codec, error_feedback=error_feedback,
                budget_bytes=budget_bytes, total_outer_steps=total_outer_steps,
                min_world_size=min_world_size, min_world_size_timeout=min_world_size_timeout,
                poll_interval=poll_interval, sync_every=sync_every, check_every=check_every,
                replay_heals=replay_heals))
        except BaseException:
            self._blocking.close()
            raise
        self.shared = self.core.shared
        self._members = self.core

    @property
    def outer_model(self) -> torch.nn.Module:
        """The outer parameters."""
        return self.core.outer_model

    @property
    def cycles(self) -> int:
        """Cycles done (``inner_steps`` inner steps each; the shared state's revision counts syncs)."""
        return self.core.cycle

    def step(self, backward: Backward) -> StepResult | None:
        """One inner step; None once ``total_outer_steps`` cycles were done."""
        return drive(self.core.step(backward), self._blocking.execute)

    def statistics(self) -> dict[str, Any]:
        """Per fragment: size, codec, rounds, rounds lost, bytes sent."""
        return self.core.statistics()

    def close(self) -> None:
        """Leave the run (exchanges in flight are abandoned) and stop the background thread."""
        self._blocking.close()

    def __enter__(self) -> StreamingDiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
