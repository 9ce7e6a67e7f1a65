"""Issue 33, the member that sends its frames out of release order: it sends its receiver, in place of
each frame its plan released, the next one (``seq + 1``, the same length, garbage data), so its bytes
agree with its plan and with what the receiver took, and the receiver takes them into the later frames'
registered receives and waits for the first, which never comes. By what the receiver took, the master's
plan rule (pccl/master/plan_rule.py) read it as having completed the receives those bytes cover in the
sender's release order, and so as holding the sends they released: before this work the honest receiver
was struck alone and removed after two stalled operations, the sender stayed. Now the receiver reports
the partner whose later frame filled while an earlier one from it stayed open through the stall
(``CollectiveDone.early``, pccl/peer/early_frames.py): it is not judged as a holder for that operation
and its report accuses the partner (the pair rule: both leave at the second). Virtual network and time."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import trio
import trio.testing

from pccl.collectives.kinds import get_kind
from pccl.master.blame import STRIKES
from pccl.master.plan_rule import OpFrames, false_early, plan_holders
from pccl.master.testimony import StallTestimony
from pccl.peer.communicator import Communicator
from pccl.peer.early_frames import early_partners, release_order
from pccl.testing import DEFAULT_PEER_CONFIG, TestCluster, VirtualNetwork, open_test_cluster

from ._helpers import stalled_rounds
from .test_plan_holder import COMBOS, descriptor, frames_of

STALL = 5.0


def send_shifted(monkeypatch: pytest.MonkeyPatch, evil: Communicator, victim: int) -> list[int]:
    """``evil`` sends each frame meant for ``victim`` as the next frame (``seq + 1``). Returns the list
    the victim's id is appended to, once per frame shifted."""
    assert evil.pool is not None
    links = evil.pool.links
    real = type(links).send
    victims: list[int] = []

    async def send(self: Any, peer_id: int, tag: int, op_seq: int, seq: int, data: memoryview, *,
                   conn_index: int) -> None:
        if self is links and peer_id == victim:
            victims.append(peer_id)
            seq += 1
        await real(self, peer_id, tag, op_seq, seq, data, conn_index=conn_index)

    monkeypatch.setattr(type(links), "send", send)
    return victims


def successor(cl: TestCluster, evil: Communicator) -> int:
    ring = list(cl.master.state.ring)
    return ring[(ring.index(evil.peer_id) + 1) % len(ring)]


async def test_a_member_sending_out_of_release_order_leaves_with_the_receiver_it_accuses(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, p2p_stall_timeout=STALL, schedule="ring")
    net = VirtualNetwork(latency=0.0005, buffer_size=1 << 20)
    async with open_test_cluster(4, network=net, config=cfg) as cl:
        evil = cl.peer(1)
        victim = successor(cl, evil)
        others = sorted(p for p in cl.master.state.ring if p not in (evil.peer_id, victim))
        shifted = send_shifted(monkeypatch, evil, victim)
        t0 = trio.current_time()
        stalls = await stalled_rounds(cl, 1024, STRIKES + 3)
        assert shifted and set(shifted) == {victim}
        assert stalls == STRIKES, caplog.text  # then it was gone, and nothing stalled again
        # the honest receiver was not struck as a holder: it leaves only with the member it accuses
        assert f"peer {victim} evicted: its testimony contradicted itself" not in caplog.text, caplog.text
        assert f"filled while an earlier one from peer {evil.peer_id}" in caplog.text
        assert evil.peer_id not in cl.master.state.ring
        assert sorted(cl.master.state.ring) == others
        assert trio.current_time() - t0 < STRIKES * (2 * STALL + 2) + 5


# ---------------------------------------------------------------------------------------------------
# pure: every kind under every schedule, the sender at every position, each of its receivers the victim

Testimony = dict[int, dict[int, tuple[int, int]]]


def standstill_shifted(frames: OpFrames, liar: int, victim: int | None,
                       reads: bool = True) -> tuple[Testimony, list[set[tuple[int, int]]]]:
    """Every peer's testimony, and the frames ``(sender rank, seq)`` each rank took whole, once the
    operation stood still. Every peer takes whatever arrives (into its frame's registered receive) and
    works through its receives in plan order, sending what its plan releases; the ``liar`` sends
    ``victim``, in place of the frame at each position of its release order to it, the next one (the
    last none), and otherwise runs its plan (``reads``; else it reads nothing: the non-reader)."""
    plans, n = frames.plans, len(frames.ids)
    nbytes = [{p.sends[j].seq: frames.send_bytes[r][j] for j in range(len(p.sends))}
              for r, p in enumerate(plans)]
    done = [0] * n
    emitted = [set[int]() for _ in range(n)]
    arrived = [set[tuple[int, int]]() for _ in range(n)]
    sent = [[0] * n for _ in range(n)]
    to_victim = [j for j in release_order(plans[liar]) if plans[liar].sends[j].peer == victim]
    moved = True
    while moved:
        moved = False
        for r, plan in enumerate(plans):
            for j in list(plan.initial) + [j for u in plan.unlocks[:done[r]] for j in u]:
                if j in emitted[r]:
                    continue
                emitted[r].add(j)
                moved = True
                if r == liar and j in to_victim:
                    k = to_victim.index(j) + 1
                    if k >= len(to_victim):
                        continue
                    j = to_victim[k]
                f = plan.sends[j]
                arrived[f.peer].add((r, f.seq))
                sent[r][f.peer] += nbytes[r][f.seq]
            while (r != liar or reads) and done[r] < len(plan.recvs):
                g = plan.recvs[done[r]]
                if (g.peer, g.seq) not in arrived[r]:
                    break
                done[r] += 1
                moved = True
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for r in range(n):
        took = [0] * n
        for q, seq in arrived[r]:
            took[q] += nbytes[q][seq]
        if r == liar and not reads:
            took = [0] * n
        out[frames.ids[r]] = {frames.ids[q]: (sent[r][q], took[q]) for q in range(n) if q != r}
    return out, arrived


def early_of(frames: OpFrames, r: int, arrived: set[tuple[int, int]]) -> list[int]:
    ids = list(frames.ids)
    return early_partners(frames.plans[r], r, ids, 0, lambda q: frames.plans[q],
                          {(ids[q], 0, seq) for q, seq in arrived})


@pytest.mark.parametrize(("kind", "schedule", "n"), COMBOS)
def test_an_honest_receiver_is_never_named_and_names_only_the_sender_out_of_order(
    kind: str, schedule: str, n: int,
) -> None:
    frames = frames_of(kind, schedule, n)
    for liar in range(n):
        # a non-reader (truthful or lying) sends in order: no honest peer reports a frame out of order
        _, arrived = standstill_shifted(frames, liar, None, reads=False)
        assert all(early_of(frames, r, arrived[r]) == [] for r in range(n) if r != liar)
        for victim in sorted({f.peer for f in frames.plans[liar].sends}):
            testimony, arrived = standstill_shifted(frames, liar, victim)
            early = {frames.ids[r]: early_of(frames, r, arrived[r]) for r in range(n) if r != liar}
            # only the victim reports, and only the liar
            assert all(e == [] for p, e in early.items() if p != frames.ids[victim]), early
            assert early[frames.ids[victim]] in ([], [frames.ids[liar]])
            # an honest report is never false by its own testimony
            for p, e in early.items():
                assert false_early(frames, p, testimony[p], e) == []
            store = StallTestimony()
            store.plans.note(1, descriptor(kind, schedule, frames.ids[1] if get_kind(kind).rooted else -1),
                             list(frames.ids))
            for p, rows in testimony.items():
                store.add(1, p, [(q, s, k) for q, (s, k) in rows.items()], early=early.get(p, ()))
            named = {h for h, *_ in store.holders(1)}
            assert named <= {frames.ids[liar]}, (liar, victim, named, early)
            by_bytes = {h for h, *_ in plan_holders(frames, testimony, {})}  # the rule without the report
            if frames.ids[victim] in by_bytes:
                # wherever its bytes alone would make it a holder, it reports the sender
                assert early[frames.ids[victim]] == [frames.ids[liar]], (liar, victim)


def test_without_the_report_the_receiver_of_a_shifted_sender_is_named() -> None:
    """The attack the report answers: a ring all-reduce, the sender shifting its frames by one; by its
    bytes alone the honest receiver holds what its plan released (the end-to-end test above, pure)."""
    frames = frames_of("all_reduce", "ring", 4)
    liar, victim = 1, 2
    testimony, arrived = standstill_shifted(frames, liar, victim)
    assert frames.ids[victim] in {h for h, *_ in plan_holders(frames, testimony, {})}
    assert early_of(frames, victim, arrived[victim]) == [frames.ids[liar]]


def test_a_report_its_own_testimony_shows_no_frame_for_is_false() -> None:
    """A partner it receives nothing from, or one it says it took nothing from, cannot have sent it a
    frame out of order: the master strikes such a reporter alone (pccl/master/server.py)."""
    frames = frames_of("all_reduce", "ring", 4)
    ids = frames.ids
    testimony, _ = standstill_shifted(frames, 1, 2)
    victim = ids[2]
    assert false_early(frames, victim, testimony[victim], [ids[1]]) == []  # the real one
    # on a ring it receives only from its predecessor
    assert false_early(frames, victim, testimony[victim], [ids[3], ids[0]]) == [ids[3], ids[0]]
    took_nothing = {**testimony[victim], ids[1]: (testimony[victim][ids[1]][0], 0)}
    assert false_early(frames, victim, took_nothing, [ids[1]]) == [ids[1]]
