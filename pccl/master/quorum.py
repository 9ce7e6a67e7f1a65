"""The live quorum rule and the hold it imposes (docs/concepts.md "No split brain").

Pure (no trio, sockets or clocks: times are passed in). :class:`Quorum` knows the current epoch's
members (``base``), whether the rule applies (``mode`` and whether a peer can fail over), since when the
master is held for lack of a majority, and what a master that gave a run up, or holds none, still
remembers: the generation it dismissed, whether it is fresh, and the newcomers it accepted alone
(``provisional``: they yield to re-registering members).
"""

from __future__ import annotations

MODES = ("auto", "on", "off")


class Quorum:
    """Whether this master holds a majority of its epoch's members, and its hold clock.

    Args:
        mode: ``"auto"`` (the rule applies once a peer said it can fail over), ``"on"`` or ``"off"``
            (MasterConfig.quorum).
    """

    def __init__(self, mode: str = "auto") -> None:
        if mode not in MODES:
            raise ValueError(f"quorum must be 'auto', 'on' or 'off', not {mode!r}")
        self.mode = mode
        self.failover = False  # a peer said it can fail over to another master
        self._base: list[int] = []
        # How many of ``base`` the ring holds, counted for that ring list (rings are assigned, never
        # changed in place: the identity says when to recount).
        self._held: tuple[list[int] | None, int] = (None, 0)
        self.held_since: float | None = None  # None: not held
        self.dismissed_generation: int | None = None  # a run given up for lack of a quorum
        self.fresh = True  # holds no run it rebuilt or gave up (its lone newcomers are provisional)
        self.provisional: set[int] = set()  # newcomers accepted alone while holding no run
        self.yielding = False  # provisional newcomers are being kicked: accept nobody alone meanwhile

    @property
    def enforced(self) -> bool:
        """Whether the rule applies: ``mode == "on"``, or ``"auto"`` once a peer can fail over."""
        return self.mode == "on" or (self.mode == "auto" and self.failover)

    @property
    def base(self) -> list[int]:
        """The current epoch's members (ring order), whom the rule counts. Assign a new list."""
        return self._base

    @base.setter
    def base(self, value: list[int]) -> None:
        self._base = value
        self._held = (None, 0)

    def held_count(self, ring: list[int]) -> int:
        """How many of ``base`` are in ``ring`` (counted once per ring or base change, not per vote)."""
        got_ring, count = self._held
        if got_ring is not ring:
            count = len(set(ring) & set(self._base))
            self._held = (ring, count)
        return count

    def quorate(self, ring: list[int]) -> bool:
        """Whether ``ring`` holds more than half of the epoch's members (always, with none known)."""
        return not self._base or 2 * self.held_count(ring) > len(self._base)

    def ok(self, ring: list[int], rebuilding: bool) -> bool:
        """Not held for the quorum's sake: not rebuilding, and the rule holds or does not apply."""
        return not rebuilding and (not self.enforced or self.quorate(ring))

    def note(self, held: bool, now: float) -> str | None:
        """Follow a membership change: ``"held"`` when a hold starts now, ``"resumed"`` when one ends,
        else None."""
        if held and self.held_since is None:
            self.held_since = now
            return "held"
        if not held and self.held_since is not None:
            self.held_since = None
            return "resumed"
        return None

    def deadline(self, timeout: float) -> float | None:
        """When the current hold runs out of ``timeout`` (None: not held)."""
        return None if self.held_since is None else self.held_since + timeout

    def overdue(self, now: float, timeout: float) -> bool:
        """Whether the current hold lasted more than ``timeout`` seconds by ``now``."""
        return self.held_since is not None and now > self.held_since + timeout

    def give_up(self, generation: int) -> None:
        """The run of ``generation`` is given up: no members, no hold, its re-registrations refused."""
        self.base = []
        self.held_since = None
        self.dismissed_generation = generation
        self.fresh = True

    def start_rebuild(self, members: list[int], now: float) -> None:
        """A rebuild from re-registrations starts: ``members`` are the epoch's, held until a majority is
        back."""
        self.base = list(members)
        self.fresh = False
        self.held_since = now

    def alone(self, peer_id: int) -> None:
        """``peer_id`` was accepted alone (world of one): the epoch's only member; provisional at a master
        that holds no run."""
        self.base = [peer_id]
        if self.fresh:
            self.provisional = {peer_id}

    def only_provisional(self, ring: list[int]) -> bool:
        """Whether every accepted peer is a newcomer accepted alone while this master held no run."""
        provisional = self.provisional
        if not provisional:  # the usual case: no set built per re-registration
            return not ring
        return provisional.issuperset(ring)
