"""What the ring collectives need from a data pool: the narrow interface :mod:`pccl.collectives.ring`
runs on. :class:`pccl.peer.pool.P2PPool` implements it; the collectives never import the peer side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class Receive(Protocol):
    """A registered receive of one frame (see :meth:`DataPool.expect`)."""

    async def wait(self) -> None:
        """Return once the frame has fully arrived in its destination.

        Raises:
            RankConnectionLostError: the connection broke or the operation was forgotten.
            RemoteProtocolError: the frame had the wrong length.
        """
        ...


class DataPool(Protocol):
    """Frame transport between ring neighbours, routed by ``(peer, tag, op_seq, seq)``."""

    @property
    def pool_size(self) -> int:
        """Connections per neighbour and direction."""
        ...

    def stripes(self, peer_id: int) -> int:
        """How many connections an operation stripes its frames to ``peer_id`` over (>= 1)."""
        ...

    def begin_transfer(self, peer_id: int) -> Any:
        """A large operation starts sending to ``peer_id``: a handle for :meth:`end_transfer` (the pool
        may size its stripes from the throughput; one that does not returns anything)."""
        ...

    def end_transfer(self, transfer: Any, nbytes: int, completed: bool) -> None:
        """The transfer :meth:`begin_transfer` returned ``transfer`` for ended: ``nbytes`` were sent
        (``completed``: the whole operation's data plane succeeded)."""
        ...

    async def send(
        self, peer_id: int, tag: int, op_seq: int, seq: int, data: memoryview, *, conn_index: int
    ) -> None:
        """Send one frame to ``peer_id`` (on connection ``conn_index % stripes(peer_id)``)."""
        ...

    async def reopen(self, peer_id: int) -> None:
        """Reopen the lost connections to ``peer_id`` (raises RankConnectionFailedError if it cannot)."""
        ...

    def expect(self, peer_id: int, tag: int, op_seq: int, seq: int, dest: memoryview) -> Receive:
        """Register a receive of frame ``(tag, op_seq, seq)`` from ``peer_id`` into ``dest``."""
        ...

    def forget_op(self, op_seq: int) -> None:
        """Drop every receive of ``op_seq``; nothing writes into its destinations afterwards."""
        ...

    async def disconnect(self, peer_id: int) -> None:
        """Close every connection with ``peer_id`` (its stream state is unknown after a failure)."""
        ...

    async def disconnect_all(self, peer_ids: Iterable[int]) -> None:
        """:meth:`disconnect` each of ``peer_ids``, shielded from cancellation (a failed
        operation's partners: it runs while that operation is being cancelled)."""
        ...


__all__ = ["DataPool", "Receive"]
