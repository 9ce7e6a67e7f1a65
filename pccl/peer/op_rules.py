"""The rules of one collective call on a peer (pure: no trio, no I/O): the tag, the descriptor it votes
with (checked against the peer's group and the kind's sizes before voting), and what stops a commenced
operation from running on the ring the master named. A part of :class:`pccl.peer.state.PeerState`; the
kinds' own rules are :mod:`pccl.collectives.kinds`'.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import InvalidArgumentError, PCCLError, RankConnectionLostError, TooFewPeersError
from .._types import DataType, QuantizationAlgorithm, QuantizationOptions, ReduceOp
from ..collectives.kinds import get_kind
from ..wire import messages as m


class CollectiveRules:
    """The collective-call rules of :class:`~pccl.peer.state.PeerState` (which provides ``group``,
    ``group_ring`` and ``check_tag_free``)."""

    group: int

    @property
    def group_ring(self) -> list[int]:
        raise NotImplementedError

    def check_tag_free(self, tag: int) -> None:
        raise NotImplementedError


    @staticmethod
    def check_tag(tag: object) -> None:
        """Raises InvalidArgumentError unless ``tag`` is a non-negative 63-bit integer."""
        if not isinstance(tag, int) or tag < 0 or tag >= 2**63:
            raise InvalidArgumentError(f"tag must be a non-negative 64-bit integer, got {tag!r}")

    def describe_collective(
        self,
        kind: str,
        *,
        tag: int,
        dtype: DataType,
        send_count: int,
        recv_count: int,
        op: ReduceOp,
        root: int = 0,
        quantization: QuantizationOptions | None = None,
        schedule: str = "auto",
    ) -> m.CollectiveDescriptor:
        """Check a collective call against this peer's group and build the descriptor it votes with.

        Checked before voting, so that the other peers are not dragged into a failed op.

        Args:
            kind: the name of a kind of :mod:`pccl.collectives.kinds` ("all_reduce", "reduce_scatter",
                "all_gather", "broadcast", "reduce", "all_to_all").
            tag: the operation's tag (see :meth:`check_tag`).
            dtype: the buffers' dtype (``send`` and ``recv`` agree).
            send_count: elements of ``send``.
            recv_count: elements of ``recv``.
            op: the reduction.
            root: rooted kinds (broadcast, reduce) only: the root's rank in this group's ring.
            quantization: optional wire compression.
            schedule: the requested schedule (``PeerConfig.schedule``): part of the descriptor, so a
                peer configured differently fails the vote with a clear mismatch instead of waiting
                for frames of another plan.

        Returns:
            The descriptor (a root as a peer id).

        Raises:
            InvalidArgumentError: an unknown kind, sizes that do not fit the kind or the group,
                quantization of something else than a floating-point all_reduce, a root out of range.
            InvalidUsageError: ``tag`` is already running here.
            TooFewPeersError: fewer than 2 peers in the group.
        """
        try:
            k = get_kind(kind)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        group = self.group_ring
        n = len(group)
        problem = k.size_problem(max(n, 1), send_count, recv_count)
        if problem is not None:
            raise InvalidArgumentError(problem)
        self.check_tag_free(tag)
        if n < 2:
            raise TooFewPeersError(
                f"{k.name} needs at least 2 accepted peers in peer group {self.group}, it has {n}; peers "
                "that connect() wait to be accepted until the accepted peers call update_topology() "
                "(are_peers_pending() tells whether any is waiting)"
            )
        q = quantization or QuantizationOptions(algorithm=QuantizationAlgorithm.NONE)
        if q.algorithm != QuantizationAlgorithm.NONE and (not k.exchange or not dtype.is_floating):
            # (the ring quantizes reduce_scatter too; the API offers it for all_reduce, whose kind
            # alone also has the two-rank exchange)
            raise InvalidArgumentError("quantization applies to floating-point all_reduce only")
        root_id = -1
        if k.rooted:
            if not 0 <= root < n:
                raise InvalidArgumentError(f"root rank {root} out of range for group size {n}")
            root_id = group[root]
        return m.CollectiveDescriptor(
            kind=k.name,
            dtype=int(dtype),
            element_count=send_count,
            op=int(op),
            root=root_id,
            quantization=int(q.algorithm),
            quantized_dtype=int(q.quantized_datatype),
            schedule=schedule,
        )

    @staticmethod
    def commence_problem(
        descriptor: m.CollectiveDescriptor, recv_count: int, ring: Sequence[int], called_n: int | None = None
    ) -> tuple[str, PCCLError] | None:
        """What stops a commenced op from running with the ring the master named, if anything.

        Args:
            descriptor: the op's descriptor.
            recv_count: elements of the caller's ``recv``.
            ring: the ring the op commenced on.
            called_n: the group size the caller saw when it called (None: not known).

        Returns:
            None, or ``(reason for CollectiveDone, error for the caller)``: a kind whose buffers are
            sized by the group (all_gather, all_to_all) on a group that changed size since the call
            checked them, or a rooted kind (broadcast, reduce) whose root is gone.
        """
        n = len(ring)
        k = get_kind(descriptor.kind)
        if k.sized_by_group:
            problem = k.size_problem(n, descriptor.element_count, recv_count)
            if problem is not None or (called_n is not None and n != called_n):
                sized = "" if called_n in (None, n) else f", not the {called_n} its buffers were sized for"
                detail = f" ({problem})" if problem else ""
                return "group size changed", InvalidArgumentError(
                    f"{k.name}: the group has {n} peers now{sized}{detail}"
                )
        if k.rooted and descriptor.root not in ring:
            return "root lost", RankConnectionLostError(
                f"{k.name} root peer {descriptor.root} is no longer in the group"
            )
        return None

    @staticmethod
    def root_position(descriptor: m.CollectiveDescriptor, ring: Sequence[int]) -> int:
        """The root's position in the ring the op commenced on (0 for kinds without a root).

        The descriptor names the root by peer id (equal on every participant: the master checked);
        the caller's ``root`` rank was of its own view of the group, which a member's loss the
        caller has not heard of yet shifts against that ring.

        Raises:
            ValueError: a rooted op whose root is not in ``ring`` (:meth:`commence_problem` says so
                first).
        """
        return ring.index(descriptor.root) if get_kind(descriptor.kind).rooted else 0



__all__ = ["CollectiveRules"]
