"""The Work handle of the pccl torch.distributed backend, and its errors."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PCCLWork", "PeerLostError", "ProcessGroupBrokenError"]


class ProcessGroupBrokenError(RuntimeError):
    """The pccl process group no longer has the peers its rank and world size describe.

    Every call of the configuration fails (with :class:`PeerLostError`, the subclass raised today) until
    the group is reconfigured (:meth:`Manager.start_step` does it).
    """


class PeerLostError(ProcessGroupBrokenError):
    """A peer was lost during (or before) this collective: nobody committed its result, and the caller's
    buffers hold exactly what they held before the call. The group is broken until reconfigured."""


class PCCLWork(dist.Work):
    """An operation of the pccl backend: :meth:`wait` blocks until it finished (raising its error), and
    :meth:`get_future` completes with the output tensors (or the error), for DDP's comm hooks."""

    def __init__(self, call: str, result: Any) -> None:
        super().__init__()
        self.call = call
        self._result = result
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future[Any] = torch.futures.Future()

    def finish(self, error: BaseException | None) -> None:
        """Mark the operation finished (called once, by the backend's trio thread)."""
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the operation finished; raise its error (:class:`PeerLostError` when a peer was
        lost, with the buffers as they were before the call).

        Args:
            timeout: give up waiting after this long (``TimeoutError``; the operation keeps running).
                None or zero: wait as long as it takes (pccl bounds every operation itself).
        """
        seconds = None if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise TimeoutError(f"{self.call}: not finished after {seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once the operation finished successfully."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The operation's error (None while running or after success)."""
        return self._error

    def result(self) -> Any:
        """The output tensors."""
        return self._result

    def get_future(self) -> torch.futures.Future[Any]:
        """A future completed with the output tensors, or with the operation's error."""
        return self._future

    def __repr__(self) -> str:
        state = "running" if not self._done.is_set() else ("ok" if self._error is None else "failed")
        return f"<PCCLWork {self.call} {state}>"
