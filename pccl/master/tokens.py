"""Member tokens: a member proves it is one when it re-registers (docs/security.md "Re-registration").

A master gives every peer it registers (``Registered``) or takes back (``Reregistered``) a token bound to
its id and the master's generation::

    t = PRF(K, "member", generation, peer_id)

and a member's ``Reregister`` must carry the token of the generation it reports. ``K``:

* with a shared secret (``MasterConfig.secret``): derived from the secret, so every master of the run
  (the same one, a restarted one, a standby) verifies the tokens of every generation;
* without one: random per master process, so a master recognizes the tokens it issued itself. Another
  master process's token (a restarted or standby master; generation numbers alone do not tell
  processes apart) it cannot verify: it takes such a member on trust only while it holds no run of its
  own or rebuilds one from re-registrations, and later for the generations it rebuilt its run from
  (a member back late), as before; otherwise it refuses the claim (retryable: a standby may hold the
  peer's run). A stranger can so join a restarted master's rebuild without a secret; with one it cannot.

Pure: no clock, no I/O (hashlib and hmac only).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_BYTES = 32
_PERSON = b"pccl-member-tok"


def _prf(key: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=TOKEN_BYTES, person=_PERSON)
    for p in parts:
        h.update(len(p).to_bytes(2, "big") + p)
    return h.digest()


class MemberTokens:
    """Issues and checks member tokens (see the module docstring).

    Args:
        key: the token key (at least 16 bytes).
        shared: True when every master of the run derives the same key (from the shared secret): the
            tokens of every generation are then verifiable here.
    """

    def __init__(self, key: bytes, *, shared: bool = False) -> None:
        if len(key) < 16:
            raise ValueError("the member token key must be at least 16 bytes")
        self.shared = shared
        # The keyed hash, set up once: a token costs a copy and one update (a rebuild makes one per member).
        self._base = hashlib.blake2b(key=key, digest_size=TOKEN_BYTES, person=_PERSON)

    @classmethod
    def for_secret(cls, secret: str | None) -> MemberTokens:
        """The tokens of a master with ``secret`` (None or "": a random key of this process)."""
        if not secret:
            return cls(secrets.token_bytes(TOKEN_BYTES))
        return cls(_prf(secret.encode("utf-8"), b"member token key"), shared=True)

    def issue(self, generation: int, peer_id: int) -> bytes:
        """The token of ``peer_id`` at ``generation``, to give that peer."""
        h = self._base.copy()
        # the parts "member", generation, peer_id, each length-prefixed as _prf does
        h.update(b"\x00\x06member\x00\x08" + generation.to_bytes(8, "big")
                 + b"\x00\x08" + peer_id.to_bytes(8, "big"))
        return h.digest()

    def valid(self, generation: int, peer_id: int, token: bytes) -> bool:
        """True when ``token`` is ``peer_id``'s at ``generation`` under this key: this master issued it
        (or, with a shared secret, a master of the run did)."""
        return hmac.compare_digest(token, self.issue(generation, peer_id))


__all__ = ["TOKEN_BYTES", "MemberTokens"]
