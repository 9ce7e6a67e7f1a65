"""This peer's X25519 key pair for P2P credentials (docs/security.md "P2P bound to membership").

Drawn once per process (:meth:`KeyPair.generate`); the public half goes to the master in ``Register`` and
``Reregister``, the private half never leaves the process. The Diffie-Hellman value with each other
member's public key is cached (a member's key does not change; the cache is bounded).
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

_CACHE_LIMIT = 4096


class KeyPair:
    """An X25519 key pair (a :class:`pccl.wire.credentials.KeyAgreement`).

    Args:
        private: the private key; default: a fresh random one.
    """

    def __init__(self, private: X25519PrivateKey | None = None) -> None:
        self._private = private if private is not None else X25519PrivateKey.generate()
        self._public = self._private.public_key().public_bytes_raw()
        self._shared: dict[bytes, bytes | None] = {}

    @classmethod
    def generate(cls) -> KeyPair:
        """A fresh random key pair."""
        return cls()

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> KeyPair:
        """The key pair of the 32-byte private key ``raw`` (tests use fixed ones).

        Raises:
            ValueError: ``raw`` is not 32 bytes.
        """
        return cls(X25519PrivateKey.from_private_bytes(raw))

    @property
    def public(self) -> bytes:
        """The public key, 32 bytes."""
        return self._public

    def shared(self, peer_public: bytes) -> bytes | None:
        """The Diffie-Hellman value with ``peer_public``.

        Returns:
            32 bytes, or None when ``peer_public`` is no usable key (not 32 bytes, or a point of small
            order, whose value would be all zeros).
        """
        if peer_public in self._shared:
            return self._shared[peer_public]
        value: bytes | None
        try:
            value = self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:
            value = None
        if len(self._shared) >= _CACHE_LIMIT:
            self._shared.clear()
        self._shared[peer_public] = value
        return value

    def __repr__(self) -> str:  # never print the private key
        return f"<KeyPair public={self._public[:4].hex()}...>"


__all__ = ["KeyPair"]
