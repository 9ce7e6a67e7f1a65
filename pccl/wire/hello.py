"""The hello check every listener runs (the master's and each peer's P2P listener; docs/protocol.md).

Pure: it looks at the messages of a connection's handshake and says whether to accept it, and if not,
why, as a :class:`HelloRefusal` whose ``problem`` maps to the result code sent in ``Refused``.

The handshake is a mutual challenge-response; the secret never travels::

    client -> Hello(..., nonce=Nc)                      Nc, Ns: fresh random 16 bytes
    server -> Challenge(nonce=Ns, proof=HMAC(K, "server", purpose, Nc, Ns))
    client -> Proof(proof=HMAC(K, "client", purpose, Nc, Ns))
    server -> HelloOk | Refused

``K`` is the shared secret (the empty key without one), HMAC-SHA256, compared in constant time. The
client checks the server's proof before answering, so it never proves itself to a side that does not know
the secret; a recorded handshake replayed later fails because the listener's nonce is new; the role label
keeps either side's proof from being reflected as the other's.

On a P2P connection ``K`` also holds the credential of exactly that connection (its peer pair, channel and
epoch, derived by both ends from their X25519 keys and the epoch set the master issued;
:mod:`pccl.wire.credentials`): both sides then prove the credential as well
as the secret, and the Hello's ``generation`` / ``epoch`` say which set it comes from.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Collection
from dataclasses import dataclass

from .._config import PROTOCOL_VERSION
from .._errors import Result
from .messages import Challenge, Hello, Message, Proof, Refused

NONCE_BYTES = 16  # what this side sends
MIN_NONCE_BYTES = 16  # what it accepts
MAX_NONCE_BYTES = 64
_LABEL = b"pccl-hello-v2"


class HelloProblem(enum.Enum):
    """Why a connection's first message was refused."""

    NOT_HELLO = "not_hello"
    NONCE = "nonce"
    VERSION = "version"
    PURPOSE = "purpose"
    SECRET = "secret"
    CHANNEL = "channel"
    CREDENTIAL = "credential"
    RUN = "run"

    @property
    def result(self) -> Result:
        """The result code a ``Refused`` carries for this problem."""
        return _RESULTS[self]


# A first message that is no Hello or speaks another protocol version is the other side's protocol
# error; a wrong purpose, secret or channel is a misuse (wrong address, wrong configuration).
_RESULTS = {
    HelloProblem.NOT_HELLO: Result.REMOTE_ERROR,
    HelloProblem.NONCE: Result.REMOTE_ERROR,
    HelloProblem.VERSION: Result.REMOTE_ERROR,
    HelloProblem.PURPOSE: Result.INVALID_USAGE,
    HelloProblem.SECRET: Result.INVALID_USAGE,
    HelloProblem.CHANNEL: Result.INVALID_USAGE,
    HelloProblem.CREDENTIAL: Result.INVALID_USAGE,
    HelloProblem.RUN: Result.INVALID_USAGE,
}


@dataclass(frozen=True)
class HelloRefusal:
    """A refused hello: what is wrong and the reason text for ``Refused.reason``."""

    problem: HelloProblem
    reason: str

    @property
    def result(self) -> Result:
        """The result code for ``Refused.code``."""
        return self.problem.result


def _key(secret: str | None, credential: bytes) -> bytes:
    raw = (secret or "").encode("utf-8")
    if not credential:
        return raw
    # Both, unambiguously: the secret's length first.
    return len(raw).to_bytes(4, "big") + raw + credential


def proof(
    secret: str | None,
    role: str,
    purpose: str,
    client_nonce: bytes,
    server_nonce: bytes,
    credential: bytes = b"",
) -> bytes:
    """HMAC-SHA256 over both nonces, keyed with the secret ("" and None: the empty key) and, on a
    credentialed P2P connection, the credential.

    Args:
        secret: the shared secret.
        role: "server" (in Challenge) or "client" (in Proof).
        purpose: the connection's purpose ("master", "p2p").
        client_nonce: the Hello's nonce.
        server_nonce: the Challenge's nonce.
        credential: the connection's P2P credential (b"": none).

    Returns:
        The 32-byte proof.
    """
    key = _key(secret, credential)
    parts = (_LABEL, role.encode(), purpose.encode(), client_nonce, server_nonce)
    msg = b"".join(len(p).to_bytes(2, "big") + p for p in parts)
    return hmac.new(key, msg, hashlib.sha256).digest()


def _nonce_ok(nonce: bytes) -> bool:
    return MIN_NONCE_BYTES <= len(nonce) <= MAX_NONCE_BYTES


def check_hello(
    msg: Message,
    *,
    purpose: str,
    channels: Collection[str] | None = None,
    listener: str = "this listener",
    run: str = "",
) -> HelloRefusal | None:
    """Check the first message of a connection (the secret is checked later, by :func:`check_proof`).

    Args:
        msg: the message received first.
        purpose: the purpose this listener serves ("master" or "p2p").
        channels: the P2P channels served (None: the hello's channel is not checked).
        listener: how the reasons name this side ("the master", "this peer").
        run: the master's run name ("": none); see :func:`check_run`.

    Returns:
        None to go on with :func:`challenge`, else the refusal.
    """
    if not isinstance(msg, Hello):
        return HelloRefusal(HelloProblem.NOT_HELLO, f"expected Hello, got {type(msg).__name__}")
    if msg.protocol_version != PROTOCOL_VERSION:
        return HelloRefusal(
            HelloProblem.VERSION,
            f"protocol version mismatch: the connecting peer speaks version {msg.protocol_version}, "
            f"{listener} speaks version {PROTOCOL_VERSION}",
        )
    mismatch = check_run(run, msg.run)
    if mismatch is not None:
        return HelloRefusal(HelloProblem.RUN, mismatch)
    if msg.purpose != purpose:
        return HelloRefusal(
            HelloProblem.PURPOSE,
            f"{listener} serves purpose {purpose!r}; connection purpose {msg.purpose!r} is not served here",
        )
    if not _nonce_ok(msg.nonce):
        return HelloRefusal(
            HelloProblem.NONCE,
            f"hello without a nonce of {MIN_NONCE_BYTES}-{MAX_NONCE_BYTES} bytes (got {len(msg.nonce)})",
        )
    if channels is not None and msg.channel not in channels:
        return HelloRefusal(HelloProblem.CHANNEL, f"unknown P2P channel {msg.channel!r}")
    return None


def check_run(master_run: str, peer_run: str) -> str | None:
    """The run-name rule of the master's hello (docs/concepts.md "Run names").

    A peer without a name joins any master (the established API sets none); a named peer joins a master
    of its own name or a master without one (which then takes the name, see
    :meth:`pccl.master.server.MasterServer`); a named peer and a master of another name are refused.

    Returns:
        None when the peer may go on, else the reason, naming both runs.
    """
    if not peer_run or not master_run or peer_run == master_run:
        return None
    return (f"other run: this peer belongs to run {peer_run!r} and the master serves run {master_run!r} "
            f"(a peer joins only the master of its own run: check PCCL_RUN / PeerConfig.run and the "
            f"master's --run, or the address)")


def challenge(hello: Hello, *, secret: str | None, server_nonce: bytes, credential: bytes = b"") -> Challenge:
    """The listener's answer to an accepted :class:`Hello` (``server_nonce``: fresh random bytes;
    ``credential``: the one the connection must prove, b"" for none)."""
    mac = proof(secret, "server", hello.purpose, hello.nonce, server_nonce, credential)
    return Challenge(nonce=server_nonce, proof=mac)


def check_proof(
    msg: Message, hello: Hello, *, secret: str | None, server_nonce: bytes, credential: bytes = b""
) -> HelloRefusal | None:
    """Check the connecting side's :class:`Proof`.

    Args:
        msg: the message received after the Challenge.
        hello: the connection's Hello.
        secret: None: no secret is required (any proof is accepted, unless ``credential`` is given); a
            string: the proof must be made with exactly it. The master passes its configured secret (None
            when unset); a P2P listener always passes a string, "" when the group has no secret.
        server_nonce: the nonce sent in the Challenge.
        credential: the P2P credential the connection must prove as well (b"": none).

    Returns:
        None to accept (answer HelloOk), else the refusal.
    """
    if isinstance(msg, Refused):
        # The connecting side found the Challenge not made with its secret and says so before closing.
        return HelloRefusal(HelloProblem.SECRET, f"the connecting side refused the challenge: {msg.reason}")
    if not isinstance(msg, Proof):
        return HelloRefusal(HelloProblem.NOT_HELLO, f"expected Proof, got {type(msg).__name__}")
    if secret is None and not credential:
        return None
    want = proof(secret, "client", hello.purpose, hello.nonce, server_nonce, credential)
    if hmac.compare_digest(msg.proof, want):
        return None
    if not credential:
        return HelloRefusal(HelloProblem.SECRET, "bad secret: missing or not the shared secret")
    what = (f"the P2P credential the master issued to peer {hello.peer_id} for {hello.channel!r} connections "
            f"in epoch {hello.epoch} (generation {hello.generation})")
    if secret:
        return HelloRefusal(HelloProblem.SECRET, f"bad secret or credential: the proof is not made with the "
                                                 f"shared secret and {what}")
    return HelloRefusal(HelloProblem.CREDENTIAL, f"bad credential: the proof is not made with {what}")


def check_challenge(msg: Message, hello: Hello, *, secret: str | None, credential: bytes = b"") -> str | None:
    """The connecting side's check of the listener's answer to its Hello.

    Args:
        msg: the answer.
        hello: the Hello this side sent.
        secret: this side's secret (None or "": none).
        credential: the P2P credential this side proves (b"": none); the listener must prove it too.

    Returns:
        None when ``msg`` is a Challenge whose proof is made with ``secret`` and ``credential`` (answer
        with :func:`answer`), else why the handshake fails (a Refused's reason, quoted).
    """
    if isinstance(msg, Refused):
        return f"refused: {msg.reason}"
    if not isinstance(msg, Challenge):
        return f"expected Challenge, got {type(msg).__name__}"
    if not _nonce_ok(msg.nonce):
        return f"challenge without a nonce of {MIN_NONCE_BYTES}-{MAX_NONCE_BYTES} bytes"
    want = proof(secret, "server", hello.purpose, hello.nonce, msg.nonce, credential)
    if not hmac.compare_digest(msg.proof, want):
        if credential:
            return (
                "bad secret or credential: the other side's challenge is not made with this side's secret "
                "and P2P credential (another secret, or not the peer the master named)"
            )
        return (
            "bad secret: missing or not the shared secret "
            "(the other side's challenge is not made with this side's)"
        )
    return None


def answer(challenge_msg: Challenge, hello: Hello, *, secret: str | None, credential: bytes = b"") -> Proof:
    """The connecting side's :class:`Proof` for a checked Challenge."""
    return Proof(proof=proof(secret, "client", hello.purpose, hello.nonce, challenge_msg.nonce, credential))


__all__ = [
    "MAX_NONCE_BYTES", "MIN_NONCE_BYTES", "NONCE_BYTES", "HelloProblem", "HelloRefusal", "answer",
    "challenge", "check_challenge", "check_hello", "check_proof", "check_run", "proof",
]
