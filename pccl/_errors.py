"""The ``PCCLError`` hierarchy and result codes.

Every public call raises exactly one of these (never a bare ``ExceptionGroup``,
``trio.BrokenResourceError`` or ``OSError``). Each error carries a :class:`Result`
code compatible with the established PCCL library.
"""

from __future__ import annotations

import enum


class Result(enum.IntEnum):
    """Result codes: upstream's (the C header ``pcclResult_t``, 0..12) first, with the same names and
    numbers, then the codes only pccl has (13 and up)."""

    SUCCESS = 0
    NOT_INITIALIZED = 1
    INTERNAL_ERROR = 2
    INVALID_ARGUMENT = 3
    INVALID_USAGE = 4
    TOO_FEW_PEERS = 5
    MASTER_CONNECTION_FAILED = 6
    RANK_CONNECTION_FAILED = 7
    RANK_CONNECTION_LOST = 8
    NO_SHARED_STATE_AVAILABLE = 9
    PENDING_ASYNC_OPS = 10
    UPDATE_TOPOLOGY_FAILED = 11
    TOPOLOGY_OPTIMIZATION_FAILED = 12
    # pccl's own codes
    SYSTEM_ERROR = 13
    REMOTE_ERROR = 14
    IN_PROGRESS = 15
    SHARED_STATE_SYNC_FAILED = 16
    KICKED = 17


class PCCLError(Exception):
    """Base of every error raised by pccl.

    Two ways to build one:

    * ours: ``PCCLError(message, result=None)``: ``str(err)`` is ``"RESULT_NAME: message"``; a subclass
      supplies its own default result;
    * the established bindings': ``PCCLError(result, func_name)`` (a :class:`Result` or its integer code,
      then the failing function's name): ``str(err)`` is ``"<func_name> failed with error: NAME: NAME"``,
      exactly as there.

    Attributes:
        result: the :class:`Result` code.
        message: a human-readable explanation.
        func_name: the failing function (the established form only; ``""`` otherwise).
    """

    default_result: Result = Result.INTERNAL_ERROR

    def __init__(self, message: str | Result | int = "", result: Result | str | None = None) -> None:
        self.func_name = ""
        self._upstream_form = False
        if isinstance(message, int) and not isinstance(message, bool):
            # the established call order: PCCLError(result, func_name)
            self.result: Result = _as_result(message)
            self.func_name = str(result) if result is not None else ""
            self.message = f"{self.func_name} failed with error: {self.result.name}"
            self._upstream_form = True
            super().__init__(self.message)
            return
        if isinstance(result, str):
            raise TypeError("PCCLError(message, result): result must be a Result, not a string")
        self.result = result if result is not None else self.default_result
        self.message = str(message)
        super().__init__(f"{self.result.name}: {message}" if message else self.result.name)

    def __str__(self) -> str:
        if self._upstream_form:
            return f"{self.message}: {self.result.name}"
        return super().__str__()

    @staticmethod
    def check(result: int, func_name: str) -> None:
        """Raise for a non-SUCCESS code, like the established ``PCCLError.check``.

        Args:
            result: a :class:`Result` or its integer code.
            func_name: the name put in the message.

        Raises:
            PCCLError: ``result`` is not SUCCESS (the subclass for that code, e.g. :class:`TooFewPeersError`).
        """
        code = _as_result(result)
        if code != Result.SUCCESS:
            raise error_class(code)(code, func_name)


def _as_result(code: int) -> Result:
    try:
        return Result(code)
    except ValueError:
        return Result.INTERNAL_ERROR


class InvalidArgumentError(PCCLError, ValueError):
    """A call was given an argument it cannot use."""

    default_result = Result.INVALID_ARGUMENT


class InvalidBufferError(InvalidArgumentError, AssertionError):
    """A tensor or array a call cannot use (wrong type, dtype, size, contiguity, device).

    Also an ``AssertionError``: the established bindings ``assert`` on bad buffers, so handlers written for
    them catch it.
    """


class InvalidUsageError(PCCLError):
    """A call was made in a state where it is not allowed."""

    default_result = Result.INVALID_USAGE


class PendingAsyncOpsError(InvalidUsageError):
    """A topology change was requested while collectives are in flight."""

    default_result = Result.PENDING_ASYNC_OPS


class TooFewPeersError(PCCLError):
    """A collective needs at least two peers in the group."""

    default_result = Result.TOO_FEW_PEERS


class MasterConnectionError(PCCLError):
    """The connection to the master failed or was lost (broken socket or missed heartbeats)."""

    default_result = Result.MASTER_CONNECTION_FAILED


class HelloRefusedError(MasterConnectionError):
    """The hello with the master failed for a reason a retry cannot cure (bad secret, another run,
    another protocol version, not a pccl master): :meth:`pccl.Communicator.connect` does not retry it.
    ``message`` names the cause."""

    default_result = Result.MASTER_CONNECTION_FAILED


class KickedError(MasterConnectionError):
    """The master removed this peer on purpose; ``message`` says why."""

    default_result = Result.MASTER_CONNECTION_FAILED


class RankConnectionFailedError(PCCLError):
    """A P2P connection to another peer could not be established."""

    default_result = Result.RANK_CONNECTION_FAILED


class RankConnectionLostError(PCCLError):
    """A participant of a collective failed; the operation was aborted and buffers restored."""

    default_result = Result.RANK_CONNECTION_LOST


class UpdateTopologyFailedError(PCCLError):
    """``update_topology`` could not establish every new P2P connection; retry it."""

    default_result = Result.UPDATE_TOPOLOGY_FAILED


class TopologyOptimizationFailedError(PCCLError):
    """``optimize_topology`` failed; retry it."""

    default_result = Result.TOPOLOGY_OPTIMIZATION_FAILED


class SharedStateSyncError(PCCLError):
    """A shared-state sync failed; the local tensors are unchanged."""

    default_result = Result.SHARED_STATE_SYNC_FAILED


class NoSharedStateAvailableError(SharedStateSyncError):
    """No peer could provide the elected shared state."""

    default_result = Result.NO_SHARED_STATE_AVAILABLE


class ProtocolError(PCCLError):
    """A protocol rule was broken."""

    default_result = Result.INTERNAL_ERROR


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol forbids (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The other side broke the protocol (bad frame, unknown type, illegal message, version mismatch)."""

    default_result = Result.REMOTE_ERROR


_CLASS_BY_RESULT: dict[Result, type[PCCLError]] = {
    Result.INVALID_ARGUMENT: InvalidArgumentError,
    Result.INVALID_USAGE: InvalidUsageError,
    Result.PENDING_ASYNC_OPS: PendingAsyncOpsError,
    Result.TOO_FEW_PEERS: TooFewPeersError,
    Result.MASTER_CONNECTION_FAILED: MasterConnectionError,
    Result.RANK_CONNECTION_FAILED: RankConnectionFailedError,
    Result.RANK_CONNECTION_LOST: RankConnectionLostError,
    Result.UPDATE_TOPOLOGY_FAILED: UpdateTopologyFailedError,
    Result.TOPOLOGY_OPTIMIZATION_FAILED: TopologyOptimizationFailedError,
    Result.SHARED_STATE_SYNC_FAILED: SharedStateSyncError,
    Result.NO_SHARED_STATE_AVAILABLE: NoSharedStateAvailableError,
    Result.KICKED: KickedError,
    Result.REMOTE_ERROR: RemoteProtocolError,
}


def error_class(result: Result) -> type[PCCLError]:
    """The :class:`PCCLError` subclass that stands for ``result`` (``PCCLError`` itself when none does)."""
    return _CLASS_BY_RESULT.get(result, PCCLError)
