"""The master's open votes as objects (issue 32): one small object per open vote, each pure.

* :mod:`.base`: what every round shares: :class:`~.base.Expel` (the sender broke the protocol) and the
  vote's key.
* :mod:`.collective`: :class:`~.collective.CollectiveRound`, the vote and run of one collective
  (group, tag), with the reservations of the speculative start (:class:`~.collective.Reservations`),
  and :class:`~.collective.CollectiveVotes`, the open collective rounds of the run.
* :mod:`.topology`: :class:`~.topology.TopologyRound`, an update/optimize topology vote and its
  bandwidth measurement and P2P setup.
* :mod:`.sync`: :class:`~.sync.SyncRound`, a group's shared-state sync vote and run.

The are_peers_pending vote is :class:`pccl.master.votes.PendingRound`. Each round gets what it needs
from the master through a narrow context (a :class:`typing.Protocol` in its module) and returns effects
or decisions; :class:`~pccl.master.state.MasterState` keeps membership and routing, and walks the open
rounds in one loop (docs/master.md).
"""
