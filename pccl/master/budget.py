"""The master's connection and memory budgets after the hello (pure: no trio, no sockets, no clock).

Issue 33 finding 8: the hello gate (:mod:`pccl.wire.admission`) bounds connections *in* their hello; once
past it (anyone passes without a secret; an insider passes with one) nothing bounded them: 716 heartbeating
connections used all 1024 descriptors and new peers could not join; 500 connections each with an unfinished
256 KiB frame added 218 MiB to the master. :class:`ConnectionBudget` decides, for every connection past its
hello that is not an accepted member (a *guest*: a newcomer waiting for admission, or a stranger), whether
it may stay:

* at most ``per_host`` guests from one source address;
* descriptors: a guest is admitted only while the connections open, those in their hello, the status
  page's, and a fixed reserve leave ``headroom`` descriptors free: as many as there are members (every one
  of them can reconnect at once), and at least :data:`MIN_HEADROOM`;
* a guest that claims the id of a member away from this master (its link broke; it re-registers) is
  exempt from the per-host cap (at most one connection holds an id), not from the descriptor limit itself.

:class:`FrameBudget` bounds the bytes of unfinished large frames (over :data:`LARGE_FRAME` bytes) that all
guests together may have the master buffer; a guest whose frame does not fit is kicked with the reason, and
each large frame must complete within the budget's ``deadline``. Members are not counted: each may have one
frame of at most its type's cap under way, and members are admitted by vote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Descriptors the master keeps for itself beyond its connections (listeners, logs, the event loop).
FD_RESERVE = 32
#: The least number of descriptors kept free for members whatever their number.
MIN_HEADROOM = 64
#: Default most guests from one source address.
DEFAULT_GUESTS_PER_HOST = 256
#: Frames larger than this count against the guests' frame budget (the cap of a message without lists).
LARGE_FRAME = 64 * 1024
#: Default bytes of unfinished large frames of all guests together.
DEFAULT_GUEST_FRAME_BYTES = 16 << 20
#: Default seconds a guest's large frame may take to arrive whole.
DEFAULT_FRAME_DEADLINE = 10.0


def descriptor_limit() -> int:
    """This process's soft limit on open descriptors (a large number where it cannot be read)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 1 << 20
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft > 0 else 1 << 20


@dataclass
class ConnectionBudget:
    """Who of the connections past their hello may stay (see the module docstring).

    Args:
        nofile: the descriptor limit (default: this process's soft ``RLIMIT_NOFILE``).
        per_host: most guests from one source address.
    """

    nofile: int = field(default_factory=descriptor_limit)
    per_host: int = DEFAULT_GUESTS_PER_HOST
    refused_total: int = 0

    def admit(self, host: str, *, open_fds: int, members: int, guests_from_host: int,
              away_claim: bool) -> str | None:
        """Whether a new guest from ``host`` may stay: None, or why not (then close it).

        Args:
            host: its source address.
            open_fds: descriptors the master's connections use now (members, guests, connections in
                their hello, the status page's), this one included.
            members: accepted members now.
            guests_from_host: other guests from ``host`` now.
            away_claim: its hello claims the id of a member away from this master.
        """
        headroom = 0 if away_claim else max(MIN_HEADROOM, members)
        reason = None
        if open_fds + FD_RESERVE + headroom > self.nofile:
            reason = (f"{open_fds} connections are open and {headroom} descriptors are kept for members "
                      f"(the descriptor limit is {self.nofile})")
        elif not away_claim and guests_from_host >= self.per_host:
            reason = (f"{guests_from_host} connections from {host} wait for admission "
                      f"(the cap per host is {self.per_host})")
        if reason is not None:
            self.refused_total += 1
        return reason


@dataclass
class FrameBudget:
    """Bytes of unfinished large frames the master buffers for guests (see the module docstring).

    Args:
        limit: the most bytes, all guests together.
        deadline: seconds a large frame of a guest may take to arrive whole.
    """

    limit: int = DEFAULT_GUEST_FRAME_BYTES
    deadline: float = DEFAULT_FRAME_DEADLINE
    used: int = 0
    peak: int = 0
    refused_total: int = 0

    def take(self, n: int) -> str | None:
        """Reserve ``n`` bytes for a frame under way, or say why not."""
        if self.used + n > self.limit:
            self.refused_total += 1
            return (f"a {n}-byte frame does not fit the master's budget for unfinished frames of peers "
                    f"not yet admitted ({self.used} of {self.limit} bytes in use)")
        self.used += n
        self.peak = max(self.peak, self.used)
        return None

    def give(self, n: int) -> None:
        """Release bytes reserved by :meth:`take`."""
        self.used = max(0, self.used - n)


__all__ = [
    "DEFAULT_FRAME_DEADLINE", "DEFAULT_GUESTS_PER_HOST", "DEFAULT_GUEST_FRAME_BYTES", "FD_RESERVE",
    "LARGE_FRAME", "MIN_HEADROOM", "ConnectionBudget", "FrameBudget", "descriptor_limit",
]
