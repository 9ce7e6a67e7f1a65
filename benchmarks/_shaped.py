"""A slow link emulated in userspace, at pccl's transport seam, for benchmarks on one machine.

This kernel has no netem (tc's tbf can cap a rate, nothing can add delay), so the link is emulated in
the sending process: :class:`ShapedTransport` wraps pccl's TCP transport, and every stream it opens or
accepts sends through

* a **token bucket for the process's uplink**: a write of ``n`` bytes occupies the uplink for
  ``n / rate`` seconds after the previous write finished, whatever its destination (every peer has
  an access link of ``rate`` bytes/s up; all its connections share it); the writer is held until its
  bytes have left, as a sender is held by a full socket buffer on a saturated path;
* a **delay line**: the bytes reach the socket ``delay`` seconds after they left, in order, while the
  writer goes on.

Each direction is shaped by its sender, so two processes that both use it see ``2 * delay`` of RTT and
``rate`` each way. Traffic to the addresses in ``control`` (the master) gets the delay and no rate
limit. Underneath is loopback TCP (or pccl's same-host Unix sockets): the emulated link adds to a
near-zero one. This is not a WAN emulator (no loss, no queue, no kernel TCP dynamics over the long
path: congestion control sees loopback); it models a fixed-rate, fixed-delay path.
"""

from __future__ import annotations

import math

import trio

from pccl.transport import Address, Listener, Stream, StreamBroken, TcpTransport

__all__ = ["ShapedTransport"]


class _Link:
    def __init__(self) -> None:
        self.next_free = 0.0


class _ShapedStream:
    def __init__(self, inner: Stream, link: _Link | None, rate: float, delay: float) -> None:
        self._inner = inner
        self._link = link
        self._rate = rate
        self._delay = delay
        self._send, self._recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)
        self._error: BaseException | None = None
        self._drained = trio.Event()
        trio.lowlevel.spawn_system_task(self._pump)

    @property
    def peer_address(self) -> Address:
        return self._inner.peer_address

    @property
    def local_address(self) -> Address:
        return self._inner.local_address

    async def _pump(self) -> None:
        try:
            async with self._recv:
                async for due, data in self._recv:
                    await trio.sleep_until(due)
                    await self._inner.send_all(data)
        except BaseException as exc:  # reported to the next writer
            self._error = exc if isinstance(exc, Exception) else StreamBroken("shaped stream cancelled")
        finally:
            self._drained.set()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise StreamBroken(f"shaped stream: {self._error}")
        payload = bytes(data)
        now = trio.current_time()
        left = now
        if self._link is not None and self._rate > 0:
            start = max(now, self._link.next_free)
            left = start + len(payload) / self._rate
            self._link.next_free = left
        try:
            self._send.send_nowait((left + self._delay, payload))
        except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            raise StreamBroken("shaped stream closed") from exc
        if left > now:
            await trio.sleep_until(left)

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        return await self._inner.receive_some(max_bytes)

    async def receive_into(self, buf: memoryview) -> int:
        return await self._inner.receive_into(buf)

    async def aclose(self) -> None:
        self._send.close()
        with trio.move_on_after(self._delay + 1.0):
            await self._drained.wait()
        await self._inner.aclose()


class _ShapedListener:
    def __init__(self, inner: Listener, owner: ShapedTransport) -> None:
        self._inner = inner
        self._owner = owner

    @property
    def address(self) -> Address:
        return self._inner.address

    async def accept(self) -> Stream:
        stream = await self._inner.accept()
        return self._owner.wrap(stream, stream.peer_address)

    async def aclose(self) -> None:
        await self._inner.aclose()


class ShapedTransport:
    """pccl's TCP transport with every sent byte rate-limited and delayed (see the module).

    Args:
        rate: bytes per second to each destination (0: no limit).
        delay: one-way delay in seconds.
        control: addresses (host, port) that get no rate limit (the master).
        control_delay: their one-way delay (default ``delay``).
    """

    def __init__(self, *, rate: float, delay: float, control: set[tuple[str, int]] | None = None,
                 control_delay: float | None = None) -> None:
        self.inner = TcpTransport()
        self.rate = rate
        self.delay = delay
        self.control = control or set()
        self.control_delay = delay if control_delay is None else control_delay
        self._uplink = _Link()

    def wrap(self, stream: Stream, remote: Address) -> Stream:
        """``stream`` shaped towards ``remote`` (the uplink's rate unless it is a control address)."""
        if (remote[0], remote[1]) in self.control:
            return _ShapedStream(stream, None, 0.0, self.control_delay)  # type: ignore[return-value]
        return _ShapedStream(stream, self._uplink, self.rate, self.delay)  # type: ignore[return-value]

    async def connect(self, host: str, port: int) -> Stream:
        return self.wrap(await self.inner.connect(host, port), (host, port))

    async def listen(self, host: str, port: int) -> Listener:
        return _ShapedListener(await self.inner.listen(host, port), self)  # type: ignore[return-value]
