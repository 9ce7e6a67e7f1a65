"""Shared-state sync through the full stack on loopback TCP (docs/protocol.md section 5)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import pccl
from pccl import SharedStateSyncStrategy as S
from pccl.peer.shared_state import SharedState, TensorInfo

from ._cluster import loopback_cluster, sync_all, sync_killing_the_holder


def _state(value: int, revision: int = 1, n: int = 1024, keys: tuple[str, ...] = ("w",)) -> SharedState:
    return SharedState(
        [TensorInfo.from_numpy(np.full(n, value, np.uint8), k) for k in keys], revision=revision
    )


async def test_two_peers_one_direction_and_identical_moves_nothing() -> None:
    async with loopback_cluster(2) as cl:
        states = [_state(42), _state(0)]
        infos = await sync_all(cl.comms, states)
        txs = sorted(i.tx_bytes for i in infos)
        rxs = sorted(i.rx_bytes for i in infos)
        assert txs == [0, 1024] and rxs == [0, 1024]
        sender = next(i for i, inf in enumerate(infos) if inf.tx_bytes == 1024)
        receiver = 1 - sender
        assert infos[receiver].rx_bytes == 1024
        a, b = (s.tensor_infos[0].tensor for s in states)
        assert a.tobytes() == b.tobytes()
        for s in states:
            s.revision += 1
        infos = await sync_all(cl.comms, states)
        assert all(i.tx_bytes == 0 and i.rx_bytes == 0 for i in infos)


async def test_only_differing_keys_move() -> None:
    keys = tuple(f"k{i}" for i in range(16))
    async with loopback_cluster(3) as cl:
        states = [_state(7, keys=keys, n=256) for _ in range(3)]
        odd = states[2]
        untouched = {}
        for j, info in enumerate(odd.tensor_infos):
            if j % 4 == 0:
                info.tensor[:] = 99
            else:
                untouched[info.name] = info.tensor
        before = {k: t.copy() for k, t in untouched.items()}
        infos = await sync_all(cl.comms, states)
        assert infos[2].rx_bytes == 4 * 256
        assert sum(i.tx_bytes for i in infos) == 4 * 256
        for k, t in untouched.items():
            assert t.tobytes() == before[k].tobytes()
            assert t is odd.tensor_infos[int(k[1:])].tensor  # user references stay valid
        assert all((info.tensor == 7).all() for info in odd.tensor_infos)


async def test_majority_wins_regardless_of_order() -> None:
    async with loopback_cluster(3) as cl:
        states = [_state(42), _state(43), _state(43)]
        infos = await sync_all(cl.comms, states)
        assert all((s.tensor_infos[0].tensor == 43).all() for s in states)
        assert infos[0].rx_bytes == 1024


async def test_two_groups_do_not_mix() -> None:
    async with loopback_cluster(4, groups=[0, 0, 1, 1]) as cl:
        states = [_state(1), _state(1), _state(2), _state(2)]
        infos = await sync_all(cl.comms, states)
        assert all(i.tx_bytes == 0 and i.rx_bytes == 0 for i in infos)
        assert [int(s.tensor_infos[0].tensor[0]) for s in states] == [1, 1, 2, 2]


async def test_revision_rules() -> None:
    async with loopback_cluster(2) as cl:
        states = [_state(5, revision=13), _state(5, revision=13)]
        infos = await sync_all(cl.comms, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos)
        # skipping a revision is refused; the other proceeds
        states[0].revision = 15
        states[1].revision = 14
        res = await sync_all(cl.comms, states)
        assert isinstance(res[0], pccl.SharedStateSyncError) and "skip" in str(res[0])
        assert isinstance(res[1], pccl.SharedStateSyncInfo)
        # a newcomer at revision 0 adopts the group's revision and content
        newcomer = await cl.add_peer()
        states[0].revision = 15
        states[1].revision = 15
        fresh = _state(0, revision=0)
        res = await sync_all(cl.comms, [*states, fresh])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res), res
        assert fresh.revision == 15 and (fresh.tensor_infos[0].tensor == 5).all()
        assert newcomer.world_size == 3


async def test_key_mismatch_refused_every_time_others_proceed() -> None:
    async with loopback_cluster(3) as cl:
        states = [_state(1), _state(1), _state(1, keys=("other",))]
        for rev in (1, 2):
            for s in states:
                s.revision = rev
            res = await sync_all(cl.comms, states)
            assert isinstance(res[2], pccl.SharedStateSyncError)
            assert isinstance(res[0], pccl.SharedStateSyncInfo) and isinstance(
                res[1], pccl.SharedStateSyncInfo
            )


async def test_strategies() -> None:
    async with loopback_cluster(3) as cl:
        # two SEND_ONLY with different content: conflict refused, the third has nobody to follow
        states = [_state(1), _state(2), _state(3)]
        res = await sync_all(cl.comms, states, [S.SEND_ONLY, S.SEND_ONLY, S.ENFORCE_POPULAR])
        assert isinstance(res[0], pccl.PCCLError) and isinstance(res[1], pccl.PCCLError)
        assert isinstance(res[2], pccl.SharedStateSyncInfo)  # the ENFORCE_POPULAR peer elects itself
        # RECEIVE_ONLY everywhere: nobody can provide
        states = [_state(1, revision=2) for _ in range(3)]
        res = await sync_all(cl.comms, states, [S.RECEIVE_ONLY] * 3)
        assert all(
            isinstance(r, pccl.PCCLError) and r.result == pccl.Result.NO_SHARED_STATE_AVAILABLE for r in res
        ), res
        # SEND_ONLY beats a popular majority; RECEIVE_ONLY receives (the failed round did not advance)
        states = [_state(9, revision=2), _state(4, revision=2), _state(4, revision=2)]
        res = await sync_all(cl.comms, states, [S.SEND_ONLY, S.ENFORCE_POPULAR, S.RECEIVE_ONLY])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res), res
        assert all((s.tensor_infos[0].tensor == 9).all() for s in states)


async def test_holder_killed_mid_transfer_the_other_holder_serves() -> None:
    """Issue 35: a donor that dies mid-transfer costs only its chunks in flight; the other holder
    sends them and the call succeeds, bit-exact."""
    size = 32 * 1024 * 1024
    async with loopback_cluster(3) as cl:
        sa = SharedState([TensorInfo.from_numpy(np.full(size, 1, np.uint8), "w")], revision=1)
        sb = SharedState([TensorInfo.from_numpy(np.full(size, 1, np.uint8), "w")], revision=1)
        sc = SharedState([TensorInfo.from_numpy(np.zeros(size, np.uint8), "w")], revision=1)
        info = await sync_killing_the_holder(cl, [sa, sb, sc])
        assert isinstance(info, pccl.SharedStateSyncInfo), info
        assert (sc.tensor_infos[0].tensor == 1).all()
        assert cl.comms[-1].statistics()["heal_donors_failed"] == 1


async def test_all_holders_killed_mid_transfer_keeps_old_bits_and_retry_succeeds() -> None:
    size = 32 * 1024 * 1024
    async with loopback_cluster(3) as cl:
        c = cl.comms[2]
        sa = SharedState([TensorInfo.from_numpy(np.full(size, 1, np.uint8), "w")], revision=1)
        sb = SharedState([TensorInfo.from_numpy(np.full(size, 1, np.uint8), "w")], revision=1)
        sc = SharedState([TensorInfo.from_numpy(np.zeros(size, np.uint8), "w")], revision=1)
        assert isinstance(await sync_killing_the_holder(cl, [sa, sb, sc], both=True), pccl.PCCLError)
        assert (sc.tensor_infos[0].tensor == 0).all()  # atomic: old bits kept
        # the survivor syncs again, alone
        res = await sync_all([c], [sc])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in res), res


@pytest.mark.parametrize("steps", [6])
async def test_late_joiner_receives_once_then_zero_bytes(steps: int) -> None:
    """Deterministic training: same reduced gradients + in-place updates keep states identical."""
    async with loopback_cluster(2) as cl:

        def mk() -> tuple[SharedState, np.ndarray]:
            w = np.zeros(64, np.float32)
            return SharedState([TensorInfo.from_numpy(w, "w")]), w

        peers = [(c, *mk()) for c in cl.comms]
        for step in range(steps):
            if step == 2:
                c = await cl.add_peer()
                peers.append((c, *mk()))
            for _, st, _ in peers:
                st.revision = step + 1
            syncs = await sync_all([p[0] for p in peers], [p[1] for p in peers])
            assert all(isinstance(s, pccl.SharedStateSyncInfo) for s in syncs), syncs
            if step == 2:
                assert syncs[-1].rx_bytes == 64 * 4
                assert sum(s.rx_bytes for s in syncs[:-1]) == 0
            elif step > 0:
                assert all(s.tx_bytes == 0 and s.rx_bytes == 0 for s in syncs)
            grads = [np.full(64, float(i + step), np.float32) for i in range(len(peers))]

            async def reduce_and_step(i: int) -> None:
                comm, _, w = peers[i]
                await comm.all_reduce(grads[i], op=pccl.ReduceOp.AVG, tag=0)
                w -= 0.1 * grads[i]

            async with trio.open_nursery() as n:
                for i in range(len(peers)):
                    n.start_soon(reduce_and_step, i)
        ws = [p[2].tobytes() for p in peers]
        assert len(set(ws)) == 1
