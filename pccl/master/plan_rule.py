"""The plan rule: a member that testifies it took bytes it did not pass on, under any schedule and kind
(pure: no trio, no sockets, no clock). Issue 33 item 6, the lying non-reader.

A member that stops reading and testifies (``CollectiveDone.io``) that it took the bytes its partners
sent it agrees with every partner, so the pair rule (pccl/master/testimony.py) finds nothing. Its own
plan gives it away: the master recomputes every participant's plan from the descriptor it checked and the
schedule they ran (the descriptor's, or for ``"auto"`` the one most participants report:
pccl/master/op_plans.py), never from one member's word. A plan lists its receives
in the order the executor takes them in (``Plan.recvs``; the frame it waits on holds up every later
one) and, for each receive, the sends that it releases (``Plan.unlocks``; ``Plan.initial`` need
nothing). What a partner ``q`` sends a peer ``p`` is released in ``q``'s own release order (its
initial frames, then those of its first receive, its second...): at a standstill with no send under
way, everything ``q`` released is written, so what ``p`` took from ``q`` is a prefix of that order.
So from what ``p`` says it took from each partner the master knows which of ``p``'s receives are
complete, the first one that is not (the one it waits on), and so the sends released to each
successor ``s`` (``required``). An honest ``p`` whose sends all completed has sent all of them: it
holds back nothing. :func:`plan_holders` names ``p`` when ``required - passed`` exceeds
:data:`SLACK` (``passed``: what ``s`` says it took from ``p``), provided ``p``,
``s`` and every partner ``p`` receives from testified, ``s`` is not behind on ``p``'s frames (it
took at least what ``p`` says it sent: else the pair rule judges them) and no send of a partner to
``p`` and no send of ``p`` at all was under way (``CollectiveDone.blocked``: released frames not
written; a peer writes its frames one after the other, so one send under way holds up the rest).

Frame lengths are the payload bytes the pool counts (pccl/peer/op_io.py): ``elements * itemsize``,
quantized frames ``metadata + elements * quantized itemsize`` (pccl/collectives/op_plan.py).

What the rule trusts: that ``p``'s partners send in their release order, as every honest peer does.
A member that sends its frames out of that order (a later frame before an earlier one, which its
receiver takes into the later frame's registered receive) can make an honest receiver look like a
holder (docs/security.md "A liar naming an honest member").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TypeVar, overload

from .._types import DataType, QuantizationAlgorithm
from ..collectives.kinds import get_kind
from ..collectives.op_plan import DEFAULT_BLOCK_BYTES, QUANTIZED_BLOCK_DIVISOR, build_plan, frame_bytes
from ..collectives.plan import SCHEDULES, Plan
from ..kernels.quantize import metadata_size
from ..wire.messages import CollectiveDescriptor

T = TypeVar("T")

#: Bytes a peer may hold back without being named. At a standstill an honest peer holds back nothing
#: its plan released: a frame being written is a send under way (``blocked``: not judged), and what it
#: took counts whole frames from the header on. Held amounts are whole frames, so any allowance below
#: the smallest frame (a quantized frame's metadata, 24 bytes) is this same rule.
SLACK = 0
#: Frames past which one report's judgement would build too many plans (:func:`report_frames`, estimated
#: before building anything): each report judges only the peers its testimony can change (its maker and
#: its partners, :func:`affected`), building their plans and those of the partners they receive from,
#: each rank's plan once per operation (pccl/master/testimony.py ``holders``). That covers ring
#: operations of up to ~100 members and halving-doubling and tree ones of up to 256 (small buffers;
#: ``all_to_all``, whose ranks are all partners, ~23). Measured (benchmarks/stall_reports.py, a stalled
#: 4 KiB all-reduce, every waiting participant reporting): worst report 31 ms at 100 in a ring, 0.4 ms at
#: 256 in halving-doubling (docs/security.md). A larger stalled operation is judged by the pair and
#: ``stalled_on`` rules only (a ring all-reduce also by the coarse ring rule, which needs no plan:
#: pccl/master/testimony.py ``ring_holders``).
MAX_FRAMES = 4096


class _PerRank(Sequence[T]):
    """``n`` values, one per rank, each made on first use by ``make(rank)`` and kept."""

    def __init__(self, n: int, make: Callable[[int], T]) -> None:
        self._n = n
        self._make = make
        self._got: dict[int, T] = {}

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, rank: int) -> T: ...

    @overload
    def __getitem__(self, rank: slice) -> Sequence[T]: ...

    def __getitem__(self, rank: int | slice) -> T | Sequence[T]:
        if isinstance(rank, slice):
            return [self[r] for r in range(self._n)[rank]]
        if not 0 <= rank < self._n:
            raise IndexError(rank)
        got = self._got.get(rank)
        if got is None:
            got = self._got[rank] = self._make(rank)
        return got


class OpFrames:
    """Every participant's plan of one operation and its frames' lengths (index: rank = ring index),
    each rank's built on first use.

    Attributes:
        ids: peer id of each rank.
        plans: each rank's plan.
        send_bytes: each rank's send frames' lengths (``plans[r].sends`` order).
        recv_bytes: each rank's receive frames' lengths (``plans[r].recvs`` order).
        estimate: :func:`estimated_frames` of all the ranks' plans (0: not estimated).
    """

    estimate = 0

    def __init__(self, ids: Sequence[int], build: Callable[[int], Plan], itemsize: int,
                 quantized: tuple[int, int] | None) -> None:
        self.ids = tuple(ids)
        n = len(self.ids)
        self.plans: Sequence[Plan] = _PerRank(n, build)
        sizes = _PerRank(n, lambda r: frame_bytes(self.plans[r], itemsize, quantized))
        self.send_bytes: Sequence[tuple[int, ...]] = _PerRank(n, lambda r: sizes[r][0])
        self.recv_bytes: Sequence[tuple[int, ...]] = _PerRank(n, lambda r: sizes[r][1])

    @property
    def schedule(self) -> str:
        """The schedule the peers ran ("ring", "exchange", "hd", "tree")."""
        return self.plans[0].schedule


def run_schedule(d: CollectiveDescriptor) -> str | None:
    """The schedule the peers run for ``d`` (pccl.collectives.cost.schedule_for on a fixed request):
    the ring when quantized, else the kind's plan for the request; None for ``"auto"`` (a peer that did
    not resolve it: the master cannot know what the members picked) or an unknown kind or schedule."""
    try:
        k = get_kind(d.kind)
    except ValueError:
        return None
    if d.schedule not in SCHEDULES:
        return None
    return "ring" if d.quantization != int(QuantizationAlgorithm.NONE) else k.run_schedule(d.schedule)


def estimated_frames(schedule: str, n: int, count: int, block_elems: int) -> int:
    """A generous estimate of the frames of every participant's plan of one operation (see
    :data:`MAX_FRAMES`): a ring rank's at most ``2 (n - 1)`` steps of up to the whole buffer's blocks,
    a halving-doubling or tree rank's at most ``2 log2 n + 2`` exchanges of up to the whole buffer's
    blocks, each sent and received."""
    blocks = -(-count // block_elems) + 1
    if schedule == "ring":
        return 4 * n * (n - 1) * blocks
    return 2 * n * (2 * max(1, (n - 1).bit_length()) + 2) * blocks


def report_frames(schedule: str, n: int, count: int, block_elems: int, kind: str = "") -> int:
    """A generous estimate of the frames of the plans one report's judgement builds (see
    :data:`MAX_FRAMES`): the peers a testimony can change (its maker and its partners, :func:`affected`)
    and the partners each of those receives from (:func:`released` walks their release orders): 5 ranks
    of a ring; for a halving-doubling or tree rank with ``P`` partners, itself, its partners and theirs
    (``1 + P + P (P - 1) / 2``: a hypercube's neighbours of neighbours); each rank's frames as
    :func:`estimated_frames` counts them; every rank for ``all_to_all`` (each rank's partners are all).
    """
    per_rank = -(-estimated_frames(schedule, n, count, block_elems) // n)
    partners = 2 if schedule == "ring" else (n - 1).bit_length() + 1
    touched = 5 if schedule == "ring" else 1 + partners + partners * (partners - 1) // 2
    if kind == "all_to_all":
        touched = n
    return per_rank * min(n, touched)


def op_frames(d: CollectiveDescriptor, participants: Sequence[int], block_bytes: int = DEFAULT_BLOCK_BYTES,
              max_frames: int | None = None) -> OpFrames | None:
    """The plans the ``participants`` (ring order) run for descriptor ``d``, or None where the master
    cannot know them (an unresolved ``"auto"``, a descriptor no peer could plan, a root not among
    them) or one report's judgement would build more than ``max_frames`` of them
    (:func:`report_frames`; None: :data:`MAX_FRAMES`). Each rank's plan is built when first used."""
    schedule = run_schedule(d)
    n = len(participants)
    if schedule is None or n < 2 or d.element_count < 0:
        return None
    try:
        k = get_kind(d.kind)
        itemsize = DataType(d.dtype).itemsize
        quantized: tuple[int, int] | None = None
        block_elems = max(1, block_bytes // itemsize)
        if d.quantization != int(QuantizationAlgorithm.NONE):
            meta = metadata_size(QuantizationAlgorithm(d.quantization))
            quantized = (meta, 1 if d.quantized_dtype == int(DataType.UINT8) else 2)
            block_elems = max(1, block_elems // QUANTIZED_BLOCK_DIVISOR)
        root = list(participants).index(d.root) if k.rooted else 0
        limit = MAX_FRAMES if max_frames is None else max_frames
        if report_frames(schedule, n, d.element_count, block_elems, k.name) > limit:
            return None
        total = estimated_frames(schedule, n, d.element_count, block_elems)

        def build(rank: int) -> Plan:
            return build_plan(k, n, rank, d.element_count, itemsize, schedule=schedule, root=root,
                              block_bytes=block_bytes, quantized=quantized is not None)

        build(0)  # a descriptor no peer could plan either raises here
    except (ValueError, TypeError, ArithmeticError):
        return None
    frames = OpFrames(participants, build, itemsize, quantized)
    frames.estimate = total
    return frames


def _release_order(plan: Plan) -> list[int]:
    """The plan's send indices in the order they are released: its initial sends, then those each
    receive unlocks, receive by receive."""
    out = list(plan.initial)
    for u in plan.unlocks:
        out.extend(u)
    return out


def released(frames: OpFrames, rank: int, took: Mapping[int, int]) -> tuple[int, dict[int, int]]:
    """What rank ``rank`` must have sent, given it took ``took[q]`` bytes from each rank ``q``.

    Returns:
        ``(w, required)``: the index of the first receive of its plan not complete (``len(recvs)``:
        all are), and the bytes of the sends released to each rank before it (its initial sends and
        those of its receives ``0 .. w-1``).
    """
    plan = frames.plans[rank]
    index = {(f.peer, f.seq): i for i, f in enumerate(plan.recvs)}
    done = [False] * len(plan.recvs)
    for q in {f.peer for f in plan.recvs}:
        budget = took.get(q, 0)
        qplan, qbytes = frames.plans[q], frames.send_bytes[q]
        for j in _release_order(qplan):
            f = qplan.sends[j]
            if f.peer != rank:
                continue
            if qbytes[j] > budget:
                break
            budget -= qbytes[j]
            i = index.get((q, f.seq))
            if i is not None:
                done[i] = True
    w = done.index(False) if False in done else len(done)
    required: dict[int, int] = {}
    mine = frames.send_bytes[rank]
    for j in list(plan.initial) + [j for u in plan.unlocks[:w] for j in u]:
        peer = plan.sends[j].peer
        required[peer] = required.get(peer, 0) + mine[j]
    return w, required


def plan_holders(frames: OpFrames, testimony: Mapping[int, Mapping[int, tuple[int, int]]],
                 blocked: Mapping[int, Collection[int]],
                 candidates: Collection[int] | None = None,
                 slack: int = SLACK) -> list[tuple[int, int, int, int]]:
    """The peers of a stalled operation that hold frames their own testimony says they released (module
    docstring).

    Args:
        frames: the operation's plans (:func:`op_frames`).
        testimony: testifier (peer id) -> partner -> ``(sent to it, taken from it)``.
        blocked: testifier -> partners its sends to were under way.
        candidates: the peer ids to judge (None: every participant).
        slack: bytes a peer may hold back unnamed (:data:`SLACK`).

    Returns:
        ``(holder, successor, bytes released to it, bytes it says it took)``, at most one per holder.
    """
    ids = frames.ids
    found: list[tuple[int, int, int, int]] = []
    for rank, peer in enumerate(ids):
        if candidates is not None and peer not in candidates:
            continue
        mine = testimony.get(peer)
        plan = frames.plans[rank]
        if mine is None or not plan.sends or blocked.get(peer):
            continue  # (a send of its under way holds up every later one: released, not written)
        sources = {f.peer for f in plan.recvs}
        if any(ids[q] not in testimony or peer in blocked.get(ids[q], ()) for q in sources):
            continue  # a partner that did not testify, or whose send to it was under way
        _, required = released(frames, rank, {q: mine.get(ids[q], (0, 0))[1] for q in sources})
        for s, owed in sorted(required.items()):
            succ = ids[s]
            theirs = testimony.get(succ)
            if theirs is None:
                continue
            passed = theirs.get(peer, (0, 0))[1]
            if passed < mine.get(succ, (0, 0))[0]:
                continue  # the successor is behind on its frames: the pair rule judges them
            if owed - passed > slack:
                found.append((peer, succ, owed, passed))
                break
    return found


def false_blocks(frames: OpFrames, reporter: int, rows: Mapping[int, tuple[int, int]],
                 named: Iterable[int]) -> list[int]:
    """The peers of ``named`` that ``reporter`` says a send of its to was under way (``stalled_on``,
    ``blocked``) although its own testimony (``rows``: partner -> ``(sent, taken)``) and plan leave it
    nothing to send them: its plan has no send to them, or every send its plan released to them (by what
    it says it took, counted generously: a frame taken in part counts as taken) is among those it says
    completed. No honest peer says so: a send under way is a released frame not yet counted as sent."""
    if reporter not in frames.ids:
        return []
    rank = frames.ids.index(reporter)
    plan = frames.plans[rank]
    sources = {f.peer for f in plan.recvs}
    _, required = released(frames, rank, {q: rows.get(frames.ids[q], (0, 0))[1] for q in sources})
    out: list[int] = []
    for b in named:
        s = frames.ids.index(b) if b in frames.ids else -1
        if s < 0 or required.get(s, 0) <= rows.get(b, (0, 0))[0]:
            out.append(b)
    return out


def false_early(frames: OpFrames, reporter: int, rows: Mapping[int, tuple[int, int]],
                named: Iterable[int]) -> list[int]:
    """The peers of ``named`` that ``reporter`` says sent it a frame out of their release order
    (``CollectiveDone.early``: one taken whole while an earlier one had not come) although its own plan
    and testimony (``rows``: partner -> ``(sent, taken)``) leave no such frame: its plan receives
    nothing from them, or it says it took nothing from them. No honest peer says so
    (pccl/peer/early_frames.py names a partner only for a frame of it taken whole, and counted)."""
    if reporter not in frames.ids:
        return []
    plan = frames.plans[frames.ids.index(reporter)]
    sources = {frames.ids[f.peer] for f in plan.recvs}
    return [b for b in named if b not in sources or rows.get(b, (0, 0))[1] <= 0]


def finished(frames: OpFrames, reporter: int, rows: Mapping[int, tuple[int, int]]) -> bool:
    """Whether ``reporter``'s own testimony (``rows``: partner -> ``(sent, taken)``) says it completed
    every receive of its plan: then its plan released all its sends, and with none of them under way
    (the caller checks ``blocked``) nothing was left for its data plane to wait on, so an operation it
    reports stalled contradicts its own testimony (issue 33, the member that stops where it owes
    nothing: its last receives release no send, so no partner's testimony or plan can show it)."""
    if reporter not in frames.ids:
        return False
    rank = frames.ids.index(reporter)
    plan = frames.plans[rank]
    sources = {f.peer for f in plan.recvs}
    w, _ = released(frames, rank, {q: rows.get(frames.ids[q], (0, 0))[1] for q in sources})
    return w == len(plan.recvs)


def undelivered(frames: OpFrames, reporter: int, rows: Mapping[int, tuple[int, int]],
                complete: Iterable[int]) -> list[tuple[int, int, int]]:
    """The partners among ``complete`` (participants that reported their part of the operation done:
    every frame their plan sends written) whose plans send ``reporter`` more bytes than it says it took
    from them (``rows``: partner -> ``(sent, taken)``).

    Returns:
        ``(partner, bytes its plan sends reporter, bytes reporter says it took)`` for each. Such a pair
        tells the same story as a pair of testimonies that disagree (pccl/master/testimony.py): one of
        the two lies, or their link holds the frames; the master cannot tell which.
    """
    if reporter not in frames.ids:
        return []
    rank = frames.ids.index(reporter)
    done = set(complete)
    out: list[tuple[int, int, int]] = []
    for q in sorted({f.peer for f in frames.plans[rank].recvs}):  # its partners' plans only
        peer = frames.ids[q]
        if peer == reporter or peer not in done:
            continue
        qplan, qbytes = frames.plans[q], frames.send_bytes[q]
        owed = sum(qbytes[j] for j, f in enumerate(qplan.sends) if f.peer == rank)
        taken = rows.get(peer, (0, 0))[1]
        if owed > taken:
            out.append((peer, owed, taken))
    return out


def affected(frames: OpFrames, peer: int) -> set[int]:
    """The participants whose judgement a testimony of ``peer`` can change: itself and its partners."""
    if peer not in frames.ids:
        return set()
    rank = frames.ids.index(peer)
    plan = frames.plans[rank]
    partners: Iterable[int] = {f.peer for f in plan.sends} | {f.peer for f in plan.recvs}
    return {peer, *(frames.ids[q] for q in partners)}


__all__ = [
    "MAX_FRAMES", "SLACK", "OpFrames", "affected", "estimated_frames", "false_blocks", "finished",
    "op_frames", "plan_holders", "released", "report_frames", "run_schedule", "undelivered",
]
