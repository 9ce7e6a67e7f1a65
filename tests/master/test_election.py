"""Tests for the pure shared-state election core (pccl/master/election.py, docs/protocol.md section 5)."""

from __future__ import annotations

import ast
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl import DataType, Result
from pccl import SharedStateSyncStrategy as Strategy
from pccl.master import election
from pccl.master.election import (
    ElectionResult,
    FetchItem,
    Refusal,
    SyncVote,
    TensorEntry,
    elect,
    fetch_rows,
    validate_vote,
    vote_from_wire,
)

EP = Strategy.ENFORCE_POPULAR
RO = Strategy.RECEIVE_ONLY
SO = Strategy.SEND_ONLY
FAILED = Result.SHARED_STATE_SYNC_FAILED
NONE_AVAILABLE = Result.NO_SHARED_STATE_AVAILABLE


def entry(
    key: str,
    h: int,
    *,
    dtype: DataType = DataType.FLOAT32,
    shape: tuple[int, ...] = (4,),
    aci: bool = False,
) -> TensorEntry:
    return TensorEntry(
        key=key,
        dtype=int(dtype),
        shape=shape,
        nbytes=math.prod(shape) * dtype.itemsize,
        hash=h,
        allow_content_inequality=aci,
    )


def vote(revision: int, hashes: Mapping[str, int], strategy: Strategy = EP, **kw: object) -> SyncVote:
    """A vote whose tensors are float32[4] with the given hashes (``kw`` overrides entry fields)."""
    return SyncVote(
        revision=revision,
        strategy=strategy,
        entries=tuple(entry(k, h, **kw) for k, h in hashes.items()),  # type: ignore[arg-type]
    )


def vote_of(revision: int, entries: list[TensorEntry], strategy: Strategy = EP) -> SyncVote:
    return SyncVote(revision=revision, strategy=strategy, entries=tuple(entries))


def fetched(result: ElectionResult) -> dict[int, dict[str, int]]:
    """{peer: {key: expected_hash}} for every non-refused peer."""
    return {p: {f.key: f.expected_hash for f in plan} for p, plan in result.plans.items()}


def codes(result: ElectionResult) -> dict[int, Result]:
    return {p: r.code for p, r in result.refused.items()}


# ============================================================================================
# Table: the docs/protocol.md section 5 behaviours


@dataclass
class Case:
    votes: dict[int, SyncVote]
    last_revision: int | None
    revision: int
    fetch: dict[int, dict[str, int]]  # every non-refused peer -> {key: expected_hash}
    refused: dict[int, Result] = field(default_factory=dict)
    holders: tuple[int, ...] = ()


K3 = {"a": 1, "b": 2, "c": 3}
KEYS16 = {f"layer{i:02d}.weight": 100 + i for i in range(16)}
KEYS16_4_DIFF = {k: (h + 1000 if i in (1, 5, 9, 15) else h) for i, (k, h) in enumerate(KEYS16.items())}

CASES: dict[str, Case] = {
    "two peers 42s vs 0s: tie goes to the lowest id, the other fetches": Case(
        votes={0: vote(0, {"a": 42, "b": 42}), 1: vote(0, {"a": 0, "b": 0})},
        last_revision=None,
        revision=0,
        fetch={0: {}, 1: {"a": 42, "b": 42}},
        holders=(0,),
    ),
    "two peers 0s vs 42s: ids swapped, the tie still goes to the lowest id": Case(
        votes={1: vote(0, {"a": 42, "b": 42}), 0: vote(0, {"a": 0, "b": 0})},
        last_revision=None,
        revision=0,
        fetch={0: {}, 1: {"a": 0, "b": 0}},
        holders=(0,),
    ),
    "identical content: every plan is empty": Case(
        votes={0: vote(3, K3), 1: vote(3, K3), 2: vote(3, K3)},
        last_revision=2,
        revision=3,
        fetch={0: {}, 1: {}, 2: {}},
        holders=(0, 1, 2),
    ),
    "16 keys, 4 differ on one peer of 3: only those 4 are fetched": Case(
        votes={0: vote(1, KEYS16), 1: vote(1, KEYS16_4_DIFF), 2: vote(1, KEYS16)},
        last_revision=0,
        revision=1,
        fetch={
            0: {},
            1: {
                k: KEYS16[k] for k in ("layer01.weight", "layer05.weight", "layer09.weight", "layer15.weight")
            },
            2: {},
        },
        holders=(0, 2),
    ),
    "{42, 43, 43}: the popular 43 wins over the lowest id": Case(
        votes={0: vote(0, {"a": 42}), 1: vote(0, {"a": 43}), 2: vote(0, {"a": 43})},
        last_revision=None,
        revision=0,
        fetch={0: {"a": 43}, 1: {}, 2: {}},
        holders=(1, 2),
    ),
    "2-2 popularity tie: the content held by the lowest id wins": Case(
        votes={3: vote(0, {"a": 7}), 1: vote(0, {"a": 8}), 2: vote(0, {"a": 8}), 0: vote(0, {"a": 7})},
        last_revision=None,
        revision=0,
        fetch={0: {}, 1: {"a": 7}, 2: {"a": 7}, 3: {}},
        holders=(0, 3),
    ),
    "revision skip: the skipping peer is refused, the rest sync": Case(
        votes={0: vote(6, K3), 1: vote(6, K3), 2: vote(7, K3)},
        last_revision=5,
        revision=6,
        fetch={0: {}, 1: {}},
        refused={2: FAILED},
        holders=(0, 1),
    ),
    "every peer skips: all refused, revision unchanged": Case(
        votes={0: vote(9, K3), 1: vote(9, K3)},
        last_revision=5,
        revision=5,
        fetch={},
        refused={0: FAILED, 1: FAILED},
    ),
    "first sync at revision 13; a newcomer at 0 is outdated and fetches": Case(
        votes={0: vote(13, K3), 1: vote(13, K3), 2: vote(0, {"a": 0, "b": 0, "c": 0})},
        last_revision=None,
        revision=13,
        fetch={0: {}, 1: {}, 2: {"a": 1, "b": 2, "c": 3}},
        holders=(0, 1),
    ),
    "first sync: a single newest peer wins even against a majority": Case(
        votes={0: vote(13, K3 | {"a": 9}), 1: vote(12, K3 | {"a": 1}), 2: vote(12, K3 | {"a": 1})},
        last_revision=None,
        revision=13,
        fetch={0: {}, 1: {"a": 9}, 2: {"a": 9}},
        holders=(0,),
    ),
    "L=13: peers at 14 are up-to-date, 13 and 2 are outdated": Case(
        votes={
            0: vote(14, {"a": 5}),
            1: vote(14, {"a": 5}),
            2: vote(13, {"a": 4}),
            3: vote(2, {"a": 5}),
        },
        last_revision=13,
        revision=14,
        fetch={0: {}, 1: {}, 2: {"a": 5}, 3: {}},
        holders=(0, 1),
    ),
    "L=13, nobody advanced: every peer at 13 is up-to-date, revision stays 13": Case(
        votes={0: vote(13, {"a": 5}), 1: vote(13, {"a": 6}), 2: vote(13, {"a": 6})},
        last_revision=13,
        revision=13,
        fetch={0: {"a": 6}, 1: {}, 2: {}},
        holders=(1, 2),
    ),
    "outdated majority does not vote": Case(
        votes={0: vote(4, {"a": 1}), 1: vote(3, {"a": 2}), 2: vote(3, {"a": 2}), 3: vote(3, {"a": 2})},
        last_revision=3,
        revision=4,
        fetch={0: {}, 1: {"a": 1}, 2: {"a": 1}, 3: {"a": 1}},
        holders=(0,),
    ),
    "key-set mismatch: only that peer is refused": Case(
        votes={0: vote(1, K3), 1: vote(1, {"a": 1, "b": 2}), 2: vote(1, K3 | {"c": 30})},
        last_revision=0,
        revision=1,
        fetch={0: {}, 2: {"c": 3}},
        refused={1: FAILED},
        holders=(0,),
    ),
    "dtype mismatch: only that peer is refused": Case(
        votes={
            0: vote(1, K3),
            1: vote_of(1, [entry("a", 1), entry("b", 2, dtype=DataType.FLOAT16, shape=(8,)), entry("c", 3)]),
            2: vote(1, K3),
        },
        last_revision=0,
        revision=1,
        fetch={0: {}, 2: {}},
        refused={1: FAILED},
        holders=(0, 2),
    ),
    "shape mismatch: only that peer is refused": Case(
        votes={
            0: vote(1, K3),
            1: vote(1, K3),
            2: vote_of(1, [entry("a", 1), entry("b", 2, shape=(2, 2)), entry("c", 3)]),
        },
        last_revision=0,
        revision=1,
        fetch={0: {}, 1: {}},
        refused={2: FAILED},
        holders=(0, 1),
    ),
    "allow_content_inequality flag mismatch: only that peer is refused": Case(
        votes={
            0: vote(1, K3),
            1: vote(1, K3),
            2: vote_of(1, [entry("a", 1, aci=True), entry("b", 2), entry("c", 3)]),
        },
        last_revision=0,
        revision=1,
        fetch={0: {}, 1: {}},
        refused={2: FAILED},
        holders=(0, 1),
    ),
    "schema tie between two candidates: the lowest id's schema wins": Case(
        votes={5: vote(0, {"a": 1}), 2: vote(0, {"b": 1})},
        last_revision=None,
        revision=0,
        fetch={2: {}},
        refused={5: FAILED},
        holders=(2,),
    ),
    "outdated peer with a different key set is refused too": Case(
        votes={0: vote(2, K3), 1: vote(2, K3), 2: vote(1, {"a": 1})},
        last_revision=1,
        revision=2,
        fetch={0: {}, 1: {}},
        refused={2: FAILED},
        holders=(0, 1),
    ),
    "SEND_ONLY x2 different: both refused, the rest proceed": Case(
        votes={
            0: vote(0, {"a": 1}, SO),
            1: vote(0, {"a": 2}, SO),
            2: vote(0, {"a": 3}),
            3: vote(0, {"a": 4}),
        },
        last_revision=None,
        revision=0,
        fetch={2: {}, 3: {"a": 3}},
        refused={0: FAILED, 1: FAILED},
        holders=(2,),
    ),
    "SEND_ONLY x2 with different key sets: both refused": Case(
        votes={0: vote(0, {"a": 1}, SO), 1: vote(0, {"b": 1}, SO), 2: vote(0, {"a": 1})},
        last_revision=None,
        revision=0,
        fetch={2: {}},
        refused={0: FAILED, 1: FAILED},
        holders=(2,),
    ),
    "SEND_ONLY x3, two agree: all three refused": Case(
        votes={
            0: vote(0, {"a": 1}, SO),
            1: vote(0, {"a": 1}, SO),
            2: vote(0, {"a": 2}, SO),
            3: vote(0, {"a": 5}),
        },
        last_revision=None,
        revision=0,
        fetch={3: {}},
        refused={0: FAILED, 1: FAILED, 2: FAILED},
        holders=(3,),
    ),
    "SEND_ONLY x2 different, only a RECEIVE_ONLY left: it gets NO_SHARED_STATE_AVAILABLE": Case(
        votes={0: vote(0, {"a": 1}, SO), 1: vote(0, {"a": 2}, SO), 2: vote(0, {"a": 3}, RO)},
        last_revision=None,
        revision=0,
        fetch={},
        refused={0: FAILED, 1: FAILED, 2: NONE_AVAILABLE},
    ),
    "SEND_ONLY x2 different, only an outdated peer left: NO_SHARED_STATE_AVAILABLE": Case(
        votes={0: vote(4, {"a": 1}, SO), 1: vote(4, {"a": 2}, SO), 2: vote(3, {"a": 1})},
        last_revision=3,
        revision=4,
        fetch={},
        refused={0: FAILED, 1: FAILED, 2: NONE_AVAILABLE},
    ),
    "SEND_ONLY x2 identical: both hold, nobody refused": Case(
        votes={0: vote(0, {"a": 1}, SO), 1: vote(0, {"a": 1}, SO), 2: vote(0, {"a": 2})},
        last_revision=None,
        revision=0,
        fetch={0: {}, 1: {}, 2: {"a": 1}},
        holders=(0, 1),
    ),
    "SEND_ONLY peers differing only in an allow_content_inequality tensor agree": Case(
        votes={
            0: vote_of(0, [entry("a", 1), entry("s", 10, aci=True)], SO),
            1: vote_of(0, [entry("a", 1), entry("s", 11, aci=True)], SO),
        },
        last_revision=None,
        revision=0,
        fetch={0: {}, 1: {}},
        holders=(0, 1),
    ),
    "RECEIVE_ONLY everywhere: all refused with NO_SHARED_STATE_AVAILABLE": Case(
        votes={0: vote(0, K3, RO), 1: vote(0, K3, RO), 2: vote(0, K3, RO)},
        last_revision=None,
        revision=0,
        fetch={},
        refused={0: NONE_AVAILABLE, 1: NONE_AVAILABLE, 2: NONE_AVAILABLE},
    ),
    "newest revision held only by RECEIVE_ONLY: nobody can provide it": Case(
        votes={0: vote(8, K3, RO), 1: vote(7, K3), 2: vote(7, K3)},
        last_revision=None,
        revision=8,
        fetch={},
        refused={0: NONE_AVAILABLE, 1: NONE_AVAILABLE, 2: NONE_AVAILABLE},
    ),
    "SEND_ONLY beats an ENFORCE_POPULAR majority; the majority fetches": Case(
        votes={0: vote(0, {"a": 1, "b": 1}), 1: vote(0, {"a": 1, "b": 1}), 2: vote(0, {"a": 1, "b": 9}, SO)},
        last_revision=None,
        revision=0,
        fetch={0: {"b": 9}, 1: {"b": 9}, 2: {}},
        holders=(2,),
    ),
    "SEND_ONLY schema beats a majority schema": Case(
        votes={0: vote(0, {"a": 1}), 1: vote(0, {"a": 1}), 2: vote(0, {"a": 1, "b": 2}, SO)},
        last_revision=None,
        revision=0,
        fetch={2: {}},
        refused={0: FAILED, 1: FAILED},
        holders=(2,),
    ),
    "outdated SEND_ONLY is refused, the rest proceed": Case(
        votes={0: vote(4, {"a": 1}, SO), 1: vote(5, {"a": 2}), 2: vote(5, {"a": 3})},
        last_revision=4,
        revision=5,
        fetch={1: {}, 2: {"a": 2}},
        refused={0: FAILED},
        holders=(1,),
    ),
    "RECEIVE_ONLY + ENFORCE_POPULAR: the RECEIVE_ONLY peer fetches": Case(
        votes={0: vote(2, {"a": 1, "b": 2}, RO), 1: vote(2, {"a": 5, "b": 2})},
        last_revision=1,
        revision=2,
        fetch={0: {"a": 5}, 1: {}},
        holders=(1,),
    ),
    "RECEIVE_ONLY majority does not count in popularity": Case(
        votes={
            0: vote(0, {"a": 1}, RO),
            1: vote(0, {"a": 1}, RO),
            2: vote(0, {"a": 2}),
            3: vote(0, {"a": 3}, RO),
        },
        last_revision=None,
        revision=0,
        fetch={0: {"a": 2}, 1: {"a": 2}, 2: {}, 3: {"a": 2}},
        holders=(2,),
    ),
    "RECEIVE_ONLY with the elected content fetches nothing and holds nothing": Case(
        votes={0: vote(0, {"a": 2}, RO), 1: vote(0, {"a": 2})},
        last_revision=None,
        revision=0,
        fetch={0: {}, 1: {}},
        holders=(1,),
    ),
    "allow_content_inequality: not compared among up-to-date peers": Case(
        votes={
            0: vote_of(3, [entry("w", 1), entry("rng", 100, aci=True)]),
            1: vote_of(3, [entry("w", 1), entry("rng", 101, aci=True)]),
            2: vote_of(3, [entry("w", 1), entry("rng", 102, aci=True)], RO),
        },
        last_revision=2,
        revision=3,
        fetch={0: {}, 1: {}, 2: {}},
        holders=(0, 1),
    ),
    "allow_content_inequality: an outdated newcomer fetches it from the primary holder's value": Case(
        votes={
            0: vote_of(3, [entry("w", 1), entry("rng", 100, aci=True)]),
            1: vote_of(3, [entry("w", 1), entry("rng", 101, aci=True)]),
            2: vote_of(0, [entry("w", 0), entry("rng", 0, aci=True)]),
            3: vote_of(0, [entry("w", 0), entry("rng", 0, aci=True)], RO),
            4: vote_of(3, [entry("w", 0), entry("rng", 0, aci=True)], RO),
        },
        last_revision=2,
        revision=3,
        fetch={0: {}, 1: {}, 2: {"w": 1, "rng": 100}, 3: {"w": 1, "rng": 100}, 4: {"w": 1}},
        holders=(0, 1),
    ),
    "allow_content_inequality: an outdated peer already holding the primary's value skips it": Case(
        votes={
            0: vote_of(3, [entry("w", 1), entry("rng", 100, aci=True)]),
            1: vote_of(2, [entry("w", 0), entry("rng", 100, aci=True)]),
        },
        last_revision=2,
        revision=3,
        fetch={0: {}, 1: {"w": 1}},
        holders=(0,),
    ),
    "empty shared state syncs with nothing to fetch": Case(
        votes={0: vote(0, {}), 1: vote(0, {})},
        last_revision=None,
        revision=0,
        fetch={0: {}, 1: {}},
        holders=(0, 1),
    ),
    "no votes at all: nothing happens": Case(
        votes={},
        last_revision=4,
        revision=4,
        fetch={},
    ),
    "a malformed vote is refused with INVALID_ARGUMENT and the rest proceed": Case(
        votes={
            0: vote(0, {"a": 1}),
            1: vote_of(0, [entry("a", 1), entry("a", 2)]),
            2: vote(0, {"a": 3}),
        },
        last_revision=None,
        revision=0,
        fetch={0: {}, 2: {"a": 1}},
        refused={1: Result.INVALID_ARGUMENT},
        holders=(0,),
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_election_table(case: Case) -> None:
    result = elect(case.votes, last_revision=case.last_revision)
    assert result.revision == case.revision
    assert codes(result) == case.refused
    assert fetched(result) == case.fetch
    assert result.elected_holders == case.holders
    assert result.succeeded == bool(case.fetch)
    _check_invariants(case.votes, case.last_revision, result)


# ============================================================================================
# Specific behaviours


def test_42_43_43_independent_of_vote_order() -> None:
    a = {0: vote(0, {"a": 42}), 1: vote(0, {"a": 43}), 2: vote(0, {"a": 43})}
    b = {2: a[2], 0: a[0], 1: a[1]}
    c = {1: a[1], 2: a[2], 0: a[0]}
    results = [elect(v, last_revision=None) for v in (a, b, c)]
    assert results[0] == results[1] == results[2]
    assert fetched(results[0]) == {0: {"a": 43}, 1: {}, 2: {}}


def test_fetch_item_carries_size_and_holders() -> None:
    votes = {
        0: vote_of(0, [entry("m", 5, dtype=DataType.FLOAT64, shape=(3, 7))]),
        1: vote_of(0, [entry("m", 5, dtype=DataType.FLOAT64, shape=(3, 7))]),
        2: vote_of(0, [entry("m", 6, dtype=DataType.FLOAT64, shape=(3, 7))]),
    }
    result = elect(votes, last_revision=None)
    [item] = result.plans[2]
    assert item.key == "m"
    assert item.expected_hash == 5
    assert item.nbytes == 3 * 7 * 8
    assert sorted(item.holders) == [0, 1]


def test_aci_holders_are_only_those_with_the_primary_value() -> None:
    votes = {
        0: vote_of(5, [entry("w", 1), entry("rng", 100, aci=True)]),
        1: vote_of(5, [entry("w", 1), entry("rng", 101, aci=True)]),
        2: vote_of(5, [entry("w", 1), entry("rng", 100, aci=True)]),
        3: vote_of(4, [entry("w", 0), entry("rng", 0, aci=True)]),
    }
    result = elect(votes, last_revision=4)
    items = {f.key: f for f in result.plans[3]}
    assert items["rng"].expected_hash == 100
    assert sorted(items["rng"].holders) == [0, 2]
    assert sorted(items["w"].holders) == [0, 1, 2]


def test_holders_spread_over_four_holders_for_one_requester() -> None:
    base = {f"k{i}": i for i in range(8)}
    votes = {p: vote(1, base) for p in range(4)}
    votes[9] = vote(0, {k: h + 50 for k, h in base.items()})
    result = elect(votes, last_revision=0)
    plan = result.plans[9]
    assert len(plan) == 8
    first = Counter(item.holders[0] for item in plan)
    assert len(first) > 1
    assert sorted(first.values()) == [2, 2, 2, 2]  # equal tensors: round-robin, 2 each
    for item in plan:
        assert sorted(item.holders) == [0, 1, 2, 3]  # all holders listed: the rest are fallbacks


def test_holders_spread_by_bytes_not_by_count() -> None:
    # One huge tensor and eight small ones: the holder serving the huge one gets no small one.
    entries = [entry("huge", 1, shape=(1000,))] + [entry(f"s{i}", 1, shape=(10,)) for i in range(8)]
    stale = [replace(e, hash=2) for e in entries]
    votes = {0: vote_of(1, entries), 1: vote_of(1, entries), 2: vote_of(1, entries), 3: vote_of(0, stale)}
    result = elect(votes, last_revision=0)
    load: Counter[int] = Counter()
    for item in result.plans[3]:
        load[item.holders[0]] += item.nbytes
    huge_holder = next(item.holders[0] for item in result.plans[3] if item.key == "huge")
    assert load[huge_holder] == 4000
    assert sorted(load.values()) == [160, 160, 4000]


def test_holders_spread_across_requesters() -> None:
    # Two holders, four requesters, one key each: each holder is first choice twice.
    votes = {0: vote(1, {"w": 1}), 1: vote(1, {"w": 1})}
    for p in range(2, 6):
        votes[p] = vote(0, {"w": 0})
    result = elect(votes, last_revision=0)
    first = Counter(result.plans[p][0].holders[0] for p in range(2, 6))
    assert first == Counter({0: 2, 1: 2})


def test_sixteen_keys_four_differ_sizes() -> None:
    result = elect(
        CASES["16 keys, 4 differ on one peer of 3: only those 4 are fetched"].votes, last_revision=0
    )
    assert sum(item.nbytes for item in result.plans[1]) == 4 * 16


# ============================================================================================
# Refusal reasons: clear, naming the keys / revisions involved


def reason_of(votes: dict[int, SyncVote], peer: int, last_revision: int | None = None) -> str:
    return elect(votes, last_revision=last_revision).refused[peer].reason


def test_reason_revision_skip() -> None:
    reason = reason_of({0: vote(6, K3), 1: vote(8, K3)}, 1, last_revision=5)
    assert "revision 8 skips ahead of 6" in reason


def test_reason_missing_and_extra_keys() -> None:
    reason = reason_of({0: vote(0, K3), 1: vote(0, K3), 2: vote(0, {"a": 1, "zz": 2})}, 2)
    assert "missing key(s) 'b', 'c'" in reason
    assert "unexpected key(s) 'zz'" in reason


def test_reason_dtype_and_shape() -> None:
    good = [entry("a", 1), entry("b", 2)]
    bad = [entry("a", 1, dtype=DataType.FLOAT16, shape=(8,)), entry("b", 2, shape=(2, 2))]
    reason = reason_of({0: vote_of(0, good), 1: vote_of(0, good), 2: vote_of(0, bad)}, 2)
    assert "'a' is FLOAT16, elected FLOAT32" in reason
    assert "'b' has shape (2, 2), elected (4,)" in reason


def test_reason_lists_at_most_a_few_keys() -> None:
    many = {f"k{i:03d}": 1 for i in range(100)}
    reason = reason_of({0: vote(0, many), 1: vote(0, many), 2: vote(0, {})}, 2)
    assert "and 95 more" in reason
    assert len(reason) < 400


def test_reason_conflicting_send_only() -> None:
    votes = {0: vote(0, {"a": 1, "b": 1}, SO), 1: vote(0, {"a": 1, "b": 2}, SO), 2: vote(0, {"a": 1, "b": 1})}
    result = elect(votes, last_revision=None)
    for p in (0, 1):
        assert "conflicting SEND_ONLY content" in result.refused[p].reason
        assert "'b'" in result.refused[p].reason


def test_reason_outdated_send_only() -> None:
    reason = reason_of({0: vote(3, K3, SO), 1: vote(4, K3)}, 0, last_revision=3)
    assert "SEND_ONLY" in reason and "3" in reason and "4" in reason


def test_reason_no_shared_state() -> None:
    reason = reason_of({0: vote(0, K3, RO), 1: vote(0, K3, RO)}, 0)
    assert "RECEIVE_ONLY" in reason and "revision 0" in reason


# ============================================================================================
# validate_vote / vote_from_wire / fetch_rows

GOOD = vote(0, K3)


def _with_entry(**changes: object) -> SyncVote:
    return replace(GOOD, entries=(replace(GOOD.entries[0], **changes), *GOOD.entries[1:]))  # type: ignore[arg-type]


INVALID: dict[str, tuple[object, str]] = {
    "not a vote": ("vote", "not a SyncVote"),
    "negative revision": (replace(GOOD, revision=-1), "revision -1"),
    "bool revision": (replace(GOOD, revision=True), "revision True"),
    "huge revision": (replace(GOOD, revision=1 << 64), "revision"),
    "unknown strategy": (replace(GOOD, strategy=7), "strategy 7"),  # type: ignore[arg-type]
    "entries as list": (replace(GOOD, entries=list(GOOD.entries)), "not a tuple"),  # type: ignore[arg-type]
    "entry not a TensorEntry": (replace(GOOD, entries=("a",)), "not a TensorEntry"),  # type: ignore[arg-type]
    "duplicate key": (replace(GOOD, entries=(*GOOD.entries, GOOD.entries[0])), "duplicate key 'a'"),
    "key not str": (_with_entry(key=3), "not str"),
    "unknown dtype": (_with_entry(dtype=99), "unknown dtype 99"),
    "shape not a tuple": (_with_entry(shape=[4]), "not tuple"),
    "negative dim": (_with_entry(shape=(-4,), nbytes=16), "shape dimension -4"),
    "negative nbytes": (_with_entry(nbytes=-16), "nbytes=-16"),
    "nbytes mismatch": (_with_entry(nbytes=15), "needs 16"),
    "negative hash": (_with_entry(hash=-1), "hash"),
    "hash over 64 bits": (_with_entry(hash=1 << 64), "hash"),
    "flag not bool": (_with_entry(allow_content_inequality=1), "allow_content_inequality"),
}


@pytest.mark.parametrize("bad,needle", list(INVALID.values()), ids=list(INVALID))
def test_validate_vote_refuses(bad: object, needle: str) -> None:
    refusal = validate_vote(bad)
    assert refusal is not None
    assert refusal.code == Result.INVALID_ARGUMENT
    assert needle in refusal.reason


def test_validate_vote_accepts() -> None:
    assert validate_vote(GOOD) is None
    assert validate_vote(vote(0, {})) is None
    assert validate_vote(vote_of(0, [entry("e", (1 << 64) - 1, shape=(0, 3))])) is None


def test_vote_from_wire_roundtrip() -> None:
    rows = [["a", int(DataType.FLOAT32), [2, 2], 16, 7, False], ["b", int(DataType.INT8), [], 1, 0, True]]
    result = vote_from_wire(revision=3, strategy=int(SO), entries=rows)
    assert result == SyncVote(
        revision=3,
        strategy=SO,
        entries=(
            TensorEntry(key="a", dtype=10, shape=(2, 2), nbytes=16, hash=7, allow_content_inequality=False),
            TensorEntry(key="b", dtype=1, shape=(), nbytes=1, hash=0, allow_content_inequality=True),
        ),
    )
    assert isinstance(result, SyncVote) and result.strategy is SO


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"revision": 0, "strategy": 9, "entries": []}, "strategy"),
        ({"revision": "0", "strategy": 0, "entries": []}, "revision"),
        ({"revision": 0, "strategy": 0, "entries": {}}, "not a list"),
        ({"revision": 0, "strategy": 0, "entries": [["a", 10, [1], 4, 0]]}, "6-field"),
        ({"revision": 0, "strategy": 0, "entries": [["a", 10, 1, 4, 0, False]]}, "shape"),
        ({"revision": 0, "strategy": 0, "entries": [["a", 10, [1], 4, 0, False]] * 2}, "duplicate"),
    ],
)
def test_vote_from_wire_refuses(fields: dict[str, object], needle: str) -> None:
    result = vote_from_wire(**fields)
    assert isinstance(result, Refusal)
    assert result.code == Result.INVALID_ARGUMENT
    assert needle in result.reason


def test_fetch_rows() -> None:
    items = [
        FetchItem(key="a", expected_hash=5, nbytes=8, holders=(3, 1)),
        FetchItem(key="b", expected_hash=6, nbytes=0, holders=(1,)),
    ]
    assert fetch_rows(items) == [["a", 5, [3, 1]], ["b", 6, [1]]]


def test_module_is_pure() -> None:
    tree = ast.parse(Path(election.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"trio", "socket", "time", "random", "asyncio", "threading"}


# ============================================================================================
# Invariants and the property test


def _check_invariants(
    votes: Mapping[int, SyncVote], last_revision: int | None, result: ElectionResult
) -> None:
    """Properties every election must have, whatever the votes."""
    assert set(result.plans).isdisjoint(result.refused)
    assert set(result.plans) | set(result.refused) == set(votes)
    assert list(result.plans) == sorted(result.plans)
    assert list(result.refused) == sorted(result.refused)
    for refusal in result.refused.values():
        assert refusal.reason
    if not result.succeeded:
        assert result.elected_holders == ()
        return
    if last_revision is not None:
        assert result.revision <= last_revision + 1
        for p, v in votes.items():
            if v.revision > last_revision + 1:
                assert result.refused[p].code == FAILED
    hashes = {p: {e.key: e.hash for e in votes[p].entries} for p in votes}
    aci = {e.key for e in votes[result.elected_holders[0]].entries if e.allow_content_inequality}
    holders = result.elected_holders
    assert holders == tuple(sorted(holders)) and set(holders) <= set(result.plans)
    primary = hashes[holders[0]]
    for h in holders:
        assert votes[h].strategy != RO
        assert votes[h].revision == result.revision
        assert result.plans[h] == ()
        assert {k: v for k, v in hashes[h].items() if k not in aci} == {
            k: v for k, v in primary.items() if k not in aci
        }
    for p, plan in result.plans.items():
        v = votes[p]
        assert v.revision <= result.revision
        if v.strategy == SO:
            assert plan == () and p in holders
        keys = [item.key for item in plan]
        assert len(keys) == len(set(keys)) and keys == sorted(keys)
        after = dict(hashes[p])
        for item in plan:
            assert item.holders, "a fetch item without a holder"
            assert p not in item.holders
            assert len(set(item.holders)) == len(item.holders)
            assert hashes[p][item.key] != item.expected_hash, "fetches a tensor it already has"
            for h in item.holders:
                assert h in holders
                assert votes[h].strategy != RO
                assert hashes[h][item.key] == item.expected_hash
            assert item.nbytes == next(e.nbytes for e in v.entries if e.key == item.key)
            after[item.key] = item.expected_hash
            if item.key in aci:
                assert v.revision < result.revision, (
                    "an up-to-date peer fetches an allow_content_inequality key"
                )
        # After applying its plan, every peer holds the elected content (and, if outdated, the primary
        # holder's allow_content_inequality tensors too).
        for key, h in primary.items():
            if key not in aci or v.revision < result.revision:
                assert after[key] == h


DTYPES = [DataType.FLOAT32, DataType.FLOAT16, DataType.INT64]


@st.composite
def elections(draw: st.DrawFn) -> tuple[dict[int, SyncVote], int | None]:
    n_keys = draw(st.integers(0, 5))
    schema = [
        (f"t{i}", draw(st.sampled_from(DTYPES)), (draw(st.integers(0, 3)),), draw(st.booleans()))
        for i in range(n_keys)
    ]
    last_revision = draw(st.none() | st.integers(0, 4))
    base = 0 if last_revision is None else last_revision
    ids = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True))
    votes: dict[int, SyncVote] = {}
    for p in ids:
        rows = list(schema)
        if rows and draw(st.integers(0, 9)) == 0:  # occasionally a mismatching layout
            i = draw(st.integers(0, len(rows) - 1))
            mutation = draw(st.sampled_from(["drop", "dtype", "flag"]))
            key, dtype, shape, flag = rows[i]
            if mutation == "drop":
                del rows[i]
            elif mutation == "dtype":
                rows[i] = (key, DataType.UINT8 if dtype != DataType.UINT8 else DataType.INT8, shape, flag)
            else:
                rows[i] = (key, dtype, shape, not flag)
        entries = tuple(entry(k, draw(st.integers(0, 2)), dtype=d, shape=s, aci=f) for k, d, s, f in rows)
        strategy = draw(st.sampled_from([EP, EP, EP, RO, SO]))
        revision = max(0, base + draw(st.integers(-2, 2)))
        votes[p] = SyncVote(revision=revision, strategy=strategy, entries=entries)
    return votes, last_revision


@settings(max_examples=400, deadline=None)
@given(data=elections(), order=st.randoms(use_true_random=False))
def test_election_properties(data: tuple[dict[int, SyncVote], int | None], order: object) -> None:
    votes, last_revision = data
    result = elect(votes, last_revision=last_revision)
    _check_invariants(votes, last_revision, result)
    # Determinism: the mapping's insertion order does not matter.
    items = list(votes.items())
    order.shuffle(items)  # type: ignore[attr-defined]
    assert elect(dict(items), last_revision=last_revision) == result
    # And the same votes always give the same answer.
    assert elect(dict(votes), last_revision=last_revision) == result


@settings(max_examples=200, deadline=None)
@given(data=elections())
def test_identical_content_moves_zero_bytes(data: tuple[dict[int, SyncVote], int | None]) -> None:
    votes, last_revision = data
    # Give every peer the first peer's tensors at one common revision: nothing may move.
    first = next(iter(votes.values()))
    revision = 0 if last_revision is None else last_revision + 1
    same = {p: replace(v, revision=revision, entries=first.entries) for p, v in votes.items()}
    result = elect(same, last_revision=last_revision)
    if any(v.strategy != RO for v in same.values()):
        assert not result.refused
        assert all(plan == () for plan in result.plans.values())
        assert result.elected_holders == tuple(sorted(p for p, v in same.items() if v.strategy != RO))
    else:
        assert set(codes(result).values()) == {NONE_AVAILABLE}
