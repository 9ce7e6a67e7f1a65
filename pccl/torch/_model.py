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

    Raises:
        InvalidArgumentError: an optimizer parameter that is not in ``model``, optimizer state that is not
            a tensor, a non-contiguous tensor or an unsupported dtype.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 extra: Mapping[str, torch.Tensor] | None = None, buffers: bool = True,
                 local_buffers: bool = False) -> None:
        self.model = model
        self.optimizer = optimizer
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

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.state.tensor_infos)

    def __repr__(self) -> str:
        return f"<SharedModel revision={self.revision} tensors={len(self.state.tensor_infos)}>"
