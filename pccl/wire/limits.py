"""How much work a received control frame may cost, before and after a connection is trusted.

Pure: no trio, no sockets. A :class:`FrameLimits` says how large a frame the framer accepts at all
(checked on the length prefix, before anything is buffered for it), how large a frame of each message
type may be (checked on the first two payload bytes, before it is decoded), and the limits msgpack
decodes with (longest string, binary, array and map). docs/security.md explains the numbers.

* :data:`PRE_AUTH`: until the hello (and, with a secret, the challenge-response) has succeeded: only
  the handshake messages, at most 4 KiB, arrays of at most 16 items, no maps. Decoding such a frame
  costs microseconds whatever its content; its nesting is bounded by its size.
* :func:`master_inbound`: what the master reads from an accepted peer. Messages without lists are
  64 KiB at most (a failure reason is the largest field); the messages with per-peer lists have their
  own caps; shared-state rows travel in several frames of at most 32 KiB (:func:`split_rows`). A frame
  of a type the master never receives gets the small cap, so it is decoded cheaply and then refused by
  the state machine with its usual reason.
* :func:`p2p_inbound`: what a P2P listener reads after the hello (state requests, bandwidth probes).
* :func:`trusted`: what a peer reads from the master it connected to, or from a P2P listener it dialled,
  once that side has answered HelloOk: any message up to the configured frame size (peer tables grow
  with the world).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar, get_args, get_origin

import msgpack

from .._errors import InvalidArgumentError, RemoteProtocolError
from . import messages as m

PRE_AUTH_MAX_FRAME = 4 * 1024
PRE_AUTH_OTHER_MAX = 256
SMALL_MAX_FRAME = 64 * 1024
LIST_MAX_FRAME = 256 * 1024
# SharedStateSync / SharedStateEntries (the master reading a peer) and StateRequest (a P2P listener),
# half the small cap: 64 KiB of one-byte lists (65k objects) costs ~15 ms with the GC pass it triggers;
# the sender splits its rows or keys over frames of at most this size (see :func:`split_rows`), so that
# one frame decodes in a few milliseconds whatever it holds (docs/security.md, hostile_frames.py).
STATE_SYNC_MAX_FRAME = 32 * 1024
# The most rows one shared-state vote may carry in all its frames, and the most frames it may take
# (``SharedStateEntries`` frames plus the final ``SharedStateSync``): the master keeps a peer's rows
# until its vote arrives, at most ``SHARED_STATE_MAX_FRAMES * STATE_SYNC_MAX_FRAME`` bytes of frames.
SHARED_STATE_MAX_ENTRIES = 1 << 17
SHARED_STATE_MAX_FRAMES = 128
# Room a frame keeps, beyond its rows, for the envelope and the other fields.
_SPLIT_HEADROOM = 256

_T = TypeVar("_T")

_FIXARRAY_2 = 0x92  # msgpack: an array of two items (every message is [tag, values])


@dataclass(frozen=True)
class FrameLimits:
    """Limits on received control frames (see the module docstring).

    Attributes:
        name: what the reasons call this stage ("before the hello", ...).
        max_frame: largest frame the framer accepts (length prefix checked before buffering).
        default_tag_max: largest payload of a message type not in ``tag_max``.
        tag_max: per message tag, the largest payload.
        unpack: keyword arguments for ``msgpack.unpackb`` (``max_str_len`` and the like).
    """

    name: str
    max_frame: int
    default_tag_max: int
    tag_max: Mapping[int, int] = field(default_factory=dict)
    unpack: Mapping[str, int] = field(default_factory=dict)

    def check_head(self, length: int, head: bytes) -> None:
        """Refuse a frame from its length and first two payload bytes, before it is buffered whole.

        Raises:
            RemoteProtocolError: not a two-item array starting with a small tag, or larger than its
                type allows.
        """
        if length < 2 or head[0] != _FIXARRAY_2 or head[1] >= 0x80:
            raise RemoteProtocolError("malformed message envelope")
        tag = head[1]
        limit = self.tag_max.get(tag, self.default_tag_max)
        if length > limit:
            cls = m.message_types().get(tag)
            what = cls.__name__ if cls is not None else f"message type {tag}"
            raise RemoteProtocolError(
                f"{what} of {length} bytes exceeds the limit of {limit} bytes {self.name}"
            )

    def check(self, payload: bytes) -> None:
        """:meth:`check_head` on a whole payload.

        Raises:
            RemoteProtocolError: see :meth:`check_head`.
        """
        self.check_head(len(payload), payload[:2] if len(payload) >= 2 else b"\x00\x00")

    def unpack_for(self, tag: int) -> Mapping[str, int]:
        """The msgpack limits for a message of type ``tag``: :attr:`unpack`, with arrays limited to the
        schema's longest fixed array when the type has no variable-length list."""
        fixed = _FIXED_ARRAYS.get(tag)
        if fixed is None or not self.unpack:
            return self.unpack
        return {**self.unpack, "max_array_len": min(fixed, self.unpack.get("max_array_len", fixed))}

    def decode(self, payload: bytes) -> m.Message:
        """:meth:`check`, then :func:`pccl.wire.messages.decode` with the msgpack limits.

        Raises:
            RemoteProtocolError: see :meth:`check` and ``decode``.
        """
        self.check(payload)
        return m.decode(payload, unpack_limits=self.unpack_for(payload[1]))


def _fixed_array(tp: Any) -> int | None:
    """Longest array a value of type ``tp`` packs to, or None when it has a variable-length list."""
    origin = get_origin(tp)
    if origin is list or origin is dict:
        return None
    if origin is typing.Union or origin is types.UnionType:
        sizes = [_fixed_array(a) for a in get_args(tp)]
        return None if None in sizes else max([0, *(s for s in sizes if s is not None)])
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):
        hints = typing.get_type_hints(tp)
        inner = [_fixed_array(hints[f]) for f in tp._fields]
        return None if None in inner else max([len(tp._fields), *(s for s in inner if s is not None)])
    return 0


def _schema_fixed_arrays() -> dict[int, int]:
    out: dict[int, int] = {}
    for tag, cls in m.message_types().items():
        hints = typing.get_type_hints(cls)
        sizes = [_fixed_array(hints[f.name]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        if None not in sizes:
            out[tag] = max([2, len(sizes), *(s for s in sizes if s is not None)])
    return out


# Per message tag without variable-length lists: the longest array its schema has (the envelope, the
# field list, a descriptor row). msgpack refuses any longer array before building it.
_FIXED_ARRAYS = _schema_fixed_arrays()


def _unpack(*, strings: int, arrays: int, binary: int = 0) -> Mapping[str, int]:
    return MappingProxyType(
        {"max_str_len": strings, "max_bin_len": binary, "max_array_len": arrays, "max_map_len": 0,
         "max_ext_len": 0}
    )


# The handshake: Hello and its answers (and the challenge-response messages, when defined).
_HANDSHAKE_TAGS = (m.Hello.TAG, m.Challenge.TAG, m.Proof.TAG, m.HelloOk.TAG, m.Refused.TAG)



HANDSHAKE_TAGS = frozenset(_HANDSHAKE_TAGS)


def pre_auth(max_frame: int = PRE_AUTH_MAX_FRAME) -> FrameLimits:
    """Limits until the handshake has succeeded: :data:`PRE_AUTH_MAX_FRAME`, handshake messages only.

    Handshake messages may always be :data:`PRE_AUTH_MAX_FRAME` long, however small the configured
    frame size (:class:`~pccl.wire.stream.MessageStream` sends them so too).

    Args:
        max_frame: the configured frame size (other message types stay below it).
    """
    cap = PRE_AUTH_MAX_FRAME
    return FrameLimits(
        name="before the hello",
        max_frame=cap,
        # Any other message: decoded only when tiny (then refused with "expected Hello").
        default_tag_max=min(PRE_AUTH_OTHER_MAX, max_frame),
        tag_max=MappingProxyType(dict.fromkeys(_HANDSHAKE_TAGS, cap)),
        unpack=_unpack(strings=1024, arrays=16, binary=256),
    )


PRE_AUTH = pre_auth()


#: The longest binary a peer sends the master: its P2P public key or its member token (32 bytes each; a
#: longer key is refused
#: by the decoder, a shorter one by the master with the reason).
PUBLIC_KEY_MAX = 64


def master_inbound(max_frame: int) -> FrameLimits:
    """Limits on what the master reads from a peer after its hello.

    Args:
        max_frame: ``MasterConfig.max_frame_size``; no cap exceeds it.
    """
    caps = {
        m.P2PConnectionsDone.TAG: LIST_MAX_FRAME,
        m.BandwidthReport.TAG: LIST_MAX_FRAME,
        m.Reregister.TAG: LIST_MAX_FRAME,  # the ring and the operations in doubt
        m.SharedStateSync.TAG: STATE_SYNC_MAX_FRAME,
        m.SharedStateEntries.TAG: STATE_SYNC_MAX_FRAME,
    }
    return FrameLimits(
        name="from a peer",
        max_frame=max_frame,
        default_tag_max=min(SMALL_MAX_FRAME, max_frame),
        tag_max=MappingProxyType({t: min(c, max_frame) for t, c in caps.items()}),
        # binaries: only the 32-byte X25519 key of Register / Reregister (protocol 5)
        unpack=_unpack(strings=SMALL_MAX_FRAME, arrays=1 << 17, binary=PUBLIC_KEY_MAX),
    )


def p2p_inbound(max_frame: int) -> FrameLimits:
    """Limits on what a P2P listener reads on an accepted connection (state and bench channels).

    Args:
        max_frame: ``PeerConfig.max_frame_size``; no cap exceeds it.
    """
    return FrameLimits(
        name="on a P2P connection",
        max_frame=max_frame,
        default_tag_max=min(SMALL_MAX_FRAME, max_frame),
        tag_max=MappingProxyType({t: min(STATE_SYNC_MAX_FRAME, max_frame)
                                  for t in (m.StateRequest.TAG, m.StateChunkRequest.TAG)}),
        unpack=_unpack(strings=SMALL_MAX_FRAME, arrays=1 << 17),
    )


def trusted(max_frame: int) -> FrameLimits:
    """Limits on what a peer reads from the side it connected to, once that side said HelloOk."""
    return FrameLimits(name="from a trusted side", max_frame=max_frame, default_tag_max=max_frame)


def split_rows(rows: Sequence[_T], max_frame: int = STATE_SYNC_MAX_FRAME) -> list[list[_T]]:
    """Split ``rows`` (shared-state entry rows, state-request keys) into consecutive chunks that each
    fit a frame of :data:`STATE_SYNC_MAX_FRAME` bytes (or ``max_frame``, when smaller).

    Args:
        rows: the rows, in order.
        max_frame: a smaller frame size to fit (the receiver's, when it is known to be smaller).

    Returns:
        At least one chunk (an empty one for no rows); their concatenation is ``rows``.

    Raises:
        InvalidArgumentError: a single row is too large for any frame.
    """
    budget = min(STATE_SYNC_MAX_FRAME, max_frame) - _SPLIT_HEADROOM
    chunks: list[list[_T]] = [[]]
    size = 0
    for row in rows:
        n = len(msgpack.packb(row))
        if n > budget:
            raise InvalidArgumentError(f"a shared-state row of {n} bytes does not fit a {budget}-byte frame")
        if size + n > budget:
            chunks.append([])
            size = 0
        chunks[-1].append(row)
        size += n
    return chunks


def describe(limits: FrameLimits) -> dict[str, Any]:
    """The limits as plain data (for docs and the status page)."""
    return {
        "name": limits.name,
        "max_frame": limits.max_frame,
        "default_tag_max": limits.default_tag_max,
        "tag_max": {m.message_types()[t].__name__: v for t, v in limits.tag_max.items()},
        "unpack": dict(limits.unpack),
    }


__all__ = [
    "LIST_MAX_FRAME", "PRE_AUTH", "PRE_AUTH_MAX_FRAME", "PUBLIC_KEY_MAX", "SHARED_STATE_MAX_ENTRIES",
    "SHARED_STATE_MAX_FRAMES",
    "SMALL_MAX_FRAME", "STATE_SYNC_MAX_FRAME", "FrameLimits", "describe", "master_inbound", "p2p_inbound",
    "pre_auth", "split_rows", "trusted",
]
