"""Sans-I/O length-prefixed framing.

A frame is a 4-byte little-endian unsigned length followed by that many payload bytes.
The length is checked against ``max_frame_size`` *before* anything is allocated for it, so a
hostile length prefix costs nothing. No trio, no sockets: bytes in, frames out.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from .._errors import LocalProtocolError, RemoteProtocolError

_LEN = struct.Struct("<I")
HEADER_SIZE = _LEN.size
MAX_FRAME_LIMIT = 0xFFFFFFFF


def encode_frame(payload: bytes, *, max_frame_size: int = MAX_FRAME_LIMIT) -> bytes:
    """Prefix ``payload`` with its length.

    Raises:
        LocalProtocolError: if the payload is larger than ``max_frame_size``.
    """
    if len(payload) > max_frame_size:
        raise LocalProtocolError(f"frame of {len(payload)} bytes exceeds the limit of {max_frame_size}")
    return _LEN.pack(len(payload)) + payload


class Framer:
    """Incremental frame decoder: ``feed(bytes)`` then ``next_frame()`` until it returns None.

    Args:
        max_frame_size: largest payload accepted (checked on the length prefix).
        check_head: optional ``check(length, first_two_payload_bytes)`` run once per frame as soon as
            those bytes are in, before the rest is buffered; it raises to refuse the frame.
    """

    def __init__(
        self, *, max_frame_size: int, check_head: Callable[[int, bytes], None] | None = None
    ) -> None:
        if not 0 < max_frame_size <= MAX_FRAME_LIMIT:
            raise ValueError("max_frame_size out of range")
        self.max_frame_size = max_frame_size
        self.check_head = check_head
        self._checked = -1  # buffer position of the frame whose head was checked
        self._buf = bytearray()
        self._pos = 0
        self._eof = False

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes; ``b""`` marks end of stream."""
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("data fed after end of stream")
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed."""
        return len(self._buf) - self._pos

    @property
    def at_eof(self) -> bool:
        """True once end of stream was fed."""
        return self._eof

    def next_frame(self) -> bytes | None:
        """Return the next complete payload, or None if more bytes are needed.

        Raises:
            RemoteProtocolError: the length prefix exceeds the limit, or the stream ended inside a
                frame.
        """
        avail = len(self._buf) - self._pos
        if avail >= HEADER_SIZE:
            (length,) = _LEN.unpack_from(self._buf, self._pos)
            if length > self.max_frame_size:
                raise RemoteProtocolError(
                    f"frame length {length} exceeds the limit of {self.max_frame_size} bytes"
                )
            if self.check_head is not None and self._checked != self._pos:
                if length < 2:
                    self.check_head(length, b"\x00\x00")
                    self._checked = self._pos
                elif avail >= HEADER_SIZE + 2:
                    start = self._pos + HEADER_SIZE
                    self.check_head(length, bytes(self._buf[start : start + 2]))
                    self._checked = self._pos
            if avail >= HEADER_SIZE + length:
                start = self._pos + HEADER_SIZE
                payload = bytes(self._buf[start : start + length])
                self._pos = start + length
                self._checked = -1
                self._compact()
                return payload
        if self._eof and avail > 0:
            raise RemoteProtocolError(f"stream ended inside a frame ({avail} bytes pending)")
        return None

    def pending_length(self) -> int | None:
        """The length of the frame under way (its prefix is in, its payload not whole), or None."""
        avail = len(self._buf) - self._pos
        if avail < HEADER_SIZE:
            return None
        (length,) = _LEN.unpack_from(self._buf, self._pos)
        return int(length) if avail < HEADER_SIZE + length else None

    def take_buffered(self, n: int) -> bytes:
        """Consume up to ``n`` raw bytes already buffered (for raw payloads following a frame)."""
        k = min(n, len(self._buf) - self._pos)
        out = bytes(self._buf[self._pos : self._pos + k])
        self._pos += k
        self._compact()
        return out

    def _compact(self) -> None:
        if self._pos and (self._pos > 65536 or self._pos == len(self._buf)):
            del self._buf[: self._pos]
            self._pos = 0
