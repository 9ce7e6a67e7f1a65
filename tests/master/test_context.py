"""The rounds' view of the master (pccl/master/context.py ``MasterContext``) and the bound handler table,
each checked on a real ``MasterState``: what the rounds read (group sizes, members, the peers left out
while they heal), the sequence numbers, and that every message type reaches its part in one call."""

from __future__ import annotations

from pccl.master.state import MasterState, _Part
from pccl.wire import messages as m

from ._effects import sends
from .test_state import Harness


def _group(n: int, group: int = 0) -> tuple[Harness, list[int]]:
    hs = Harness()
    ids = [hs.join(group)[0] for _ in range(n)]
    hs.update([ids[0]])
    assert hs.st.accepted() == ids
    return hs, ids


def test_the_context_reads_the_membership_it_is_built_on() -> None:
    hs, ids = _group(3)
    ctx = hs.st.context
    assert ctx.group_size(0) == 3 and ctx.group_size(7) == 0
    assert ctx.accepted(0) == ids and ctx.accepted(7) == []
    assert ctx.known(ids[0]) and not ctx.known(999)
    assert [r.peer_id for r in ctx.table(ids[:2])] == ids[:2]
    hs.st.peer_lost(ids[2], "gone")
    assert ctx.group_size(0) == 2 and not ctx.known(ids[2])  # the counts follow the ring


def test_nobody_is_left_out_without_a_live_heal_and_a_healer_is() -> None:
    hs, (a, b, c) = _group(3)
    ctx, heals = hs.st.context, hs.st.heals
    assert ctx.left_out(0, "op") == frozenset() and ctx.left_out(0, "sync") == frozenset()
    assert not heals.moved  # nothing asked of the heal book: no group went on without a healer
    heals.start(seq=9, group=0, revision=1, fetchers=[c], donors=[a, b])
    assert ctx.left_out(0, "op") == {c} and ctx.left_out(0, "sync") == {c}
    assert ctx.left_out(1, "op") == frozenset()
    assert heals.moved == {c}  # a vote of its group went on without it


def test_sequence_numbers_are_fresh_and_settling_an_op_is_recorded() -> None:
    hs, _ = _group(2)
    ctx = hs.st.context
    first = ctx.next_op_seq()
    assert ctx.next_op_seq() == first + 1 and hs.st._op_seq == first + 1
    sync = ctx.next_sync_seq()
    assert ctx.next_sync_seq() == sync + 1 and hs.st._sync_seq == sync + 1
    ctx.sync_settled(0, sync, True, revision=5)
    assert ctx.revision_of(0) == 5 and hs.st.statistics()["revisions"] == {0: 5}


def test_every_message_type_reaches_its_part_bound_once() -> None:
    st = MasterState()
    for kind, entry in MasterState._HANDLERS.items():
        bound = st._handlers[kind]
        if isinstance(entry, _Part):
            assert getattr(bound, "__self__", None) is getattr(st, entry.part), kind
            assert getattr(bound, "__name__", None) == entry.method, kind
        else:
            assert getattr(bound, "__self__", None) is st, kind
    assert set(st._handlers) == set(MasterState._HANDLERS)


def test_a_collective_vote_completes_through_the_context_only_when_every_member_voted() -> None:
    hs, ids = _group(3)
    desc = m.CollectiveDescriptor("all_reduce", 6, 8, 0, 0, 0, 0)
    for p in ids[:-1]:
        assert hs.h(p, m.CollectiveInitiate(tag=1, descriptor=desc)) == []
    assert hs.st.context.check_op((0, 1)) == []  # two of three voted: nothing to do
    eff = hs.h(ids[-1], m.CollectiveInitiate(tag=1, descriptor=desc))
    assert [p for p, _ in sends(eff, m.CollectiveCommence)] == ids
