"""This peer's P2P credentials: the newest set the master issued (docs/security.md "P2P bound to
membership").

A thin trio adapter of :mod:`pccl.wire.credentials` (which decides everything): the communicator
installs each :class:`~pccl.wire.messages.P2PCredentials` it receives; the P2P listener asks which
credential a Hello must prove (waiting, bounded, when the Hello names a set the master issued but this
peer has not processed yet: the master's messages to two peers race each other); the dialers ask
which credential to present to a member.
"""

from __future__ import annotations

import trio

from ..wire.credentials import WAIT, CredentialSet, DialCredential, judge, not_issued
from ..wire.hello import HelloRefusal
from ..wire.messages import Hello, P2PCredentials


class CredentialStore:
    """The newest :class:`~pccl.wire.credentials.CredentialSet` of this peer.

    Args:
        wait: the longest a listener waits for the set a Hello names when it is newer than this peer's
            (the peer has not processed the master's message yet).
    """

    def __init__(self, *, wait: float) -> None:
        self.wait = wait
        self._current: CredentialSet | None = None
        self._changed = trio.Event()

    @property
    def current(self) -> CredentialSet | None:
        """The set in use (None: none issued yet)."""
        return self._current

    def install(self, msg: P2PCredentials) -> bool:
        """Take the master's set; an older one than the current is ignored.

        Returns:
            True when it is now the current set.
        """
        new = CredentialSet.from_message(msg)
        cur = self._current
        if cur is not None and new.serial < cur.serial:
            return False
        self._current = new
        changed, self._changed = self._changed, trio.Event()
        changed.set()
        return True

    def for_dial(self, to_peer: int, channel: str) -> DialCredential | None:
        """The credential for a connection to ``to_peer`` on ``channel`` (None: not in the current set)."""
        cur = self._current
        return None if cur is None else cur.for_dial(to_peer, channel)

    async def credential_for(self, hello: Hello) -> bytes | HelloRefusal:
        """The credential a connection with ``hello`` must prove, or why it is refused (a
        :data:`~pccl.wire.handshake.CredentialLookup`).

        Waits at most :attr:`wait` seconds for a newer set than the current one when the Hello names one.
        """
        with trio.move_on_after(self.wait):
            while True:
                decision = judge(self._current, hello)
                if decision is not WAIT:
                    assert isinstance(decision, (bytes, HelloRefusal))
                    return decision
                await self._changed.wait()
        return not_issued(hello, self.wait)

    def __repr__(self) -> str:
        return f"<CredentialStore {self._current!r}>"


__all__ = ["CredentialStore"]
