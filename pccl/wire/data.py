"""Data-frame headers for raw tensor payloads on P2P "ring" connections.

Tensor bytes never go through msgpack: a data frame is a fixed 32-byte header followed by
``length`` raw payload bytes, which the receiver reads with ``recv_into`` straight into the
destination buffer it registered for that frame.

Header layout (little-endian, ``struct`` format ``<IIQIIQ``, 32 bytes)::

    offset  size  field
    0       4     magic    0x31444350 (b"PCD1" read as little-endian u32): catches a desynchronized
                           stream at the first bad frame instead of misrouting tensor bytes
    4       4     flags    reserved, must be 0 (quantized payloads will use it)
    8       8     tag      the operation tag (u64)
    16      4     op_seq   the master-assigned operation sequence number (u32)
    20      4     seq      index of the frame within the operation for this direction (u32)
    24      8     length   payload bytes that follow (u64, checked against a limit before use)

``(tag, op_seq, seq)`` plus the sending peer identify the receive a frame belongs to; the
connection a frame travels on carries no meaning, so concurrent operations may share connections
and one operation may stripe its frames over several.

Pure module: no trio, no sockets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .._errors import LocalProtocolError, RemoteProtocolError

DATA_MAGIC = 0x31444350
_HEADER = struct.Struct("<IIQIIQ")
DATA_HEADER_SIZE = _HEADER.size
# Upper bound for any single frame's payload, whatever the configuration: far above any block
# size we send (blocks are ~1 MiB), far below anything that could overflow a size computation.
MAX_DATA_FRAME_LENGTH = 1 << 40

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True)
class DataHeader:
    """A decoded data-frame header."""

    tag: int
    op_seq: int
    seq: int
    length: int
    flags: int = 0


def pack_data_header(tag: int, op_seq: int, seq: int, length: int, flags: int = 0) -> bytes:
    """Encode a data-frame header.

    Args:
        tag: operation tag, 0 <= tag < 2**64.
        op_seq: operation sequence number, 0 <= op_seq < 2**32.
        seq: frame index within the operation, 0 <= seq < 2**32.
        length: payload length in bytes, 0 <= length <= MAX_DATA_FRAME_LENGTH.
        flags: reserved, 0 for plain payloads.

    Returns:
        The 32-byte header.

    Raises:
        LocalProtocolError: a field is out of range.
    """
    if not (0 <= tag <= _U64 and 0 <= op_seq <= _U32 and 0 <= seq <= _U32 and 0 <= flags <= _U32):
        raise LocalProtocolError(f"data header field out of range: tag={tag} op_seq={op_seq} seq={seq}")
    if not 0 <= length <= MAX_DATA_FRAME_LENGTH:
        raise LocalProtocolError(f"data frame of {length} bytes exceeds the limit of {MAX_DATA_FRAME_LENGTH}")
    return _HEADER.pack(DATA_MAGIC, flags, tag, op_seq, seq, length)


def pack_data_header_into(
    buf: bytearray | memoryview, tag: int, op_seq: int, seq: int, length: int, flags: int = 0
) -> None:
    """Like :func:`pack_data_header`, writing into ``buf[:DATA_HEADER_SIZE]`` (no allocation).

    Raises:
        LocalProtocolError: a field is out of range.
    """
    if not (0 <= tag <= _U64 and 0 <= op_seq <= _U32 and 0 <= seq <= _U32 and 0 <= flags <= _U32):
        raise LocalProtocolError(f"data header field out of range: tag={tag} op_seq={op_seq} seq={seq}")
    if not 0 <= length <= MAX_DATA_FRAME_LENGTH:
        raise LocalProtocolError(f"data frame of {length} bytes exceeds the limit of {MAX_DATA_FRAME_LENGTH}")
    _HEADER.pack_into(buf, 0, DATA_MAGIC, flags, tag, op_seq, seq, length)


def unpack_data_header(
    buf: bytes | bytearray | memoryview, *, max_length: int = MAX_DATA_FRAME_LENGTH
) -> DataHeader:
    """Decode and validate a data-frame header (the first DATA_HEADER_SIZE bytes of ``buf``).

    Args:
        buf: at least DATA_HEADER_SIZE bytes.
        max_length: largest payload length accepted; checked before anyone allocates for it.

    Returns:
        The decoded header.

    Raises:
        RemoteProtocolError: bad magic, nonzero reserved flags, or a length over ``max_length``.
    """
    if len(buf) < DATA_HEADER_SIZE:
        raise RemoteProtocolError(f"data header needs {DATA_HEADER_SIZE} bytes, got {len(buf)}")
    magic, flags, tag, op_seq, seq, length = _HEADER.unpack_from(buf, 0)
    if magic != DATA_MAGIC:
        raise RemoteProtocolError(f"bad data frame magic 0x{magic:08x}")
    if flags != 0:
        raise RemoteProtocolError(f"unsupported data frame flags 0x{flags:x}")
    if length > min(max_length, MAX_DATA_FRAME_LENGTH):
        raise RemoteProtocolError(f"data frame length {length} exceeds the limit of {max_length}")
    return DataHeader(tag=tag, op_seq=op_seq, seq=seq, length=length, flags=flags)


def unpack_data_header_fields(buf: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """Hot-path decode: ``(tag, op_seq, seq, length)`` without building a dataclass.

    The caller must check the length against its own limit.

    Raises:
        RemoteProtocolError: bad magic or nonzero reserved flags.
    """
    magic, flags, tag, op_seq, seq, length = _HEADER.unpack_from(buf, 0)
    if magic != DATA_MAGIC or flags != 0:
        raise RemoteProtocolError(f"bad data frame header (magic 0x{magic:08x}, flags 0x{flags:x})")
    return tag, op_seq, seq, length
