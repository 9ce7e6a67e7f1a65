"""Execute collective plans in memory, the way the executor would, to test schedules.

:func:`run_plans` runs every rank's :class:`~pccl.collectives.schedule.Plan` of one operation
against the others with no sockets and no trio: frames are paired by ``(sender, receiver, seq)``,
land in the receiver's ``out`` (or its scratch area) *when they arrive* - receives are registered
up front and written straight into the buffer, as in :mod:`pccl.collectives.ring` - and are
applied (reduced) when the receiver gets to them, strictly in its ``recvs`` order. A send goes
only after the receive it depends on has been applied.

Which rank acts next, and which frame in flight arrives next, is drawn from a seeded random
generator, so different seeds explore different interleavings: a plan whose result depends on
timing (a frame overwriting data that is still to be read, a dependency missing) gives wrong
results under some seed. A plan that cannot finish raises :class:`PlanError` ("deadlock").

:func:`plan_times` is a timing model of the same execution (one-way latency and bandwidth per
directed link; each rank's interface sends one frame at a time and takes in one at a time), used
to cross-check the closed-form cost model (:mod:`pccl.collectives.cost`) on every schedule.
"""

from __future__ import annotations

import functools
import heapq
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._types import ReduceOp
from ..collectives.schedule import SRC_SEND, Plan
from ..kernels.reduce import reduce_into

__all__ = ["PlanError", "check_pairing", "plan_times", "run_plans"]

_POISON = 0xA5


class PlanError(AssertionError):
    """The plans are inconsistent: unmatched frames, wrong sizes, or a deadlock."""


def check_pairing(plans: Sequence[Plan]) -> None:
    """Every send is received exactly once, by the rank it names, with the same length.

    Raises:
        PlanError: a send without its receive (or the other way round), a size mismatch, a frame
            to oneself, an empty frame, or a dependency on a receive that does not exist.
    """
    n = len(plans)
    expected: dict[tuple[int, int, int], int] = {}
    for r, p in enumerate(plans):
        for f in p.sends:
            if not 0 <= f.peer < n or f.peer == r:
                raise PlanError(f"rank {r} send {f.seq} names peer {f.peer}")
            if f.end <= f.start:
                raise PlanError(f"rank {r} send {f.seq} is empty")
            if not -1 <= f.after < len(p.recvs):
                raise PlanError(f"rank {r} send {f.seq} waits for receive {f.after}, which does not exist")
            key = (r, f.peer, f.seq)
            if key in expected:
                raise PlanError(f"rank {r} sends seq {f.seq} to {f.peer} twice")
            expected[key] = f.end - f.start
    for r, p in enumerate(plans):
        for g in p.recvs:
            key = (g.peer, r, g.seq)
            size = expected.pop(key, None)
            if size is None:
                raise PlanError(f"rank {r} expects seq {g.seq} from {g.peer}, which never sends it")
            if size != g.end - g.start:
                raise PlanError(
                    f"rank {r} seq {g.seq} from {g.peer}: {g.end - g.start} elements, sent {size}"
                )
    if expected:
        raise PlanError(f"sends nobody receives: {sorted(expected)[:5]}")


def run_plans(
    plans: Sequence[Plan],
    inputs: Sequence[np.ndarray[Any, Any]],
    op: ReduceOp,
    out_count: int,
    *,
    seed: int = 0,
) -> list[np.ndarray[Any, Any]]:
    """Execute one operation's plans (rank ``r`` runs ``plans[r]`` on ``inputs[r]``).

    Args:
        plans: every rank's plan (from :func:`pccl.collectives.schedule.all_plans`).
        inputs: every rank's input, 1-D, one dtype; never modified.
        op: SUM, PROD, MIN or MAX (applied with the executor's kernel, in the dtype).
        out_count: elements of each rank's output.
        seed: picks the interleaving.

    Returns:
        Every rank's output. Elements no frame or local copy wrote hold ``0xA5`` bytes.

    Raises:
        PlanError: the plans do not pair up, or they deadlock.
    """
    check_pairing(plans)
    sim = _Sim(plans, inputs, op, out_count)
    rng = random.Random(seed)
    while True:
        actions: list[Callable[[], None]] = []
        for r in range(sim.n):
            if sim.ready[r]:
                actions.append(functools.partial(sim.send, r, rng.randrange(len(sim.ready[r]))))
            if sim.next_landed(r):
                actions.append(functools.partial(sim.apply_next, r))
        if sim.in_flight:
            actions.append(functools.partial(sim.arrive, rng.randrange(len(sim.in_flight))))
        if not actions:
            break
        rng.choice(actions)()
    for r, p in enumerate(plans):
        if sim.applied[r] != len(p.recvs) or sim.ready[r]:
            raise PlanError(f"deadlock: rank {r} applied {sim.applied[r]} of {len(p.recvs)} receives")
    return sim.outs


class _Sim:
    """The state of :func:`run_plans`: buffers, released sends, frames in flight."""

    def __init__(
        self, plans: Sequence[Plan], inputs: Sequence[np.ndarray[Any, Any]], op: ReduceOp, out_count: int
    ) -> None:
        self.plans = plans
        self.inputs = inputs
        self.op = op
        self.n = len(plans)
        dtype = inputs[0].dtype
        self.outs = [_poisoned(out_count, dtype) for _ in plans]
        self.scratch = [_poisoned(p.scratch_elems, dtype) for p in plans]
        # to_scratch frames without a scratch offset land at their out offsets (the exchange plan)
        self.landing = [_poisoned(out_count, dtype) for _ in plans]
        for r, p in enumerate(plans):
            if p.local_copy is not None:
                s0, s1, o0 = p.local_copy
                self.outs[r][o0 : o0 + s1 - s0] = inputs[r][s0:s1]
        self.index = [{(g.peer, g.seq): i for i, g in enumerate(p.recvs)} for p in plans]
        self.landed = [[False] * len(p.recvs) for p in plans]
        self.ready: list[list[int]] = [list(p.initial) for p in plans]
        self.in_flight: list[tuple[int, int, np.ndarray[Any, Any]]] = []
        self.applied = [0] * self.n

    def dest(self, r: int, i: int) -> np.ndarray[Any, Any]:
        g = self.plans[r].recvs[i]
        if g.to_scratch:
            if g.scratch >= 0:
                return self.scratch[r][g.scratch : g.scratch + g.end - g.start]
            return self.landing[r][g.start : g.end]
        return self.outs[r][g.start : g.end]

    def send(self, r: int, k: int) -> None:
        j = self.ready[r].pop(k)
        f = self.plans[r].sends[j]
        src = self.inputs[r] if f.source == SRC_SEND else self.outs[r]
        # the payload is read when the frame goes, as the executor's send does
        self.in_flight.append((f.peer, self.index[f.peer][(r, f.seq)], src[f.start : f.end].copy()))

    def arrive(self, k: int) -> None:
        dst, i, data = self.in_flight.pop(k)
        if self.landed[dst][i]:
            raise PlanError(f"rank {dst} receive {i} arrived twice")
        self.dest(dst, i)[:] = data
        self.landed[dst][i] = True

    def next_landed(self, r: int) -> bool:
        i = self.applied[r]
        return i < len(self.plans[r].recvs) and self.landed[r][i]

    def apply_next(self, r: int) -> None:
        i = self.applied[r]
        p = self.plans[r]
        g = p.recvs[i]
        out = self.outs[r][g.start : g.end]
        if g.to_scratch:
            reduce_into(out, self.dest(r, i), self.op)
        elif g.reduce:
            reduce_into(out, self.inputs[r][g.start : g.end], self.op)
        self.applied[r] += 1
        self.ready[r].extend(p.unlocks[i])


def _poisoned(count: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    a = np.empty(count, dtype)
    a.view(np.uint8)[:] = _POISON
    return a


def plan_times(
    plans: Sequence[Plan],
    itemsize: int,
    latency: Callable[[int, int], float],
    bandwidth: Callable[[int, int], float],
) -> list[float]:
    """When each rank finishes its plan, in a simple timing model (seconds from the start).

    Model: a frame of ``b`` bytes from ``s`` to ``d`` leaves once it is released and ``s``'s network
    interface is free (each rank sends one frame at a time, in release order) and takes
    ``b / bandwidth(s, d)`` to serialize; its first byte reaches ``d`` ``latency(s, d)`` later, and
    ``d``'s interface takes in one frame at a time too (frames from several senders queue).
    Receives are applied in plan order, instantly (reduction and copy costs are ignored). (The
    virtual network of :mod:`pccl.testing.network` limits each directed link, not a host's
    interface: there a node receiving from several peers at once is faster than here.)

    Args:
        plans: every rank's plan.
        itemsize: bytes per element.
        latency: one-way latency of the directed link, seconds.
        bandwidth: bytes/s of the directed link.

    Returns:
        Per rank, the time its last frame was sent or applied.

    Raises:
        PlanError: the plans do not pair up, or they deadlock.
    """
    check_pairing(plans)
    n = len(plans)
    index = [{(g.peer, g.seq): i for i, g in enumerate(p.recvs)} for p in plans]
    arrival: list[list[float | None]] = [[None] * len(p.recvs) for p in plans]
    applied = [0] * n
    nic_free = [0.0] * n
    ingress_free = [0.0] * n
    finish = [0.0] * n
    now_applied = [0.0] * n  # when the latest receive was applied
    events: list[tuple[float, int, int, int]] = []  # (time, kind 0=release, rank, index)
    for r, p in enumerate(plans):
        for j in p.initial:
            heapq.heappush(events, (0.0, 0, r, j))
    while events:
        t, _kind, r, j = heapq.heappop(events)
        f = plans[r].sends[j]
        start = max(t, nic_free[r])
        wire = (f.end - f.start) * itemsize / bandwidth(r, f.peer)
        done = start + wire
        nic_free[r] = done
        finish[r] = max(finish[r], done)
        d = f.peer
        i = index[d][(r, f.seq)]
        # the frame occupies d's interface for as long as it takes to serialize
        recv_start = max(start + latency(r, d), ingress_free[d])
        ingress_free[d] = recv_start + wire
        arrival[d][i] = recv_start + wire
        # apply every receive of d that has arrived, in order
        p = plans[d]
        while applied[d] < len(p.recvs) and arrival[d][applied[d]] is not None:
            k = applied[d]
            at = max(now_applied[d], arrival[d][k] or 0.0)
            now_applied[d] = at
            finish[d] = max(finish[d], at)
            applied[d] += 1
            for u in p.unlocks[k]:
                heapq.heappush(events, (at, 0, d, u))
    for r, p in enumerate(plans):
        if applied[r] != len(p.recvs):
            raise PlanError(f"deadlock: rank {r} applied {applied[r]} of {len(p.recvs)} receives")
    return finish
