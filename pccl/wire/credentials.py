"""P2P credentials: a P2P connection is bound to the membership the master issued (docs/security.md).

Pure: the epoch binding, the derivation both ends of a connection run, the set a peer holds, and the
listener's decision on a Hello. Protocol 5 (O(n) at the master)::

    (s_i, P_i)  X25519 key pair of peer i, drawn once per process; P_i sent in Register / Reregister
    B           = PRF(root, "epoch", generation, epoch)      the epoch binding; root: the master's random
                                                             per-process key; sent to the epoch's members only
    T           = [(peer_id, P_peer) for every member]       the epoch's public table
    Z_ij        = X25519(s_i, P_j) = X25519(s_j, P_i)        known to i and j only
    k_ij        = PRF(B, "pair", generation, epoch, i, P_i, j, P_j, Z_ij)   i dials j
    c           = PRF(k_ij, "channel", ch)                   the credential of i's connections to j on ch

The master sends every member the *same* :class:`~pccl.wire.messages.P2PCredentials` (``B`` and ``T``) per
epoch: building it is O(n), and it is encoded once. PRF is keyed BLAKE2b-256 (a MAC by design, RFC 7693)
over length-prefixed parts.

What binds what: ``Z_ij`` needs ``s_i`` or ``s_j``, so nobody but ``i`` and ``j`` (not another member,
not the master) can compute ``k_ij``: a valid proof for a Hello claiming peer ``i`` shows the connection
is ``i``'s. ``B`` is random to everyone but the master and the epoch's members and differs per epoch and
master generation (and per master process): a removed member, an outsider, an older epoch or another
master's set derive nothing a listener of this epoch accepts, even with a degenerate key. The listener
looks the claimed peer's key up in *its* table, so an id the master did not list gets nothing either.
Each end derives ``k_ij`` lazily, once per (peer, epoch); the Diffie-Hellman value is cached per public
key (a member's key does not change between epochs). The credential never travels: the handshake
(:mod:`pccl.wire.hello`) keys its HMAC with it.

No cryptography here beyond hashlib: the X25519 exchange comes in through :class:`KeyAgreement`
(:class:`pccl.wire.keys.KeyPair`), so the master, which only relays public keys, never loads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Protocol

from .hello import HelloProblem, HelloRefusal
from .messages import Hello, P2PCredentials, PublicKeyRow

KEY_BYTES = 32
#: The length of an X25519 public key; ``b""`` in a table: the peer registered none (it can open and
#: accept no credentialed P2P connection).
PUBLIC_KEY_BYTES = 32
_PERSON = b"pccl-p2p-cred5"


def _msg(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def _prf(key: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=KEY_BYTES, person=_PERSON)
    h.update(_msg(*parts))
    return h.digest()


def _int(v: int) -> bytes:
    return v.to_bytes(8, "big", signed=True)


def epoch_binding(root: bytes, generation: int, epoch: int) -> bytes:
    """The binding of ``epoch`` of ``generation`` at the master whose random key is ``root``."""
    return _prf(root, b"epoch", _int(generation), _int(epoch))


def pair_key(
    binding: bytes, generation: int, epoch: int, dialer: tuple[int, bytes], listener: tuple[int, bytes],
    shared: bytes,
) -> bytes:
    """``k_ij``: the key of ``dialer``'s connections to ``listener`` (each ``(peer_id, public key)``)."""
    (i, pi), (j, pj) = dialer, listener
    return _prf(binding, b"pair", _int(generation), _int(epoch), _int(i), pi, _int(j), pj, shared)


def channel_credential(pair_key_: bytes, channel: str) -> bytes:
    """The credential of connections on ``channel`` made under ``pair_key_``."""
    return _prf(pair_key_, b"channel", channel.encode("utf-8"))


def check_public_key(key: bytes) -> str | None:
    """Why ``key`` cannot be a peer's P2P public key in Register / Reregister (None: it can; ``b""``
    means none)."""
    if key and len(key) != PUBLIC_KEY_BYTES:
        return (f"its P2P public key has {len(key)} bytes; an X25519 public key has {PUBLIC_KEY_BYTES} "
                "(protocol 5)")
    return None


class CredentialIssuer:
    """The master's side: one :class:`~pccl.wire.messages.P2PCredentials` per epoch, the same for every
    member.

    Args:
        root: the master's random key (at least 16 bytes), drawn once per master process.
    """

    def __init__(self, root: bytes) -> None:
        if len(root) < 16:
            raise ValueError("the credential root must be at least 16 bytes")
        self._root = root
        self._serial: tuple[int, int] | None = None
        self._binding = b""

    def binding(self, generation: int, epoch: int) -> bytes:
        """:func:`epoch_binding` of this master (the latest one cached)."""
        if self._serial != (generation, epoch):
            self._serial = (generation, epoch)
            self._binding = epoch_binding(self._root, generation, epoch)
        return self._binding

    def table(self, rows: Iterable[tuple[int, bytes]], *, generation: int, epoch: int) -> P2PCredentials:
        """The set of ``epoch``: its binding and the members' public keys (send it to members only).

        Args:
            rows: ``(peer_id, public key)`` of the members (a later row of one peer replaces an earlier).
            generation: the master's generation.
            epoch: the epoch.

        Returns:
            One message for every member (encode it once).
        """
        return self.message([PublicKeyRow(p, k) for p, k in dict(rows).items()], generation=generation,
                            epoch=epoch)

    def message(self, rows: list[PublicKeyRow], *, generation: int, epoch: int) -> P2PCredentials:
        """The set of ``epoch`` with ``rows`` as they are (one per peer: the caller keeps them unique),
        for a caller that keeps its rows between messages (:mod:`pccl.master.issued`)."""
        return P2PCredentials(generation=generation, epoch=epoch, binding=self.binding(generation, epoch),
                              keys=rows)


class KeyAgreement(Protocol):
    """This peer's key pair (:class:`pccl.wire.keys.KeyPair`)."""

    @property
    def public(self) -> bytes:
        """The public key (32 bytes)."""
        ...

    def shared(self, peer_public: bytes) -> bytes | None:
        """The Diffie-Hellman value with ``peer_public`` (None: not a usable public key)."""
        ...


class DialCredential:
    """What a connecting side presents: the set's ``generation`` and ``epoch`` (in its Hello) and the
    credential (the key of its proof)."""

    __slots__ = ("epoch", "generation", "key")

    def __init__(self, generation: int, epoch: int, key: bytes) -> None:
        self.generation = generation
        self.epoch = epoch
        self.key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DialCredential) and (self.generation, self.epoch, self.key) == (
            other.generation, other.epoch, other.key)

    def __hash__(self) -> int:
        return hash((self.generation, self.epoch, self.key))

    def __repr__(self) -> str:  # never print keys
        return f"<DialCredential generation={self.generation} epoch={self.epoch}>"


class CredentialSet:
    """One peer's view of one epoch's :class:`~pccl.wire.messages.P2PCredentials`, and its derivations.

    Args:
        me: this peer's id.
        keys: this peer's key pair.
        generation: the set's master generation.
        epoch: the set's epoch.
        binding: the epoch binding.
        table: peer id -> public key of the epoch's members.
    """

    def __init__(self, *, me: int, keys: KeyAgreement, generation: int, epoch: int, binding: bytes,
                 table: Mapping[int, bytes]) -> None:
        self.me = me
        self.keys = keys
        self.generation = generation
        self.epoch = epoch
        self.binding = binding
        self.table = dict(table)
        self._pairs: dict[tuple[int, bool], bytes | None] = {}  # (peer, I dial) -> k, None: unusable key

    @classmethod
    def from_message(cls, msg: P2PCredentials, *, me: int, keys: KeyAgreement) -> CredentialSet:
        """Decode the master's message for peer ``me`` holding ``keys``."""
        return cls(me=me, keys=keys, generation=msg.generation, epoch=msg.epoch, binding=msg.binding,
                   table={r.peer_id: r.public_key for r in msg.keys})

    def merged(self, msg: P2PCredentials) -> CredentialSet:
        """This set with ``msg``'s rows added: the master sends rows of members that re-register while
        it rebuilds (same serial, same binding); another binding replaces the set."""
        if (msg.generation, msg.epoch) != self.serial or msg.binding != self.binding:
            return CredentialSet.from_message(msg, me=self.me, keys=self.keys)
        out = CredentialSet(me=self.me, keys=self.keys, generation=self.generation, epoch=self.epoch,
                            binding=self.binding, table=self.table)
        for r in msg.keys:
            out.table[r.peer_id] = r.public_key
        out._pairs = {k: v for k, v in self._pairs.items() if out.table.get(k[0]) == self.table.get(k[0])}
        return out

    @property
    def serial(self) -> tuple[int, int]:
        """``(generation, epoch)``: sets are ordered by it; the newest one is current."""
        return (self.generation, self.epoch)

    def _pair(self, peer: int, dialing: bool) -> bytes | None:
        got = self._pairs.get((peer, dialing), b"")
        if got != b"":
            return got
        theirs = self.table.get(peer, b"")
        shared = self.keys.shared(theirs) if len(theirs) == PUBLIC_KEY_BYTES else None
        k: bytes | None = None
        if shared is not None:
            me, other = (self.me, self.keys.public), (peer, theirs)
            dialer, listener = (me, other) if dialing else (other, me)
            k = pair_key(self.binding, self.generation, self.epoch, dialer, listener, shared)
        self._pairs[(peer, dialing)] = k
        return k

    def for_dial(self, to_peer: int, channel: str) -> DialCredential | None:
        """The credential for a connection to ``to_peer`` on ``channel`` (None: ``to_peer`` is not in
        this set, or has no usable key)."""
        if to_peer not in self.table or to_peer == self.me:
            return None
        k = self._pair(to_peer, True)
        if k is None:
            return None
        return DialCredential(self.generation, self.epoch, channel_credential(k, channel))

    def for_accept(self, from_peer: int, channel: str) -> bytes | None:
        """The credential a connection from ``from_peer`` on ``channel`` must prove (None: ``from_peer``
        is not in this set, or has no usable key). A Hello claiming this peer's own id gets one too
        (from this peer's key with itself: nobody else can make it), so it is refused at the proof like
        any other claim it cannot back."""
        if from_peer not in self.table:
            return None
        k = self._pair(from_peer, False)
        return None if k is None else channel_credential(k, channel)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CredentialSet) and (
            self.me, self.keys.public, self.serial, self.binding, self.table) == (
            other.me, other.keys.public, other.serial, other.binding, other.table)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:  # never print keys
        return (f"<CredentialSet peer={self.me} generation={self.generation} epoch={self.epoch} "
                f"table={len(self.table)} peers>")


class Wait:
    """The listener's decision: the Hello names a newer set than this peer holds, or a peer its set
    does not list yet; wait for the master's next message."""

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
        or :data:`WAIT`: the set it names is newer than ``current``, or ``current`` does not list the
        claimed peer yet (a rebuilding master sends the row of a member that re-registers to the
        members back before it, racing that member's own connections); wait a bounded time for the
        master's message and judge again.
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
    if hello.peer_id not in current.table:
        return WAIT
    cred = current.for_accept(hello.peer_id, hello.channel)
    if cred is None:
        return HelloRefusal(
            HelloProblem.CREDENTIAL,
            f"no usable P2P key: the master's set of epoch {current.epoch} (generation {current.generation}) "
            f"lists no valid public key for peer {hello.peer_id}",
        )
    return cred


def not_issued(hello: Hello, waited: float) -> HelloRefusal:
    """The refusal when the set a Hello names, or the claimed peer's row, did not arrive within
    ``waited`` seconds."""
    return HelloRefusal(
        HelloProblem.CREDENTIAL,
        f"unknown P2P credential: a connection claiming peer {hello.peer_id} presented one of epoch "
        f"{hello.epoch} (generation {hello.generation}), which the master did not issue to this peer "
        f"within {waited:g}s (or issued without that peer)",
    )


__all__ = [
    "KEY_BYTES", "PUBLIC_KEY_BYTES", "WAIT", "CredentialIssuer", "CredentialSet", "DialCredential",
    "KeyAgreement", "Wait", "channel_credential", "check_public_key", "epoch_binding", "judge", "not_issued",
    "pair_key",
]
