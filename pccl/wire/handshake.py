"""The handshake of every connection, both ends, over a :class:`~pccl.wire.stream.MessageStream`.

A thin trio adapter of :mod:`pccl.wire.hello` (which decides everything): :func:`accept_hello` is what a
listener runs (Hello -> Challenge -> Proof), :func:`offer_hello` what the connecting side runs. Callers
bound both with their hello / connect timeout and send ``Refused`` themselves.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Collection

import trio

from .._config import PROTOCOL_VERSION
from .._errors import Result
from ..transport import StreamBroken
from .hello import NONCE_BYTES, HelloRefusal, answer, challenge, check_challenge, check_hello, check_proof
from .messages import Challenge, Hello, HelloOk, Refused
from .stream import MessageStream

_GOODBYE_TIMEOUT = 1.0  # seconds to tell the listener why this side ends the handshake

#: ``credential_for(hello)``: the credential a P2P connection must prove (its HMAC key, with the secret),
#: or why it is refused; it may wait, bounded, for a set of credentials the master is about to deliver.
CredentialLookup = Callable[[Hello], Awaitable["bytes | HelloRefusal"]]


class HandshakeFailed(Exception):
    """The connecting side's handshake failed; ``reason`` says why, ``refused`` whether the other side
    refused (then ``reason`` is its ``Refused.reason``)."""

    def __init__(self, reason: str, *, refused: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused


def new_nonce() -> bytes:
    """Fresh random bytes for a Hello or a Challenge."""
    return secrets.token_bytes(NONCE_BYTES)


async def accept_hello(
    ms: MessageStream,
    *,
    purpose: str,
    secret: str | None,
    channels: Collection[str] | None = None,
    listener: str = "this listener",
    credential_for: CredentialLookup | None = None,
    run: str = "",
) -> tuple[Hello | None, HelloRefusal | None]:
    """Run the listener's side: read the Hello, answer a Challenge, check the Proof.

    Args:
        ms: the new connection.
        purpose: what this listener serves ("master", "p2p").
        secret: see :func:`pccl.wire.hello.check_proof`.
        channels: the P2P channels served (None: not checked).
        listener: how refusal reasons name this side.
        credential_for: P2P listeners bound to membership: the credential the Hello's claimed peer,
            channel and epoch must prove (None: no credential, the secret alone decides).
        run: the master's run name ("": none; :func:`pccl.wire.hello.check_run`).

    Returns:
        ``(hello, None)`` when accepted (the caller answers HelloOk), else ``(None, refusal)`` (the caller
        sends Refused).

    Raises:
        pccl.transport.StreamBroken: the connection broke.
        RemoteProtocolError: a malformed frame.
    """
    msg = await ms.receive()
    refusal = check_hello(msg, purpose=purpose, channels=channels, listener=listener, run=run)
    if refusal is not None:
        return None, refusal
    assert isinstance(msg, Hello)
    credential = b""
    if credential_for is not None:
        found = await credential_for(msg)
        if isinstance(found, HelloRefusal):
            return None, found
        credential = found
    server_nonce = new_nonce()
    await ms.send(challenge(msg, secret=secret, server_nonce=server_nonce, credential=credential))
    reply = await ms.receive()
    refusal = check_proof(reply, msg, secret=secret, server_nonce=server_nonce, credential=credential)
    return (msg, None) if refusal is None else (None, refusal)


async def offer_hello(
    ms: MessageStream,
    *,
    purpose: str,
    secret: str | None,
    peer_id: int = -1,
    channel: str = "",
    index: int = 0,
    protocol_version: int = PROTOCOL_VERSION,
    credential: bytes = b"",
    generation: int = 0,
    epoch: int = -1,
    run: str = "",
) -> HelloOk:
    """Run the connecting side: Hello, check the listener's Challenge, Proof, read HelloOk.

    Args:
        ms: the new connection.
        purpose: "master" or "p2p".
        secret: this side's shared secret (None or "": none).
        peer_id: for P2P, this peer's id.
        channel: for P2P, the channel.
        index: for P2P, the slot in the pool.
        protocol_version: the version to speak (tests speak others).
        credential: for P2P, the credential of this connection (of the master's set; b"": none); the
            listener must prove it too.
        generation: for P2P, the master generation of the credential's set.
        epoch: for P2P, the epoch of the credential's set (-1: no credential).
        run: to the master, this peer's run name ("": none).

    Returns:
        The listener's HelloOk.

    Raises:
        HandshakeFailed: refused (the reason says why), or the listener does not know the secret (the
            listener is then told why in a ``Refused``, so that its log names the cause too).
        pccl.transport.StreamBroken: the connection broke.
        RemoteProtocolError: a malformed frame.
    """
    hello = Hello(protocol_version=protocol_version, purpose=purpose, peer_id=peer_id, channel=channel,
                  index=index, nonce=new_nonce(), generation=generation, epoch=epoch, run=run)
    await ms.send(hello)
    reply = await ms.receive()
    if isinstance(reply, Refused):
        raise HandshakeFailed(reply.reason, refused=True)
    problem = check_challenge(reply, hello, secret=secret, credential=credential)
    if problem is not None:
        if isinstance(reply, Challenge):
            # Tell the listener why this side gives up, so that its log says "bad secret" rather than
            # "connection closed" (best effort: the connection closes next either way).
            with trio.move_on_after(_GOODBYE_TIMEOUT):
                try:
                    await ms.send(Refused(reason=problem, code=int(Result.INVALID_USAGE)))
                except StreamBroken:
                    pass
        raise HandshakeFailed(problem)
    assert isinstance(reply, Challenge)
    await ms.send(answer(reply, hello, secret=secret, credential=credential))
    final = await ms.receive()
    if isinstance(final, Refused):
        raise HandshakeFailed(final.reason, refused=True)
    if not isinstance(final, HelloOk):
        raise HandshakeFailed(f"expected HelloOk, got {type(final).__name__}")
    return final


__all__ = ["CredentialLookup", "HandshakeFailed", "accept_hello", "new_nonce", "offer_hello"]
