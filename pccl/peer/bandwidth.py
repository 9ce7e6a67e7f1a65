"""Point-to-point latency and bandwidth probes for ``optimize_topology``.

The master asks a peer to measure its links to some targets (a schedule in which no peer sends or
receives twice at once, so probes do not share a peer's bandwidth). Each target gets one "bench"
connection to its P2P listener, and on it

* a **latency** probe: :data:`PING_SAMPLES` empty probes (``BenchRequest(nbytes=0)``, answered at
  once), one after another; the link's one-way latency is half the median round trip (the median:
  one slow sample, e.g. a scheduling hiccup, does not move it);
* a **bandwidth** probe: a short timed transfer whose size grows from 256 KiB until one transfer
  takes at least a quarter of the probe duration (or 64 MiB), timed without the round trip the
  latency probe measured, so a probe costs roughly ``duration`` plus a few round trips on any
  link, instead of the established library's fixed 10 s per link.

The report row of a target is ``[peer_id, bytes_per_second, one_way_latency_seconds]``
(``[peer_id, 0, 0]``: unreachable); the master keeps both beside each other and sends its summary
to the peers for their schedule choice (docs/topology.md).
"""

from __future__ import annotations

import logging
import statistics
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

PING_SAMPLES = 3
"""Round trips timed per latency probe (their median is kept)."""


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


async def ping(ms: MessageStream, samples: int = PING_SAMPLES) -> float:
    """Measure the one-way latency (seconds) of an open "bench" connection: half the median of
    ``samples`` round trips of an empty probe.

    Raises:
        ValueError: ``samples < 1``.
        StreamBroken: the connection broke or answered something else.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    rtts: list[float] = []
    for _ in range(samples):
        t0 = trio.current_time()
        await ms.send(m.BenchRequest(nbytes=0))
        reply = await ms.receive()
        rtts.append(trio.current_time() - t0)
        if not isinstance(reply, m.BenchResult) or reply.nbytes != 0:
            raise StreamBroken(f"unexpected ping reply {type(reply).__name__}")
    return statistics.median(rtts) / 2


async def probe(ms: MessageStream, duration: float, rtt: float = 0.0) -> float:
    """Measure the sustained throughput (bytes/s) of an open "bench" connection.

    Transfers grow from 256 KiB (x4) until one takes at least ``duration / 4`` (or 64 MiB); the
    result is that last transfer's rate. A transfer's time is the sender's round trip (request sent
    to answer read) less ``rtt``, the connection's empty round trip (twice :func:`ping`'s latency):
    what is left is the time the bytes took, which the link's latency would otherwise swamp (a
    256 KiB transfer over a 25 ms link is 50 ms of round trip and 0.2 ms of bytes at 10 Gbit/s).
    It is never taken below the receiver's own timing of the bytes.

    Args:
        ms: the connection.
        duration: seconds the probe aims for.
        rtt: the connection's empty round trip in seconds (0: unknown, the whole round trip counts).

    Raises:
        StreamBroken: the connection broke or answered something else.
    """
    nbytes = _START
    while True:
        t0 = trio.current_time()
        await ms.send_with_raw(m.BenchRequest(nbytes=nbytes), _PAYLOAD.data[:nbytes])
        reply = await ms.receive()
        elapsed = trio.current_time() - t0
        if not isinstance(reply, m.BenchResult):
            raise StreamBroken(f"unexpected probe reply {type(reply).__name__}")
        took = max(elapsed - max(rtt, 0.0), reply.seconds, 1e-9)
        if took >= duration / 4 or nbytes >= _MAX:
            return nbytes / took
        nbytes = min(nbytes * 4, _MAX)


async def measure_targets(dialer: Dialer, targets: list[list[Any]], duration: float) -> list[list[Any]]:
    """Probe each target in turn: its latency (:func:`ping`), then its bandwidth (:func:`probe`).

    Args:
        dialer: opens the "bench" connections.
        targets: rows ``[peer_id, host, port]``.
        duration: seconds each bandwidth probe aims for.

    Returns:
        Rows ``[peer_id, bytes_per_second, one_way_latency_seconds]``; ``[peer_id, 0.0, 0.0]`` for a
        target that could not be measured (unreachable).
    """
    results: list[list[Any]] = []
    for row in targets:
        pid, host, port = int(row[0]), str(row[1]), int(row[2])
        rate = latency = 0.0
        try:
            with trio.fail_after(max(dialer.connect_timeout, duration * 20)):
                ms = await dialer.dial(host, port, channel="bench", peer_id=pid)
                try:
                    latency = await ping(ms)
                    rate = await probe(ms, duration, rtt=2 * latency)
                finally:
                    await ms.aclose()
        except (PCCLError, StreamBroken, trio.TooSlowError) as exc:
            log.warning("link probe to peer %d failed: %s", pid, exc)
            rate = latency = 0.0
        results.append([pid, rate, latency])
    return results
