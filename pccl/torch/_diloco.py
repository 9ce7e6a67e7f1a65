"""DiLoCo's outer loop, as generators of communication requests (see ``_ops.py``).

Every peer trains its model (the *inner* model) with its inner optimizer; an outer copy of the
parameters (the same on every peer: the shared state, with the outer optimizer's state) is updated
every ``inner_steps`` steps with the average of the pseudo-gradients ``outer - inner``. Synchronous:
the average is applied at once. Delayed (one step late): the all-reduce of round r runs in the
background during round r+1's inner steps and is applied at the end of round r+1; shared state is
synced only while no all-reduce runs, and before a newcomer is admitted the running all-reduce is
finished and applied, so the newcomer receives outer parameters that include it.

``replay_heals`` (issue 35 item 4; docs/concepts.md "Replaying the rounds missed"): the outer all-reduce
sums the pseudo-gradients and a count of contributors (1 from each peer that trained the round, 0 from one
that did not), and every peer divides by the count. A newcomer that heals live then does not make the
members wait for its transfer: while it fetches the snapshot of revision ``r`` it takes part in their
outer all-reduces contributing zeros and keeps each round's average; once it has the snapshot it applies
those outer steps to it (the same optimizer step, from the snapshot's optimizer state: the same bits as
the members) and joins the group's next sync, where nothing moves.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import torch

from .._errors import InvalidArgumentError, InvalidUsageError, PCCLError
from .._types import QuantizationOptions, ReduceOp
from ._buckets import Buckets
from ._model import SharedModel
from ._ops import (
    AllReduce,
    Op,
    PollAllReduce,
    StartAllReduce,
    StartSync,
    SyncPlanned,
    WaitAllReduce,
    WaitAny,
    is_result,
    live_heal_result,
    sync_until_done,
    wait_for_members,
)
from ._train import Backward, Step, StepResult

#: What the members lose when a replaying newcomer whose heal failed closes its driver.
_MEMBERS_LOSE = "the members' round in flight, if any, runs again without it"

__all__ = ["DiLoCoCore", "check_arguments", "default_outer_optimizer"]


def default_outer_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum 0.9 and learning rate 0.7 (the DiLoCo paper's outer optimizer)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclasses.dataclass
class _Membership:
    just_joined: bool
    min_world_size: int
    poll_interval: float
    timeout: float | None = None
    rank: int = 0
    world_size: int = 1


def check_arguments(inner_steps: int, *, delayed: bool, replay_heals: bool) -> None:
    """Refuse DiLoCo's bad schedule arguments (InvalidArgumentError). Pure: the blocking driver calls it
    before it connects, so a bad argument is reported as such, not after (or as) a connection error."""
    if inner_steps < 1:
        raise InvalidArgumentError("inner_steps must be >= 1")
    if replay_heals and delayed:
        raise InvalidArgumentError("replay_heals is built for delayed=False DiLoCo only")


class DiLoCoCore:
    """Per-peer state of DiLoCo and its generators (driver-independent).

    Args:
        model: the inner model (trained locally).
        inner_optimizer: its optimizer (local state, not shared).
        outer_optimizer: builds the outer optimizer from the outer parameters (a list of
            ``nn.Parameter``); default :func:`default_outer_optimizer`.
        inner_steps: inner steps per outer step (H).
        delayed: one-step-delayed outer updates (the all-reduce overlaps the next inner steps).
        quantization: wire compression of the pseudo-gradients (e.g. MIN_MAX to UINT8), or None.
        just_joined, total_outer_steps, bucket_bytes, max_in_flight, min_world_size, poll_interval,
            min_world_size_timeout: as in :class:`~pccl.torch._train.TrainCore` (``total_outer_steps``
            counts outer steps).
        replay_heals: the average over contributors only, and a newcomer's live heal replaying the rounds
            it missed (the module docstring; ``delayed=False`` only).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 outer_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None,
                 inner_steps: int, delayed: bool, quantization: QuantizationOptions | None,
                 just_joined: bool, total_outer_steps: int | None, bucket_bytes: int, max_in_flight: int,
                 min_world_size: int, poll_interval: float,
                 min_world_size_timeout: float | None = None, replay_heals: bool = False) -> None:
        check_arguments(inner_steps, delayed=delayed, replay_heals=replay_heals)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.outer_model = copy.deepcopy(model)
        for p in self.outer_model.parameters():
            p.requires_grad_(True)
        outer_params = list(self.outer_model.parameters())
        self.outer_optimizer = (outer_optimizer or default_outer_optimizer)(outer_params)
        self.shared = SharedModel(self.outer_model, self.outer_optimizer, buffers=False)
        self.members = _Membership(just_joined, min_world_size, poll_interval, min_world_size_timeout)
        self.joined = just_joined
        self.first_sync = True
        self.inner_params = [p for p in model.parameters()]
        self.outer_params = outer_params
        self.buckets = Buckets(self.inner_params, bucket_bytes)
        self.inner_steps = inner_steps
        self.delayed = delayed
        self.quantization = quantization
        self.total_outer_steps = total_outer_steps
        self.max_in_flight = max_in_flight
        self.running: Any = None  # delayed mode: the background all-reduce of the previous round
        self.inner_step = 0  # inner steps done in this round
        self.round_index = 0  # outer rounds before this one (applied or running)
        self.round_started = False
        self.syncs = 0
        self.unreported_rx = 0  # bytes received by syncs since the last StepResult
        self.unreported_tx = 0  # bytes sent by pseudo-gradient reduces since the last StepResult
        # replay_heals: the contributors' count, reduced (SUM, never quantized) with the pseudo-gradients
        self.replay_heals = replay_heals
        device = self.buckets.send[0].device if len(self.buckets) else torch.device("cpu")
        self.count_send = torch.ones(1, dtype=torch.float32, device=device)
        self.count_recv = torch.zeros(1, dtype=torch.float32, device=device)
        self.rounds_observed = 0  # outer all-reduces this peer took part in without contributing
        self.rounds_replayed = 0  # outer rounds this peer replayed after a live heal

    def local_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this peer (the inner optimizer's state: the inner model restarts
        from the outer parameters at every round)."""
        return {"inner_optimizer": self.inner_optimizer.state_dict()}

    def resumed(self, local: dict[str, Any] | None) -> None:
        """After a resume: the inner optimizer's state from the checkpoint, when it has one."""
        if local is not None and "inner_optimizer" in local:
            self.inner_optimizer.load_state_dict(local["inner_optimizer"])

    # -- pieces ---------------------------------------------------------------------------------------

    def _reduce(self) -> AllReduce:
        if self.replay_heals:
            return AllReduce(self.buckets.pairs, ReduceOp.SUM, self.quantization, self.max_in_flight,
                             retry_lost=True, exact=[(self.count_send, self.count_recv)])
        return AllReduce(self.buckets.pairs, ReduceOp.AVG, self.quantization, self.max_in_flight,
                         retry_lost=True)

    def _own_average(self) -> None:
        """Nobody else contributed: this peer's own pseudo-gradient is the average."""
        self.buckets.copy_send_to_recv()
        self.count_recv.fill_(1.0)

    def _averages(self) -> list[torch.Tensor]:
        """The round's averaged pseudo-gradients (new tensors), from the receive buffers: as reduced, or
        with ``replay_heals`` the sums divided by the contributors' count (the same arithmetic on every
        peer: the same bits)."""
        if not self.replay_heals:
            return [g.clone() for g in self.buckets.recv_views()]
        count = float(self.count_recv.item())
        if count < 1:
            raise InvalidUsageError(f"an outer round with {count:g} contributors")
        return [g.div(self.count_recv) for g in self.buckets.recv_views()]

    def _apply(self, averages: list[torch.Tensor] | None = None) -> None:
        """Outer step with the averaged pseudo-gradients (default: those of the receive buffers)."""
        grads = self._averages() if averages is None else averages
        for p, g in zip(self.outer_params, grads, strict=True):
            p.grad = g
        self.outer_optimizer.step()
        self.shared.keep_state_references()
        self.shared.revision += 1

    def _sync(self) -> Generator[Op, Any, None]:
        newcomer = self.first_sync and self.joined
        if newcomer:
            self.shared.revision = 0  # a newcomer takes the group's state, whatever its own revision
        self.first_sync = False
        if newcomer and self.replay_heals:
            info = yield from self._heal_replaying()
        else:
            info = yield from sync_until_done(self.shared.state)
        self.syncs += 1
        self.unreported_rx += info.rx_bytes

    def _heal_replaying(self) -> Generator[Op, Any, Any]:
        """A newcomer's first sync with ``replay_heals``: should it fetch a live heal of revision ``r``, it
        takes part in the members' outer all-reduces meanwhile (zeros, counted as no contributor) and keeps
        each round's average; once it has revision ``r`` (complete and verified) it applies the kept
        rounds' outer steps and votes again, joining the group's sync at the revision it reached."""
        handle = yield StartSync(self.shared.state)
        healing = yield SyncPlanned(handle)
        if healing is None:  # an ordinary sync (or refused): as without replay
            try:
                return (yield WaitAllReduce(handle))
            except PCCLError as exc:
                if not is_result(exc, "RANK_CONNECTION_LOST"):
                    raise
                return (yield from sync_until_done(self.shared.state))  # the group re-forms: again
        kept: list[list[torch.Tensor]] = []
        total = self.total_outer_steps
        for s, _ in self.buckets.pairs:
            s.zero_()
        self.count_send.zero_()
        try:
            while not (yield PollAllReduce(handle)):
                if total is not None and healing + len(kept) >= total:
                    break  # the members' run has no round left: they only sync once more
                running = yield StartAllReduce(self._reduce())
                yield WaitAny((running, handle))
                if handle.finished and handle.error is not None and not running.finished:
                    # The heal failed (the master lost, no donor left) while a round was awaited: give
                    # up now, the round abandoned (at a new master this peer is an ordinary member, and
                    # the members may wait for it in their next vote while it waits for their round).
                    yield from live_heal_result(handle, _MEMBERS_LOSE)
                info = yield WaitAllReduce(running)
                self.unreported_tx += info.tx_bytes
                self.rounds_observed += 1
                kept.append(self._averages())
        finally:
            self.count_send.fill_(1.0)
        # raises if the heal failed: nothing applied
        fetched = yield from live_heal_result(handle, _MEMBERS_LOSE)
        for averages in kept:  # the outer steps of rounds healing .. healing + len(kept) - 1
            self._apply(averages)
        self.rounds_replayed += len(kept)
        joined = yield from sync_until_done(self.shared.state)
        return type(fetched)(tx_bytes=fetched.tx_bytes + joined.tx_bytes,
                             rx_bytes=fetched.rx_bytes + joined.rx_bytes)

    def _reduce_now(self) -> Generator[Op, Any, None]:
        try:
            info = yield self._reduce()
            self.unreported_tx += info.tx_bytes
        except Exception as exc:
            if not is_result(exc, "TOO_FEW_PEERS"):
                raise
            self._own_average()  # nobody left: this peer's own pseudo-gradient

    def _wait_running(self) -> Generator[Op, Any, None]:
        """Wait for the background reduce; its average is then in the receive buffers."""
        handle, self.running = self.running, None
        try:
            info = yield WaitAllReduce(handle)
            self.unreported_tx += info.tx_bytes
        except Exception as exc:
            if not is_result(exc, "TOO_FEW_PEERS"):
                raise
            self._own_average()

    def _reset_inner(self) -> None:
        with torch.no_grad():
            for p, o in zip(self.inner_params, self.outer_params, strict=True):
                p.copy_(o)

    def _settle_running(self) -> Generator[Op, Any, None]:
        """Before admitting: a newcomer must receive the outer state with the running reduce applied."""
        if self.running is not None:
            yield from self._wait_running()
            self._apply()

    # -- the round -----------------------------------------------------------------------------------

    def begin_round(self) -> Generator[Op, Any, bool]:
        """Membership (draining a running reduce before admitting), sync, reset the inner model.

        Returns False once ``total_outer_steps`` outer steps were applied.
        """
        core = self.members
        core.rank, core.world_size = yield from wait_for_members(
            core, core.min_world_size, core.timeout, core.poll_interval, self._settle_running)
        last = self.total_outer_steps is not None and self.shared.revision + 1 >= self.total_outer_steps
        if self.running is not None and last:
            yield from self._wait_running()
            self._apply()
        if self.running is None:
            yield from self._sync()
        if self.total_outer_steps is not None and self.shared.revision >= self.total_outer_steps:
            self._reset_inner()  # the run is over: the model takes the final outer parameters
            return False
        self._reset_inner()
        self.round_started = True
        self.round_index = self.shared.revision + (1 if self.running is not None else 0)
        self.inner_step = 0
        return True

    def end_round(self) -> Generator[Op, Any, None]:
        """Pseudo-gradients, their average (now, or in the background) and the outer step."""
        if not self.delayed:
            self.buckets.pack_difference(self.outer_params)
            if self.members.world_size > 1:
                yield from self._reduce_now()
            else:
                self._own_average()
            self._apply()
        else:
            previous = self.running is not None
            if previous:
                yield from self._wait_running()  # the send buffers are free again
            # outer - inner against the outer parameters this round started from (before applying the
            # previous round's average)
            self.buckets.pack_difference(self.outer_params)
            if previous:
                self._apply()  # the previous round's average, one round late
                yield from self._sync()
            if self.members.world_size > 1:
                self.running = yield StartAllReduce(self._reduce())
            else:
                self._own_average()
                self._apply()
        self.round_started = False

    def step(self, backward: Backward) -> Generator[Op, Any, StepResult | None]:
        """One inner step (a round's first one begins the round, its last one ends it)."""
        if not self.round_started:
            if not (yield from self.begin_round()):
                return None
        core = self.members
        index = self.round_index * self.inner_steps + self.inner_step
        self.inner_optimizer.zero_grad()
        loss = backward(Step(index, core.rank, core.world_size))
        self.inner_optimizer.step()
        self.inner_step += 1
        if self.inner_step == self.inner_steps:
            yield from self.end_round()
        rx, self.unreported_rx = self.unreported_rx, 0
        tx, self.unreported_tx = self.unreported_tx, 0
        return StepResult(index, loss, core.world_size, 1, rx, tx)
