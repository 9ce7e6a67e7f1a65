"""Point-to-point bandwidth probes for ``optimize_topology``.

The master asks a peer to measure its links to some targets (a schedule in which no peer sends or
receives twice at once, so probes do not share a peer's bandwidth). A probe is a short timed
transfer on the target's P2P listener ("bench" channel): the size doubles from 256 KiB until one
transfer takes at least a quarter of the probe duration (or 64 MiB), so a probe costs roughly
``duration`` on any link speed, instead of the established library's fixed 10 s per link.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import trio

from .._errors import PCCLError
from ..transport import StreamBroken
from ..wire import messages as m
from ..wire.stream import MessageStream
from .links import Dialer

log = logging.getLogger("pccl.bandwidth")

_START = 256 * 1024
_MAX = 64 * 1024 * 1024
_PAYLOAD = np.zeros(_MAX, dtype=np.uint8)


async def serve_probe(ms: MessageStream) -> None:
    """The "bench" channel: receive each probe and answer with the time it took to arrive."""
    sink = np.empty(4 * 1024 * 1024, dtype=np.uint8)
    view = sink.data
    while True:
        try:
            req = await ms.receive()
        except StreamBroken:
            return
        if not isinstance(req, m.BenchRequest) or not 0 <= req.nbytes <= _MAX:
            await ms.send(m.Refused(reason="bad bandwidth probe"))
            return
        t0 = trio.current_time()
        left = req.nbytes
        while left:
            k = min(left, len(view))
            await ms.receive_raw_into(view[:k])
            left -= k
        await ms.send(m.BenchResult(nbytes=req.nbytes, seconds=trio.current_time() - t0))


async def probe(ms: MessageStream, duration: float) -> float:
    """Measure the throughput (bytes/s) of an open "bench" connection."""
    nbytes = _START
    best = 0.0
    while True:
        t0 = trio.current_time()
        await ms.send_with_raw(m.BenchRequest(nbytes=nbytes), _PAYLOAD.data[:nbytes])
        reply = await ms.receive()
        elapsed = trio.current_time() - t0
        if not isinstance(reply, m.BenchResult):
            raise StreamBroken(f"unexpected probe reply {type(reply).__name__}")
        # Sender-side round trip includes the reply latency: a conservative estimate.
        rate = nbytes / max(elapsed, 1e-9)
        best = max(best, rate)
        if elapsed >= duration / 4 or nbytes >= _MAX:
            return best
        nbytes = min(nbytes * 4, _MAX)


async def measure_targets(dialer: Dialer, targets: list[list[Any]], duration: float) -> list[list[Any]]:
    """Probe each target in turn; returns rows ``[peer_id, bytes_per_second]`` (0 = unreachable).

    Args:
        dialer: opens the "bench" connections.
        targets: rows ``[peer_id, host, port]``.
        duration: seconds each probe aims for.
    """
    results: list[list[Any]] = []
    for row in targets:
        pid, host, port = int(row[0]), str(row[1]), int(row[2])
        rate = 0.0
        try:
            with trio.fail_after(max(dialer.connect_timeout, duration * 20)):
                ms = await dialer.dial(host, port, channel="bench", peer_id=pid)
                try:
                    rate = await probe(ms, duration)
                finally:
                    await ms.aclose()
        except (PCCLError, StreamBroken, trio.TooSlowError) as exc:
            log.warning("bandwidth probe to peer %d failed: %s", pid, exc)
        results.append([pid, rate])
    return results
