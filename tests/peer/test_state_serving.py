"""A holder's answers to chunk and manifest requests (pccl/peer/shared_state.py), bad ones refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pccl.kernels import hashing
from pccl.peer import shared_state as ss
from pccl.peer.shared_state import SharedState, SyncContext, TensorInfo
from pccl.wire import messages as m

MIB = 1 << 20


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[m.Message, bytes]] = []

    async def send(self, msg: m.Message) -> None:
        self.sent.append((msg, b""))

    async def send_with_raw(self, msg: m.Message, raw: Any) -> None:
        self.sent.append((msg, bytes(raw)))


def _ctx() -> tuple[SyncContext, np.ndarray]:
    data = np.random.default_rng(3).integers(0, 256, 3 * MIB + 5, dtype=np.uint8)
    state = SharedState([TensorInfo.from_numpy(data, "w")], revision=1)
    return SyncContext(state=state, hashes={"w": hashing.content_hash(data)}, seq=4), data


async def _serve(req: Any) -> tuple[str, _Recorder]:
    ctx, _ = _ctx()
    rec = _Recorder()
    by_name = {i.name: i for i in ctx.state.tensor_infos}
    return await ss._serve_one(ctx, by_name, rec, req), rec  # type: ignore[arg-type]


async def test_chunks_and_manifests_are_served() -> None:
    _, data = _ctx()
    refusal, rec = await _serve(m.StateChunkRequest(sync_seq=4, pieces=[["w", MIB, 100], ["w", 0, 0]]))
    assert refusal == ""
    assert rec.sent[0] == (m.StateChunk(key="w", offset=MIB, nbytes=100), data[MIB : MIB + 100].tobytes())
    assert rec.sent[1][0] == m.StateChunk(key="w", offset=0, nbytes=0)
    req = m.StateManifestRequest(sync_seq=4, key="w", chunk_bytes=MIB, first=1, count=9)
    refusal, rec = await _serve(req)
    assert refusal == ""
    msg = rec.sent[0][0]
    assert isinstance(msg, m.StateManifest) and msg.first == 1
    assert msg.sums == hashing.chunk_sums(data, MIB)[1:]


@pytest.mark.parametrize("req", [
    m.StateChunkRequest(sync_seq=4, pieces=[["nope", 0, 1]]),
    m.StateChunkRequest(sync_seq=4, pieces=[["w", 3 * MIB, 6]]),
    m.StateChunkRequest(sync_seq=4, pieces=[["w", -1, 1]]),
    m.StateChunkRequest(sync_seq=4, pieces=[["w", 0]]),
    m.StateChunkRequest(sync_seq=4, pieces=[["w", 0, True]]),
    m.StateManifestRequest(sync_seq=4, key="w", chunk_bytes=1000, first=0, count=1),
    m.StateManifestRequest(sync_seq=4, key="w", chunk_bytes=MIB, first=-1, count=1),
    m.StateManifestRequest(sync_seq=4, key="w", chunk_bytes=MIB, first=0, count=10**6),
    m.StateManifestRequest(sync_seq=4, key="x", chunk_bytes=MIB, first=0, count=1),
])
async def test_bad_requests_are_refused_with_a_reason(req: Any) -> None:
    refusal, rec = await _serve(req)
    assert refusal and not rec.sent
