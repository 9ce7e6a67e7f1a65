"""Issue 18: a restarted or standby master rebuilds the run from the members' re-registrations.

The pure MasterState driven message by message (docs/concepts.md "Surviving the master").
"""

from __future__ import annotations

from typing import Any

from pccl import Result
from pccl.master.state import Kick, MasterState, Send
from pccl.wire import messages as m

from ._effects import kicks, member_reregister, sends


class Harness:
    """A live master with members joined and admitted the ordinary way."""

    def __init__(self) -> None:
        self.st = MasterState()

    def join(self) -> tuple[int, list[Any]]:
        pid = self.st.new_connection("127.0.0.1", 0.0)
        return pid, self.st.handle(pid, m.Register(p2p_port=40000 + pid), 0.0)

    def update(self, voters: list[int]) -> None:
        eff: list[Any] = []
        for p in voters:
            eff += self.st.handle(p, m.UpdateTopologyVote(), 0.0)
        for pid, msg in sends(eff, m.EstablishP2P):
            self.st.handle(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True), 0.0)

RING = [3, 1, 2]  # the last epoch's members, ring order (not id order)
EPOCH = 7


def rereg(st: MasterState, pid: int, *, epoch: int = EPOCH, ring: list[int] | None = None, revision: int = 4,
          generation: int = 1, group: int = 0, claim: int | None = None) -> tuple[int, list[Any]]:
    got = st.new_connection("127.0.0.1", 0.0, claim=pid if claim is None else claim)
    msg = member_reregister(st, peer_id=pid, p2p_port=40000 + pid, peer_group=group, epoch=epoch,
                       ring=list(RING if ring is None else ring), revision=revision, generation=generation)
    return got, st.handle(got, msg, 0.0)


def test_restarted_master_adopts_epoch_ring_revision_and_a_newer_generation() -> None:
    st = MasterState()
    pid, eff = rereg(st, 1, generation=3)
    assert pid == 1  # the claimed id is granted
    (who, ok), = sends(eff, m.Reregistered)
    assert who == 1 and ok == m.Reregistered(peer_id=1, generation=4, epoch=EPOCH)
    s = st.statistics()
    assert s["generation"] == 4 and s["epoch"] == EPOCH and s["rebuilding"]
    assert s["revisions"] == {0: 4}
    assert st.accepted() == [1]  # taken back at once, no admission vote


def test_votes_wait_for_a_majority_of_the_last_epoch_then_resume_in_the_old_ring_order() -> None:
    st = MasterState()
    rereg(st, 1)
    desc = m.CollectiveDescriptor("all_reduce", 1, 10, 0, -1, 0, 0)
    # 1 of 3 back: its all-reduce vote does not complete (it would run alone otherwise)
    assert not sends(st.handle(1, m.CollectiveInitiate(tag=0, descriptor=desc), 0.0), m.CollectiveCommence)
    assert not sends(st.handle(1, m.PeersPendingVote(), 0.0))
    _, eff = rereg(st, 2)  # 2 of 3: a majority
    assert not st.statistics()["rebuilding"]
    # the votes now wait for peer 2 (a member again), then complete
    assert not sends(eff, m.PeersPendingResult) and not sends(eff, m.CollectiveCommence)
    answered = sends(st.handle(2, m.PeersPendingVote(), 0.0), m.PeersPendingResult)
    assert sorted(p for p, _ in answered) == [1, 2]
    eff = st.handle(2, m.CollectiveInitiate(tag=0, descriptor=desc), 0.0)
    commence = sends(eff, m.CollectiveCommence)
    assert sorted(p for p, _ in commence) == [1, 2]
    assert commence[0][1].op_seq >= 2 << 24  # generation 2: above generation 1
    # the latecomer is taken back too, in its old place in the ring
    _, eff = rereg(st, 3)
    assert sends(eff, m.Reregistered) and st.accepted() == RING


def test_rebuilt_master_admits_newcomers_by_vote_as_usual() -> None:
    st = MasterState()
    rereg(st, 1, ring=[1, 2])
    rereg(st, 2, ring=[1, 2])
    pid = st.new_connection("127.0.0.1", 0.0)
    assert pid == 3  # fresh ids never collide with the members'
    eff = st.handle(pid, m.Register(p2p_port=40003), 0.0)
    (_, reg), = sends(eff, m.Registered)
    assert reg.generation == 2 and not sends(eff, m.Accepted)
    assert st.registered() == [3]


def test_a_newcomer_is_not_accepted_alone_while_rebuilding() -> None:
    st = MasterState()
    rereg(st, 1)
    st.peer_lost(1, "left")
    pid = st.new_connection("127.0.0.1", 0.0)
    assert not sends(st.handle(pid, m.Register(p2p_port=40009), 0.0), m.Accepted)


def test_a_peer_of_a_newer_generation_refuses_an_older_master() -> None:
    hs = Harness()  # a live master of generation 1 with a member
    a, _ = hs.join()
    # Its first topology round completed: a run, no longer a newcomer accepted alone at a master
    # that held no run (that one yields to re-registering members: tests/master/test_quorum.py).
    hs.update([a])
    assert hs.st.generation == 1
    pid, eff = rereg(hs.st, 5, ring=[5], generation=2)
    (k,) = kicks(eff)
    assert k.peer_id == pid and k.code == int(Result.MASTER_CONNECTION_FAILED) and "older" in k.reason
    assert hs.st.accepted() == [a]


def test_live_master_takes_a_dropped_member_back_only_in_the_same_epoch() -> None:
    hs = Harness()
    a, _ = hs.join()
    b, _ = hs.join()
    hs.update([a])
    epoch = hs.st.epoch
    hs.st.peer_lost(b, "left (connection closed)")
    pid, eff = rereg(hs.st, b, epoch=epoch, ring=[a, b], generation=1)
    assert pid == b and sends(eff, m.Reregistered) and hs.st.accepted() == [a, b]
    hs.st.peer_lost(b, "left (connection closed)")
    _, eff = rereg(hs.st, b, epoch=epoch - 1, ring=[a, b], generation=1)
    # KICKED (final for the peer): the run moved to another epoch without it. It was a retryable
    # MASTER_CONNECTION_FAILED, which left the peer retrying for its whole window (60 s by default).
    assert [k.code for k in kicks(eff)] == [int(Result.KICKED)]
    assert hs.st.accepted() == [a]


def test_a_claimed_id_still_held_is_not_granted_and_the_reregister_is_refused() -> None:
    st = MasterState()
    rereg(st, 1)
    pid, eff = rereg(st, 1)  # id 1 is connected: a fresh id, and the Reregister is refused
    assert pid != 1
    assert [type(e) for e in eff if isinstance(e, (Kick, Send))] == [Kick]


def test_an_older_epoch_than_the_rebuild_is_refused_a_newer_one_replaces_the_ring() -> None:
    st = MasterState()
    rereg(st, 1, epoch=EPOCH, ring=[1, 2, 3, 4, 5])
    _, eff = rereg(st, 2, epoch=EPOCH - 1)
    assert kicks(eff)
    _, eff = rereg(st, 3, epoch=EPOCH + 1, ring=[1, 3])  # knows a newer epoch: 2 of 2 back
    assert sends(eff, m.Reregistered)
    s = st.statistics()
    assert s["epoch"] == EPOCH + 1 and not s["rebuilding"] and st.accepted() == [1, 3]


def test_rebuilding_from_a_member_that_missed_a_newer_master_moves_on_to_the_newer_generation() -> None:
    """Issue 18, found by the chaos test with master restarts: the first member back had been away while
    the run went on at a newer master (it reports generation 3, the others 5). The rebuild follows the
    newer one, and the member that missed it must join again (refused for good: KICKED)."""
    st = MasterState()
    rereg(st, 1, generation=3)
    assert st.generation == 4
    _, eff = rereg(st, 2, generation=5)
    assert st.generation == 6 and st.statistics()["rebuilding"]
    (kick,) = kicks(eff)
    assert kick.peer_id == 1 and kick.code == int(Result.KICKED) and "generation 3" in kick.reason
    (who, ok), = sends(eff, m.Reregistered)
    assert who == 2 and ok.generation == 6
    assert st.accepted() == [2]


def test_a_member_that_missed_a_newer_master_is_refused_in_either_order() -> None:
    st = MasterState()
    rereg(st, 2, generation=5)
    _, eff = rereg(st, 1, generation=3)  # after the newer one: the same outcome as before it
    (kick,) = kicks(eff)
    assert kick.peer_id == 1 and kick.code == int(Result.KICKED) and st.generation == 6
    assert st.accepted() == [2]


def test_a_member_its_group_no_longer_lists_is_refused_in_either_order() -> None:
    """Found by the chaos test with master restarts: peer 3 was dropped from the group (peers 1 and 2 ran
    operations without it, their tables no longer list it) but re-registers with the same epoch."""
    for order in ([3, 1, 2], [1, 2, 3]):
        st = MasterState()
        out: list[Any] = []
        for pid in order:
            ring = [1, 2, 3] if pid == 3 else [1, 2]
            out += rereg(st, pid, ring=ring)[1]
        assert [k.peer_id for k in kicks(out)] == [3] and kicks(out)[0].code == int(Result.KICKED), order
        assert sorted(st.accepted()) == [1, 2], order


def test_a_member_of_another_group_gets_credentials_for_its_own_groups_ring_whoever_returned_first() -> None:
    # Two groups: the rebuild's expected ring comes from the first peer back (group 1). A group-0 member
    # returning next must hold the P2P keys of every member of its own group's ring once those are back
    # too, whatever the order; without them its first collective fails at connect ("the master issued
    # none for it") and retries in a loop (found by the chaos test with master restarts). Since protocol 5
    # the master knows a member's key only once it is back: each one back gets the table of those back,
    # and those back before it get its row.
    st = MasterState()
    rereg(st, 5, ring=[5, 6, 7], group=1)
    _, eff = rereg(st, 1, ring=[1, 2, 3], group=0)
    mine = dict(sends(eff, m.P2PCredentials))
    assert {row.peer_id for row in mine[1].keys} == {1, 5}
    assert [row.peer_id for row in mine[5].keys] == [1]
    for late in (3, 2):
        _, eff = rereg(st, late, ring=[1, 2, 3], group=0)
        got = dict(sends(eff, m.P2PCredentials))
        assert [row.peer_id for row in got[1].keys] == [late]  # 1 learns the key of each one back after it
        assert {row.peer_id for row in got[late].keys} >= {1, 5}


def test_a_member_taken_back_during_the_rebuild_that_leaves_and_returns_is_taken_back_again() -> None:
    """Found by tests/integration/test_live_master_link.py (links reset at random): a member back during
    the rebuild (generation 1, taken back into this master's generation 2) loses its link before a
    majority is back and re-registers reporting generation 2, this master's own. That is not a newer
    master: before, the rebuild moved on to generation 3, refused the members back so far as having
    missed it, and the master crashed (KeyError) refusing the member's own earlier entry."""
    ring = [1, 2, 3, 4, 5]
    st = MasterState()
    rereg(st, 1, ring=ring)
    rereg(st, 2, ring=ring)
    assert st.generation == 2 and st.statistics()["rebuilding"]  # 2 of 5: no majority yet
    st.peer_lost(1, "left (connection closed)", 0.0, broken=True)
    _, eff = rereg(st, 1, ring=ring, generation=2)
    assert not kicks(eff) and st.generation == 2
    (who, ok), = sends(eff, m.Reregistered)
    assert who == 1 and ok.generation == 2
    _, eff = rereg(st, 3, ring=ring)  # the majority: the rebuild ends with the three of them
    assert not kicks(eff) and not st.statistics()["rebuilding"] and sorted(st.accepted()) == [1, 2, 3]
