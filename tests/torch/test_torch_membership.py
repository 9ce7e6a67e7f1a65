"""The membership phase of TrainingRun's core: an ``are_peers_pending()`` lost with the master is asked
again (its vote never reached a master: RANK_CONNECTION_LOST), it does not end the run (issue 18)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pccl import RankConnectionLostError, TooFewPeersError
from pccl.torch._ops import Members, PeersPending, UpdateTopology
from pccl.torch._train import TrainCore


def test_a_pending_query_lost_with_the_master_is_asked_again() -> None:
    core = SimpleNamespace(just_joined=False, min_world_size=2, min_world_size_timeout=None,
                           poll_interval=0.1, rank=0, world_size=1)
    gen = TrainCore.membership(core)  # type: ignore[arg-type]
    assert isinstance(next(gen), PeersPending)
    lost = RankConnectionLostError("lost the master; reconnecting: retry")
    assert isinstance(gen.throw(lost), PeersPending)
    assert isinstance(gen.send(True), UpdateTopology)
    assert isinstance(gen.send(None), Members)
    with pytest.raises(StopIteration):
        gen.send((0, 3))
    # Other errors still end it.
    gen = TrainCore.membership(core)  # type: ignore[arg-type]
    next(gen)
    with pytest.raises(TooFewPeersError):
        gen.throw(TooFewPeersError("alone"))
