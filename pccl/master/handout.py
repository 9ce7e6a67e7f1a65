"""Who gets which P2P credentials, and when (docs/security.md "P2P bound to membership").

Pure (no trio, sockets or clocks: times are passed in). :class:`CredentialHandout` turns the set
issued last (:class:`~pccl.master.issued.IssuedSet`) into the messages the members get: a new set for
every accepted member when the epoch changes outside a topology round, a member's table when it is
taken back, and the rows owed those holding the set (batched while the master is held).
"""

from __future__ import annotations

from .effects import Effect, Send
from .issued import IssuedSet
from .membership import Membership, Phase


class CredentialHandout:
    """The credential messages of one master.

    Args:
        issued: the set issued last and the rows owed its holders.
        members: the peer table and the ring (whose keys go into a set, and who holds one).
    """

    def __init__(self, issued: IssuedSet, members: Membership) -> None:
        self.issued = issued
        self.members = members

    def reissue(self, generation: int, epoch: int) -> list[Effect]:
        """A new set of ``(generation, epoch)`` for every accepted member (one message, encoded once)."""
        ring, peers = self.members.ring, self.members.peers
        full = self.issued.issue(generation, epoch, ((p, peers[p].public_key) for p in ring))
        return [Send(p, full) for p in ring]

    def on_return(self, peer_id: int, generation: int, epoch: int, now: float) -> list[Effect]:
        """The credentials after ``peer_id``'s ``Reregistered``, O(n).

        A set of this (generation, epoch) already issued: ``peer_id`` gets it, with every accepted
        member's row, and the members holding it get the rows it lacked (``peer_id``'s, as one shared
        message, at once without a batch delay, else by :meth:`due` / :meth:`overdue`), so connections
        between members work whoever returned first. Otherwise (a restarted master's first member back,
        or the rebuild moved to a newer epoch) every accepted member gets a new set.
        """
        if self.issued.serial != (generation, epoch):
            return self.reissue(generation, epoch)
        # Within one serial the ring grows only by re-registrations (a topology round or a new epoch
        # issues a new set), so the rows of the members back since are the only ones holders lack.
        mine, owed = self.issued.take_back(peer_id, self.members.peers[peer_id].public_key, now)
        effects: list[Effect] = [Send(peer_id, mine)]
        if owed and self.issued.delay <= 0:
            effects += self.pay()
        return effects

    def due(self, resumed: bool) -> list[Effect]:
        """The owed rows, if the master is not held (``resumed``). They are batched only while it is
        (rebuilding, its roll call: no vote completes, so no P2P connection is due); once votes
        complete, every member must hold them before a vote sends it to work with the others."""
        return self.pay() if self.issued.owed and resumed else []

    def pay(self) -> list[Effect]:
        """The owed rows of the set issued last, one message for every member holding it."""
        paid = self.issued.pay()
        if paid is None:
            return []
        rows, last = paid
        peers = self.members.peers
        return [Send(p, rows) for p in self.issued.members() if p != last and p in peers
                and peers[p].phase is not Phase.CONNECTED]

    def deadline(self) -> float | None:
        """When owed rows must go out (None: none is owed); :meth:`overdue` then sends them."""
        return self.issued.deadline()

    def overdue(self, now: float) -> list[Effect]:
        """The rows owed the holders once their delay ran out by ``now``: one message for each holder
        with the rows of every member taken back since the last one."""
        return self.pay() if self.issued.due(now) else []
