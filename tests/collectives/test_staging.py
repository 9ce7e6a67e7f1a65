"""Pipelined staging of device tensors (pccl.collectives.staging) on the fake device of
pccl.testing.fake_device, over an in-memory pool that logs every frame: overlap, ordering, failure at
every copy and frame, cancellation. Deterministic: copies complete only when every task is blocked
(or when a test completes them), and the assertions read the event log, never a clock."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from pccl import RankConnectionLostError, ReduceOp
from pccl.collectives.executor import run_collective
from pccl.collectives.ring import plan_for
from pccl.collectives.schedule import SRC_SEND, output_count
from pccl.collectives.staging import DeviceCopyError, Staging
from pccl.kernels.reduce import finalize_avg
from pccl.testing.fake_device import FakeCopy, FakeDevice

# ------------------------------------------------------------------------------------------------
# an in-memory DataPool that logs sends and arrivals


class _Slot:
    def __init__(self, dest: memoryview) -> None:
        self.dest = dest
        self.event = trio.Event()
        self.error: str | None = None

    async def wait(self) -> None:
        await self.event.wait()
        if self.error is not None:
            raise RankConnectionLostError(self.error)


class Net:
    def __init__(self) -> None:
        self.slots: dict[tuple[int, int, int, int], _Slot] = {}  # (src, dst, op_seq, seq)
        self.early: dict[tuple[int, int, int, int], bytes] = {}
        self.broken: set[frozenset[int]] = set()
        self.pools: dict[int, Pool] = {}
        # frames on the wire, oldest first: delivered one per idle moment by drive()
        self.wire: list[tuple[tuple[int, int, int, int], bytes]] = []

    def deliver_one(self) -> int:
        """Deliver the oldest frame on the wire (to a dropped receive if its link broke)."""
        while self.wire:
            key, payload = self.wire.pop(0)
            src, dst, _o, seq = key
            if frozenset((src, dst)) in self.broken:
                continue
            slot = self.slots.get(key)
            if slot is None:
                self.early[key] = payload
            elif not slot.event.is_set():
                self.pools[dst]._arrive(slot, seq, payload)
            return 1
        return 0

    def break_link(self, a: int, b: int) -> None:
        self.broken.add(frozenset((a, b)))
        for (src, dst, _o, _s), slot in self.slots.items():
            if {src, dst} == {a, b} and not slot.event.is_set():
                slot.error = "link broken"
                slot.event.set()


class Pool:
    pool_size = 1

    def __init__(self, net: Net, me: int, log: list[tuple[Any, ...]]) -> None:
        self.net, self.me, self.log = net, me, log
        net.pools[me] = self
        self.fail_send_at: int | None = None  # break the link at this frame's send

    def stripes(self, peer_id: int) -> int:
        return 1

    def begin_transfer(self, peer_id: int) -> None:
        return None

    def end_transfer(self, transfer: None, nbytes: int, completed: bool) -> None:
        pass

    async def reopen(self, peer_id: int) -> None:
        raise AssertionError("a single connection is never reopened")

    async def send(
        self, peer_id: int, tag: int, op_seq: int, seq: int, data: memoryview, *, conn_index: int
    ) -> None:
        await trio.lowlevel.checkpoint()
        if self.fail_send_at == seq:
            self.net.break_link(self.me, peer_id)
        if frozenset((self.me, peer_id)) in self.net.broken:
            raise RankConnectionLostError("link broken")
        self.log.append(("send", seq))
        self.net.wire.append(((self.me, peer_id, op_seq, seq), bytes(data)))

    def _arrive(self, slot: _Slot, seq: int, payload: bytes) -> None:
        slot.dest[:] = payload
        self.log.append(("arrive", seq))
        slot.event.set()

    def expect(self, peer_id: int, tag: int, op_seq: int, seq: int, dest: memoryview) -> _Slot:
        slot = _Slot(dest)
        key = (peer_id, self.me, op_seq, seq)
        self.net.slots[key] = slot
        if frozenset((self.me, peer_id)) in self.net.broken:
            slot.error = "link broken"
            slot.event.set()
        elif key in self.net.early:
            self._arrive(slot, seq, self.net.early.pop(key))
        return slot

    def forget_op(self, op_seq: int) -> None:
        for (_src, dst, o, _s), slot in self.net.slots.items():
            if dst == self.me and o == op_seq and not slot.event.is_set():
                slot.error = "forgotten"
                slot.event.set()

    async def disconnect(self, peer_id: int) -> None:
        self.net.break_link(self.me, peer_id)

    async def disconnect_all(self, peer_ids: Iterable[int]) -> None:
        for p in peer_ids:
            self.net.break_link(self.me, p)


# ------------------------------------------------------------------------------------------------
# running one operation on n peers with fake devices


BLOCK = 64  # bytes: 16 float32 per frame, so every chunk is several frames


class Peer:
    def __init__(self, rank: int, x: np.ndarray, *, in_place: bool = True, avg: int = 0) -> None:
        self.rank = rank
        self.log: list[tuple[Any, ...]] = []
        self.device = FakeDevice(self.log)
        self.tensor = x.copy()  # "device" memory: the caller's send (and recv when in place)
        self.original = x.copy()
        self.recv = self.tensor if in_place else np.full_like(x, -1)
        self.stage = np.full_like(x, 7777)  # stale bits: reading a block before its copy shows
        self.staging = Staging(self.device, self.tensor, self.stage, recv=self.recv, average_over=avg)
        self.out: np.ndarray | None = None
        self.error: BaseException | None = None


async def run_op(
    xs: list[np.ndarray],
    *,
    kind: str = "all_reduce",
    op: ReduceOp = ReduceOp.SUM,
    schedule: str = "ring",
    in_place: bool = True,
    avg: bool = False,
    setup: Callable[[list[Peer], Net], None] | None = None,
    quantization: Any = None,
    block_bytes: int = BLOCK,
) -> list[Peer]:
    n = len(xs)
    net = Net()
    peers = [Peer(r, x, in_place=in_place, avg=n if avg else 0) for r, x in enumerate(xs)]
    pools = [Pool(net, r, p.log) for r, p in enumerate(peers)]
    if setup is not None:
        setup(peers, net)

    async def one(p: Peer) -> None:
        p.out = np.zeros(output_count(kind, n, p.stage.size), p.stage.dtype)
        kwargs: dict[str, Any] = {} if quantization is None else {"quantization": quantization}
        try:
            await run_collective(
                pools[p.rank], kind=kind, ring=list(range(n)), my_id=p.rank, tag=1, op_seq=1,
                send=p.stage, out=p.out, op=op, block_bytes=block_bytes, schedule=schedule,
                staging=p.staging, **kwargs,
            )
        except Exception as exc:
            p.error = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive, peers, net)
        async with trio.open_nursery() as ops:
            for p in peers:
                ops.start_soon(one, p)
        nursery.cancel_scope.cancel()
    return peers


async def drive(peers: list[Peer], net: Net) -> None:
    """Until cancelled: whenever every task is blocked, the wire delivers its oldest frame and
    every device completes its oldest copy (a wire and copy engines of equal speed per block)."""
    idle = 0
    while True:
        await trio.testing.wait_all_tasks_blocked()
        moved = net.deliver_one() + sum(p.device.complete(1) for p in peers)
        idle = 0 if moved else idle + 1
        assert idle < 1000, "nothing moves: the operation is stuck"
        if not moved:
            await trio.lowlevel.checkpoint()


def _xs(n: int, count: int, seed: int = 0, dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-50, 50, count).astype(dtype) for _ in range(n)]


def _index(log: list[tuple[Any, ...]], entry: tuple[Any, ...]) -> int:
    return log.index(entry)


# ------------------------------------------------------------------------------------------------
# correctness: the staged data plane gives the unstaged one's bits


CASES = [
    ("ring", "all_reduce"), ("ring", "reduce_scatter"), ("ring", "all_gather"), ("ring", "broadcast"),
    ("hd", "all_reduce"), ("hd", "reduce_scatter"), ("tree", "all_reduce"), ("tree", "broadcast"),
]


@pytest.mark.parametrize(("schedule", "kind"), CASES)
@pytest.mark.parametrize("n", [2, 3])
async def test_staged_results_equal_the_host_path(schedule: str, kind: str, n: int) -> None:
    count = 16 * 4 * n + 3  # several frames per chunk, uneven chunks
    xs = _xs(n, count, seed=n)
    in_place = kind != "all_gather"
    peers = await run_op(xs, kind=kind, schedule=schedule, in_place=in_place)
    ref_pools = Net()
    refs = [np.zeros(output_count(kind, n, count), np.float32) for _ in range(n)]
    pools = [Pool(ref_pools, r, []) for r in range(n)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive, [], ref_pools)
        async with trio.open_nursery() as ops:
            for r in range(n):
                ops.start_soon(functools.partial(
                    run_collective, pools[r], kind=kind, ring=list(range(n)), my_id=r, tag=1, op_seq=1,
                    send=xs[r], out=refs[r], block_bytes=BLOCK, schedule=schedule))
        nursery.cancel_scope.cancel()
    for p in peers:
        assert p.error is None, p.error
        assert p.out is not None
        a, b = plan_for(kind, n, p.rank, count, 4, schedule=schedule, block_bytes=BLOCK).owned
        assert p.out[a:b].tobytes() == refs[p.rank][a:b].tobytes()
        assert not p.device.pending
        if in_place:
            # delivered into the caller's tensor during the data plane, exactly the host result
            assert p.staging.delivered
            assert p.recv[a:b].tobytes() == refs[p.rank][a:b].tobytes()
            assert p.recv[:a].tobytes() == p.original[:a].tobytes()  # reduce_scatter: the rest untouched
            assert p.recv[b:].tobytes() == p.original[b:].tobytes()
        else:
            assert not p.staging.delivered
            assert (p.recv == -1).all()  # the commit writes it, not the data plane


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
async def test_avg_is_divided_per_range_as_the_commit_would(dtype: Any) -> None:
    n, count = 3, 16 * 12 + 5
    xs = _xs(n, count, seed=5, dtype=dtype)
    peers = await run_op(xs, op=ReduceOp.SUM, avg=True)
    want = np.sum(np.stack(xs), axis=0, dtype=dtype)
    finalize_avg(want, n)
    for p in peers:
        assert p.error is None, p.error
        assert p.staging.delivered
        assert p.recv.tobytes() == want.tobytes()
        # forwarded frames carried the sums: each range was divided only after its last send


async def test_quantized_operations_deliver_at_the_commit() -> None:
    from pccl import QuantizationAlgorithm, QuantizationOptions
    from pccl._types import DataType

    q = QuantizationOptions(algorithm=QuantizationAlgorithm.MIN_MAX, quantized_datatype=DataType.UINT8)
    peers = await run_op(_xs(2, 16 * 8), quantization=q)
    for p in peers:
        assert p.error is None, p.error
        assert not p.staging.delivered
        assert p.tensor.tobytes() == p.original.tobytes()
        assert p.staging.statistics()["to_device"] == 0


# ------------------------------------------------------------------------------------------------
# overlap and ordering, read off the event log


def _send_blocks(rank: int, n: int, count: int, block: int) -> list[tuple[int, tuple[int, int]]]:
    """(seq, range of send) of this rank's frames that read send, in seq order."""
    plan = plan_for("all_reduce", n, rank, count, 4, block_bytes=block)
    return [(f.seq, (f.start, f.end)) for f in plan.sends if f.source == SRC_SEND]


# Two peers' all-reduces up to 512 KB run the exchange plan, whose local copy reads all of send at
# once: these run above it. 6 frames per chunk either way.
SIZES = [(2, 1 << 16), (3, BLOCK), (4, BLOCK)]


@pytest.mark.parametrize(("n", "block"), SIZES)
async def test_copy_of_the_next_block_overlaps_the_send_of_this_one(n: int, block: int) -> None:
    """Fails if copies and sends run one after another (all copies first, or each copy only
    queued once the previous block went out): frames go while the copy of the next block is
    queued and not yet complete."""
    count = n * 6 * block // 4
    peers = await run_op(_xs(n, count), block_bytes=block)
    for p in peers:
        assert p.error is None
        log = p.log
        blocks = _send_blocks(p.rank, n, count, block)
        overlapped = 0
        for (seq, _rng), (_seq2, (a, b)) in itertools.pairwise(blocks):
            sent = _index(log, ("send", seq))
            queued = _index(log, ("queue", "d2h", a, b))
            done = _index(log, ("complete", "d2h", a, b))
            assert queued < done
            if queued < sent < done:
                overlapped += 1
        assert overlapped >= 1, log
        # and no frame read its block before the block's copy completed (else 7777s would show)
        for seq, (a, b) in blocks:
            assert _index(log, ("complete", "d2h", a, b)) < _index(log, ("send", seq))


@pytest.mark.parametrize(("n", "block"), SIZES)
async def test_results_go_to_the_device_while_later_frames_arrive(n: int, block: int) -> None:
    """Fails if the result is copied to the device only after the data plane: a copy of a final
    range is queued, and completes, before the last frame arrives."""
    count = n * 6 * block // 4
    peers = await run_op(_xs(n, count), block_bytes=block)
    for p in peers:
        log = p.log
        last_arrival = max(i for i, e in enumerate(log) if e[0] == "arrive")
        first_h2d = min(i for i, e in enumerate(log) if e[:2] == ("queue", "h2d"))
        first_h2d_done = min(i for i, e in enumerate(log) if e[:2] == ("complete", "h2d"))
        assert first_h2d < first_h2d_done < last_arrival, log
        assert p.staging.statistics()["to_device"] >= 2


def test_device_copies_are_queued_in_the_order_the_plan_reads_send() -> None:
    """Rank 1 of a 3-ring first sends chunk 0, then reduces chunk 2, then chunk 1 (its own):
    its copies are queued in that order (not by address), before any result copy."""
    n, count = 3, 16 * 2 * 3
    device = FakeDevice()
    x = np.arange(count, dtype=np.float32)
    st = Staging(device, x, np.empty_like(x), recv=x)
    plan = plan_for("all_reduce", n, 1, count, 4, block_bytes=BLOCK)
    st.begin(plan, np.zeros_like(x))
    queued = [(c.lo, c.hi) for c in device.copies]
    chunk = count // n
    first, second, third = (0, chunk), (2 * chunk, 3 * chunk), (1 * chunk, 2 * chunk)
    assert queued == [(a, a + 16) for lo, hi in (first, second, third) for a in range(lo, hi, 16)]
    assert device.ordered_after_caller == 1
    assert all(c.direction == "d2h" for c in device.copies)


async def test_every_result_copy_is_queued_behind_the_copy_of_its_previous_bits() -> None:
    """The restore relies on it: a range of recv is overwritten only after the stage holds it."""
    peers = await run_op(_xs(3, 16 * 12))
    for p in peers:
        for k, c in enumerate(p.device.copies):
            if c.direction == "h2d":
                before = [
                    d for d in p.device.copies[:k] if d.direction == "d2h" and d.lo < c.hi and c.lo < d.hi
                ]
                assert before and sum(d.hi - d.lo for d in before) >= c.hi - c.lo


# ------------------------------------------------------------------------------------------------
# failure at every stage: the caller's tensor is restored


async def _abort_all(peers: list[Peer]) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * len(peers)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive, peers, Net())

        async def abort(p: Peer) -> None:
            try:
                await p.staging.abort()
            except DeviceCopyError as exc:
                errors[p.rank] = exc

        async with trio.open_nursery() as aborts:
            for p in peers:
                aborts.start_soon(abort, p)
        nursery.cancel_scope.cancel()
    return errors


N_COPIES = 16  # 2 peers x 128 elements: 8 copies to the host and 8 results to the device each


@pytest.mark.parametrize("avg", [False, True])
@pytest.mark.parametrize("k", range(N_COPIES))
async def test_a_failed_copy_at_every_stage_restores_recv(k: int, avg: bool) -> None:
    count = 16 * 8

    def fail_kth(peers: list[Peer], net: Net) -> None:
        seen = [0]

        def match(c: FakeCopy) -> bool:
            seen[0] += 1
            return seen[0] == k + 1

        peers[0].device.fail_when(match)

    peers = await run_op(_xs(2, count, seed=k), setup=fail_kth, avg=avg)
    # even the last copy is awaited (by finish()): no failed copy passes unnoticed
    assert isinstance(peers[0].error, DeviceCopyError), peers[0].error
    await _abort_all(peers)
    for p in peers:
        assert p.tensor.tobytes() == p.original.tobytes(), (k, p.rank)
        assert not p.device.pending


@pytest.mark.parametrize("seq", range(8))
async def test_a_broken_link_at_every_frame_restores_recv(seq: int) -> None:
    def fail(peers: list[Peer], net: Net) -> None:
        net.pools[1].fail_send_at = seq

    peers = await run_op(_xs(2, 16 * 8, seed=seq), setup=fail)
    assert all(p.error is not None for p in peers)
    errors = await _abort_all(peers)
    assert errors == [None, None]
    for p in peers:
        assert p.tensor.tobytes() == p.original.tobytes()


@pytest.mark.parametrize(
    ("kind", "avg"), [("all_reduce", True), ("reduce_scatter", True), ("broadcast", False)]
)
async def test_an_operation_that_fails_after_its_data_plane_is_rolled_back(kind: str, avg: bool) -> None:
    """The master aborts after every data plane finished (another participant failed): recv,
    already holding the result, gets its previous bits back."""
    xs = _xs(3, 16 * 9)
    peers = await run_op(xs, kind=kind, avg=avg)
    assert all(p.error is None and p.staging.delivered for p in peers)
    changed = [p.tensor.tobytes() != p.original.tobytes() for p in peers]
    assert changed == [kind != "broadcast" or p.rank != 0 for p in peers]  # broadcast: root 0 keeps its bits
    errors = await _abort_all(peers)
    assert errors == [None, None, None]
    for p in peers:
        assert p.tensor.tobytes() == p.original.tobytes()
        assert not p.staging.delivered


async def test_a_failed_restore_is_reported() -> None:
    peers = await run_op(_xs(2, 16 * 8))
    peers[0].device.fail_when(lambda c: c.direction == "h2d")
    errors = await _abort_all(peers)
    assert isinstance(errors[0], DeviceCopyError)
    assert "could not be restored" in str(errors[0])
    assert errors[1] is None
    assert peers[1].tensor.tobytes() == peers[1].original.tobytes()


# ------------------------------------------------------------------------------------------------
# cancellation


async def test_cancellation_waits_for_queued_copies_then_restores() -> None:
    """Cancelled mid-operation: abort does not return while a copy still reads or writes host
    memory, and then restores recv, even though the abort itself runs in a cancelled scope."""
    n, count = 2, 16 * 8
    net = Net()
    peers = [Peer(r, x) for r, x in enumerate(_xs(n, count))]
    pools = [Pool(net, r, p.log) for r, p in enumerate(peers)]
    returned_with_pending: list[int] = []

    async def one(p: Peer, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        p.out = np.zeros(count, np.float32)
        with trio.CancelScope() as scope:
            task_status.started()
            p.scope = scope  # type: ignore[attr-defined]
            try:
                await run_collective(
                    pools[p.rank], kind="all_reduce", ring=[0, 1], my_id=p.rank, tag=1, op_seq=1,
                    send=p.stage, out=p.out, block_bytes=BLOCK, staging=p.staging,
                )
            finally:
                await p.staging.abort()  # in the cancelled scope: shielded inside
                returned_with_pending.append(len(p.device.pending))

    async with trio.open_nursery() as nursery:
        for p in peers:
            await nursery.start(one, p)
        await trio.testing.wait_all_tasks_blocked()
        # let a few copies complete so the data plane has begun, some results delivered
        for _ in range(100):  # until some result went to a device and both still have copies queued
            some_delivered = any(p.staging.statistics()["to_device"] for p in peers)
            if some_delivered and all(p.device.pending for p in peers):
                break
            net.deliver_one()
            for p in peers:
                p.device.complete(1)
            await trio.testing.wait_all_tasks_blocked()
        # (recorded, asserted below: an assertion failing in here would leave the aborts waiting)
        delivered = [p.staging.statistics()["to_device"] for p in peers]
        pending = [len(p.device.pending) for p in peers]
        for p in peers:
            p.scope.cancel()  # type: ignore[attr-defined]
        await trio.testing.wait_all_tasks_blocked()
        returned_before_copies_completed = list(returned_with_pending)
        for _ in range(4):  # the queued copies, then the restore copies
            for p in peers:
                p.device.complete_all()
            await trio.testing.wait_all_tasks_blocked()
    assert any(delivered) and all(pending), (delivered, pending)
    assert returned_before_copies_completed == []  # abort waited for the queued copies
    assert returned_with_pending == [0, 0]
    for p in peers:
        assert p.tensor.tobytes() == p.original.tobytes()


async def test_a_staging_runs_one_operation() -> None:
    x = np.zeros(32, np.float32)
    st = Staging(FakeDevice(), x, np.empty_like(x), recv=x)
    plan = plan_for("all_reduce", 2, 0, 32, 4, block_bytes=BLOCK)
    st.begin(plan, np.zeros_like(x))
    with pytest.raises(Exception, match="one operation"):
        st.begin(plan, np.zeros_like(x))
