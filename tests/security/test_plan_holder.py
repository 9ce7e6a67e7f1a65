"""Issue 33 item 6, the lying non-reader under any schedule and kind (pccl/master/plan_rule.py): a member
that stops reading and testifies that it took what its partners sent it. The master rebuilds every
participant's plan from the descriptor it checked and, from what a peer says it took, the sends its
plan released: a peer that testifies it took frames whose released sends its partners never got (more
than one frame, the unit) is named alone; an honest peer never is."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest
import trio
import trio.testing

from pccl._types import DataType, QuantizationAlgorithm
from pccl.collectives.kinds import KINDS, get_kind
from pccl.collectives.op_plan import build_plan
from pccl.master import plan_rule
from pccl.master.blame import STRIKES
from pccl.master.plan_rule import (
    OpFrames,
    affected,
    estimated_frames,
    false_blocks,
    op_frames,
    plan_holders,
    released,
    run_schedule,
)
from pccl.master.testimony import StallTestimony
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster
from pccl.wire.messages import CollectiveDescriptor

from ._helpers import lie_about_reading, stalled_rounds

COUNT = 960  # elements: n equal blocks for every n used here (all_to_all)
IDS = (11, 12, 13, 14, 15)


def descriptor(kind: str, schedule: str, root: int = -1, quantization: int = 0) -> CollectiveDescriptor:
    return CollectiveDescriptor(kind=kind, dtype=int(DataType.FLOAT32), element_count=COUNT, op=0, root=root,
                                quantization=quantization, quantized_dtype=int(DataType.UINT8),
                                schedule=schedule)


def frames_of(kind: str, schedule: str, n: int, quantization: int = 0) -> OpFrames:
    ids = IDS[:n]
    f = op_frames(descriptor(kind, schedule, ids[1] if get_kind(kind).rooted else -1, quantization), ids)
    assert f is not None
    return f


def standstill(frames: OpFrames, liar: int, lie: bool = True) -> dict[int, dict[int, tuple[int, int]]]:
    """Every peer's testimony once the operation stood still with rank ``liar`` reading nothing (its
    initial sends still go out): the others take every frame sent to them and work through their
    receives in plan order, releasing sends as their plans say. The liar says it took what its partners
    sent it (``lie``) or, truthfully, nothing."""
    plans, n = frames.plans, len(frames.ids)
    done, sent = [0] * n, [set[int]() for _ in range(n)]
    where = [{(f.peer, f.seq): j for j, f in enumerate(p.sends)} for p in plans]
    moved = True
    while moved:
        moved = False
        for r, plan in enumerate(plans):
            for j in list(plan.initial) + [j for u in plan.unlocks[:done[r]] for j in u]:
                if j not in sent[r]:
                    sent[r].add(j)
                    moved = True
            while r != liar and done[r] < len(plan.recvs):
                f = plan.recvs[done[r]]
                if where[f.peer][(r, f.seq)] not in sent[f.peer]:
                    break
                done[r] += 1
                moved = True
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for r in range(n):
        rows: dict[int, tuple[int, int]] = {}
        for q in range(n):
            if q == r:
                continue
            to_q = sum(frames.send_bytes[r][j] for j in sent[r] if plans[r].sends[j].peer == q)
            from_q = sum(frames.send_bytes[q][j] for j in sent[q] if plans[q].sends[j].peer == r)
            rows[frames.ids[q]] = (to_q, from_q if (r != liar or lie) else 0)
        out[frames.ids[r]] = rows
    return out


def stalled(frames: OpFrames, testimony: dict[int, dict[int, tuple[int, int]]], liar: int) -> bool:
    """Whether an honest peer waits on a frame (it took less than its plan receives in all)."""
    for r in range(len(frames.plans)):
        if r == liar:
            continue
        need = sum(frames.recv_bytes[r])
        if sum(k for _, k in testimony[frames.ids[r]].values()) < need:
            return True
    return False


COMBOS = [(kind, schedule, n) for kind in KINDS for schedule in ("ring", "hd", "tree") for n in (3, 4, 5)]


@pytest.mark.parametrize(("kind", "schedule", "n"), COMBOS)
def test_the_liar_is_named_alone_and_an_honest_peer_never(kind: str, schedule: str, n: int) -> None:
    frames = frames_of(kind, schedule, n)
    named_somewhere = False
    for liar in range(n):
        lying = standstill(frames, liar)
        holders = plan_holders(frames, lying, {})
        assert {h for h, *_ in holders} <= {frames.ids[liar]}, (liar, holders)
        # truthful, it names itself by the pair rule; the plan rule has nothing against anyone
        assert plan_holders(frames, standstill(frames, liar, lie=False), {}) == []
        if holders:
            named_somewhere = True
            ((_, _, owed, passed),) = holders
            assert owed > passed  # frames its plan released that the partner never got
    stalls = any(stalled(frames, standstill(frames, liar), liar) for liar in range(n))
    # wherever a lying non-reader stalls an honest peer, some position of it is caught; kinds whose
    # sends need no receive (all_to_all: every frame goes at once) cannot be stalled by a non-reader
    assert named_somewhere or not stalls


@pytest.mark.parametrize(("kind", "schedule"), [("all_reduce", "ring"), ("all_reduce", "hd"),
                                                 ("all_reduce", "tree"), ("all_gather", "ring"),
                                                 ("reduce_scatter", "hd"), ("broadcast", "tree"),
                                                 ("broadcast", "ring"), ("reduce", "tree")])
def test_every_stalling_liar_position_of_the_main_schedules_is_named(kind: str, schedule: str) -> None:
    frames = frames_of(kind, schedule, 4)
    for liar in range(4):
        lying = standstill(frames, liar)
        # what its plan released to a partner (by what it says it took) that the partner never got
        me = lying[frames.ids[liar]]
        _, owed = released(frames, liar, {q: me[frames.ids[q]][1] for q in range(4) if q != liar})
        held = [s for s in owed if owed[s] > lying[frames.ids[s]][frames.ids[liar]][1]]
        # named exactly where it holds back a frame its lie says its plan released
        assert (plan_holders(frames, lying, {}) != []) == bool(held), (liar, held)
        assert bool(held) == stalled(frames, lying, liar) or not held
    assert any(plan_holders(frames, standstill(frames, liar), {}) for liar in range(4))


def test_the_exact_threshold() -> None:
    frames = frames_of("all_reduce", "hd", 4)
    liar = 0
    lying = standstill(frames, liar)
    me = frames.ids[liar]
    took = {q: lying[me][frames.ids[q]][1] for q in range(1, 4)}
    _, owed = released(frames, liar, took)
    (s, total), = [(s, b) for s, b in owed.items() if b > lying[frames.ids[s]][me][1]]
    unit = max(b for j, b in enumerate(frames.send_bytes[liar]) if frames.plans[liar].sends[j].peer == s)
    succ = frames.ids[s]

    def with_passed(passed: int) -> dict[int, dict[int, tuple[int, int]]]:
        t = {p: dict(rows) for p, rows in lying.items()}
        t[me][succ] = (min(t[me][succ][0], passed), t[me][succ][1])  # it says it sent what was taken
        t[succ][me] = (t[succ][me][0], passed)
        return t

    # (the liar judged: the successor's figures are moved past what the liar really sent)
    # SLACK (0): an honest peer at a standstill holds back nothing its plan released
    assert plan_holders(frames, with_passed(total), {}, {me}) == []
    assert plan_holders(frames, with_passed(total - 1), {}, {me}) == [(me, succ, total, total - 1)]
    # an allowance of one frame: that frame held is not named, one byte more is
    assert plan_holders(frames, with_passed(total - unit), {}, {me}, slack=unit) == []
    assert plan_holders(frames, with_passed(total - unit - 1), {}, {me}, slack=unit) == [
        (me, succ, total, total - unit - 1)]


def test_what_other_rules_judge_or_nobody_can_tell_is_left_alone() -> None:
    frames = frames_of("all_reduce", "tree", 4)
    liar = next(r for r in range(4) if plan_holders(frames, standstill(frames, r), {}))
    lying = standstill(frames, liar)
    me = frames.ids[liar]
    ((_, succ, _, _),) = plan_holders(frames, lying, {})
    # a send of it under way (to the successor or anyone: it holds up its later sends)
    assert plan_holders(frames, lying, {me: {succ}}) == []
    assert plan_holders(frames, lying, {me: {p for p in frames.ids if p not in (me, succ)}}) == []
    # a send of a partner to it under way
    src = {frames.ids[f.peer] for f in frames.plans[liar].recvs}
    for q in src:
        assert plan_holders(frames, lying, {q: {me}}) == []
    # it, the successor and every partner it receives from must have testified
    for gone in {me, succ, *src}:
        assert plan_holders(frames, {p: r for p, r in lying.items() if p != gone}, {}) == []
    # the successor behind on its frames (took less than it says it sent): the pair rule's case
    behind = {p: dict(r) for p, r in lying.items()}
    for s in {frames.ids[f.peer] for f in frames.plans[liar].sends}:
        behind[me][s] = (behind[s][me][1] + 1, behind[me][s][1])
    assert plan_holders(frames, behind, {}) == []
    # only the peers a testimony can change are judged
    assert plan_holders(frames, lying, {}, candidates={p for p in frames.ids if p != me}) == []
    assert me in affected(frames, succ) and affected(frames, 99) == set()


def test_quantized_frames_have_their_wire_lengths_and_a_quantized_liar_is_named() -> None:
    d = descriptor("all_reduce", "hd", quantization=int(QuantizationAlgorithm.MIN_MAX))
    assert run_schedule(d) == "ring"  # quantized operations run the ring whatever was asked
    frames = frames_of("all_reduce", "hd", 4, quantization=int(QuantizationAlgorithm.MIN_MAX))
    assert frames.schedule == "ring"
    chunk = COUNT // 4
    assert set(frames.send_bytes[0]) == {28 + chunk}  # MIN_MAX metadata + one byte per value
    named = [plan_holders(frames, standstill(frames, liar), {}) for liar in range(4)]
    assert all(h == [] or h[0][0] == frames.ids[liar] for liar, h in enumerate(named)) and any(named)


def test_the_schedules_a_report_may_name_are_the_planners() -> None:
    # op_plans spells them out (the master starts without the collectives): the two lists must agree
    from pccl.collectives.plan import SCHEDULES
    from pccl.master.op_plans import SCHEDULES as REPORTABLE

    assert REPORTABLE == SCHEDULES


def test_what_the_master_cannot_know_is_not_judged() -> None:
    assert run_schedule(descriptor("all_reduce", "auto")) is None  # an unresolved request
    assert op_frames(descriptor("all_reduce", "auto"), IDS[:4]) is None
    assert op_frames(descriptor("no_such_kind", "ring"), IDS[:4]) is None
    assert op_frames(descriptor("broadcast", "tree", root=99), IDS[:4]) is None  # root not a participant
    assert op_frames(descriptor("all_reduce", "ring"), IDS[:4], max_frames=8) is None  # too large
    assert op_frames(descriptor("all_to_all", "ring")._replace(element_count=7), IDS[:4]) is None  # no plan


def test_testimony_judges_by_the_plans_most_participants_report_once_per_operation() -> None:
    frames = frames_of("all_reduce", "tree", 4)
    liar = next(r for r in range(4) if plan_holders(frames, standstill(frames, r), {}))
    lying = standstill(frames, liar)
    me = frames.ids[liar]
    auto = descriptor("all_reduce", "auto")
    t = StallTestimony()
    t.plans.note(5, auto, frames.ids)
    assert t.plans.known(5) and not t.plans.known(6)
    found = []
    # the liar reports another schedule ("ring": under it, it would hold nothing) and testifies first
    order = [me] + [p for p in frames.ids if p != me]
    for i, peer in enumerate(order):
        rows = [(p, s, k) for p, (s, k) in lying[peer].items()]
        t.add(5, peer, rows, schedule="ring" if peer == me else "tree")
        # "auto": not judged until more than half the participants (3 of 4) report the same schedule
        assert (t.plans.schedule(5) == "tree") == (i >= 3)
        found += t.holders(5, peer)
    assert [h[0] for h in found] == [me]  # once, judged under the majority's plans
    # an operation asked for by name is judged by the descriptor's schedule, whatever is reported
    t.plans.note(6, descriptor("all_reduce", "tree"), frames.ids)
    for peer in frames.ids:
        t.add(6, peer, [(p, s, k) for p, (s, k) in lying[peer].items()], schedule="hd")
    assert t.plans.schedule(6) == "tree" and [h[0] for h in t.holders(6)] == [me]
    # reports of no schedule, or by a non-participant, count for nothing
    t.plans.note(7, auto, frames.ids)
    for peer in (*frames.ids[:2], 99, 98):
        t.plans.claim(7, peer, "tree")
    t.plans.claim(7, frames.ids[2], "spiral")
    assert t.plans.schedule(7) is None and t.plans.frames(7) is None


# --- end to end: the default schedule ("auto") --------------------------------------------------------


STALL = 5.0
AUTO = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=STALL)  # schedule "auto", the default


async def test_a_lying_non_reader_under_the_default_schedule_is_removed_alone_after_two_stalls(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    small = 1024  # 4 KiB int32 all-reduces in 1 MiB windows: every send completes, nobody is send-blocked
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=AUTO) as cl:
        assert AUTO.schedule == "auto"
        evil = cl.peer(2)
        lie_about_reading(monkeypatch, cl, evil)
        ran: list[str] = []  # the schedule of each stalled operation, as the master rebuilt its plans
        real_frames = plan_rule.op_frames

        def spy(d: CollectiveDescriptor, participants: list[int]) -> OpFrames | None:
            ran.append(d.schedule)
            return real_frames(d, participants)

        monkeypatch.setattr(plan_rule, "op_frames", spy)
        honest = [cl.peer(i).peer_id for i in cl.alive if cl.peer(i) is not evil]
        t0 = trio.current_time()
        stalls = await stalled_rounds(cl, small, STRIKES + 2, members_are=honest)
        # "auto" picked a schedule other than the ring for 4 KiB among 4 peers: the ring rule alone
        # would not have judged it
        assert len(ran) == STRIKES and "ring" not in ran, ran
        assert "took 0 of them" not in caplog.text  # the pairs agreed: the lie hid it from them
        assert stalls == STRIKES  # then it was gone, and nothing stalled again
        assert evil.peer_id not in cl.master.state.peers
        assert all(p in cl.master.state.peers for p in honest)
        assert f"peer {evil.peer_id} evicted: its testimony contradicted itself in 2 operations" \
            in caplog.text
        assert trio.current_time() - t0 < STRIKES * (STALL + 2) + 5


# --- a liar naming an honest member (issue 33: its sends "under way", stalled_on / blocked) -----------


def test_a_send_under_way_that_the_accusers_own_testimony_leaves_no_frame_for_is_false() -> None:
    frames = frames_of("all_reduce", "ring", 4)
    liar = 1
    me, pred, succ = frames.ids[liar], frames.ids[0], frames.ids[2]
    lying = standstill(frames, liar)
    rows = lying[me]
    # it sends nothing to its predecessor (a ring sends to the successor only): a send "under way" to
    # it, or to a peer that is no participant, is false
    assert false_blocks(frames, me, rows, [pred, 99]) == [pred, 99]
    # to its successor, while it says it took frames whose releases it has not sent: it may be true
    # (a successor that does not read holds them), so it stands: a liar saying so takes its successor
    # down with it as before (docs/security.md)
    _, owed = released(frames, liar, {q: rows[frames.ids[q]][1] for q in (0, 2, 3)})
    assert owed[2] > rows[succ][0] and false_blocks(frames, me, rows, [succ]) == []
    # ... but not once it says it sent every frame its plan released to it
    done = {**rows, succ: (owed[2], rows[succ][1])}
    assert false_blocks(frames, me, done, [succ]) == [succ]
    # an honest peer's report is never false: in every standstill of every combination, each peer whose
    # last frame to a partner is still being written (not counted as sent) names that partner
    for kind, schedule, n in COMBOS:
        f = frames_of(kind, schedule, n)
        for stuck in range(n):
            t = standstill(f, stuck, lie=False)
            for r, peer in enumerate(f.ids):
                for s in range(n):
                    sent = t[peer].get(f.ids[s], (0, 0))[0]
                    if s == r or sent == 0:
                        continue
                    last = max(b for j, b in enumerate(f.send_bytes[r]) if f.plans[r].sends[j].peer == s)
                    under_way = {**t[peer], f.ids[s]: (sent - min(last, sent), t[peer][f.ids[s]][1])}
                    assert false_blocks(f, peer, under_way, [f.ids[s]]) == [], (kind, schedule, n, r, s)


async def test_a_liar_naming_a_member_it_sends_nothing_is_removed_alone(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lying non-reader also says its send to its ring predecessor was under way (``blocked``): it
    sends that peer nothing, so the accusation is false and it alone is struck; before, the accusation
    counted like a ``stalled_on`` and the predecessor left with it."""
    caplog.set_level(logging.WARNING, logger="pccl")
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    cfg = dataclasses.replace(AUTO, schedule="ring")
    async with open_test_cluster(4, network=net, config=cfg) as cl:
        evil = cl.peer(2)
        lie_about_reading(monkeypatch, cl, evil)
        ring = [cl.peer(i).peer_id for i in cl.alive]
        pred = ring[ring.index(evil.peer_id) - 1]
        real_blocked = type(evil.pool).op_blocked

        def naming(self: object, op_seq: int) -> list[int]:
            got: list[int] = real_blocked(self, op_seq)  # type: ignore[arg-type]
            return [pred] if self is evil.pool else got

        monkeypatch.setattr(type(evil.pool), "op_blocked", naming)
        honest = [p for p in ring if p != evil.peer_id]
        stalls = await stalled_rounds(cl, 1024, STRIKES + 2, members_are=honest)
        assert stalls == STRIKES
        assert evil.peer_id not in cl.master.state.peers and pred in cl.master.state.peers
        assert all(p in cl.master.state.peers for p in honest)
        assert f"peer {evil.peer_id} says its sends to [{pred}] were under way" in caplog.text
        assert f"peer {evil.peer_id} evicted: its testimony contradicted itself in 2 operations" \
            in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_the_frame_estimate_is_generous(kind: str) -> None:
    """The master builds no more plans than :data:`~pccl.master.plan_rule.MAX_FRAMES` allows: the
    estimate it checks first is never below what it then builds."""
    k = get_kind(kind)
    sizes_of = itertools.product(("ring", "hd", "tree"), (2, 3, 5, 8), (0, 7, 96), (3, 64))
    for schedule, n, count, block in sizes_of:
        if k.size_problem(n, count, count * n if kind == "all_gather" else count) is not None:
            continue
        run = k.run_schedule(schedule)
        try:
            plans = [build_plan(k, n, r, count, 1, schedule=run, block_bytes=block) for r in range(n)]
        except ValueError:
            continue
        built = sum(len(p.sends) + len(p.recvs) for p in plans)
        assert built <= estimated_frames(run, n, count, block), (schedule, n, count, block)
