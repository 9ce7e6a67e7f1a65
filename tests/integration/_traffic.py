"""What the master-crash and link-break tests share: the peer configuration that keeps reconnecting, the
control messages read out of the virtual network's traffic (to cut a connection exactly at one message)
and a gradient that names its sender."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Hashable, Iterable, Iterator

import numpy as np

from pccl import PeerConfig
from pccl.testing import DEFAULT_PEER_CONFIG
from pccl.wire import messages as m
from pccl.wire.framing import HEADER_SIZE

_LEN = struct.Struct("<I")  # the frame's length prefix (pccl/wire/framing.py)
assert _LEN.size == HEADER_SIZE

RECONNECTING_PEER: PeerConfig = dataclasses.replace(DEFAULT_PEER_CONFIG, reconnect_window=30.0)
"""The test clusters' peer configuration with a reconnect window far longer than any outage the tests
make (virtual time): a peer that loses its master keeps reconnecting instead of giving up."""


class ControlFrames:
    """Parses the control messages of virtual connections out of their traffic chunks (a
    :class:`pccl.testing.TrafficEvent` carries an arbitrary piece of the stream), per stream ``key``."""

    def __init__(self) -> None:
        self._carry: dict[Hashable, bytes] = {}

    def messages(self, key: Hashable, data: bytes) -> Iterator[tuple[int, int, m.Message]]:
        """Every message complete by the end of ``data`` (the next chunk of stream ``key``), as
        ``(start, end, message)``: where its frame starts and ends, as offsets into ``data`` (the start
        is negative when the frame began in an earlier chunk). The bytes after the last complete frame
        are kept for the next chunk once the iteration runs to its end; a hook that resets the
        connection at a message stops iterating there, and that stream has no next chunk."""
        carry = self._carry.get(key, b"")
        buf = carry + data
        pos = 0
        while len(buf) - pos >= HEADER_SIZE:
            (n,) = _LEN.unpack_from(buf, pos)
            end = pos + HEADER_SIZE + n
            if end > len(buf):
                break
            yield pos - len(carry), end - len(carry), m.decode(bytes(buf[pos + HEADER_SIZE : end]))
            pos = end
        self._carry[key] = bytes(buf[pos:])


def grad(peer_id: int, step: int, words: int = 32) -> np.ndarray:
    """A contribution that names its peer and step: element 0 of the SUM (bit ``peer_id``) tells who
    took part."""
    g = np.random.default_rng([peer_id, step]).integers(-1000, 1000, words).astype(np.int64)
    g[0] = 1 << peer_id
    return g


def array_sum(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """``sum(arrays)`` of one or more arrays, typed as the array it is (``sum`` of none is the int 0)."""
    total = sum(arrays)
    assert isinstance(total, np.ndarray), "no arrays to sum"
    return total
