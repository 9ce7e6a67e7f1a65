"""Message stream adapter: frames + msgpack messages over a transport :class:`~pccl.transport.Stream`.

Writers are serialized with a ``trio.StrictFIFOLock`` so concurrent tasks never interleave
frames; exactly one task reads. Raw byte payloads (state transfers, bandwidth probes) can follow
a control frame on the same stream via :meth:`MessageStream.receive_raw_into`.
"""

from __future__ import annotations

import trio

from .._errors import RemoteProtocolError
from ..transport import Stream, StreamBroken, receive_exactly_into
from .framing import Framer, encode_frame
from .messages import Message, decode, encode

_RECV_SIZE = 256 * 1024


class MessageStream:
    """Send and receive control messages on one stream."""

    def __init__(self, stream: Stream, *, max_frame_size: int) -> None:
        self.stream = stream
        self.max_frame_size = max_frame_size
        self._framer = Framer(max_frame_size=max_frame_size)
        self._send_lock = trio.StrictFIFOLock()

    async def send(self, msg: Message) -> None:
        """Send one message. Raises StreamBroken."""
        data = encode_frame(encode(msg), max_frame_size=self.max_frame_size)
        async with self._send_lock:
            await self.stream.send_all(data)

    async def send_with_raw(self, msg: Message, raw: memoryview | bytes) -> None:
        """Send a message immediately followed by raw bytes, atomically w.r.t. other senders."""
        data = encode_frame(encode(msg), max_frame_size=self.max_frame_size)
        async with self._send_lock:
            await self.stream.send_all(data)
            await self.stream.send_all(raw)

    async def receive(self) -> Message:
        """Receive the next message.

        Raises:
            StreamBroken: the stream broke or closed (EOF between frames included).
            RemoteProtocolError: the peer sent something malformed.
        """
        while True:
            payload = self._framer.next_frame()
            if payload is not None:
                return decode(payload)
            if self._framer.at_eof:
                raise StreamBroken("connection closed by the other side")
            data = await self.stream.receive_some(_RECV_SIZE)
            self._framer.feed(data)

    async def receive_raw_into(self, buf: memoryview) -> None:
        """Fill ``buf`` with raw bytes that follow the last frame."""
        pre = self._framer.take_buffered(len(buf))
        if pre:
            buf[: len(pre)] = pre
        if len(pre) < len(buf):
            await receive_exactly_into(self.stream, buf[len(pre) :])

    async def aclose(self) -> None:
        """Close the underlying stream."""
        await self.stream.aclose()


def expect(msg: Message, cls: type[Message]) -> Message:
    """Raise RemoteProtocolError unless ``msg`` is a ``cls``."""
    if not isinstance(msg, cls):
        raise RemoteProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg
