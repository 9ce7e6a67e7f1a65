"""SharedModel: a torch model's parameters, buffers and optimizer state as one pccl shared state."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._errors import InvalidArgumentError
from ..peer.shared_state import SharedState, TensorInfo

__all__ = ["SharedModel", "create_optimizer_state"]


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Create the lazily made state of every parameter of ``optimizer`` that has none yet.

    torch optimizers create their state (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``, SGD's
    ``momentum_buffer``) at their first ``step()``. Here one step runs with zero gradients, then the
    parameters are put back bit for bit and every state tensor created by that step is zeroed, which is
    the state of an optimizer that has taken no step (the next real step then behaves as the first).
    State that already exists (restored from a checkpoint, or made eagerly, like Adagrad's) is left as
    it is. Gradients are restored too.

    Returns:
        The tensors created (empty when every parameter already had state).
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)]
    if not params:
        return []
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    # Only the stateless parameters take part: the others get no gradient for the step, so torch skips them.
    others = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if optimizer.state.get(p)]
    try:
        with torch.no_grad():
            for p in params:
                p.grad = torch.zeros_like(p)
        for p, _ in others:
            p.grad = None
        optimizer.step()
    finally:
        with torch.no_grad():
            for p, data, grad in saved:
                p.copy_(data)
                p.grad = grad
        for p, grad in others:
            p.grad = grad
    created: list[torch.Tensor] = []
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                value.zero_()
                created.append(value)
    return created


class SharedModel:
    """The shared state of a model's parameters and buffers and of its optimizer's state.

    Keys are stable names: ``param/<name>``, ``buffer/<name>`` (``model.named_parameters()`` /
    ``named_buffers()``), ``optim/<param name>/<state key>`` and ``extra/<key>``. The optimizer's state
    is created up front (:func:`create_optimizer_state`) without changing the parameters, so every peer
    has the same keys from its first sync. Tensors are referenced, not copied: a sync writes into the
    model and the optimizer in place. The revision (:attr:`revision`) is the number of steps applied;
    the drivers keep it across syncs.

    Args:
        model: the module whose parameters and buffers are shared.
        optimizer: its optimizer (every parameter it updates must belong to ``model``), or None.
        extra: more tensors to share (a learning-rate schedule's state, a data cursor...), by key.
        buffers: share the model's buffers (default True). A buffer that each peer updates from its own
            data (BatchNorm's running statistics) differs between peers: pass ``local_buffers=True``
            to share it only with newcomers (``allow_content_inequality``), or ``buffers=False``.
        local_buffers: see ``buffers``.
        scheduler: the optimizer's learning-rate scheduler (any with an integer ``last_epoch``): its
            position and the groups' learning rates are shared (``sched/last_epoch``, ``sched/lr``),
            so a newcomer continues the group's schedule.

    Raises:
        InvalidArgumentError: an optimizer parameter that is not in ``model``, optimizer state that is not
            a tensor, a non-contiguous tensor or an unsupported dtype.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 extra: Mapping[str, torch.Tensor] | None = None, buffers: bool = True,
                 local_buffers: bool = False, scheduler: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        named = dict(model.named_parameters())
        self._names = {id(p): name for name, p in named.items()}
        infos: list[TensorInfo] = [TensorInfo.from_torch(p.detach(), f"param/{n}") for n, p in named.items()]
        if buffers:
            infos += [TensorInfo.from_torch(b, f"buffer/{n}", allow_content_inequality=local_buffers)
                      for n, b in model.named_buffers()]
        self._optim_refs: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        if optimizer is not None:
            for g in optimizer.param_groups:
                for p in g["params"]:
                    if id(p) not in self._names:
                        raise InvalidArgumentError(
                            f"the optimizer updates a tensor of shape {list(p.shape)} that is not a "
                            "parameter of the model")
            create_optimizer_state(optimizer)
            for g in optimizer.param_groups:
                for p in g["params"]:
                    state = optimizer.state[p]
                    for key in sorted(state):
                        value = state[key]
                        if not isinstance(value, torch.Tensor):
                            raise InvalidArgumentError(
                                f"optimizer state {key!r} of {self._names[id(p)]!r} is a "
                                f"{type(value).__name__}, not a tensor: it cannot be shared")
                        infos.append(TensorInfo.from_torch(value, f"optim/{self._names[id(p)]}/{key}"))
                        self._optim_refs.append((state, key, value))
        for key, t in (extra or {}).items():
            infos.append(TensorInfo.from_torch(t, f"extra/{key}"))
        self._sched_epoch = torch.zeros(1, dtype=torch.int64)
        self._sched_lrs = torch.zeros(0, dtype=torch.float64)
        if scheduler is not None:
            if optimizer is None or getattr(scheduler, "optimizer", None) is not optimizer:
                raise InvalidArgumentError("the scheduler must drive the SharedModel's optimizer")
            if not isinstance(getattr(scheduler, "last_epoch", None), int):
                raise InvalidArgumentError(f"{type(scheduler).__name__} has no integer last_epoch: it "
                                           "cannot be shared")
            assert optimizer is not None
            self._sched_lrs = torch.zeros(len(optimizer.param_groups), dtype=torch.float64)
            infos.append(TensorInfo.from_torch(self._sched_epoch, "sched/last_epoch"))
            infos.append(TensorInfo.from_torch(self._sched_lrs, "sched/lr"))
            self.before_sync()
        self.state = SharedState(infos)

    @property
    def revision(self) -> int:
        """The shared state's revision: the number of steps applied (set by each sync)."""
        return self.state.revision

    @revision.setter
    def revision(self, value: int) -> None:
        self.state.revision = int(value)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every shared tensor by key (references)."""
        return {t.name: t.tensor for t in self.state.tensor_infos}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters with ``requires_grad``, in ``named_parameters()`` order."""
        return [p for _, p in self.model.named_parameters() if p.requires_grad]

    def name_of(self, param: torch.Tensor) -> str:
        """The model's name of ``param``."""
        return self._names[id(param)]

    def keep_state_references(self) -> None:
        """Make sure the optimizer still uses the shared tensors (call after each optimizer step).

        torch's built-in optimizers update their state in place; one that replaced a state tensor
        would silently leave the shared state behind. The new value is copied into the shared tensor and
        the optimizer pointed back at it.
        """
        for state, key, ref in self._optim_refs:
            value = state.get(key)
            if value is not ref:
                if isinstance(value, torch.Tensor):
                    with torch.no_grad():
                        ref.copy_(value)
                state[key] = ref

    def before_sync(self) -> None:
        """Copy the scheduler's position (``last_epoch``) and the groups' learning rates into the shared
        tensors (the drivers call it before each sync; nothing to do without a scheduler)."""
        if self.scheduler is None or self.optimizer is None:
            return
        self._sched_epoch[0] = int(self.scheduler.last_epoch)
        for i, g in enumerate(self.optimizer.param_groups):
            self._sched_lrs[i] = float(g["lr"])

    def after_sync(self) -> None:
        """Put the synced position and learning rates back into the scheduler and the optimizer (a
        newcomer continues the group's schedule; the others are unchanged)."""
        if self.scheduler is None or self.optimizer is None:
            return
        self.scheduler.last_epoch = int(self._sched_epoch[0])
        lrs = [float(v) for v in self._sched_lrs]
        for g, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        self.scheduler._last_lr = lrs

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint: every shared tensor (copied) and the revision (see :meth:`load_state_dict`)."""
        self.before_sync()
        return {"format": "pccl.torch.SharedModel/1", "revision": self.revision,
                "tensors": {k: t.detach().clone() for k, t in self.tensors().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` in place (model, optimizer state, scheduler, extras, revision).

        Raises:
            InvalidArgumentError: not such a checkpoint, or keys, shapes or dtypes that differ.
        """
        if not isinstance(state, Mapping) or state.get("format") != "pccl.torch.SharedModel/1":
            raise InvalidArgumentError("not a pccl.torch SharedModel checkpoint")
        saved: Mapping[str, torch.Tensor] = state["tensors"]
        mine = self.tensors()
        if set(saved) != set(mine):
            missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
            raise InvalidArgumentError(f"checkpoint keys differ: missing {missing}, unexpected {extra}")
        for k, t in mine.items():
            if saved[k].shape != t.shape or saved[k].dtype != t.dtype:
                raise InvalidArgumentError(f"checkpoint tensor {k!r} is {saved[k].dtype} "
                                           f"{list(saved[k].shape)}, the model's {t.dtype} {list(t.shape)}")
        with torch.no_grad():
            for k, t in mine.items():
                t.copy_(saved[k])
        self.revision = int(state["revision"])
        self.after_sync()

    def save(self, path: Any) -> None:
        """``torch.save(self.state_dict(), path)``."""
        torch.save(self.state_dict(), path)

    def load(self, path: Any) -> None:
        """Restore a checkpoint written by :meth:`save`."""
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.state.tensor_infos)

    def __repr__(self) -> str:
        return f"<SharedModel revision={self.revision} tensors={len(self.state.tensor_infos)}>"
