"""P2P credentials: a P2P connection is bound to the membership the master issued (docs/security.md).

Pure: key derivation, the set a peer holds, and the listener's decision on a Hello. The master draws a
random ``root`` once per process; everything else is derived, so a restarted master needs nothing from its
predecessor and no table of pairs is stored anywhere::

    E     = PRF(root, "epoch", generation, epoch)   the master's key of one epoch
    k_j   = PRF(E, "listen", j)                     peer j's listen key (sent to j only)
    d_ij  = PRF(k_j, "dial", i)                     i's dial key for j (sent to i only)
    c     = PRF(d_ij, "channel", ch)                the credential of i's connections to j on channel ch

PRF is keyed BLAKE2b-256 (a MAC by design, RFC 7693) over length-prefixed parts. Peer j derives ``c`` for
any claimed ``i`` from its own ``k_j``, so a listener needs one key per epoch however large the group;
peer i gets one dial key per other member, so it can open a credentialed connection to *any* member of
the epoch (ring successor, halving-doubling and tree partners, shared-state holders, bandwidth targets).
Nobody but the master and ``i`` can compute ``d_ij``: a valid proof for a Hello claiming peer ``i`` on
channel ``ch`` shows the connection is ``i``'s, for that channel, in that epoch. The credential never
travels: the handshake (:mod:`pccl.wire.hello`) keys its HMAC with it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .hello import HelloProblem, HelloRefusal
from .messages import CredentialRow, Hello, P2PCredentials

KEY_BYTES = 32
_PERSON = b"pccl-p2p-cred"


def _msg(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def _keyed(key: bytes) -> hashlib.blake2b:
    return hashlib.blake2b(key=key, digest_size=KEY_BYTES, person=_PERSON)


def _prf(key: bytes, *parts: bytes) -> bytes:
    h = _keyed(key)
    h.update(_msg(*parts))
    return h.digest()


def _int(v: int) -> bytes:
    return v.to_bytes(8, "big", signed=True)


def epoch_key(root: bytes, generation: int, epoch: int) -> bytes:
    """The master's key of ``epoch`` of ``generation`` (``root``: its random per-process key)."""
    return _prf(root, b"epoch", _int(generation), _int(epoch))


def listen_key(epoch_key_: bytes, peer_id: int) -> bytes:
    """Peer ``peer_id``'s listen key for the epoch of ``epoch_key_``."""
    return _prf(epoch_key_, b"listen", _int(peer_id))


def _dial_msg(from_peer: int) -> bytes:
    return _msg(b"dial", _int(from_peer))


def dial_key(listen_key_: bytes, from_peer: int) -> bytes:
    """``from_peer``'s dial key for the listener whose listen key is ``listen_key_``."""
    h = _keyed(listen_key_)
    h.update(_dial_msg(from_peer))
    return h.digest()


def channel_credential(dial_key_: bytes, channel: str) -> bytes:
    """The credential of connections on ``channel`` made with ``dial_key_``."""
    return _prf(dial_key_, b"channel", channel.encode("utf-8"))


class CredentialIssuer:
    """The master's side: issues each member its :class:`~pccl.wire.messages.P2PCredentials`.

    Args:
        root: the master's random key (at least 16 bytes), drawn once per master process.

    The listen keys of the latest epoch are cached (as keyed hash states, copied per dial key): issuing
    a set to every one of ``n`` members costs ``n`` listen keys once and ``n - 1`` dial keys per member.
    """

    def __init__(self, root: bytes) -> None:
        if len(root) < 16:
            raise ValueError("the credential root must be at least 16 bytes")
        self._root = root
        self._serial: tuple[int, int] | None = None
        self._epoch_key = b""
        self._listen: dict[int, tuple[bytes, Any]] = {}  # peer -> (listen key, its keyed hash state)

    def _listen_key(self, generation: int, epoch: int, peer_id: int) -> tuple[bytes, Any]:
        if self._serial != (generation, epoch):
            self._serial = (generation, epoch)
            self._epoch_key = epoch_key(self._root, generation, epoch)
            self._listen = {}
        got = self._listen.get(peer_id)
        if got is None:
            k = listen_key(self._epoch_key, peer_id)
            got = self._listen[peer_id] = (k, _keyed(k))
        return got

    def issue(self, peer_id: int, members: Iterable[int], *, generation: int, epoch: int) -> P2PCredentials:
        """The set of ``peer_id`` for ``epoch``: its listen key and a dial key for every other member.

        Args:
            peer_id: who receives it.
            members: the peers it may connect to (itself is skipped).
            generation: the master's generation.
            epoch: the epoch.
        """
        return self.issue_all([peer_id], members, generation=generation, epoch=epoch)[peer_id]

    def issue_all(
        self, receivers: Iterable[int], members: Iterable[int], *, generation: int, epoch: int
    ) -> dict[int, P2PCredentials]:
        """:meth:`issue` for each of ``receivers`` (the listen-key states looked up once)."""
        states = [(j, self._listen_key(generation, epoch, j)[1]) for j in dict.fromkeys(members)]
        out: dict[int, P2PCredentials] = {}
        for i in receivers:
            data = _dial_msg(i)
            rows = []
            for j, state in states:
                if j != i:
                    h = state.copy()  # = dial_key(k_j, i), without re-keying
                    h.update(data)
                    rows.append(CredentialRow(j, h.digest()))
            own = self._listen_key(generation, epoch, i)[0]
            out[i] = P2PCredentials(peer_id=i, generation=generation, epoch=epoch, key=own, dial=rows)
        return out


@dataclass(frozen=True)
class DialCredential:
    """What a connecting side presents: the set's ``generation`` and ``epoch`` (in its Hello) and the
    credential (the key of its proof)."""

    generation: int
    epoch: int
    key: bytes


@dataclass(frozen=True)
class CredentialSet:
    """One peer's credentials of one epoch (the decoded :class:`~pccl.wire.messages.P2PCredentials`)."""

    peer_id: int
    generation: int
    epoch: int
    listen_key: bytes
    dial_keys: dict[int, bytes] = field(default_factory=dict)

    @classmethod
    def from_message(cls, msg: P2PCredentials) -> CredentialSet:
        """Decode the master's message."""
        return cls(msg.peer_id, msg.generation, msg.epoch, msg.key, {r.peer_id: r.key for r in msg.dial})

    @property
    def serial(self) -> tuple[int, int]:
        """``(generation, epoch)``: sets are ordered by it; the newest one is current."""
        return (self.generation, self.epoch)

    def for_dial(self, to_peer: int, channel: str) -> DialCredential | None:
        """The credential for a connection to ``to_peer`` on ``channel`` (None: not a member of this set)."""
        d = self.dial_keys.get(to_peer)
        if d is None:
            return None
        return DialCredential(self.generation, self.epoch, channel_credential(d, channel))

    def for_accept(self, from_peer: int, channel: str) -> bytes:
        """The credential a connection from ``from_peer`` on ``channel`` must prove."""
        return channel_credential(dial_key(self.listen_key, from_peer), channel)

    def __repr__(self) -> str:  # never print keys
        return (f"<CredentialSet peer={self.peer_id} generation={self.generation} epoch={self.epoch} "
                f"dial={len(self.dial_keys)} peers>")


class Wait:
    """The listener's decision: the Hello names a newer set than this peer holds; wait for it."""

    def __repr__(self) -> str:
        return "<Wait>"


WAIT = Wait()


def judge(current: CredentialSet | None, hello: Hello) -> bytes | HelloRefusal | Wait:
    """A P2P listener's decision on a Hello that passed :func:`~pccl.wire.hello.check_hello`.

    Args:
        current: this peer's newest set (None: none issued yet).
        hello: the Hello.

    Returns:
        The credential the connecting side must prove (the key of the challenge-response), a refusal,
        or :data:`WAIT` (the set it names is newer than ``current``: the master has issued it and this
        peer has not processed it yet; wait a bounded time for it and judge again).
    """
    if hello.epoch < 0:
        return HelloRefusal(
            HelloProblem.CREDENTIAL,
            f"no P2P credential: a connection claiming peer {hello.peer_id} presented none (this peer "
            "accepts P2P connections only with the credential the master issued for them)",
        )
    claimed = (hello.generation, hello.epoch)
    if current is None or claimed > current.serial:
        return WAIT
    if claimed < current.serial:
        return HelloRefusal(
            HelloProblem.CREDENTIAL,
            f"stale P2P credential: a connection claiming peer {hello.peer_id} presented one of epoch "
            f"{hello.epoch} (generation {hello.generation}); this peer is at epoch {current.epoch} "
            f"(generation {current.generation})",
        )
    return current.for_accept(hello.peer_id, hello.channel)


def not_issued(hello: Hello, waited: float) -> HelloRefusal:
    """The refusal when the set a Hello names did not arrive within ``waited`` seconds."""
    return HelloRefusal(
        HelloProblem.CREDENTIAL,
        f"unknown P2P credential: a connection claiming peer {hello.peer_id} presented one of epoch "
        f"{hello.epoch} (generation {hello.generation}), which the master did not issue to this peer "
        f"within {waited:g}s",
    )


__all__ = [
    "KEY_BYTES", "WAIT", "CredentialIssuer", "CredentialSet", "DialCredential", "Wait", "channel_credential",
    "dial_key", "epoch_key", "judge", "listen_key", "not_issued",
]
