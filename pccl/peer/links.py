"""The narrow interfaces the peer's helpers receive instead of the communicator.

:mod:`pccl.peer.shared_state` needs a :class:`MasterLink` (send to the master, an inbox of its answers
for this exchange) and a :class:`Dialer` (open P2P connections); :mod:`pccl.peer.bandwidth` needs a
dialer. The communicator provides both (:class:`pccl.peer.p2p.P2PDialer` is the dialer).
"""

from __future__ import annotations

from typing import Protocol

from ..wire import messages as m
from ..wire.stream import MessageStream
from .mailbox import Mailbox


class MasterLink(Protocol):
    """This peer's link to the master for one exchange."""

    @property
    def inbox(self) -> Mailbox:
        """The master's messages for this exchange, in order."""
        ...

    async def send(self, msg: m.Message) -> None:
        """Send ``msg`` to the master.

        Raises:
            MasterConnectionError: the master is lost.
        """
        ...


class Dialer(Protocol):
    """Opens handshaken P2P connections to other peers' listeners."""

    @property
    def connect_timeout(self) -> float:
        """Seconds a connect (and, separately, its handshake) may take."""
        ...

    async def dial(
        self, host: str, port: int, *, channel: str, index: int = 0, peer_id: int = -1
    ) -> MessageStream:
        """Open a P2P connection on ``channel`` to ``peer_id`` (see :func:`pccl.peer.p2p.open_p2p`).

        Raises:
            RankConnectionFailedError: it could not be opened or was refused.
        """
        ...


__all__ = ["Dialer", "MasterLink"]
