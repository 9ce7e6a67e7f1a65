"""What a collective kind is (pure: no trio, no I/O): :class:`Kind`, the one object that carries a
kind's schedules (its plan builders), its cost under each, the sizes its buffers must have (the wire
descriptor's rules) and how its result is committed. The registry of kinds is
:mod:`pccl.collectives.kinds`; adding a kind is one module with a :class:`Kind` subclass and one line
there (docs/concepts.md "Collective kinds").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..linkmodel import LinkModel
from ..plan import SCHEDULES, Plan, check_plan_arguments


class Kind:
    """One collective kind. Subclasses set the class attributes and override the builders of the
    schedules they have and their costs; every method is pure and deterministic (every participant
    must compute the same plans from the same arguments).

    Attributes:
        name: the kind's name on the wire (``CollectiveDescriptor.kind``) and in statistics.
        reducing: ``op`` reduces (SUM, PROD, MIN, MAX; AVG runs as SUM and is divided at the commit).
        rooted: one rank is the root; the descriptor names it by peer id, plans take its ring index.
        quantizable: the ring may quantize its frames (its forwarding rule keeps the bits identical).
        exchange: two ranks' small operations under the ring may run the one-step exchange plan.
        sized_by_group: the buffers' layout depends on the group size (an operation commenced on a
            group of another size than the caller saw fails, the caller's buffers untouched).
        schedules: the schedules that have plans for this kind.
        fallback: a requested schedule without plans -> the schedule run instead.
    """

    name: str = ""
    reducing: bool = False
    rooted: bool = False
    quantizable: bool = False
    exchange: bool = False
    sized_by_group: bool = False
    schedules: tuple[str, ...] = SCHEDULES
    fallback: Mapping[str, str] = {}

    def __repr__(self) -> str:
        return f"<collective kind {self.name}>"

    # --- sizes and the descriptor ------------------------------------------------------------------

    def output_count(self, n: int, count: int) -> int:
        """Elements of the output array for an input of ``count`` elements on ``n`` ranks."""
        return count

    def size_problem(self, n: int, send_count: int, recv_count: int) -> str | None:
        """Why ``send`` and ``recv`` of these sizes cannot take part on a group of ``n``, or None."""
        if recv_count != self.output_count(n, send_count):
            return f"send has {send_count} elements but recv has {recv_count}"
        return None

    def plannable_count(self, n: int, count: int) -> int:
        """The nearest element count at most ``count`` that this kind can plan on ``n`` ranks (cost
        estimates price a byte count, which need not be one)."""
        return count

    def run_schedule(self, requested: str) -> str:
        """The schedule run for a request of ``requested`` (a schedule name, not "auto")."""
        return self.fallback.get(requested, requested)

    # --- plans ---------------------------------------------------------------------------------

    def ring_plan(self, n: int, rank: int, count: int, block_elems: int, root: int) -> Plan:
        """Rank ``rank``'s ring plan (arguments checked by the caller)."""
        raise ValueError(f"schedule 'ring' has no plan for {self.name!r}")

    def hd_plans(self, n: int, count: int, block_elems: int) -> tuple[Plan, ...]:
        """Every rank's halving-doubling plan."""
        raise ValueError(f"schedule 'hd' has no plan for {self.name!r}")

    def tree_plans(self, n: int, count: int, block_elems: int, root: int) -> tuple[Plan, ...]:
        """Every rank's binomial-tree plan."""
        raise ValueError(f"schedule 'tree' has no plan for {self.name!r}")

    def plans(self, schedule: str, n: int, count: int, block_elems: int, root: int) -> tuple[Plan, ...]:
        """Every rank's plan under ``schedule`` (index = ring index).

        Raises:
            ValueError: bad arguments, or a schedule without plans for this kind.
        """
        if schedule not in self.schedules:
            raise ValueError(f"schedule {schedule!r} has no plan for {self.name!r}")
        check_plan_arguments(n, 0, count, block_elems)
        if self.rooted and not 0 <= root < n:
            raise ValueError(f"{self.name} root {root} out of range for n={n}")
        if schedule == "ring":
            return tuple(self.ring_plan(n, r, count, block_elems, root) for r in range(n))
        if schedule == "hd":
            return self.hd_plans(n, count, block_elems)
        return self.tree_plans(n, count, block_elems, root)

    # --- cost ----------------------------------------------------------------------------------

    def ring_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        """Predicted seconds under the ring (``s``: bytes of each rank's input)."""
        raise ValueError(f"no ring cost for {self.name!r}")

    def hd_cost(self, n: int, s: float, lm: LinkModel) -> float:
        """Predicted seconds under halving-doubling."""
        raise ValueError(f"no hd cost for {self.name!r}")

    def tree_cost(self, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        """Predicted seconds under the binomial tree."""
        raise ValueError(f"no tree cost for {self.name!r}")

    def cost(self, schedule: str, n: int, s: float, lm: LinkModel, block_bytes: int, root: int) -> float:
        """Predicted seconds of the data plane under ``schedule`` (one of :attr:`schedules`)."""
        if schedule == "ring":
            return self.ring_cost(n, s, lm, block_bytes, root)
        if schedule == "hd":
            return self.hd_cost(n, s, lm)
        return self.tree_cost(n, s, lm, block_bytes, root)

    # --- the result ----------------------------------------------------------------------------

    def result_range(self, out_count: int, n: int, rank: int, root: int) -> tuple[int, int] | None:
        """The ``(start, end)`` of the output that the commit writes into the caller's ``recv`` on
        ring index ``rank`` (``root``: the root's ring index), or None: nothing (a non-root of a
        reduce)."""
        return 0, out_count


def root_rows(n: int, root: int) -> Sequence[int]:
    """Ring index of tree node ``v`` when the tree is rooted at ring index ``root``."""
    return [(v + root) % n for v in range(n)]


__all__ = ["Kind", "root_rows"]
