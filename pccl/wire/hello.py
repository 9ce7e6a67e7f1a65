"""The hello check every listener runs (the master's and each peer's P2P listener; docs/protocol.md).

Pure: it looks at the first message of a connection and says whether to accept it, and if not, why,
as a :class:`HelloRefusal` whose ``problem`` maps to the result code sent in ``Refused``.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Collection
from dataclasses import dataclass

from .._config import PROTOCOL_VERSION
from .._errors import Result
from .messages import Hello, Message


class HelloProblem(enum.Enum):
    """Why a connection's first message was refused."""

    NOT_HELLO = "not_hello"
    VERSION = "version"
    PURPOSE = "purpose"
    SECRET = "secret"
    CHANNEL = "channel"

    @property
    def result(self) -> Result:
        """The result code a ``Refused`` carries for this problem."""
        return _RESULTS[self]


# A first message that is no Hello or speaks another protocol version is the other side's protocol
# error; a wrong purpose, secret or channel is a misuse (wrong address, wrong configuration).
_RESULTS = {
    HelloProblem.NOT_HELLO: Result.REMOTE_ERROR,
    HelloProblem.VERSION: Result.REMOTE_ERROR,
    HelloProblem.PURPOSE: Result.INVALID_USAGE,
    HelloProblem.SECRET: Result.INVALID_USAGE,
    HelloProblem.CHANNEL: Result.INVALID_USAGE,
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


def check_hello(
    msg: Message,
    *,
    purpose: str,
    secret: str | None,
    channels: Collection[str] | None = None,
    listener: str = "this listener",
) -> HelloRefusal | None:
    """Check the first message of a connection.

    Args:
        msg: the message received first.
        purpose: the purpose this listener serves ("master" or "p2p").
        secret: None: no secret is required (any is accepted); a string: the hello must carry exactly
            it (compared in constant time). The master passes its configured secret (None when unset);
            a P2P listener always passes a string, "" when the group has no secret.
        channels: the P2P channels served (None: the hello's channel is not checked).
        listener: how the reasons name this side ("the master", "this peer").

    Returns:
        None to accept, else the refusal.
    """
    if not isinstance(msg, Hello):
        return HelloRefusal(HelloProblem.NOT_HELLO, f"expected Hello, got {type(msg).__name__}")
    if msg.protocol_version != PROTOCOL_VERSION:
        return HelloRefusal(
            HelloProblem.VERSION,
            f"protocol version mismatch: the connecting peer speaks version {msg.protocol_version}, "
            f"{listener} speaks version {PROTOCOL_VERSION}",
        )
    if msg.purpose != purpose:
        return HelloRefusal(
            HelloProblem.PURPOSE,
            f"{listener} serves purpose {purpose!r}; connection purpose {msg.purpose!r} is not served here",
        )
    if secret is not None and not hmac.compare_digest(msg.secret.encode("utf-8"), secret.encode("utf-8")):
        return HelloRefusal(HelloProblem.SECRET, "bad secret: missing or not the shared secret")
    if channels is not None and msg.channel not in channels:
        return HelloRefusal(HelloProblem.CHANNEL, f"unknown P2P channel {msg.channel!r}")
    return None


__all__ = ["HelloProblem", "HelloRefusal", "check_hello"]
