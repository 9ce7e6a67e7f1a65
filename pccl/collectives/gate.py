"""How much a speculatively started data plane may send before everyone voted (docs/protocol.md
section 4, "Speculative start").

A speculative start runs the data plane on the peer's own vote, before the master knows that every
participant voted. Frames it sends to a partner that has not voted yet wait in that partner's stash
(``PeerConfig.recv_stash_limit``); once the stash is full, the partner stops reading the connection
and every frame behind (of any operation) waits too (pccl/peer/pool.py, "Backpressure"). An
operation of any size may start speculatively because its sends are gated: until the master's
go-ahead (the tableless ``CollectiveCommence`` that says every participant voted) it sends at most
``limit`` bytes, which :func:`early_send_limit` sizes to half the stash, so one operation never
fills a partner's stash on its own. Once the go-ahead arrived the gate is open for good.

The go-ahead comes about one master round trip (plus ``MasterConfig.speculative_go_delay``) after
the last vote; in a steady run the data plane is by then far from the limit (at 1 Gbit/s a
100 ms round trip moves 12.5 MB, a quarter of the default 64 MiB stash's half), so the gate costs
nothing and the operation pays one master round trip (the confirmation) instead of two.
"""

from __future__ import annotations

from typing import Protocol


class GoAhead(Protocol):
    """The master's go-ahead of one operation (``pccl.peer.mailbox.Waiter`` is one)."""

    @property
    def done(self) -> bool:
        """True once it arrived (or failed)."""
        ...

    async def wait(self) -> object:
        """Return once it arrived; raise the error it failed with."""
        ...


def early_send_limit(recv_stash_limit: int) -> int:
    """Bytes a speculative data plane sends before the go-ahead: half the partners' stash (peers
    of a run share their configuration; a partner with a smaller stash only holds the sender back
    through TCP, as for any early frame)."""
    return max(0, recv_stash_limit // 2)


class SendGate:
    """Admits the frames of one speculative data plane: up to ``limit`` bytes at once, the rest
    once ``go`` is done (see the module docstring). Shared by the operation's sender tasks.

    Args:
        limit: bytes sent before the go-ahead (>= 0).
        go: the go-ahead.
    """

    def __init__(self, limit: int, go: GoAhead) -> None:
        if limit < 0:
            raise ValueError(f"limit ({limit}) must be >= 0")
        self.limit = limit
        self._go = go
        self.sent_early = 0  # bytes admitted before the go-ahead
        self.waited = False  # a frame waited for the go-ahead

    async def admit(self, nbytes: int) -> None:
        """Return when a frame of ``nbytes`` may be sent: at once while the bytes sent before the
        go-ahead stay within ``limit``, else when the go-ahead arrives.

        Raises:
            PCCLError: the go-ahead failed (the master was lost): the operation fails.
        """
        if self._go.done:
            await self._go.wait()  # raises if it failed
            return
        if self.sent_early + nbytes <= self.limit:
            self.sent_early += nbytes
            return
        self.waited = True
        await self._go.wait()
