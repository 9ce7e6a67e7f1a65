"""Stream helpers for tests: a connected pair of streams over any transport, and a transport wrapper
that exposes only what pccl's transport protocols require.

pccl takes faster paths when a stream offers more than :class:`~pccl.transport.Stream` requires: a
TCP socket (``TcpStream.socket``) for the data plane's direct sends and receives, ``try_send`` for
writing control messages at once. :class:`BareTransport` hides those extras, so a test exercises the
generic path: the one a custom transport without them gets.
"""

from __future__ import annotations

import trio

from ..transport import Address, Listener, Stream, TcpTransport, Transport

__all__ = ["BareListener", "BareStream", "BareTransport", "RecordingStream", "open_stream_pair"]


async def open_stream_pair(
    client: Transport,
    server: Transport,
    *,
    connect_host: str,
    listen_host: str = "0.0.0.0",
    port: int = 0,
) -> tuple[Stream, Stream]:
    """Listen on ``server`` (``listen_host:port``; 0 picks a port), connect ``client`` to
    ``connect_host`` at that port, and return ``(client end, server end)``; the listener is closed.

    Args:
        client: the transport that connects (e.g. ``network.host("a")``, a ``TcpTransport``).
        server: the transport that listens.
        connect_host: where ``client`` finds ``server`` (its address or host name).
        listen_host: the address ``server`` listens on.
        port: the port to listen on.
    """
    listener = await server.listen(listen_host, port)
    accepted: list[Stream] = []
    try:
        async with trio.open_nursery() as nursery:

            async def accept() -> None:
                accepted.append(await listener.accept())

            nursery.start_soon(accept)
            client_end = await client.connect(connect_host, listener.address[1])
    finally:
        await listener.aclose()
    return client_end, accepted[0]


class BareStream:
    """``inner`` with only the :class:`~pccl.transport.Stream` methods and properties."""

    def __init__(self, inner: Stream) -> None:
        self._inner = inner

    @property
    def peer_address(self) -> Address:
        """(host, port) of the other side."""
        return self._inner.peer_address

    @property
    def local_address(self) -> Address:
        """(host, port) of this side."""
        return self._inner.local_address

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """See :meth:`pccl.transport.Stream.send_all`."""
        await self._inner.send_all(data)

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        """See :meth:`pccl.transport.Stream.receive_some`."""
        return await self._inner.receive_some(max_bytes)

    async def receive_into(self, buf: memoryview) -> int:
        """See :meth:`pccl.transport.Stream.receive_into`."""
        return await self._inner.receive_into(buf)

    async def aclose(self) -> None:
        """See :meth:`pccl.transport.Stream.aclose`."""
        await self._inner.aclose()


class RecordingStream(BareStream):
    """A :class:`BareStream` that logs ``(trio.current_time(), bytes)`` of every write in ``writes``
    (under a MockClock: how a pacer spread its bytes over virtual time)."""

    def __init__(self, inner: Stream) -> None:
        super().__init__(inner)
        self.writes: list[tuple[float, int]] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Log the write, then :meth:`pccl.transport.Stream.send_all` on the inner stream."""
        self.writes.append((trio.current_time(), len(memoryview(data).cast("B"))))
        await super().send_all(data)


class BareListener:
    """A listener whose accepted streams are :class:`BareStream`."""

    def __init__(self, inner: Listener) -> None:
        self._inner = inner

    @property
    def address(self) -> Address:
        """(host, port) it listens on."""
        return self._inner.address

    async def accept(self) -> Stream:
        """The next connection, wrapped."""
        return BareStream(await self._inner.accept())

    async def aclose(self) -> None:
        """Stop listening."""
        await self._inner.aclose()


class BareTransport:
    """``inner`` (default: a new :class:`~pccl.transport.TcpTransport`) handing out :class:`BareStream`
    connections and :class:`BareListener` listeners."""

    def __init__(self, inner: Transport | None = None) -> None:
        self._inner = inner if inner is not None else TcpTransport()

    async def connect(self, host: str, port: int) -> Stream:
        """See :meth:`pccl.transport.Transport.connect`."""
        return BareStream(await self._inner.connect(host, port))

    async def listen(self, host: str, port: int) -> Listener:
        """See :meth:`pccl.transport.Transport.listen`."""
        return BareListener(await self._inner.listen(host, port))
