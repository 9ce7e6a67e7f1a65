"""The trio side of the serving cap (:class:`pccl.peer.ratecap.RateCap`): senders sleep its answers,
this peer's collectives report when their data planes run, and the serving connections' kernel pacing
follows the rate in force.

A sender asleep on its debt is woken when the rate changes (a collective of this peer started or
ended) and asks the cap again: a piece granted at the idle rate waits longer once a collective starts,
one waiting at the collective rate goes sooner once it ends. What :class:`ServePace` keeps of the
serving connections is only what the kernel needs: each one's pacing rate (``SO_MAX_PACING_RATE``,
set again at every change, so what is already in the socket drains at the new rate) and a small
unsent limit (``TCP_NOTSENT_LOWAT`` of one piece), so that a collective that starts finds at most
about a piece of ours not yet sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

from ..transport import Stream, limit_send_rate, limit_unsent
from .ratecap import RateCap

__all__ = ["ServePace"]


class ServePace:
    """Paces serving under ``cap`` and yields to this peer's collectives (see the module doc).

    Args:
        cap: the pure bucket (its ``rate`` while a collective runs, its ``idle_rate`` between).
    """

    def __init__(self, cap: RateCap) -> None:
        self.cap = cap
        self._changed = trio.Event()
        self._streams: set[Stream] = set()
        self.changes = 0  # rate changes (statistics)

    async def pace(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent (charged now; re-asked after every rate change)."""
        wait = self.cap.take(nbytes, trio.current_time())
        while wait > 0:
            changed = self._changed
            with trio.move_on_after(wait):
                await changed.wait()
            if not changed.is_set():
                return  # slept the whole wait at an unchanged rate: granted (asking again could find
                # a rounding's worth left, forever)
            wait = self.cap.wait(trio.current_time())
        await trio.lowlevel.checkpoint()

    @contextmanager
    def collective(self) -> Iterator[None]:
        """A collective's data plane runs in this block: serving drops to ``cap.rate`` until it ends
        (however it ends)."""
        self._changed_if(self.cap.collective_started(trio.current_time()))
        try:
            yield
        finally:
            self._changed_if(self.cap.collective_ended(trio.current_time()))

    @contextmanager
    def serving(self, stream: Stream) -> Iterator[None]:
        """``stream`` serves under this pace in this block: its kernel pacing follows the rate in
        force and at most about one piece waits unsent in it (best effort: TCP only)."""
        paced = limit_send_rate(stream, self.cap.rate_now)
        limit_unsent(stream, self.cap.piece)
        if paced:
            self._streams.add(stream)
        try:
            yield
        finally:
            self._streams.discard(stream)

    def _changed_if(self, changed: bool) -> None:
        if not changed:
            return
        self.changes += 1
        event, self._changed = self._changed, trio.Event()
        event.set()
        rate = self.cap.rate_now
        for stream in list(self._streams):
            limit_send_rate(stream, rate)
