"""The communication requests of the training cores, and the drivers that run them.

The data-parallel step and the DiLoCo round (``_train.py``, ``_diloco.py``) are written once, as
generators that *yield* these requests and receive each one's result (or have its ``PCCLError``
thrown in). They do the local torch work themselves and never touch trio, sockets or clocks; the
executor (``_exec.py``) runs the requests on an async communicator, from a trio task (the async
drivers) or from the user's thread through a background trio thread (the blocking drivers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar

from .._errors import PCCLError, Result, SharedStateSyncError, TooFewPeersError
from .._types import QuantizationOptions, ReduceOp

__all__ = [
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Joining",
    "Members",
    "Op",
    "PeersPending",
    "PollAllReduce",
    "Sleep",
    "StartAllReduce",
    "StartPeersPending",
    "StartSync",
    "Sync",
    "SyncPlanned",
    "UpdateTopology",
    "WaitAllReduce",
    "WaitAny",
    "drive",
    "drive_async",
    "is_result",
    "live_heal_result",
    "sync_until_done",
    "wait_for_members",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PeersPending:
    """``are_peers_pending()``; result: bool."""


@dataclasses.dataclass(frozen=True)
class UpdateTopology:
    """``update_topology()``; result: None."""


@dataclasses.dataclass(frozen=True)
class Members:
    """This peer's rank and its group's size; result: ``(rank, world_size)``."""


@dataclasses.dataclass(frozen=True)
class Sync:
    """``sync_shared_state(state)``; result: ``SharedStateSyncInfo``."""

    state: Any


@dataclasses.dataclass(frozen=True)
class Sleep:
    """Wait ``seconds`` (alone, waiting for peers); result: None. ``min_world_size`` > 0: the wait is for
    that many peers (the executor says so at WARNING while it lasts)."""

    seconds: float
    min_world_size: int = 0


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """All-reduce ``pairs`` (``(send, recv)`` tensors), at most ``max_in_flight`` at once on tags
    ``base_tag + i``, launched in index order; result: ``ReduceInfo`` (bytes summed).

    ``retry_lost=False``: the first failure of any bucket is raised once every bucket finished (the
    caller retries the whole step). ``retry_lost=True``: buckets that fail with RANK_CONNECTION_LOST
    are retried with the survivors until all succeed (TOO_FEW_PEERS when nobody is left).

    ``exact``: more pairs, launched after ``pairs`` (their tags follow), reduced with SUM and without
    quantization (a count of contributors, for an average over contributors only: DiLoCo's
    ``replay_heals``). With ``retry_lost``, a lost peer then makes **every** bucket run again with the
    survivors (those completed before the loss hold its part, which the count would no longer include).
    """

    pairs: Sequence[tuple[Any, Any]]
    op: ReduceOp = ReduceOp.AVG
    quantization: QuantizationOptions | None = None
    max_in_flight: int = 4
    base_tag: int = 0
    retry_lost: bool = False
    exact: Sequence[tuple[Any, Any]] = ()


@dataclasses.dataclass(frozen=True)
class AllGather:
    """``all_gather(send, recv, tag=tag)``: every peer's ``send`` into ``recv`` in rank order; result:
    ``ReduceInfo``. ``recv`` must hold ``world_size * len(send)`` elements (INVALID_ARGUMENT when the
    group changed size since)."""

    send: Any
    recv: Any
    tag: int = 0


@dataclasses.dataclass(frozen=True)
class AllToAll:
    """``all_to_all(send, recv, tag=tag)``: block ``j`` of ``send`` to rank ``j``, block ``i`` of ``recv``
    from rank ``i`` (``world_size`` equal blocks each); result: ``ReduceInfo``. INVALID_ARGUMENT when
    the group changed size since."""

    send: Any
    recv: Any
    tag: int = 0


@dataclasses.dataclass(frozen=True)
class StartAllReduce:
    """Launch ``reduce`` (an all-reduce, with its ``retry_lost``, an all-gather or an all-to-all) in the
    background; result: a handle for WaitAllReduce."""

    reduce: AllReduce | AllGather | AllToAll


@dataclasses.dataclass(frozen=True)
class StartSync:
    """Launch ``sync_shared_state(state)`` in the background as a peer that would observe its group's
    collectives should it fetch in a live heal (issue 35 item 4, DiLoCo's ``replay_heals``); result: a
    handle for :class:`SyncPlanned`, and for :class:`WaitAllReduce` / :class:`PollAllReduce` (its
    ``SharedStateSyncInfo``, or its error raised)."""

    state: Any


@dataclasses.dataclass(frozen=True)
class SyncPlanned:
    """Wait until a :class:`StartSync`'s plan came (or the sync ended without one); result: ``None`` when
    it does not fetch a live heal, else the revision it heals to (it observes meanwhile)."""

    handle: Any


@dataclasses.dataclass(frozen=True)
class StartPeersPending:
    """``are_peers_pending()`` launched in the background: the vote goes out and the caller goes on (the
    communicator allows the vote while collectives are in flight); result: a handle for WaitAllReduce
    and PollAllReduce, whose result is the answer (bool) or the vote's error raised."""


@dataclasses.dataclass(frozen=True)
class WaitAllReduce:
    """Wait for a background reduce (or a :class:`StartSync`, or a :class:`StartPeersPending`); result:
    its info (the vote's answer), or its error raised."""

    handle: Any


@dataclasses.dataclass(frozen=True)
class WaitAny:
    """Wait until one of ``handles`` (of :class:`StartAllReduce` / :class:`StartSync`) has finished,
    without taking its result; result: None."""

    handles: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class PollAllReduce:
    """Whether a background reduce has finished (succeeded or failed), without waiting; result: bool.
    A finished one's :class:`WaitAllReduce` returns at once."""

    handle: Any


Op = (PeersPending | UpdateTopology | Members | Sync | Sleep | AllReduce | AllGather | AllToAll
      | StartAllReduce | StartSync | SyncPlanned | StartPeersPending | WaitAllReduce | WaitAny
      | PollAllReduce)


def is_result(exc: BaseException, *names: str) -> bool:
    """True when ``exc`` is a PCCLError whose result is one of ``names`` (Result member names)."""
    return isinstance(exc, PCCLError) and exc.result in {Result[n] for n in names}


class Joining(Protocol):
    """What :func:`wait_for_members` reads and clears: whether the next membership phase skips its
    admission vote once (a newcomer, admitted by the running peers, does not vote on itself)."""

    just_joined: bool


def wait_for_members(
    driver: Joining,
    min_world_size: int,
    timeout: float | None,
    poll_interval: float,
    before_update: Callable[[], Generator[Op, Any, None]] | None = None,
    answered: bool | None = None,
) -> Generator[Op, Any, tuple[int, int]]:
    """The membership phase every driver shares: admit pending peers (``before_update`` runs first, when
    there are any), then wait, polling every ``poll_interval`` s, until the group has ``min_world_size``
    peers; raises TooFewPeersError once ``timeout`` s (counted as polls) passed. Returns (rank, world size).
    ``answered``: the answer of the first round's vote, when it was already taken (in the background).
    """
    waited = 0.0
    while True:
        if driver.just_joined:
            driver.just_joined = False
        else:
            try:
                if answered is None:
                    pending = yield PeersPending()
                else:  # (used once: a later round votes)
                    pending, answered = answered, None
                if pending:
                    if before_update is not None:
                        yield from before_update()
                    yield UpdateTopology()
            except Exception as exc:
                if not is_result(exc, "UPDATE_TOPOLOGY_FAILED", "RANK_CONNECTION_LOST"):
                    raise  # (RANK_CONNECTION_LOST: are_peers_pending's vote lost with the master)
                continue  # every peer saw it: vote again
        rank, world_size = yield Members()
        if world_size >= min_world_size:
            return rank, world_size
        if timeout is not None and waited >= timeout:
            raise TooFewPeersError(
                f"waited {waited:g} s for {min_world_size} peers; the group has {world_size}")
        yield Sleep(poll_interval, min_world_size)
        waited += poll_interval


def sync_until_done(state: Any) -> Generator[Op, Any, Any]:
    """Sync ``state`` with the group, again after each peer lost during the sync (RANK_CONNECTION_LOST:
    the group re-forms and the same revision is synced again); any other error propagates. Returns the
    sync's info."""
    while True:
        try:
            return (yield Sync(state))
        except Exception as exc:
            if not is_result(exc, "RANK_CONNECTION_LOST"):
                raise


def live_heal_result(handle: Any, members_lose: str) -> Generator[Op, Any, Any]:
    """A replaying newcomer's live heal (``handle``: its background sync): the heal's result, or its
    failure as a SharedStateSyncError that says what to do (``members_lose``: what the members lose
    when this driver closes, in the driver's words)."""
    try:
        return (yield WaitAllReduce(handle))
    except PCCLError as exc:
        raise SharedStateSyncError(
            f"the live heal of this newcomer failed ({exc}); nothing was applied. Its peer now counts in its "
            "group's votes as a member whose state it does not hold: close this driver (its peer leaves; "
            f"{members_lose}) and start it again to heal") from exc


def drive(gen: Generator[Op, Any, T], execute: Callable[[Op], Any]) -> T:
    """Run a core generator to completion, executing each request with ``execute`` (blocking).

    A ``PCCLError`` raised by ``execute`` is thrown into the generator; anything else propagates.
    """
    value: Any = None
    error: PCCLError | None = None
    while True:
        try:
            op = gen.throw(error) if error is not None else gen.send(value)
        except StopIteration as stop:
            result: T = stop.value
            return result
        try:
            value, error = execute(op), None
        except PCCLError as exc:
            value, error = None, exc


async def drive_async(gen: Generator[Op, Any, T], execute: Callable[[Op], Awaitable[Any]]) -> T:
    """:func:`drive` for an async ``execute``."""
    value: Any = None
    error: PCCLError | None = None
    while True:
        try:
            op = gen.throw(error) if error is not None else gen.send(value)
        except StopIteration as stop:
            result: T = stop.value
            return result
        try:
            value, error = await execute(op), None
        except PCCLError as exc:
            value, error = None, exc
