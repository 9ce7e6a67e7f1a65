"""The membership calls of the native async :class:`~pccl.peer.communicator.Communicator`
(``update_topology``, ``optimize_topology``, ``are_peers_pending``) and the P2P setup of a topology
round (:meth:`MembershipCalls._establish`, run for the core's ``Establish`` effect). A part of the
communicator, which provides the attributes declared here.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import trio

from .._errors import PCCLError, RankConnectionLostError
from .._waits import format_wait
from ..collectives.cost import LinkModel
from ..collectives.schedule import send_partners
from ..wire import messages as m
from .mailbox import Waiter
from .notices import WaitReporter
from .state import Establish, PeerState, error_from_code


class MembershipCalls:
    """The membership part of :class:`~pccl.peer.communicator.Communicator`."""

    config: Any
    pool: Any
    _core: PeerState
    _ops: dict[int, Any]
    _links: LinkModel | None
    _notices: WaitReporter
    _topology_waiter: Waiter[m.TopologyResult] | None
    _pending_waiters: collections.deque[Waiter[m.PeersPendingResult]]

    @property
    def peer_id(self) -> int:
        raise NotImplementedError

    async def _await_link(self) -> None:
        raise NotImplementedError

    async def _send(self, msg: m.Message) -> None:
        raise NotImplementedError

    async def _establish(self, effect: Establish) -> None:
        self._links = LinkModel.from_summary(effect.links)
        nxt = effect.successor
        ok, failed, reason = True, [], ""
        targets = [] if nxt is None else [nxt]
        ids = [r.peer_id for r in effect.group]
        if nxt is not None and self.config.schedule != "ring" and self.peer_id in ids:
            # every rank the halving-doubling and tree plans may send to, opened now rather than on
            # first use (a connect on first use would fail under a partition that the data plane
            # rides out, and costs the operation a round trip)
            rank = ids.index(self.peer_id)
            targets += [effect.group[r] for r in send_partners(len(ids), rank) if effect.group[r] != nxt]

        async def one(row: m.PeerRow) -> None:
            nonlocal ok, reason
            try:
                with trio.fail_after(self.config.p2p_connection_timeout):
                    await self.pool.connect(row.peer_id, row.host, row.port)
            except (PCCLError, trio.TooSlowError) as exc:
                ok, reason = False, reason or str(exc)
                failed.append(row.peer_id)

        async with trio.open_nursery() as nursery:
            for row in targets:
                nursery.start_soon(one, row)
        self._core.setup_done(effect.epoch, ok)  # in doubt from here on, even if the send fails
        try:
            await self._send(
                m.P2PConnectionsDone(epoch=effect.epoch, success=ok, failed_peers=failed, reason=reason)
            )
        except PCCLError:
            pass
        if not self._ops:
            # The peers no plan of the new ring sends to lose this peer's connections (kept, every
            # membership change of a long run would add some until this peer held one to each).
            # Never under an operation, whose frames may be on them; an operation that starts
            # meanwhile sends only to the peers kept.
            await self.pool.retire({row.peer_id for row in targets})

    async def update_topology(self) -> None:
        """Vote to admit pending peers; returns once every accepted peer voted and connected.

        Raises:
            PendingAsyncOpsError: collectives of this peer are still in flight.
            UpdateTopologyFailedError: P2P setup failed somewhere; retry.
            MasterConnectionError: the master is lost.
        """
        await self._topology_call(m.UpdateTopologyVote(), "update_topology")

    async def optimize_topology(self) -> None:
        """Vote to measure missing link bandwidths and re-solve the ring (no newcomers admitted).

        Raises:
            PendingAsyncOpsError, TopologyOptimizationFailedError, MasterConnectionError.
        """
        await self._topology_call(m.OptimizeTopologyVote(), "optimize_topology")

    async def _topology_call(self, vote: m.Message, name: str) -> None:
        await self._await_link()
        self._core.begin_topology(name)
        waiter: Waiter[m.TopologyResult] = Waiter()
        self._topology_waiter = waiter
        try:
            await self._send(vote)
            with self._notices.waiting(("topology", name), functools.partial(self._describe_vote_wait, name)):
                result = await waiter.wait()
        finally:
            self._topology_waiter = None
            self._core.end_membership()
        if not result.success:
            raise error_from_code(result.code, result.reason or f"{name} failed")

    def _describe_vote_wait(self, name: str, waited: float) -> str:
        return (f"peer {self.peer_id}: {name}() has waited {format_wait(waited)} for the master's answer: "
                f"the vote completes once every accepted peer of the run calls {name}() (the master's log "
                f"names those it waits for); MasterConfig.vote_timeout bounds it")

    async def are_peers_pending(self) -> bool:
        """Collective query (all accepted peers call it): are peers waiting to be accepted?

        May be called while collectives are in flight.
        """
        await self._await_link()
        waiter: Waiter[m.PeersPendingResult] = Waiter()
        self._pending_waiters.append(waiter)
        self._core.begin_pending()
        try:
            try:
                await self._send(m.PeersPendingVote())
            except RankConnectionLostError:
                if not self._core.reconnecting:
                    raise
                # The link broke as the vote went out: it waits like a vote that went out. The
                # re-registration reports it waiting, and the master it reconnects to counts it
                # (docs/concepts.md "A member's link breaks", "Rounds in doubt").
            with self._notices.waiting(("pending", id(waiter)),
                                       functools.partial(self._describe_vote_wait, "are_peers_pending")):
                return (await waiter.wait()).pending
        finally:
            self._core.end_pending()
            if waiter in self._pending_waiters:
                self._pending_waiters.remove(waiter)



__all__ = ["MembershipCalls"]
