"""The ``PCCLError`` hierarchy and result codes.

Every public call raises exactly one of these (never a bare ``ExceptionGroup``,
``trio.BrokenResourceError`` or ``OSError``). Each error carries a :class:`Result`
code compatible with the established PCCL library.
"""

from __future__ import annotations

import enum


class Result(enum.IntEnum):
    """Result codes, named and numbered like the established PCCL library."""

    SUCCESS = 0
    NOT_INITIALIZED = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6
    IN_PROGRESS = 7
    NUM_RESULTS = 8
    MASTER_CONNECTION_FAILED = 9
    RANK_CONNECTION_FAILED = 10
    RANK_CONNECTION_LOST = 11
    NO_SHARED_STATE_AVAILABLE = 12
    PENDING_ASYNC_OPS = 13
    UPDATE_TOPOLOGY_FAILED = 14
    TOPOLOGY_OPTIMIZATION_FAILED = 15
    TOO_FEW_PEERS = 16
    SHARED_STATE_SYNC_FAILED = 17
    KICKED = 18


class PCCLError(Exception):
    """Base of every error raised by pccl.

    Attributes:
        result: the :class:`Result` code.
        message: a human-readable explanation.
    """

    default_result: Result = Result.INTERNAL_ERROR

    def __init__(self, message: str = "", result: Result | None = None) -> None:
        self.result: Result = result if result is not None else self.default_result
        self.message = message
        super().__init__(f"{self.result.name}: {message}" if message else self.result.name)


class InvalidArgumentError(PCCLError, ValueError):
    """A call was given an argument it cannot use."""

    default_result = Result.INVALID_ARGUMENT


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
