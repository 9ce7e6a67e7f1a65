"""Streaming DiLoCo (Douillard et al., 2025, arXiv 2502.12996), as a generator of communication requests.

The model's parameters are split into ``P`` fragments. Every fragment is synced once per *cycle* of
``H`` inner steps, fragment ``p`` at inner step ``p * H // P`` of the cycle (staggered, so the
traffic is spread over the cycle instead of arriving all at once); with ``overlap="auto"``, in the run's
last cycle at ``p * H // (P + 1)``, so that the last fragment's exchange has ``2 H / (P + 1)`` steps
instead of ``H / P`` to arrive before the run's end, which must wait for it (below):

1. its pseudo-gradient ``outer_p - inner_p`` is measured and its average over the peers is launched
   in the background on its own tag: a ring all-reduce; with a codec and 2 peers, an all-gather of
   both payloads, decoded and averaged in rank order on both; with a codec and 3 or more peers, the
   two-stage exchange (an all-to-all of chunk payloads, each chunk's owner averaging its chunk in rank
   order and encoding the result again with its chunk residual, then an all-gather of the encoded
   chunks, launched at the first step that finds the all-to-all done and ``overlap // 2`` steps after
   the launch at the latest): a ring all-reduce's ``2 (n - 1) / n`` of the compressed size;
2. ``overlap`` inner steps later (at the end of the cycle at the latest) the average is waited for,
   the outer optimizer steps the fragment's outer parameters with it, and the fragment's inner
   parameters are merged: ``inner_p := mixing * inner_p + (1 - mixing) * outer_p``. With
   ``overlap="auto"`` (the drivers' default) there is no fixed count: the exchange is asked at every
   inner step after its send, without waiting, whether it is complete (its second stage goes out at
   the first step that finds the first one done), and is applied at the first step that finds it
   done. It is waited for only where it must be applied: at its fragment's next send (one cycle
   later: an exchange still on the wire at a cycle's end is carried into the next cycle), and at a
   cycle's start before newcomers are admitted and before a sync (the run's end; a ``check_every``
   cycle). Except the last fragment's round of a cycle that ends at a ``check_every`` sync within the
   run: no peer applies it before that sync (it is not even polled), so every peer syncs the same
   outer state without waiting for it; it is applied after the sync, when found done (before it is
   admitted when a newcomer is pending: then it is waited for first). So the
   overlap is as long as the exchange takes on this link, in whatever number of inner steps that is,
   up to a whole cycle. Every peer still applies the same averages to the same outer parameters (a
   fragment's outer step touches its own parameters only, whenever it comes), so the outer state is
   identical on every peer wherever nothing is in flight (as at every sync); but the inner
   parameters, and with them the next pseudo-gradients, depend on the step at which the merge came,
   so a run is not repeatable to the digit as it is with a fixed ``overlap``, and a checkpoint saved
   at another cycle's end leaves out the rounds still in flight (resumed, they are lost rounds, below).

With ``overlap=0`` and ``mixing=0`` each fragment is synchronous DiLoCo. One fragment is in flight per
tag, and where newcomers are admitted and the shared state (outer parameters, outer optimizer state,
the cycle count) is synced none is (the shared state's revision counts these syncs): with an integer
overlap at every membership cycle's start (every ``sync_every``-th, after a blocking vote); with
``"auto"`` the membership vote goes out in the background at such a cycle's start (and at the run's
last) and inner steps go on; the next cycle's start reads the answer, the same on every peer (the
master's): someone waits -> admitted and synced there; nobody -> no sync (the outer state is
identical by construction), unless ``check_every`` asks for one. The run's first cycle and its end
always sync; with ``"auto"`` the final sync comes in the last cycle, at the step where its last round
lands (:meth:`StreamingCore._final_due`), and the steps left run without communication.

When a fragment's exchange fails (a peer lost in it, the group changed size under an all-gather) only
that fragment's round is lost: its outer parameters are not updated this cycle (its inner ones keep
training, and its next pseudo-gradient measures the whole distance again); the others go on. Should one
peer have applied a round that another lost, the next sync gives every peer the same outer state again
(with ``"auto"``: the next admission, ``check_every`` sync or the run's end).

Codecs with error feedback (``_codec.py``): a peer's residual (what its compressed contribution
lost) is added to its next pseudo-gradient of that fragment, and in the two-stage exchange the chunk
owner's residual (what encoding the chunk's average lost) to its next average of that chunk; a lost
round keeps the previous residuals.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Literal

import torch

from .._errors import InvalidArgumentError
from .._types import ReduceOp
from ._codec import (
    ChunkedCodec,
    Codec,
    DeflateCodec,
    average_payloads,
)
from ._fragments import CodecSpec, Fragment, build_fragments, choose_codecs, split_fragments
from ._model import SharedModel
from ._ops import (
    AllGather,
    AllReduce,
    AllToAll,
    Members,
    Op,
    PollAllReduce,
    StartAllReduce,
    StartPeersPending,
    WaitAllReduce,
    is_result,
    sync_until_done,
    wait_for_members,
)
from ._stream_contrib import contributors_average, counted_average, flagged
from ._stream_replay import heal_replaying
from ._train import Backward, Step, StepResult

__all__ = ["CodecSpec", "Fragment", "StreamingCore", "check_schedule", "split_fragments"]


def _overlap_steps(overlap: object, inner_steps: int) -> tuple[bool, int]:
    """``(auto, steps)`` of an ``overlap`` argument: ``"auto"`` (applied when found done; ``steps`` then
    only bounds it, the cycle's last) or a fixed count in ``[0, inner_steps)``."""
    if overlap == "auto":
        return True, inner_steps - 1
    if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < inner_steps:
        raise InvalidArgumentError(f'overlap must be "auto" or an int in [0, inner_steps), not {overlap!r}')
    return False, overlap


def check_schedule(inner_steps: int, min_world_size: int, sync_every: int, check_every: int | None,
                   mixing: float, overlap: object, *, replay_heals: bool) -> tuple[bool, int]:
    """Refuse a streaming run's bad schedule arguments (InvalidArgumentError, saying which); else
    ``(auto, steps)`` of its ``overlap`` (:func:`_overlap_steps`). Pure: the blocking driver calls it
    before it connects, so a bad argument is reported as such, not after (or as) a connection error."""
    if inner_steps < 1 or min_world_size < 1 or sync_every < 1:
        raise InvalidArgumentError("inner_steps, min_world_size and sync_every must be >= 1")
    if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, int)
                                    or check_every < 1):
        raise InvalidArgumentError(f"check_every must be None or an int >= 1, not {check_every!r}")
    auto_overlap, steps = _overlap_steps(overlap, inner_steps)
    if replay_heals and auto_overlap:
        raise InvalidArgumentError(
            'replay_heals needs an integer overlap: with overlap="auto" the members sync only where a '
            "peer is admitted, every check_every cycles and in the run's last cycle, so a replaying "
            "newcomer could join only there")
    if not 0.0 <= mixing < 1.0:
        raise InvalidArgumentError("mixing must be in [0, 1)")
    return auto_overlap, steps


class StreamingCore:
    """Per-peer state of streaming DiLoCo and its step generator (driver-independent; see the module).

    Args:
        model: the inner model (trained locally; its buffers stay local).
        inner_optimizer: its optimizer (local state, kept across cycles).
        outer_optimizer: ``factory(outer_params) -> optimizer`` over every outer parameter (one
            optimizer; a fragment's step gives gradients to that fragment's parameters only).
        inner_steps: H, the cycle length (each fragment is synced once per cycle).
        fragments: a count, or lists of parameter names (see :func:`split_fragments`).
        overlap: inner steps an exchange overlaps before it is applied (0: applied at once), or
            ``"auto"``: applied at the first inner step after its send that finds it complete (asked
            without waiting), before its fragment's next send or a sync at the latest (the last
            fragment's round of a cycle before a ``check_every`` sync: after that sync);
            the run's last cycle then sends its fragments earlier (see the module).
        mixing: the merge factor ``alpha`` of the inner parameters (0: they take the outer ones).
        codec: one spec for every fragment or one per fragment: None / ``"fp32"``, ``"int8"``,
            ``"int4"``, ``"topk:F"``, ``"topk:F:int4"``, a codec object, or ``"auto"`` (the least lossy
            one that fits ``budget_bytes``, chosen at each cycle's start for the group's size).
        error_feedback: keep each peer's compression residual (default True).
        budget_bytes: for ``"auto"``: the bytes one peer may send per cycle for the whole model,
            shared among the fragments in proportion to their sizes.
        total_outer_steps: stop after this many cycles (None: never).
        just_joined, min_world_size, poll_interval: as in :class:`~pccl.torch._train.TrainCore`.
        min_world_size_timeout: give up (TooFewPeersError) after waiting this long in total, counted
            as ``poll_interval`` per wait, for ``min_world_size`` peers at one cycle start (None: wait
            for ever).
        sync_every: ask the master for newcomers at every ``sync_every``-th cycle's start only (cycles
            whose count is a multiple of it). With an integer ``overlap`` that is a membership phase
            (a vote, then the admission if anyone waits) and a sync of the outer state, each costing
            control-plane round trips and the peers' skew (every peer waits there for the slowest).
            With ``"auto"`` the vote goes out in the background and inner steps go on; its answer is
            acted on at the next cycle's start, by every peer alike: a newcomer waits -> every exchange
            in flight is applied, the newcomer admitted and the state synced; nobody waits -> nothing
            (no sync: the outer state is identical by construction). The run's first and last cycles
            always sync.
        base_tag: fragment ``p`` uses tag ``base_tag + p``.
        check_every: with ``"auto"``: also sync the outer state at every ``check_every``-th cycle's start
            (a blocking membership phase and sync, as with an integer overlap), which repairs a divergence
            left by a round some peers applied and others lost (a peer lost in an exchange); default 20
            (a barrier every 20 cycles bounds how long a divergence lasts); None: only at admissions and
            the run's end.
        replay_heals: every exchange carries a contributor flag and is averaged over the contributors
            only (``_stream_contrib.py``; every peer of a run sets it alike), and a newcomer that heals
            live takes part in the members' exchanges without contributing while it fetches, then replays
            them and joins at the members' next sync (``_stream_replay.py``): the members do not wait for
            its transfer. Integer ``overlap`` only.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 outer_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 inner_steps: int, fragments: int | Sequence[Sequence[str]], overlap: int | Literal["auto"],
                 mixing: float, codec: CodecSpec | Sequence[CodecSpec], error_feedback: bool,
                 budget_bytes: int | None,
                 total_outer_steps: int | None, just_joined: bool, min_world_size: int,
                 poll_interval: float, min_world_size_timeout: float | None = None,
                 sync_every: int = 1, base_tag: int = 0, check_every: int | None = 20,
                 replay_heals: bool = False) -> None:
        import copy

        self.auto_overlap, steps = check_schedule(inner_steps, min_world_size, sync_every, check_every,
                                                  mixing, overlap, replay_heals=replay_heals)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.outer_model = copy.deepcopy(model)
        for p in self.outer_model.parameters():
            p.requires_grad_(True)
        self.outer_params = list(self.outer_model.parameters())
        self.outer_optimizer = outer_optimizer(self.outer_params)
        # cycles done: shared, so a newcomer learns where the run stands (the revision counts syncs)
        self.cycle_tensor = torch.zeros(1, dtype=torch.int64)
        self.shared = SharedModel(self.outer_model, self.outer_optimizer, buffers=False,
                                  extra={"stream/cycle": self.cycle_tensor})
        self.contributors = replay_heals
        self.replay_queue: list[tuple[Fragment, torch.Tensor]] | None = None  # a replaying newcomer's rounds
        self.replay_point = (0, 0)  # its (admission cycle, join cycle)
        self.rounds_replayed = 0
        self.contributing = True  # this peer's exchanges contribute (with ``contributors``: flagged 1)
        self._contributed: dict[int, bool] = {}  # fragment -> whether its round in flight contributes
        # the uncompressed exchanges' buffers with ``contributors``: the pseudo-gradient, then the flag
        self.fragments, self._wires = build_fragments(
            list(model.named_parameters()), dict(self.outer_model.named_parameters()), fragments, codec,
            inner_steps=inner_steps, error_feedback=error_feedback, flagged=self.contributors)
        if any(f.spec == "auto" for f in self.fragments) and budget_bytes is None:
            raise InvalidArgumentError('codec "auto" needs budget_bytes')
        self.error_feedback = error_feedback
        self.budget_bytes = budget_bytes
        self.inner_steps = inner_steps
        self.overlap: int = steps
        self.mixing = mixing
        self.total_outer_steps = total_outer_steps
        self.just_joined = just_joined
        self.joined = just_joined
        self.min_world_size = min_world_size
        self.min_world_size_timeout = min_world_size_timeout
        self.poll_interval = poll_interval
        self.sync_every = sync_every
        self.check_every = check_every
        self._vote: Any = None  # the membership vote in the background ("auto"), answered by the next cycle
        self._final_synced = False  # "auto": the run's final sync done in its last cycle (_final_due)
        self.base_tag = base_tag
        self._last_offset = max(f.offset for f in self.fragments)
        self.rank = 0
        self.world_size = 1
        self.inner_step = 0  # inner steps done in this cycle
        self.fresh = True  # the inner model has not started from the outer parameters yet
        self.restored = False  # resumed with this peer's local state (inner model, residuals)
        self.syncs = 0
        self.unreported_rx = 0
        self.drained_tx = 0  # bytes of exchanges applied in a membership phase, for the next StepResult

    # -- checkpoints ---------------------------------------------------------------------------------

    def local_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this peer at a cycle's end: the inner model (streaming merges it
        with the outer one, so it is not a function of the outer state), the inner optimizer's state
        and the compression residuals."""
        return {"inner_model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "residuals": {str(f.index): f.feedback.residual.clone() for f in self.fragments
                              if f.feedback is not None},
                "chunk_residuals": {str(f.index): (f.server_residual.clone(), torch.tensor(f.server_key))
                                    for f in self.fragments if f.server_residual is not None}}

    def resumed(self, local: dict[str, Any] | None) -> None:
        """After a resume: the inner model restarts from the loaded outer parameters, or, with the
        checkpoint's local state, from its own inner model, optimizer and residuals, unless the first
        sync brings another state (a peer restarted into a running group: its local state is stale)."""
        self.fresh = True
        self.restored = local is not None
        if local is None:
            return
        self.model.load_state_dict(local["inner_model"])
        self.inner_optimizer.load_state_dict(local["inner_optimizer"])
        for f in self.fragments:
            if f.feedback is not None and str(f.index) in local["residuals"]:
                f.feedback.residual = local["residuals"][str(f.index)].clone()
            if str(f.index) in local["chunk_residuals"]:
                residual, key = local["chunk_residuals"][str(f.index)]
                f.server_residual = residual.clone()
                f.server_key = (int(key[0]), int(key[1]))

    def _forget_local(self) -> None:
        for f in self.fragments:
            if f.feedback is not None:
                f.feedback.residual.zero_()
            f.server_residual = None

    # -- the cycle's start: membership, sync ---------------------------------------------------------

    def _membership(self, answered: bool | None = None) -> Generator[Op, Any, None]:
        # the exchanges carried into this cycle stay on the wire while the group asks the master for
        # newcomers; drained before any is admitted (``answered``: the answer of a vote taken in the
        # background)
        self.rank, self.world_size = yield from wait_for_members(
            self, self.min_world_size, self.min_world_size_timeout, self.poll_interval, self._drain,
            answered=answered)

    @property
    def cycle(self) -> int:
        """Cycles done (H inner steps each)."""
        return int(self.cycle_tensor[0])

    def _checks(self, cycle: int) -> bool:
        """Whether ``cycle``'s start is a mid-run sync of the outer state whoever is admitted: with an
        integer overlap every membership point (every ``sync_every``-th cycle); with ``"auto"`` every
        ``check_every``-th cycle (None: none; newcomers are then admitted, and the state synced, at the
        start of the cycle after a membership point's vote said one waits)."""
        if not self.auto_overlap:
            return cycle % self.sync_every == 0
        return self.check_every is not None and cycle % self.check_every == 0

    def _answer(self) -> Generator[Op, Any, bool | None]:
        """The answer of the membership vote taken in the background since the last membership point
        (waited for if it has not come yet: a vote is one master round trip, a cycle is longer); None when
        it failed (every member sees that: the membership phase then votes again, blocking)."""
        handle, self._vote = self._vote, None
        try:
            return bool((yield WaitAllReduce(handle)))
        except Exception as exc:
            if not is_result(exc, "UPDATE_TOPOLOGY_FAILED", "RANK_CONNECTION_LOST"):
                raise
            return None

    def _final_due(self, s: int) -> bool:
        """Whether the run's final sync comes at inner step ``s`` of its last cycle (``"auto"``): every
        fragment was sent in this cycle and its round applied (or lost). The outer state is final then
        (no round is sent after it), so the sync is there and not at the run's end: the inner steps left
        change nothing the run keeps (the model takes the outer parameters at the end) and run without
        communication, so no peer waits for the slowest to finish them. The last round lands at about
        the same moment on every peer (it is complete when the slowest peer has sent), so the peers meet
        at this sync with little skew. A round still on the wire at the cycle's end is waited for
        there, and the sync is at the run's end."""
        return (self.auto_overlap and not self._final_synced and self._last_cycle()
                and all(self._send_step(f) <= s and not f.in_flight for f in self.fragments))

    def _final_sync(self) -> Generator[Op, Any, None]:
        """The run's final membership and sync (see :meth:`_final_due`): the last cycle's vote read (a
        newcomer waiting is admitted), the state synced with the cycle count at the run's end, so a
        newcomer admitted here ends at once with the final outer state."""
        answered = (yield from self._answer()) if self._vote is not None else None
        yield from self._membership(answered)
        assert self.total_outer_steps is not None
        self.cycle_tensor[0] = self.total_outer_steps  # the state synced says: the run is over
        self.shared.revision += 1
        try:
            info = yield from sync_until_done(self.shared.state)
        finally:
            self.cycle_tensor[0] = self.total_outer_steps - 1  # this peer's own last steps go on
        self._final_synced = True
        self.syncs += 1
        self.unreported_rx += info.rx_bytes

    def _begin_cycle(self) -> Generator[Op, Any, bool]:
        over = self.total_outer_steps is not None and self.cycle >= self.total_outer_steps
        if over and self._final_synced:
            self._inner_from_outer()  # synced in the last cycle (_final_due): the model takes the outer state
            return False
        answered: bool | None = None
        voted = self._vote is not None
        if voted:
            answered = yield from self._answer()
        if not self.fresh and not over and not self._checks(self.cycle):
            # no sync here unless a newcomer is admitted (the same decision on every peer: the master's
            # answer); the run's end always syncs
            if voted and answered is False:
                self.rank, self.world_size = yield Members()
                if self.world_size < self.min_world_size:
                    answered = None  # too few peers: the membership phase waits for more, then syncs
            if not voted or answered is False:
                if self._votes_now():
                    self._vote = yield StartPeersPending()
                return True
        yield from self._membership(answered)  # (a newcomer pending: every exchange applied before admission)
        yield from self._drain(deferred=False)  # every exchange a peer may have applied: before the sync
        if self.fresh and self.joined:
            self.shared.revision = 0  # a newcomer takes the group's state, whatever its own revision
        elif not self.fresh:
            self.shared.revision += 1  # each sync advances the revision by one
        if self.contributors and self.fresh and self.joined:
            info = yield from heal_replaying(self)  # live, replaying the rounds it missed, or ordinary
        else:
            info = yield from sync_until_done(self.shared.state)
        for f in self.fragments:
            f.deferred = False  # synced: applied when found done from here on
        self.syncs += 1
        self.unreported_rx += info.rx_bytes
        if self.total_outer_steps is not None and self.cycle >= self.total_outer_steps:
            self._inner_from_outer()  # the run is over: the model takes the final outer parameters
            return False
        if self.fresh or info.rx_bytes:
            # a newcomer (or a peer whose outer state was repaired) starts from the group's parameters;
            # a run restarted from its checkpoints (the sync brought nothing) keeps the inner state
            if info.rx_bytes or not self.restored:
                if self.restored:
                    self._forget_local()
                self._inner_from_outer()
            self.fresh = self.restored = False
        choose_codecs(self.fragments, self.budget_bytes, self.world_size, self.error_feedback)
        return True

    def _votes_now(self) -> bool:
        """Whether this cycle's start (not the run's first, no sync here) sends the membership vote into
        the background, acted on at the next cycle's start: with ``"auto"``, at every ``sync_every``-th
        cycle and at the run's last (whose answer the run's end admits before its sync)."""
        return self.auto_overlap and (self.cycle % self.sync_every == 0 or self._last_cycle())

    def _last_cycle(self) -> bool:
        """Whether the cycle running now is the run's last."""
        return self.total_outer_steps is not None and self.cycle + 1 >= self.total_outer_steps

    def _send_step(self, f: Fragment) -> int:
        """The inner step of this cycle at which ``f`` is sent: ``p * H // P``; with ``"auto"``, in the run's
        last cycle, ``p * H // (P + 1)``: the last fragment's exchange gets ``2 H / (P + 1)`` steps instead
        of ``H / P`` to arrive before the run's end, which waits for it."""
        return f.early_offset if self.auto_overlap and self._last_cycle() else f.offset

    def _defers(self, f: Fragment) -> bool:
        """Whether the round of ``f`` sent now is *deferred*: with ``"auto"``, the last fragment's round of
        a cycle that ends at a ``check_every`` sync of the run (not its end: :meth:`_checks`) is applied
        by no peer before that sync (so every peer syncs the same outer state without waiting for it),
        unless a newcomer is pending there (then it is drained before the admission); after the sync,
        when found done."""
        return (self.auto_overlap and f.offset == self._last_offset and self._checks(self.cycle + 1)
                and not self._last_cycle())

    def _inner_from_outer(self) -> None:
        with torch.no_grad():
            for f in self.fragments:
                for p, o in zip(f.inner, f.outer, strict=True):
                    p.copy_(o)

    # -- one fragment's exchange ---------------------------------------------------------------------

    def _pseudo_gradient(self, f: Fragment) -> torch.Tensor:
        self._contributed[f.index] = self.contributing
        if not self.contributing:  # taking part without contributing: zeros (ignored by the averagers)
            return f.send.zero_()
        with torch.no_grad():
            off = 0
            for p, o in zip(f.inner, f.outer, strict=True):
                n = p.numel()
                torch.sub(o.reshape(-1), p.reshape(-1), out=f.send[off:off + n])
                off += n
        return f.send

    def _launch(self, f: Fragment) -> Generator[Op, Any, None]:
        f.rank, f.world = yield Members()
        delta = self._pseudo_gradient(f)
        if f.world < 2:
            if self._contributed[f.index]:  # (a non-contributor alone: no round)
                f.local = delta.clone()  # alone: nothing to average, nothing to compress
            return
        if f.codec is None:
            reduce = AllReduce([(f.send, f.recv)], ReduceOp.AVG, None, 1, base_tag=self.base_tag + f.index)
            if self.contributors:  # summed with the contributor flag, divided by the flags' sum
                send, recv = self._wires[f.index]
                send[f.numel] = 1.0 if self._contributed[f.index] else 0.0
                reduce = AllReduce([(send, recv)], ReduceOp.SUM, None, 1, base_tag=self.base_tag + f.index)
            f.handle = yield StartAllReduce(reduce)
            return
        f.handle = yield StartAllReduce(self._compressed(f))

    def _compressed(self, f: Fragment) -> AllGather | AllToAll:
        """Encode ``f``'s pseudo-gradient (``f.send``) for a group of ``f.world`` peers and return the
        exchange's first collective: with 2 peers an all-gather of whole payloads (one payload each
        way), with 3 or more the two-stage exchange's all-to-all (its ``2 (n - 1)`` chunk payloads in
        all are what a ring all-reduce of the codes would send)."""
        assert f.codec is not None
        tag = self.base_tag + f.index
        codec: Codec = f.codec if f.world == 2 else ChunkedCodec(f.codec, f.world)
        contributes = self._contributed.get(f.index, True)
        if f.feedback is not None and contributes:
            f.feedback.codec = codec
            f.payload, _ = f.feedback.encode(f.send)
        else:  # (a non-contributor: zeros, without a residual of its own)
            f.payload = codec.encode(f.send)
        if self.contributors:
            f.payload = flagged(f.payload, 1 if f.world == 2 else f.world, contributes)
        if f.world == 2:
            f.stage = 0
            f.gathered = torch.empty(2 * f.payload.numel(), dtype=torch.uint8)
            return AllGather(f.payload, f.gathered, tag=tag)
        f.stage = 1
        f.gathered = torch.empty(f.payload.numel(), dtype=torch.uint8)
        return AllToAll(f.payload, f.gathered, tag=tag)

    def _wait(self, f: Fragment) -> Generator[Op, Any, Any]:
        """Wait for ``f``'s collective in flight: its info, or None when the round is lost (a peer lost,
        or the group changed size under a collective sized by it): nothing of it is applied, the
        residuals stay as they were. A compressed exchange's first collective refused because the group
        changed size before it began (nothing was received) starts again, now, for the peers left, with
        an integer overlap, where every peer waits for its rounds in the same order; with ``"auto"`` it
        is lost: the order in which a peer finds its rounds refused depends on timing, and two peers
        starting different fragments' rounds again first, each waiting for its own, would wait for each
        other for ever (the master's deadlock check ends such a run)."""
        handle, f.handle = f.handle, None
        op: Op = WaitAllReduce(handle)
        while True:
            try:
                return (yield op)
            except Exception as exc:
                lost = is_result(exc, "RANK_CONNECTION_LOST", "TOO_FEW_PEERS")
                if not lost and is_result(exc, "INVALID_ARGUMENT") and f.codec is not None:
                    rank, now = yield Members()
                    if now != f.world and now >= 2 and f.stage != 2 and not self.auto_overlap:
                        if f.feedback is not None:
                            f.feedback.discard()
                        f.rank, f.world = rank, now
                        op = self._compressed(f)
                        continue
                    lost = now != f.world
                if not lost:
                    raise
            break
        self._lose(f)
        return None

    def _lose(self, f: Fragment) -> None:
        """``f``'s round is lost: nothing of it is applied, the residuals stay as they were."""
        f.lost += 1
        if f.feedback is not None:
            f.feedback.discard()
        f.server_proposed = None
        f.payload = f.gathered = None
        f.stage = f.round_tx = 0

    def _second_stage(self, f: Fragment) -> Generator[Op, Any, bool]:
        """The two-stage exchange's middle: wait for the all-to-all (this peer now holds every peer's
        payload of chunk ``rank``), average them in rank order, add this peer's chunk residual,
        compress the result once more and launch the all-gather of the compressed chunks. False
        when the round was lost."""
        assert f.codec is not None
        info = yield from self._wait(f)
        if info is None:
            return False
        if f.stage == 0:  # restarted for 2 peers, as one all-gather: the exchange is complete
            f.done = info
            return True
        assert f.gathered is not None
        f.round_tx = int(info.tx_bytes)
        c = ChunkedCodec(f.codec, f.world).chunk(f.numel)
        if self.contributors:
            counted = contributors_average(f.codec, f.gathered, f.world, c)
            if counted is None:  # nobody contributed (every peer sees the same flags): nothing to apply
                self._lose(f)
                return False
            w = counted
        else:
            w = average_payloads(f.codec, f.gathered, f.world, c)
        if self.error_feedback:
            if f.server_key != (f.world, f.rank) or f.server_residual is None:
                # a new chunking (the group changed): the old chunk's residual, at most half a
                # quantization step of the average per element, is dropped
                f.server_residual = torch.zeros(c, dtype=torch.float32)
                f.server_key = (f.world, f.rank)
            w = w + f.server_residual
        f.payload = f.codec.encode(w)
        if self.error_feedback:
            f.server_proposed = w - f.codec.decode(f.payload, c)
        f.gathered = torch.empty(f.world * f.payload.numel(), dtype=torch.uint8)
        f.stage = 2
        f.handle = yield StartAllReduce(AllGather(f.payload, f.gathered, tag=self.base_tag + f.index))
        return True

    def _stage_due(self, f: Fragment, s: int, index: int) -> Generator[Op, Any, bool]:
        """Whether the two-stage exchange of ``f`` moves to its second stage at inner step ``s``: as soon
        as its all-to-all has finished (asked without waiting, at every step after the launch), and at
        ``overlap // 2`` steps after the launch at the latest (waiting for it then). The second stage
        depends only on the all-to-all's bytes and the chunk residual, so when each peer moves on does
        not change any result; moving on early gives the all-gather the rest of the overlap."""
        if self.auto_overlap:  # as soon as it is done; the apply step waits for it otherwise
            return index > f.sent_at and bool((yield PollAllReduce(f.handle)))
        last = f.offset + self.overlap // 2
        if s == last:
            return True
        if f.offset < s < last:
            return bool((yield PollAllReduce(f.handle)))
        return False

    def _apply_due(self, f: Fragment, s: int, index: int) -> Generator[Op, Any, bool]:
        """Whether ``f``'s exchange in flight is applied at inner step ``s`` (``index`` of the run):
        ``overlap`` steps after its send; with ``"auto"``, at the first step after the send that finds
        its last stage done."""
        if not self.auto_overlap:
            return f.offset + self.overlap == s
        if index <= f.sent_at or f.stage == 1 or f.deferred:
            return False
        if f.local is not None or f.done is not None:
            return True
        return bool((yield PollAllReduce(f.handle)))

    def _drain(self, deferred: bool = True) -> Generator[Op, Any, None]:
        """Wait for and apply every exchange still in flight (carried over a cycle's end with
        ``"auto"``), the deferred ones too unless ``deferred`` is False: before newcomers are admitted
        (all) and before the sync (all but the deferred: no peer applied those)."""
        index = self.cycle * self.inner_steps
        for f in self.fragments:
            if f.in_flight and (deferred or not f.deferred):
                self.drained_tx += yield from self._finish_at(f, index)

    def _finish_at(self, f: Fragment, index: int) -> Generator[Op, Any, int]:
        """:meth:`_finish` at the run's inner step ``index`` (counted in ``mean_overlap``)."""
        f.overlap_steps += index - f.sent_at
        f.deferred = False
        return (yield from self._finish(f))

    def _finish(self, f: Fragment) -> Generator[Op, Any, int]:
        """Wait for ``f``'s exchange and apply it; returns the bytes it sent (0 when the round is lost)."""
        f.rounds += 1
        if f.local is not None:
            avg, f.local = f.local, None
            self._apply(f, avg)
            return 0
        if f.stage == 1 and not (yield from self._second_stage(f)):
            return 0
        info, f.done = f.done, None
        if info is None:
            info = yield from self._wait(f)
        if info is None:
            return 0
        average: torch.Tensor | None
        if f.codec is None:
            average = f.recv if not self.contributors else counted_average(self._wires[f.index][1], f.numel)
        else:
            assert f.gathered is not None
            if f.stage == 2:
                average = ChunkedCodec(f.codec, f.world).decode(f.gathered, f.numel)
                if f.server_proposed is not None:
                    f.server_residual, f.server_proposed = f.server_proposed, None
            elif self.contributors:
                average = contributors_average(f.codec, f.gathered, f.world, f.numel)
            else:
                average = average_payloads(f.codec, f.gathered, f.world, f.numel)
            if f.feedback is not None and average is not None:
                f.feedback.commit()
            f.payload = f.gathered = None
        if average is None:  # nobody contributed (every peer sees the same flags): nothing to apply
            self._lose(f)
            return 0
        self._apply(f, average)
        tx = f.round_tx + int(info.tx_bytes)
        f.stage = f.round_tx = 0
        f.tx_bytes += tx
        return tx

    def _apply(self, f: Fragment, avg: torch.Tensor) -> None:
        """The outer step of ``f``'s parameters with the average ``avg``, then the inner merge (a replaying
        newcomer still fetching keeps it in :attr:`replay_queue` instead)."""
        if self.replay_queue is not None:
            self.replay_queue.append((f, avg.detach().clone()))
            return
        for p in self.outer_params:
            p.grad = None
        off = 0
        for o in f.outer:
            n = o.numel()
            o.grad = avg[off:off + n].view_as(o).to(o.dtype).clone()
            off += n
        self.outer_optimizer.step()
        self.shared.keep_state_references()
        with torch.no_grad():
            for p, o in zip(f.inner, f.outer, strict=True):
                o.grad = None
                if self.mixing == 0.0:
                    p.copy_(o)
                else:
                    p.mul_(self.mixing).add_(o, alpha=1.0 - self.mixing)

    # -- the step ------------------------------------------------------------------------------------

    def step(self, backward: Backward) -> Generator[Op, Any, StepResult | None]:
        """One inner step; the fragments due at it are sent or applied; None once the run is over."""
        if self.inner_step == 0 and not (yield from self._begin_cycle()):
            return None
        s = self.inner_step
        index = self.cycle * self.inner_steps + s
        tx, self.drained_tx = self.drained_tx, 0
        for f in self.fragments:
            if self._send_step(f) == s:
                if f.in_flight:  # "auto": carried over from the last cycle, applied before its next send
                    tx += yield from self._finish_at(f, index)
                yield from self._launch(f)
                f.sent_at = index
                f.deferred = self._defers(f)
        for f in self.fragments:
            staged = f.stage == 1 and (self.auto_overlap or self.overlap >= 2) and f.handle is not None
            if staged and (yield from self._stage_due(f, s, index)):
                if not (yield from self._second_stage(f)):
                    f.rounds += 1  # lost in its first stage: nothing left in flight
        for f in self.fragments:
            if f.in_flight and (yield from self._apply_due(f, s, index)):
                tx += yield from self._finish_at(f, index)
        if self._final_due(s):
            yield from self._final_sync()
        self.inner_optimizer.zero_grad()
        loss = backward(Step(index, self.rank, self.world_size))
        self.inner_optimizer.step()
        self.inner_step += 1
        if self.inner_step == self.inner_steps:
            # those whose overlap reaches past the cycle's end: waited for here; with "auto" carried
            # into the next cycle instead, applied there when done (before their next send, or before
            # a membership cycle admits anyone or syncs, at the latest: _begin_cycle), unless this was
            # the run's last cycle (this step's result counts their bytes)
            last = self.total_outer_steps is not None and self.cycle + 1 >= self.total_outer_steps
            for f in self.fragments:
                if not f.in_flight:
                    continue
                if self.auto_overlap and not last and not (yield from self._apply_due(f, s + 1, index + 1)):
                    continue  # still on the wire
                tx += yield from self._finish_at(f, index + 1)
            self.cycle_tensor += 1
            self.inner_step = 0
        rx, self.unreported_rx = self.unreported_rx, 0
        return StepResult(index, loss, self.world_size, 1, rx, tx)

    def statistics(self) -> dict[str, Any]:
        """Per fragment: its parameters' count, codec, rounds applied and lost, bytes sent, the mean
        number of inner steps between a round's send and its application (``mean_overlap``); with a
        :class:`~pccl.torch.DeflateCodec`, its counters: deflated encodings and how many had to be
        widened (the codec object's: shared by the fragments given one object; a spec string makes one per
        fragment)."""
        out = []
        for f in self.fragments:
            row: dict[str, Any] = {"index": f.index, "numel": f.numel, "offset": f.offset,
                                   "codec": "fp32" if f.codec is None else f.codec.name, "rounds": f.rounds,
                                   "lost": f.lost, "tx_bytes": f.tx_bytes,
                                   "mean_overlap": f.overlap_steps / f.rounds if f.rounds else 0.0}
            if isinstance(f.codec, DeflateCodec):
                row.update(encodes=f.codec.encodes, widened=f.codec.widened)
            out.append(row)
        return {"fragments": out}
