"""Frames taken out of their sender's release order: a receiver's evidence against a partner (issue 33;
docs/security.md "The plan rule").

The master's plan rule reads what a peer says it took from a partner as the first frames of that
partner's release order to it (an honest partner sends its frames in that order), and so knows which of
the peer's receives completed and what its plan then released. A partner that sends a later frame in
place of an earlier one (the same length: the bytes agree) has its receiver take it into that frame's
registered receive and wait for the earlier one: by its bytes the receiver would look like a holder of
sends it never released. The receiver knows better: at its stall testimony (no byte of its data plane
moved for at least half ``p2p_stall_timeout``) a frame of that partner taken whole while an earlier one
of its release order is still not is that partner's doing (frames striped over several connections may
arrive out of order, but a frame in flight does not stand still that long; one stuck in a link is a send
under way that its sender reports). It names such partners (``CollectiveDone.early``); the master does
not judge it as a holder in that operation and reads each as its accusation of the partner.

Pure: the plans and the set of frames that arrived in, the partners out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from ..collectives.plan import Plan


def release_order(plan: Plan) -> list[int]:
    """The plan's send indices in the order they are released: its initial sends, then those each
    receive unlocks, receive by receive."""
    out = list(plan.initial)
    for u in plan.unlocks:
        out.extend(u)
    return out


def early_partners(plan: Plan, rank: int, ring: Sequence[int], tag: int,
                   partner_plan: Callable[[int], Plan],
                   arrived: Collection[tuple[int, int, int]]) -> list[int]:
    """The partners (peer ids) one of whose frames to ring index ``rank`` (running ``plan``) arrived
    whole although an earlier one of its release order (its plan: ``partner_plan(q)``) did not.

    Args:
        plan: this peer's plan.
        rank: this peer's index in ``ring``.
        ring: the operation's peer ids in ring order.
        tag: the operation's tag.
        partner_plan: the plan of a ring index.
        arrived: the frames ``(peer id, tag, seq)`` taken whole (:meth:`OpIo.arrived
            <pccl.peer.op_io.OpIo.arrived>`).
    """
    if not arrived:
        return []
    got: dict[int, set[int]] = {}
    for peer, t, seq in arrived:
        if t == tag:
            got.setdefault(peer, set()).add(seq)
    out: list[int] = []
    for q in sorted({f.peer for f in plan.recvs}):
        if q == rank or not 0 <= q < len(ring):
            continue
        mine = got.get(ring[q])
        if not mine:
            continue
        qplan = partner_plan(q)
        missing = False
        for j in release_order(qplan):
            f = qplan.sends[j]
            if f.peer != rank:
                continue
            if f.seq not in mine:
                missing = True
            elif missing:
                out.append(ring[q])
                break
    return sorted(out)


__all__ = ["early_partners", "release_order"]
