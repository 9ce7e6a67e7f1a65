"""Issue 33, the plan rule's cost per report (pccl/master/plan_rule.py ``report_frames``,
pccl/master/testimony.py ``holders``): a report's judgement builds only the plans of the peers its
testimony can change and of the partners those receive from, so the cap (``MAX_FRAMES``) bounds the
master's work per report rather than every participant's plans together; reporters that testified before
an ``"auto"`` operation's schedule was agreed are judged once it is (one more per report on a large
operation), so a liar among them is still found."""

from __future__ import annotations

import itertools

import pytest

from pccl.collectives.kinds import KINDS, get_kind
from pccl.collectives.op_plan import DEFAULT_BLOCK_BYTES
from pccl.master import plan_rule
from pccl.master import testimony as testimony_module
from pccl.master.plan_rule import OpFrames, op_frames, plan_holders, report_frames
from pccl.master.testimony import StallTestimony

from .test_plan_holder import descriptor, standstill


def built(frames: OpFrames) -> int:
    """Frames of the plans built so far."""
    got = frames.plans._got  # type: ignore[attr-defined]
    return sum(len(p.sends) + len(p.recvs) for p in got.values())


@pytest.mark.parametrize("kind", KINDS)
def test_one_report_builds_no_more_than_its_estimate(kind: str) -> None:
    k = get_kind(kind)
    for schedule, n in itertools.product(("ring", "hd", "tree"), (3, 5, 8, 13, 24, 64, 100)):
        ids = tuple(range(1, n + 1))
        d = descriptor(kind, schedule, ids[1] if k.rooted else -1)
        whole = op_frames(d, ids, max_frames=1 << 40)
        if whole is None:
            continue
        testimony = standstill(whole, 0)
        run = plan_rule.run_schedule(d)
        assert run is not None
        block = max(1, DEFAULT_BLOCK_BYTES // 4)
        limit = report_frames(run, n, d.element_count, block, kind)
        for reporter in ids:
            t = StallTestimony()
            t.plans.note(3, d, ids)
            rows = [(p, s, r) for p, (s, r) in testimony[reporter].items()]
            t.add(3, reporter, rows, schedule=run)
            t.false_blocks(3, reporter, rows, ids, run)
            t.holders(3, reporter)
            t.last_holder(3, reporter, rows, set(), run)
            frames = t.plans.frames(3)
            if frames is None:
                assert limit > plan_rule.MAX_FRAMES  # over the cap: not planned
                break
            assert built(frames) <= limit, (kind, schedule, n, reporter)


def test_a_large_ring_is_judged_without_building_every_plan() -> None:
    n = 64  # over the former cap on all the plans together (32,256 frames estimated), under this one
    ids = tuple(range(1, n + 1))
    d = descriptor("all_reduce", "ring")
    t = StallTestimony()
    t.plans.note(3, d, ids)
    whole = op_frames(d, ids, max_frames=1 << 40)
    assert whole is not None and whole.estimate > plan_rule.MAX_FRAMES
    testimony = standstill(whole, 5)
    liar = ids[5]
    found = []
    before = 0
    for reporter in ids:
        t.add(3, reporter, [(p, s, r) for p, (s, r) in testimony[reporter].items()], schedule="ring")
        found += t.holders(3, reporter)
        frames = t.plans.frames(3)
        assert frames is not None
        now = len(frames.plans._got)  # type: ignore[attr-defined]
        assert now - before <= 5, reporter  # the plans of its neighbourhood, not every participant's
        before = now
    assert [h[0] for h in found] == [h[0] for h in plan_holders(whole, testimony, {})] == [liar]


def test_early_reporters_of_a_large_auto_operation_are_judged_one_more_per_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 8
    ids = tuple(range(1, n + 1))
    whole = op_frames(descriptor("all_reduce", "hd"), ids)
    assert whole is not None
    for liar in range(n):
        testimony = standstill(whole, liar)
        if not plan_holders(whole, testimony, {}):
            continue
        me = ids[liar]
        for large in (False, True):
            if large:  # every plan together over the cap: the early reporters drain one per report
                monkeypatch.setattr(testimony_module, "JUDGE_ALL_FRAMES", whole.estimate - 1)
            t = StallTestimony()
            t.plans.note(4, descriptor("all_reduce", "auto"), ids)
            # the liar first, then its partners' reports; the schedule agreed at the fifth report
            order = [me] + [p for p in ids if p != me]
            found = []
            for peer in order:
                t.add(4, peer, [(p, s, r) for p, (s, r) in testimony[peer].items()], schedule="hd")
                found += t.holders(4, peer)
            assert [h[0] for h in found] == [me], (liar, large)
            monkeypatch.undo()
