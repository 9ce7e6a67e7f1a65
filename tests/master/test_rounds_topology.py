"""The topology round alone (pccl/master/rounds/topology.py): vote, bandwidth measurement and P2P setup,
message by message, without a MasterState."""

from __future__ import annotations

from pccl import Result
from pccl.master.rounds.base import Expel
from pccl.master.rounds.topology import (
    Loss,
    TopologyRound,
    bandwidth_matrix,
    failed_result,
    plan_measurements,
    record_bandwidth,
)
from pccl.wire import messages as m

RING = [1, 2, 3]


def ok(epoch: int) -> m.P2PConnectionsDone:
    return m.P2PConnectionsDone(epoch=epoch, success=True)


def test_the_vote_completes_when_every_accepted_peer_voted_the_same_kind() -> None:
    rnd = TopologyRound(kind="update", opened=2.0)
    assert rnd.refusal(1, "update") is None
    rnd.votes.add(1)
    assert rnd.refusal(1, "update") == Expel("duplicate update topology vote")
    assert rnd.refusal(2, "optimize") == Expel("optimize_topology while the others run update_topology")
    rnd.votes.add(2)
    assert not rnd.complete(RING)
    assert rnd.waits(set(RING)) == ("update_topology vote", {3}, "")
    assert [p for p, _ in rnd.vote_waits()] == [1, 2] and rnd.busy(RING) == set()
    rnd.votes.add(3)
    assert rnd.complete(RING) and rnd.voting and rnd.key == ("topology", None) and rnd.group is None


def test_the_setup_is_done_when_every_member_confirmed() -> None:
    rnd = TopologyRound(kind="update", votes={1, 2})
    rnd.begin_setup(5, 4, [1, 2, 3], {3}, now=7.0)
    assert not rnd.voting and rnd.from_epoch == 4 and rnd.establish_started == 7.0
    assert rnd.vote_waits() == [] and rnd.busy([1, 2]) == {1, 2, 3}
    assert rnd.refusal(1, "update") == Expel("duplicate update topology vote")  # no ballot while it sets up
    assert rnd.expects(1, 5) and not rnd.expects(1, 4) and not rnd.expects(9, 5)
    assert rnd.confirm(1, ok(5)) is None and rnd.outcome() is None
    assert rnd.confirm(1, ok(5)) == Expel("duplicate P2PConnectionsDone")
    assert rnd.waits(set()) == ("update_topology epoch 5: P2P setup", {2, 3}, " (newcomers [3])")
    assert rnd.late() == [2, 3] and rnd.old_members() == [1, 2]
    rnd.confirm(2, ok(5))
    rnd.confirm(3, ok(5))
    assert rnd.outcome() is True


def test_a_failed_connection_ends_the_setup_at_once_with_its_reason() -> None:
    rnd = TopologyRound(kind="update")
    rnd.begin_setup(2, 1, [1, 2, 3], set(), now=0.0)
    rnd.confirm(2, m.P2PConnectionsDone(epoch=2, success=False, failed_peers=[3], reason="refused"))
    assert rnd.outcome() is False and rnd.failure_reason == "peer 2 could not connect to [3]: refused"


def test_a_member_lost_fails_the_setup_and_a_voter_lost_leaves_the_vote() -> None:
    rnd = TopologyRound(kind="update")
    rnd.begin_setup(2, 1, [1, 2, 3], {3}, now=0.0)
    assert rnd.peer_lost(3) is Loss.CHECK_SETUP
    assert rnd.members == [1, 2] and rnd.newcomers == set() and rnd.outcome() is False
    assert rnd.failure_reason == "peer 3 was lost during the topology update"
    vote = TopologyRound(kind="update", votes={1, 2})
    assert vote.peer_lost(2) is Loss.CHECK_VOTE and vote.votes == {1}
    assert vote.peer_lost(1) is Loss.DROP


def test_measurements_skip_fresh_links_and_never_send_twice_per_round() -> None:
    fresh = {(1, 2): 9.0}
    plan = plan_measurements(RING, lambda a, b: fresh.get((a, b)), now=10.0, stale_after=5.0)
    assert plan == [[(2, 3), (3, 1)], [(1, 3), (2, 1), (3, 2)]]
    for edges in plan:
        assert len({a for a, _ in edges}) == len(edges) and len({b for _, b in edges}) == len(edges)


def test_measurement_rounds_run_one_after_the_other_and_survive_a_loss() -> None:
    rnd = TopologyRound(kind="optimize", votes={1, 2, 3})
    rnd.measure_rounds = [[(1, 2), (2, 3)], [(3, 1)]]
    assert not rnd.voting and rnd.vote_waits() == []
    where = {1: ("h1", 11), 2: ("h2", 12), 3: ("h3", 13)}
    first = rnd.next_measurement(where.get)
    assert first == {1: [[2, "h2", 12]], 2: [[3, "h3", 13]]} and rnd.measuring == {1, 2}
    assert rnd.waits(set()) == ("optimize_topology: bandwidth measurement", {1, 2}, "")
    assert not rnd.measured(1)
    assert rnd.peer_lost(3) is Loss.NOTHING and rnd.measuring == {2}  # 2 still measures
    assert rnd.measure_rounds == [[]]  # 3's link is gone from the rounds still to run
    assert rnd.measured(2)
    del where[3]
    assert rnd.next_measurement(where.get) is None and rnd.measuring == set()


def test_withdraw_takes_back_only_ballots_of_a_voting_round() -> None:
    rnd = TopologyRound(kind="update", votes={1, 2, 3})
    assert rnd.withdraw({2, 9}) == [2] and rnd.votes == {1, 3}
    rnd.begin_setup(2, 1, [1, 3], set(), now=0.0)
    assert rnd.withdraw({1}) == []


def test_the_retry_keeps_the_kind_and_the_members_epoch() -> None:
    rnd = TopologyRound(kind="optimize")
    rnd.begin_setup(6, 5, [1, 2], set(), now=0.0)
    again = rnd.retry([1, 2])
    assert again.kind == "optimize" and again.votes == {1, 2} and again.from_epoch == 5 and again.voting


def test_reports_are_recorded_with_their_latency_and_malformed_rows_skipped() -> None:
    bw: dict[tuple[int, int], tuple[float, float]] = {}
    lat: dict[tuple[int, int], float] = {(1, 3): 0.5}
    record_bandwidth(1, [[2, 100.0, 0.01], [3, 50], ["x", 1.0], [4, True]], 3.0, bw, lat)
    assert bw == {(1, 2): (100.0, 3.0), (1, 3): (50.0, 3.0)} and lat == {(1, 2): 0.01}
    assert bandwidth_matrix([1, 2, 3], bw) == [[None, 100.0, 50.0], [None, None, None], [None, None, None]]
    result = failed_result("optimize", 4, [], "why")
    assert result.code == int(Result.TOPOLOGY_OPTIMIZATION_FAILED)
    assert result.epoch == 4 and not result.success
