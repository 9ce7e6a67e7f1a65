"""The peer's pure core: the protocol rules of one peer, without trio, sockets or clocks.

See docs/protocol.md for the messages.
"""

from __future__ import annotations

from .._errors import (
    InvalidArgumentError,
    InvalidUsageError,
    NoSharedStateAvailableError,
    PCCLError,
    RankConnectionLostError,
    Result,
    SharedStateSyncError,
    TooFewPeersError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
)

_ERRORS_BY_RESULT: dict[Result, type[PCCLError]] = {
    Result.RANK_CONNECTION_LOST: RankConnectionLostError,
    Result.TOO_FEW_PEERS: TooFewPeersError,
    Result.INVALID_USAGE: InvalidUsageError,
    Result.INVALID_ARGUMENT: InvalidArgumentError,
    Result.UPDATE_TOPOLOGY_FAILED: UpdateTopologyFailedError,
    Result.TOPOLOGY_OPTIMIZATION_FAILED: TopologyOptimizationFailedError,
    Result.SHARED_STATE_SYNC_FAILED: SharedStateSyncError,
    Result.NO_SHARED_STATE_AVAILABLE: NoSharedStateAvailableError,
}


def error_from_code(code: int, reason: str) -> PCCLError:
    """Build the PCCLError subclass matching a result code sent by the master.

    Args:
        code: the wire result code (an unknown one becomes INTERNAL_ERROR).
        reason: the master's explanation.

    Returns:
        The error to raise in the waiting call.
    """
    try:
        result = Result(code)
    except ValueError:
        return PCCLError(reason, Result.INTERNAL_ERROR)
    return _ERRORS_BY_RESULT.get(result, PCCLError)(reason, result)
