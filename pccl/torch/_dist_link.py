"""The pccl side of a torch process group: its communicator in a background trio thread, how the group
forms, the current agreement on ranks and the numbering of calls (tags)."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .._config import PeerConfig
from .._errors import InvalidArgumentError, PCCLError, RankConnectionLostError, Result, TooFewPeersError
from ..peer.communicator import Communicator
from ._dist_kinds import Configuration, Kinds, Scratch, exchange_ranks
from ._dist_plan import NEW_PEER_OFFSET
from ._dist_work import PeerLostError
from ._exec import BackgroundThread

__all__ = ["GroupLink"]

_TAG_LIMIT = 1 << 62
_EXCHANGE_TAG = 0  # the rank exchange; the calls of a configuration take tags 1, 2, ...


class GroupLink:
    """Connects to the master, forms the group (see ``ProcessGroupPCCL``) and keeps its configuration.

    Raises:
        MasterConnectionError, InvalidArgumentError, TimeoutError: as ``ProcessGroupPCCL``.
    """

    def __init__(self, master_address: str, *, rank: int, world_size: int, timeout: float, peer_group: int,
                 config: PeerConfig | None, connect_attempts: int, poll_interval: float) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._poll = poll_interval
        self.thread = BackgroundThread("pccl-torch-dist")
        try:
            self.comm: Communicator = self._connect(master_address, peer_group, config, connect_attempts)
            self.config: Configuration = self.thread.call(self._form, rank, world_size, timeout)
        except BaseException:
            self.thread.close()
            raise
        self.joined_running_group = self.config.newcomers < self.config.size
        self.scratch = Scratch()
        self.kinds = Kinds(self.comm, self.config, self.scratch)

    def _connect(self, address: str, peer_group: int, config: PeerConfig | None,
                 attempts: int) -> Communicator:
        delay = 0.05
        for attempt in range(max(1, attempts)):
            try:
                return self.thread.open_communicator(address, peer_group=peer_group, config=config)
            except PCCLError as exc:
                if exc.result != Result.MASTER_CONNECTION_FAILED or attempt + 1 >= attempts:
                    raise
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        raise AssertionError("unreachable")

    async def _form(self, rank: int, world_size: int, timeout: float) -> Configuration:
        # Each round is what a Manager's start_step does: a pending vote (admitting whoever waits),
        # then the rank exchange. A peer admitted by others enters at the exchange, where the peers that
        # admitted it are; the group is formed once the exchange counts world_size peers, or at once
        # when the exchange shows peers that hold ranks already (this peer joined a running group).
        comm = self.comm
        admitted_by_others = len(comm.group_ring) > 1
        with trio.move_on_after(timeout) as scope:
            while True:
                try:
                    if not admitted_by_others:
                        if await comm.are_peers_pending():
                            await comm.update_topology()
                        elif len(comm.group_ring) < world_size:
                            await trio.sleep(self._poll)
                    admitted_by_others = False
                    config = await exchange_ranks(comm, NEW_PEER_OFFSET + rank, _EXCHANGE_TAG)
                except (PeerLostError, RankConnectionLostError, TooFewPeersError):
                    continue  # someone left while we gathered: go on gathering
                except PCCLError as exc:
                    if exc.result != Result.UPDATE_TOPOLOGY_FAILED:
                        raise
                    continue
                if config.newcomers < config.size or config.size >= world_size:
                    break
        if scope.cancelled_caught:
            raise TimeoutError(f"pccl: {len(comm.group_ring)} of {world_size} peers after {timeout:.0f} s")
        if config.newcomers == config.size and rank >= 0 and config.rank != rank:
            raise InvalidArgumentError(f"pccl: rank {rank} was asked for by more than one peer (or is "
                                       f"outside 0..{config.size - 1})")
        return config

    def reconfigure(self) -> Configuration:
        """Agree on ranks again with the peers now in the group (every peer calls it together).

        Raises:
            PeerLostError: a peer was lost meanwhile (call it again).
        """
        config = self.thread.call(exchange_ranks, self.comm, self.config.rank, _EXCHANGE_TAG)
        with self._lock:
            self._seq = 0  # every peer numbers the calls of the new configuration from here
            self.config = config
            self.kinds = Kinds(self.comm, config, self.scratch)
        return config

    def next_tag(self) -> int:
        """The tag of the next call (the same on every peer, which make the same calls in order)."""
        with self._lock:
            self._seq = (self._seq + 1) % _TAG_LIMIT
            return self._seq

    def run(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await afn(*args)`` in the trio thread; returns its result."""
        return self.thread.call(afn, *args)

    def start(self, afn: Callable[[], Awaitable[None]]) -> None:
        """Start ``afn()`` in the trio thread's nursery and return at once."""

        async def start() -> None:
            assert self.thread.nursery is not None
            self.thread.nursery.start_soon(afn)

        self.thread.call(start)

    def close(self) -> None:
        """Leave the run and stop the thread (idempotent)."""
        self.thread.close()
