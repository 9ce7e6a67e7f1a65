"""The plan vocabulary of the collectives (pure: no trio, no I/O): what one rank sends and receives
in one operation (:class:`Plan` of :class:`SendFrame` and :class:`RecvFrame`), chunking, and the
engines the kinds of :mod:`pccl.collectives.kinds` build their plans with: the ring's chunk steps
(:func:`ring_plan`), the two-rank exchange, recursive halving-doubling (:func:`hd_reduce`,
:func:`hd_gather`) and the binomial tree (:class:`Builder`, :func:`tree_reduce`, :func:`tree_bcast`).
:mod:`pccl.collectives.schedule` dispatches to each kind's plans; read its docstring for the
schedules themselves.

Chunks (docs/protocol.md section 4): for world size ``n`` and ``count`` elements, chunk ``c`` holds
``count // n`` elements plus one if ``c < count % n``; chunks are contiguous and in order, and
may be empty.

Every chunk is cut into blocks of at most ``block_elems`` elements so that reduction of one block
overlaps the arrival of the next, and so that a large operation can stripe its blocks over
several connections. Frames are numbered (``seq``) in the order the sender's plan lists them;
the receiver's plan lists the same frames in the same order, so ``seq`` matches on both sides
without any negotiation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULES = ("ring", "hd", "tree")

# Where a send frame reads its bytes from.
SRC_SEND = 0  # the caller's input array
SRC_OUT = 1  # the output array (partial sums, received data being forwarded)


def chunk_sizes(count: int, n: int) -> list[int]:
    """Element count of each of the ``n`` chunks of a ``count``-element buffer."""
    if n < 1 or count < 0:
        raise ValueError(f"bad chunking: count={count}, n={n}")
    q, rem = divmod(count, n)
    return [q + (1 if c < rem else 0) for c in range(n)]


def chunk_range(count: int, n: int, c: int) -> tuple[int, int]:
    """``(start, end)`` element offsets of chunk ``c`` (``0 <= c < n``)."""
    if not 0 <= c < n or count < 0:
        raise ValueError(f"chunk {c} out of range for n={n} (count={count})")
    q, rem = divmod(count, n)
    start = c * q + min(c, rem)
    return start, start + q + (1 if c < rem else 0)


def chunk_bounds(count: int, n: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every chunk, in order (``chunk_bounds(count, n)[r]`` is rank r's)."""
    return [chunk_range(count, n, c) for c in range(n)]




@dataclass(frozen=True, slots=True)
class Step:
    """One ring step for one rank: the chunk it sends, the chunk it receives, and whether the
    received data is reduced with the rank's own contribution (reduce-scatter steps)."""

    send_chunk: int
    recv_chunk: int
    reduce: bool



def block_ranges(start: int, end: int, block_elems: int) -> list[tuple[int, int]]:
    """Cut ``[start, end)`` into consecutive blocks of at most ``block_elems`` (none if empty)."""
    if block_elems < 1:
        raise ValueError("block_elems must be >= 1")
    return [(s, min(end, s + block_elems)) for s in range(start, end, block_elems)]


@dataclass(frozen=True, slots=True)
class SendFrame:
    """One frame this rank sends to its ring successor.

    Attributes:
        seq: frame number within the operation (matches the successor's RecvFrame.seq).
        source: SRC_SEND or SRC_OUT.
        start: first element in ``source``.
        end: one past the last element.
        after: index into ``Plan.recvs`` of the receive that must complete (and be reduced)
            before this frame may be sent; -1 if it can be sent at once.
        lane: which of the pool's connections to prefer, before adding the tag (blocks of one
            step take consecutive lanes so large operations stripe over every connection).
        step: the ring step (0-based) the frame belongs to; when several frames are ready on one
            connection, earlier steps go first (then ``seq`` order), so the all-gather never
            overtakes the reduce-scatter and leaves the link idle at the end of the operation.
        peer: the rank (index in the ring order) the frame goes to. Ring plans name their
            successor; halving-doubling and tree plans name any rank.
    """

    seq: int
    source: int
    start: int
    end: int
    after: int
    lane: int
    step: int = 0
    peer: int = -1


@dataclass(frozen=True, slots=True)
class RecvFrame:
    """One frame this rank receives from its ring predecessor, straight into ``out[start:end]``.

    Attributes:
        seq: frame number within the operation.
        start: first element in the output array.
        end: one past the last element.
        reduce: combine ``out[start:end]`` with this rank's input over the same range afterwards.
        to_scratch: land in a scratch buffer instead; afterwards ``out[start:end] =
            op(out[start:end], received)`` (``out`` holds this rank's input there: the plan's
            ``local_copy``). The exchange plan uses it so both ranks compute ``op(x0, x1)``.
        peer: the rank the frame comes from (ring plans: the predecessor). Frames are matched by
            ``(peer, seq)``: ``seq`` numbers the sender's frames, so frames from different peers
            may share a ``seq``.
        scratch: ``to_scratch`` frames only: element offset of the landing place in the plan's
            scratch area (``Plan.scratch_elems`` elements); ``-1``: at the frame's own ``out``
            offsets in an ``out``-sized scratch buffer (the exchange plan). Halving-doubling and
            tree plans give every such frame its own place, because their receives into one
            range of ``out`` can be in flight at the same time.
    """

    seq: int
    start: int
    end: int
    reduce: bool
    to_scratch: bool = False
    peer: int = -1
    scratch: int = -1


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one rank does in one operation.

    Attributes:
        sends: frames to send (ring: to the successor; see ``SendFrame.peer``), in ``seq`` order.
        recvs: frames to receive (ring: from the predecessor; see ``RecvFrame.peer``), in the
            order in which they are awaited and applied (a send's ``after`` dependency therefore
            also waits for every earlier receive).
        local_copy: ``(src_start, src_end, out_start)``: elements of the input copied into the
            output before the ring starts, or None.
        owned: ``(start, end)`` of the output range that is meaningful for reduce_scatter (the
            whole output for the other kinds).
        initial: indices into ``sends`` of the frames that can go at once, in order.
        unlocks: for each receive, the indices of the sends it releases.
        send_elems: elements sent in total.
        recv_elems: elements received in total.
        scratch_elems: size of the scratch area that ``to_scratch`` frames with a ``scratch``
            offset land in (0 for ring and exchange plans).
        schedule: "ring", "exchange", "hd" (recursive halving-doubling) or "tree" (binomial).
    """

    sends: tuple[SendFrame, ...]
    recvs: tuple[RecvFrame, ...]
    local_copy: tuple[int, int, int] | None
    owned: tuple[int, int]
    initial: tuple[int, ...] = ()
    unlocks: tuple[tuple[int, ...], ...] = ()
    send_elems: int = 0
    recv_elems: int = 0
    scratch_elems: int = 0
    schedule: str = "ring"


def finish(sends: list[SendFrame], recvs: list[RecvFrame], local_copy: tuple[int, int, int] | None,
            owned: tuple[int, int], scratch_elems: int = 0, schedule: str = "ring") -> Plan:
    initial: list[int] = []
    unlocks: list[list[int]] = [[] for _ in recvs]
    for i, f in enumerate(sends):
        if f.after < 0:
            initial.append(i)
        else:
            unlocks[f.after].append(i)
    return Plan(
        tuple(sends),
        tuple(recvs),
        local_copy,
        owned,
        tuple(initial),
        tuple(tuple(u) for u in unlocks),
        sum(f.end - f.start for f in sends),
        sum(f.end - f.start for f in recvs),
        scratch_elems,
        schedule,
    )



def ring_plan(
    steps: Sequence[Step], bounds: Sequence[tuple[int, int]], n: int, rank: int, block_elems: int,
    *, own_slot: bool = False,
) -> tuple[list[SendFrame], list[RecvFrame]]:
    """The frames of a ring plan (to the successor, from the predecessor) for ``steps``: at step ``t``
    the range ``bounds[steps[t].send_chunk]`` goes out and ``bounds[steps[t].recv_chunk]`` comes
    in; a step's sends after the first are exactly the blocks received at the step before.

    ``own_slot``: step 0 reads this rank's input at offsets ``0 .. count`` (the all-gather, whose
    output slot ``rank`` holds the input); otherwise it reads the input at the chunk's offsets.
    """
    sends: list[SendFrame] = []
    recvs: list[RecvFrame] = []
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    # blocks received at the previous step, in order: the next step sends exactly these.
    prev_recv_idx: list[int] = []
    for t, step in enumerate(steps):
        s0, s1 = bounds[step.send_chunk]
        send_blocks = block_ranges(s0, s1, block_elems)
        for b, (a, e) in enumerate(send_blocks):
            if t == 0:
                off = s0 if own_slot else 0
                sends.append(SendFrame(len(sends), SRC_SEND, a - off, e - off, -1, b, t, nxt))
            else:
                sends.append(SendFrame(len(sends), SRC_OUT, a, e, prev_recv_idx[b], b, t, nxt))
        r0, r1 = bounds[step.recv_chunk]
        prev_recv_idx = []
        for a, e in block_ranges(r0, r1, block_elems):
            prev_recv_idx.append(len(recvs))
            recvs.append(RecvFrame(len(recvs), a, e, step.reduce, peer=prv))
    return sends, recvs


def check_plan_arguments(n: int, rank: int, count: int, block_elems: int) -> None:
    """Raises ValueError unless ``n >= 2``, ``0 <= rank < n``, ``count >= 0`` and ``block_elems >= 1``."""
    if n < 2 or not 0 <= rank < n or count < 0 or block_elems < 1:
        raise ValueError(f"bad plan arguments: n={n} rank={rank} count={count} block_elems={block_elems}")


def plan_exchange(rank: int, count: int, block_elems: int) -> Plan:
    """All-reduce between two ranks in one step: each sends its whole input to the other and
    reduces the two inputs itself, instead of the ring's two dependent steps (reduce-scatter, then
    all-gather) of half the input each. The same bytes cross the wire, but a small operation waits
    for one arrival instead of two; each rank reduces the whole buffer instead of half, so it is
    only worth it for small buffers (see ``ring.EXCHANGE_MAX_BYTES``).

    Both ranks compute ``op(x0, x1)`` with rank 0's input as the first operand - rank 1 reduces
    the received ``x0`` with its own input as usual, rank 0 starts from a copy of its input and
    reduces the received ``x1`` into it - so the results are bit-identical even where ``op`` is
    not bitwise commutative (NaN payloads, MIN/MAX of -0.0 and 0.0).

    Raises:
        ValueError: bad arguments.
    """
    if rank not in (0, 1) or count < 0 or block_elems < 1:
        raise ValueError(f"bad exchange plan: rank={rank} count={count} block_elems={block_elems}")
    blocks = block_ranges(0, count, block_elems)
    other = 1 - rank
    sends = [SendFrame(i, SRC_SEND, a, e, -1, i, peer=other) for i, (a, e) in enumerate(blocks)]
    recvs = [RecvFrame(i, a, e, True, to_scratch=rank == 0, peer=other) for i, (a, e) in enumerate(blocks)]
    local_copy = (0, count, 0) if rank == 0 and count else None
    return finish(sends, recvs, local_copy, (0, count), schedule="exchange")




# ------------------------------------------------------------------------------------------------
# Latency-optimal schedules: recursive halving-doubling and binomial trees.
#
# These plans use the same vocabulary as the ring's, with every frame naming the rank it goes to
# or comes from (``SendFrame.peer`` / ``RecvFrame.peer``). They are built for all ranks at once by
# one symbolic run of the algorithm (``Builder``), which pairs every send with its receive and
# derives each send's dependency from the receives that last wrote the elements it reads.
#
# Bit-identical results: in every reducing plan the final value of each element is computed
# exactly once (by the rank that owns it after the reduce-scatter, or by the tree's root) and
# then only copied, so every rank ends with the same bits whatever the reduction order was; and
# the order is fixed by the plan (integer ops are exact in any order: they wrap like the dtype).


# How a receive is applied (RecvFrame fields).
COPY = 0  # out[range] = received
REDUCE = 1  # out[range] = received, then out op= send  (this rank's input as second operand)
ACCUM = 2  # lands in scratch; out[range] = op(out[range], received)


class _Writers:
    """Which receive last wrote each element of one rank's ``out`` (an interval map)."""

    __slots__ = ("_segs",)

    def __init__(self) -> None:
        self._segs: list[tuple[int, int, int]] = []  # disjoint (start, end, recv index)

    def last(self, a: int, e: int) -> int:
        """The highest receive index that wrote any element of ``[a, e)``; -1 if none."""
        return max((i for s, t, i in self._segs if s < e and a < t), default=-1)

    def write(self, a: int, e: int, idx: int) -> None:
        keep: list[tuple[int, int, int]] = []
        for s, t, i in self._segs:
            if t <= a or e <= s:
                keep.append((s, t, i))
                continue
            if s < a:
                keep.append((s, a, i))
            if e < t:
                keep.append((e, t, i))
        keep.append((a, e, idx))
        self._segs = keep


class Builder:
    """Collects every rank's frames while the algorithm is run symbolically."""

    def __init__(self, n: int, block_elems: int) -> None:
        self.n = n
        self.block_elems = block_elems
        self.sends: list[list[SendFrame]] = [[] for _ in range(n)]
        self.recvs: list[list[RecvFrame]] = [[] for _ in range(n)]
        self.writers = [_Writers() for _ in range(n)]
        self.scratch = [0] * n

    def transfer(
        self, src: int, dst: int, pieces: Sequence[tuple[int, int, int]], source: int, mode: int, step: int
    ) -> None:
        """``src`` sends ``source[s0:s1]`` for every ``(s0, s1, d0)`` of ``pieces``; ``dst``
        receives it at ``out[d0 : d0 + s1 - s0]`` and applies it by ``mode``. Cut into blocks."""
        lane = 0
        for s0, s1, d0 in pieces:
            for a, e in block_ranges(s0, s1, self.block_elems):
                after = self.writers[src].last(a, e) if source == SRC_OUT else -1
                seq = len(self.sends[src])
                self.sends[src].append(SendFrame(seq, source, a, e, after, lane, step, dst))
                lane += 1
                o0, o1 = d0 + (a - s0), d0 + (e - s0)
                scratch = -1
                if mode == ACCUM:
                    scratch = self.scratch[dst]
                    self.scratch[dst] += e - a
                idx = len(self.recvs[dst])
                self.recvs[dst].append(
                    RecvFrame(seq, o0, o1, mode == REDUCE, mode == ACCUM, src, scratch)
                )
                self.writers[dst].write(o0, o1, idx)

    def plans(
        self,
        local_copy: Sequence[tuple[int, int, int] | None],
        owned: Sequence[tuple[int, int]],
        schedule: str,
    ) -> tuple[Plan, ...]:
        return tuple(
            finish(self.sends[r], self.recvs[r], local_copy[r], owned[r], self.scratch[r], schedule)
            for r in range(self.n)
        )


def same(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Pieces that land where they are read from, ascending, adjacent ranges merged: one frame
    (per block) for what a rank sends one partner in one step, not one per chunk (a halving round
    of ``p`` ranks gives up to ``p / 2`` chunks: ``p - 1`` frames per phase, now ``log2 p``)."""
    out: list[tuple[int, int, int]] = []
    for a, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e, out[-1][0])
        else:
            out.append((a, e, a))
    return out



def _hd_shape(n: int) -> tuple[int, int, int]:
    """``(p, extra, rounds)``: the largest power of two ``p <= n``, the ``n - p`` ranks that fold
    in, and ``log2 p``."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p, p.bit_length() - 1


def hd_gather(n: int, count: int, block_elems: int) -> tuple[Plan, ...]:
    """Recursive doubling all-gather (slots ``v`` and ``p + v`` form virtual chunk ``v``; the extra
    ranks hand in their input first and get everything back at the end). See :func:`hd_reduce`."""
    p, extra, rounds = _hd_shape(n)
    b = Builder(n, block_elems)
    step = 0
    slots = [(r * count, (r + 1) * count) for r in range(n)]
    vranges = [[slots[v]] + ([slots[p + v]] if v < extra else []) for v in range(p)]
    for i in range(extra):
        b.transfer(p + i, i, [(0, count, slots[p + i][0])], SRC_SEND, COPY, step)
    step += 1 if extra else 0
    local_copy: list[tuple[int, int, int] | None] = [
        (0, count, r * count) if count else None for r in range(n)
    ]
    _hd_doubling(b, p, rounds, vranges, step)
    step += rounds
    for i in range(extra):
        a0, a1 = slots[p + i]
        b.transfer(i, p + i, same([(0, a0), (a1, n * count)]), SRC_OUT, COPY, step)
    return b.plans(local_copy, [(0, n * count)] * n, "hd")


def _hd_doubling(b: Builder, p: int, rounds: int, vranges: list[list[tuple[int, int]]], step: int) -> None:
    """Doubling rounds (``d = 1, 2, ..., p/2``): rank ``v`` sends its owned range to ``v ^ d``."""
    for k in range(rounds):
        d = 1 << k
        for v in range(p):
            lo = v & ~(d - 1)
            rng = [x for c in range(lo, lo + d) for x in vranges[c]]
            b.transfer(v, v ^ d, same(rng), SRC_OUT, COPY, step + k)


def hd_reduce(n: int, count: int, block_elems: int, *, scatter: bool) -> tuple[Plan, ...]:
    """Recursive halving (reduce-scatter) then, unless ``scatter``, recursive doubling (all-gather).

    Let ``p`` be the largest power of two ``<= n``. The ``n - p`` extra ranks fold in first:
    rank ``p + i`` hands its input to rank ``i`` (which reduces it into its own), and gets the
    result back at the end. Among ranks ``0..p-1`` the buffer is cut into ``p`` virtual chunks;
    at halving round ``k`` (distance ``d = p / 2**(k+1)``) rank ``v`` exchanges half of its
    current range with ``v ^ d`` and keeps the half that contains virtual chunk ``v``; after
    ``log2 p`` rounds rank ``v`` holds the final bits of virtual chunk ``v``. Doubling rounds
    (``d = 1, 2, ..., p/2``) exchange the owned ranges, which double each round.

    Virtual chunks: the all-reduce uses ``chunk_bounds(count, p)`` (balanced); the reduce-scatter
    (``scatter``) uses rank ``v``'s chunk plus, for ``v < n - p``, the folded rank's chunk ``p + v``
    (handed over in one last step), so the output follows the ring's chunk layout.
    """
    p, extra, rounds = _hd_shape(n)
    b = Builder(n, block_elems)
    step = 0
    if scatter:
        vranges = [
            [chunk_range(count, n, v)] + ([chunk_range(count, n, p + v)] if v < extra else [])
            for v in range(p)
        ]
    else:
        vranges = [[chunk_range(count, p, v)] for v in range(p)]
    partial = [False] * n  # whether out already holds this rank's partial sum
    for i in range(extra):
        b.transfer(p + i, i, same([(0, count)]), SRC_SEND, REDUCE, step)
        partial[i] = True
    step += 1 if extra else 0
    for k in range(rounds):
        d = p >> (k + 1)
        sources = [SRC_OUT if partial[v] else SRC_SEND for v in range(p)]
        for v in range(p):
            lo = v & ~(2 * d - 1)
            give = lo if v & d else lo + d  # the half without v's own virtual chunk
            rng = [x for c in range(give, give + d) for x in vranges[c]]
            # the partner's kept half is this rank's given half: it lands in out / scratch there
            b.transfer(v, v ^ d, same(rng), sources[v], ACCUM if partial[v ^ d] else REDUCE, step)
        for v in range(p):
            partial[v] = True
        step += 1
    if scatter:
        for i in range(extra):
            b.transfer(i, p + i, same([chunk_range(count, n, p + i)]), SRC_OUT, COPY, step)
        owned = [chunk_range(count, n, r) for r in range(n)]
        return b.plans([None] * n, owned, "hd")
    _hd_doubling(b, p, rounds, vranges, step)
    step += rounds
    for i in range(extra):
        b.transfer(i, p + i, same([(0, count)]), SRC_OUT, COPY, step)
    return b.plans([None] * n, [(0, count)] * n, "hd")


def _lowbit(v: int, n: int) -> int:
    """Size of node ``v``'s subtree span in the binomial tree over ``0..n-1`` rooted at 0."""
    if v == 0:
        return 1 << max(0, (n - 1).bit_length())
    return v & -v


def tree_children(v: int, n: int) -> list[int]:
    """Children of node ``v`` in the binomial tree over ``0..n-1`` rooted at 0, smallest first.

    Node ``v``'s parent is ``v`` minus its lowest set bit, and its subtree is the contiguous range
    ``[v, min(n, v + lowbit(v)))`` (the whole range for the root).
    """
    span = _lowbit(v, n)
    out = []
    j = 1
    while j < span and v + j < n:
        out.append(v + j)
        j <<= 1
    return out


def tree_subtree(v: int, n: int) -> tuple[int, int]:
    """``(first, end)`` of node ``v``'s subtree in the binomial tree over ``0..n-1``."""
    return v, min(n, v + _lowbit(v, n))


def tree_reduce(b: Builder, n: int, count: int, step: int, rank_of: Sequence[int] | None = None) -> None:
    """Every rank's contribution reduced up the binomial tree into node 0's ``out``, block by block
    (so a block moves up as soon as it is complete below). Children are received smallest
    subtree first: they finish first. Node ``v`` is rank ``rank_of[v]`` (default: ``v``)."""
    ranks = list(range(n)) if rank_of is None else rank_of
    for a, e in block_ranges(0, count, b.block_elems):
        for v in range(n - 1, -1, -1):
            for j, c in enumerate(tree_children(v, n)):
                source = SRC_OUT if tree_children(c, n) else SRC_SEND
                b.transfer(ranks[c], ranks[v], [(a, e, a)], source, REDUCE if j == 0 else ACCUM, step)


def tree_bcast(b: Builder, n: int, rank_of: Sequence[int], pieces: list[tuple[int, int, int]],
                root_source: int, step: int) -> None:
    """``pieces`` of the root's buffer copied down the tree, block by block, biggest subtree first."""
    for a0, a1, d0 in pieces:
        for a, e in block_ranges(a0, a1, b.block_elems):
            for v in range(n):
                for c in reversed(tree_children(v, n)):
                    source = root_source if v == 0 else SRC_OUT
                    s0 = a if source == SRC_SEND else d0 + (a - a0)
                    b.transfer(rank_of[v], rank_of[c], [(s0, s0 + e - a, d0 + (a - a0))], source, COPY, step)


