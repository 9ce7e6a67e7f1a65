"""Which newcomer holds up which vote, alone (pccl/master/admission.py ``newcomer_waits``)."""

from __future__ import annotations

from pccl.master.admission import OpenVote, newcomer_waits


def test_nothing_without_newcomers_or_votes() -> None:
    assert newcomer_waits({}, [OpenVote("sync", 1.0, 0, {1})]) == []
    assert newcomer_waits({5: (0, 0.0)}, []) == []


def test_the_oldest_vote_it_misses_counted_from_its_admission() -> None:
    votes = [
        OpenVote("collective", 4.0, 0, {1, 2}, tag=7),
        OpenVote("sync", 3.0, 1, {3}),  # another group's: not its business
        OpenVote("collective", 2.0, 0, {1, 5}, tag=6),  # it voted here
        OpenVote("update_topology", 6.0, None, {1}),
    ]
    assert newcomer_waits({5: (0, 1.0)}, votes) == [(5, 4.0, "collective tag 7 (group 0) vote", [1, 2])]
    # admitted after the vote opened: it holds the others up from its admission on
    assert newcomer_waits({5: (0, 5.0)}, votes)[0][1] == 5.0


def test_a_ring_wide_vote_concerns_every_group_and_ties_go_to_the_first_listed() -> None:
    votes = [
        OpenVote("are_peers_pending", 2.0, None, {1}),
        OpenVote("collective", 2.0, 3, {1}, tag=1),
    ]
    got = newcomer_waits({8: (3, 0.0), 9: (4, 0.0)}, votes)
    assert got == [(8, 2.0, "are_peers_pending vote", [1]), (9, 2.0, "are_peers_pending vote", [1])]
    assert newcomer_waits({8: (3, 0.0)}, votes[::-1])[0][2] == "collective tag 1 (group 3) vote"


def test_a_newcomer_in_every_vote_holds_nobody_up() -> None:
    votes = [OpenVote("sync", 1.0, 0, {4, 5}), OpenVote("optimize_topology", 0.5, None, {5})]
    assert newcomer_waits({5: (0, 0.0)}, votes) == []
    assert [w[0] for w in newcomer_waits({4: (0, 0.0), 5: (0, 0.0)}, votes)] == [4]
