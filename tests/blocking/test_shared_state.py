"""Shared-state synchronization and attributes through the blocking API."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pccl.blocking import (
    Attribute,
    Communicator,
    PCCLError,
    ReduceOp,
    Result,
    SharedState,
    SharedStateSyncInfo,
    SharedStateSyncStrategy,
    TensorInfo,
)

from ._helpers import JOIN_TIMEOUT, admit, run_threads

Cluster = Callable[..., list[Communicator]]


def _model_state(seed: int, revision: int = 0) -> tuple[SharedState, torch.Tensor, np.ndarray]:
    """A torch weight and a numpy optimizer-like buffer, filled from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 32, generator=gen)
    moments = np.random.default_rng(seed).standard_normal(100).astype(np.float64)
    state = SharedState([TensorInfo.from_torch(weight, "weight"), TensorInfo.from_numpy(moments, "moments")])
    state.revision = revision
    return state, weight, moments


def _sync_all(comms: list[Communicator], states: list[SharedState],
              strategies: list[SharedStateSyncStrategy] | None = None) -> list[SharedStateSyncInfo]:
    strategies = strategies or [SharedStateSyncStrategy.ENFORCE_POPULAR] * len(comms)
    return run_threads([lambda i=i: comms[i].sync_shared_state(states[i], strategies[i])
                        for i in range(len(comms))])


def test_identical_state_moves_zero_bytes_every_revision(pair: list[Communicator]) -> None:
    states = [_model_state(seed=1)[0] for _ in range(2)]
    for revision in range(3):
        infos = _sync_all(pair, states)
        assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0), (0, 0)]
        assert [s.revision for s in states] == [revision, revision]
        for s in states:
            s.revision += 1


def test_popular_content_wins_and_only_differing_tensors_move(cluster_factory: Cluster) -> None:
    comms = cluster_factory(3)
    made = [_model_state(seed=1), _model_state(seed=1), _model_state(seed=1)]
    outlier_weight = made[2][1]
    outlier_weight.add_(1.0)  # only "weight" differs on the third peer
    infos = _sync_all(comms, [m[0] for m in made])
    weight_bytes = 64 * 32 * 4
    assert infos[2].rx_bytes == weight_bytes and infos[2].tx_bytes == 0
    assert infos[0].rx_bytes == infos[1].rx_bytes == 0
    assert infos[0].tx_bytes + infos[1].tx_bytes == weight_bytes
    assert torch.equal(outlier_weight, made[0][1])  # updated in place
    assert made[2][2].tobytes() == made[0][2].tobytes()


def test_receive_only_and_send_only(pair: list[Communicator]) -> None:
    teacher, t_weight, _ = _model_state(seed=5)
    student, s_weight, s_moments = _model_state(seed=6)
    infos = _sync_all(pair, [teacher, student],
                      [SharedStateSyncStrategy.SEND_ONLY, SharedStateSyncStrategy.RECEIVE_ONLY])
    assert infos[0].tx_bytes == infos[1].rx_bytes == 64 * 32 * 4 + 100 * 8
    assert torch.equal(s_weight, t_weight)
    assert s_moments.tobytes() == _model_state(seed=5)[2].tobytes()


def test_late_joiner_receives_the_state_then_everyone_moves_zero_bytes(cluster_factory: Cluster,
                                                                      master_address: str) -> None:
    comms = cluster_factory(2)
    states = [_model_state(seed=3)[0] for _ in range(2)]
    for _ in range(2):
        _sync_all(comms, states)
        for s in states:
            s.revision += 1
    newcomer = Communicator(master_address)
    joining = threading.Thread(target=newcomer.connect, daemon=True)
    joining.start()
    admit(comms)
    joining.join(JOIN_TIMEOUT)
    try:
        assert all(c.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 3 for c in [*comms, newcomer])
        fresh, fresh_weight, _ = _model_state(seed=99, revision=0)
        infos = _sync_all([*comms, newcomer], [*states, fresh])
        assert infos[2].rx_bytes == 64 * 32 * 4 + 100 * 8
        assert fresh.revision == states[0].revision == 2
        assert torch.equal(fresh_weight, _model_state(seed=3)[1])
        for s in [*states, fresh]:
            s.revision += 1
        infos = _sync_all([*comms, newcomer], [*states, fresh])
        assert all(i.tx_bytes == 0 and i.rx_bytes == 0 for i in infos)
    finally:
        newcomer.close()


def test_allow_content_inequality_is_not_compared_between_up_to_date_peers(pair: list[Communicator]) -> None:
    local = [np.full(8, float(r), dtype=np.float32) for r in range(2)]
    shared = [np.arange(8, dtype=np.int64) for _ in range(2)]
    states = [SharedState([TensorInfo.from_numpy(shared[r], "shared"),
                           TensorInfo.from_numpy(local[r], "rng_state", allow_content_inequality=True)])
              for r in range(2)]
    infos = _sync_all(pair, states)
    assert all(i.tx_bytes == 0 and i.rx_bytes == 0 for i in infos)
    assert local[0][0] == 0.0 and local[1][0] == 1.0


def test_revision_skip_is_refused(pair: list[Communicator]) -> None:
    states = [_model_state(seed=1)[0] for _ in range(2)]
    _sync_all(pair, states)
    states[0].revision += 2  # skips one
    states[1].revision += 1

    def sync(i: int) -> SharedStateSyncInfo | PCCLError:
        try:
            return pair[i].sync_shared_state(states[i])
        except PCCLError as exc:
            return exc

    res = run_threads([lambda i=i: sync(i) for i in range(2)])
    assert isinstance(res[0], PCCLError) and res[0].result == Result.SHARED_STATE_SYNC_FAILED
    assert isinstance(res[1], SharedStateSyncInfo)


def test_sync_shared_state_argument_errors(pair: list[Communicator]) -> None:
    with pytest.raises(PCCLError) as info:
        pair[0].sync_shared_state([TensorInfo.from_numpy(np.zeros(2), "x")])  # type: ignore[arg-type]
    assert info.value.result == Result.INVALID_ARGUMENT
    with pytest.raises(PCCLError) as dup:
        SharedState([TensorInfo.from_numpy(np.zeros(2), "x"), TensorInfo.from_numpy(np.zeros(2), "x")])
    assert dup.value.result == Result.INVALID_ARGUMENT
    with pytest.raises(PCCLError):
        TensorInfo.from_torch(torch.zeros(4, 4).T, "not_contiguous")


# ---------------------------------------------------------------------------------------------------------
# attributes


def test_attributes_with_peer_groups(cluster_factory: Cluster) -> None:
    comms = cluster_factory(3, groups=[0, 1, 0])
    expect = {
        Attribute.GLOBAL_WORLD_SIZE: [3, 3, 3],
        Attribute.PEER_GROUP_WORLD_SIZE: [2, 1, 2],
        Attribute.LOCAL_WORLD_SIZE: [2, 1, 2],
        Attribute.NUM_DISTINCT_PEER_GROUPS: [2, 2, 2],
        Attribute.LARGEST_PEER_GROUP_WORLD_SIZE: [2, 2, 2],
    }
    for attr, want in expect.items():
        assert [c.get_attribute(attr) for c in comms] == want, attr.name
    # collectives and shared state stay within a group: the lone peer of group 1 has nobody to reduce with
    x = np.ones(4, dtype=np.float32)
    with pytest.raises(PCCLError) as info:
        comms[1].all_reduce(x, x, op=ReduceOp.SUM)
    assert info.value.result == Result.TOO_FEW_PEERS


def test_attribute_changes_only_at_membership_calls(cluster_factory: Cluster, master_address: str) -> None:
    (first,) = cluster_factory(1)
    assert first.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1
    second = Communicator(master_address)
    joining = threading.Thread(target=second.connect, daemon=True)
    joining.start()
    while not first.are_peers_pending():
        pass
    assert first.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 1  # registered is not accepted
    first.update_topology()
    joining.join(JOIN_TIMEOUT)
    assert first.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 2
    assert second.get_attribute(Attribute.GLOBAL_WORLD_SIZE) == 2
    second.close()


def test_unknown_attribute_is_invalid_argument(pair: list[Communicator]) -> None:
    with pytest.raises(PCCLError) as info:
        pair[0].get_attribute(42)  # type: ignore[arg-type]
    assert info.value.result == Result.INVALID_ARGUMENT
