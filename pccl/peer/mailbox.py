"""Where a call waits for the master's answer: a one-shot :class:`Waiter` and an ordered :class:`Mailbox`.

The communicator's reader task fills them (executing the effects of :class:`pccl.peer.state.PeerState`);
the calls wait on them. Both can be failed, which wakes the waiting call with the error.
"""

from __future__ import annotations

import collections
from typing import Generic, TypeVar

import trio

from .._errors import PCCLError
from ..wire import messages as m

T = TypeVar("T")


class Waiter(Generic[T]):
    """A one-shot slot a call waits on; the reader task fills it or fails it."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._value: T | None = None
        self._error: PCCLError | None = None

    @property
    def done(self) -> bool:
        """True once set or failed."""
        return self._event.is_set()

    def set(self, value: T) -> None:
        """Fill the slot (ignored once done)."""
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def fail(self, error: PCCLError) -> None:
        """Fail the slot (ignored once done)."""
        if not self._event.is_set():
            self._error = error
            self._event.set()

    async def wait(self) -> T:
        """The value once set.

        Raises:
            PCCLError: the error the slot was failed with.
        """
        await self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


class Mailbox:
    """An ordered inbox for one multi-message exchange (a shared-state sync gets a plan, then a result;
    both can arrive back to back before the caller looks)."""

    def __init__(self) -> None:
        self._items: collections.deque[m.Message] = collections.deque()
        self._error: PCCLError | None = None
        self._wakeup = trio.Event()

    def put(self, msg: m.Message) -> None:
        """Queue a message."""
        self._items.append(msg)
        self._wakeup.set()

    def fail(self, error: PCCLError) -> None:
        """Fail the exchange: :meth:`get` raises once the queued messages are taken."""
        if self._error is None:
            self._error = error
        self._wakeup.set()

    async def get(self) -> m.Message:
        """The next message, in arrival order.

        Raises:
            PCCLError: the mailbox was failed and is empty.
        """
        while not self._items:
            if self._error is not None:
                raise self._error
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        return self._items.popleft()


__all__ = ["Mailbox", "Waiter"]
