"""This peer's P2P credentials: its X25519 key pair and the newest set the master issued
(docs/security.md "P2P bound to membership").

A thin trio adapter of :mod:`pccl.wire.credentials` (which decides everything): the communicator
installs each :class:`~pccl.wire.messages.P2PCredentials` it receives; the P2P listener asks which
credential a Hello must prove (waiting, bounded, when the Hello names a set the master issued but this
peer has not processed yet, or a peer its set does not list yet: the master's messages to two peers race
each other); the dialers ask which credential to present to a member.
"""

from __future__ import annotations

import trio

from ..wire.credentials import WAIT, CredentialSet, DialCredential, judge, not_issued
from ..wire.hello import HelloProblem, HelloRefusal
from ..wire.keys import KeyPair
from ..wire.messages import Hello, P2PCredentials


class CredentialStore:
    """This peer's key pair and its newest :class:`~pccl.wire.credentials.CredentialSet`.

    Args:
        wait: the longest a listener waits for the set a Hello names when it is newer than this peer's,
            or for the claimed peer's row (the peer has not processed the master's message yet).
        keys: this peer's key pair (default: a fresh one; drawn once per process by the communicator).
    """

    def __init__(self, *, wait: float, keys: KeyPair | None = None) -> None:
        self.wait = wait
        self.keys = keys if keys is not None else KeyPair.generate()
        self._current: CredentialSet | None = None
        self._changed = trio.Event()
        # Members the master removed since the current set was issued: refused at once, not at the
        # next epoch (a set that lists one again, when it re-joins, lifts it).
        self._revoked: set[int] = set()

    @property
    def current(self) -> CredentialSet | None:
        """The set in use (None: none issued yet)."""
        return self._current

    @property
    def public_key(self) -> bytes:
        """This peer's public key (sent in Register and Reregister)."""
        return self.keys.public

    def install(self, msg: P2PCredentials, *, me: int) -> bool:
        """Take the master's set for peer ``me`` (this peer's id); an older one than the current is
        ignored, one of the same epoch and binding adds its rows to the current set.

        Returns:
            True when it is now (part of) the current set.
        """
        cur = self._current
        serial = (msg.generation, msg.epoch)
        if cur is not None and serial < cur.serial:
            return False
        if cur is not None and cur.me == me and cur.keys is self.keys:
            new = cur.merged(msg)
        else:
            new = CredentialSet.from_message(msg, me=me, keys=self.keys)
        if new.serial != (cur.serial if cur is not None else None):
            self._revoked.clear()
        else:
            self._revoked -= {r.peer_id for r in msg.keys}
        self._current = new
        changed, self._changed = self._changed, trio.Event()
        changed.set()
        return True

    def revoke(self, peer_id: int) -> None:
        """The master removed ``peer_id``: its connections are refused from now on (until a set of the
        master lists it again)."""
        self._revoked.add(peer_id)

    @property
    def revoked(self) -> frozenset[int]:
        """The members removed since the current set was issued."""
        return frozenset(self._revoked)

    def for_dial(self, to_peer: int, channel: str) -> DialCredential | None:
        """The credential for a connection to ``to_peer`` on ``channel`` (None: not in the current set,
        or removed since)."""
        cur = self._current
        if cur is None or to_peer in self._revoked:
            return None
        return cur.for_dial(to_peer, channel)

    async def credential_for(self, hello: Hello) -> bytes | HelloRefusal:
        """The credential a connection with ``hello`` must prove, or why it is refused (a
        :data:`~pccl.wire.handshake.CredentialLookup`).

        Waits at most :attr:`wait` seconds for a newer set than the current one when the Hello names one.
        """
        with trio.move_on_after(self.wait):
            while True:
                if hello.peer_id in self._revoked:
                    why = f"revoked P2P credential: peer {hello.peer_id} was removed from the run"
                    return HelloRefusal(HelloProblem.CREDENTIAL, why)
                decision = judge(self._current, hello)
                if decision is not WAIT:
                    assert isinstance(decision, (bytes, HelloRefusal))
                    return decision
                await self._changed.wait()
        return not_issued(hello, self.wait)

    def __repr__(self) -> str:
        return f"<CredentialStore {self._current!r}>"


__all__ = ["CredentialStore"]
