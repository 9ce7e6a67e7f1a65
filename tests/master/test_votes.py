"""The vote rounds alone (pccl/master/votes.py): the unanimity rule and the are_peers_pending round,
message by message, without a MasterState."""

from __future__ import annotations

from pccl.master.votes import PendingRound, unanimous


def test_unanimous_counts_first_then_walks_the_members_once() -> None:
    walks: list[int] = []

    def members() -> list[int]:
        walks.append(1)
        return [1, 2, 3]

    assert unanimous(set(), 0, members) is None  # nothing asked: never complete
    assert unanimous({1, 2}, 3, members) is None and walks == []  # too few ballots: no walk
    assert unanimous({1, 2, 9}, 3, members) is None and len(walks) == 1  # 9 is no member, 3 missing
    assert unanimous({1, 2, 3}, 3, members) == [1, 2, 3] and len(walks) == 2
    assert unanimous({3, 2, 1, 4}, 3, members) == [1, 2, 3]  # extra ballots do not hurt


def test_pending_round_opens_at_the_first_ballot_and_answers_in_ring_order() -> None:
    rnd = PendingRound()
    ring = [3, 1, 2]
    assert not rnd.open and rnd.waiting(ring) == {1, 2, 3}
    assert rnd.vote(1, 5.0) and rnd.open and rnd.opened == 5.0
    assert not rnd.vote(1, 6.0)  # a duplicate ballot is refused
    assert rnd.vote(2, 7.0) and rnd.opened == 5.0  # the clock runs from the first ballot
    assert rnd.waiting(ring) == {3} and not rnd.complete(ring)
    assert rnd.vote(3, 8.0) and rnd.complete(ring)
    assert rnd.take(ring) == [3, 1, 2] and not rnd.open


def test_pending_round_without_a_lost_voter_and_with_ballots_that_arrive_together() -> None:
    rnd = PendingRound()
    rnd.vote(1, 1.0)
    rnd.vote(2, 1.5)
    rnd.peer_lost(2)  # its ballot no longer counts ...
    assert rnd.votes == {1} and not rnd.complete([1, 2])
    assert rnd.complete([1])  # ... and once it is out of the ring the others complete
    rnd.take([1])
    rnd.add([4, 5], 9.0)  # a round in doubt that runs here: its voters at once
    assert rnd.opened == 9.0 and rnd.complete([4, 5])
    rnd.add([], 10.0)
    assert rnd.opened == 9.0
