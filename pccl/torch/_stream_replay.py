"""A streaming DiLoCo newcomer's live heal that replays the rounds it missed (issue 35 item 4,
``replay_heals``; docs/concepts.md "Replaying the rounds missed", streaming).

The members admit the newcomer at a membership cycle's start ``c0`` (every exchange applied) and sync
revision ``r`` with it; with ``replay_heals`` its vote says it observes, so the master runs the heal live
and the members return at once and go on with cycle ``c0``. The newcomer then, without knowing ``c0`` yet
(it is in the state it fetches):

1. **observes**: takes part in every fragment's exchanges as a non-contributor (``_stream_contrib.py``:
   zeros flagged 0, the averages over the members only), one round in flight per fragment, the next
   launched as soon as the previous ended (the members' ``k``-th round of a fragment after the admission
   is the newcomer's ``k``-th: cycle ``c0 + k``), and keeps each round's average (a lost round: nothing,
   as at the members);
2. once it has revision ``r`` (complete, verified, applied whole) it knows ``c0`` and picks its *join
   point* ``P``: the first cycle start at which the members sync (every ``sync_every``-th cycle, the run's
   end) and that no round it launched lies beyond; it goes on observing until it has every round of the
   cycles before ``P`` (rounds it launched past the run's end are abandoned);
3. **replays** them on the snapshot, fragment by fragment in round order (a fragment's outer step touches
   its own parameters and their optimizer state only, so only each fragment's order matters), with the
   snapshot's optimizer state: the members' outer state at ``P``;
4. **joins**: its sync vote at the members' revision at ``P`` (``r`` plus the syncs they made since the
   admission), counted in their sync at ``P`` or answered at once if they made it already, where nothing
   moves; from there on it trains as a member.

Integer overlaps only: with ``"auto"`` the members sync only where someone is admitted, every
``check_every`` cycles and in the run's last cycle (the membership vote runs in the background, a round is
deferred past a ``check_every`` sync), so the join point would be up to ``check_every`` cycles away and
its vote would need a place in the background membership votes (docs/concepts.md).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from .._errors import PCCLError
from ._fragments import Fragment, choose_codecs
from ._ops import (
    Op,
    PollAllReduce,
    StartSync,
    SyncPlanned,
    WaitAllReduce,
    WaitAny,
    is_result,
    live_heal_result,
    sync_until_done,
)

# ``core`` below is a :class:`~pccl.torch._streaming.StreamingCore` (typed Any: that module calls this one)
StreamingCore = Any

#: What the members lose when a replaying newcomer whose heal failed closes its driver.
_MEMBERS_LOSE = "the members' rounds in flight, if any, lose it"

__all__ = ["heal_replaying"]


def syncs_between(core: StreamingCore, first: int, last: int) -> int:
    """The members' syncs at the cycle starts ``first + 1 .. last`` (integer overlap: every
    ``sync_every``-th, and the run's end)."""
    total = core.total_outer_steps
    return sum(1 for c in range(first + 1, last + 1)
               if c % core.sync_every == 0 or (total is not None and c >= total))


def join_point(core: StreamingCore, c0: int, launched: int) -> int:
    """The first cycle start ``>= c0 + launched`` at which the members sync (capped at the run's end)."""
    p = c0 + launched
    total = core.total_outer_steps
    while p % core.sync_every and (total is None or p < total):
        p += 1
    return p if total is None else min(p, total)


def heal_replaying(core: StreamingCore) -> Generator[Op, Any, Any]:
    """A newcomer's first sync with ``replay_heals`` (see the module); returns the sync info (bytes of the
    fetch and the join). An ordinary sync (or one refused) is returned as it is."""
    handle = yield StartSync(core.shared.state)
    healing = yield SyncPlanned(handle)
    if healing is None:  # an ordinary sync: as without replay
        try:
            return (yield WaitAllReduce(handle))
        except PCCLError as exc:
            if not is_result(exc, "RANK_CONNECTION_LOST"):
                raise
            return (yield from sync_until_done(core.shared.state))
    # (codec "auto": the members chose theirs at the admission's sync, same size)
    choose_codecs(core.fragments, core.budget_bytes, core.world_size, core.error_feedback)
    kept: list[tuple[Fragment, Any]] = []
    launched = {f.index: 0 for f in core.fragments}
    fetched: Any = None
    limit: int | None = None  # rounds per fragment up to the join point, once the snapshot is in
    core.contributing = False
    core.replay_queue = kept
    try:
        while True:
            for f in core.fragments:
                if not f.in_flight and (limit is None or launched[f.index] < limit):
                    yield from core._launch(f)
                    launched[f.index] += 1
            # the rounds in flight before the join point (its round index launched - 1 < limit)
            active = [f for f in core.fragments
                      if f.in_flight and (limit is None or launched[f.index] <= limit)]
            if fetched is not None and not active:
                break
            waiting = tuple(f.handle for f in active if f.handle is not None)
            if fetched is None:
                waiting += (handle,)
            if all(f.done is None for f in active):
                yield WaitAny(waiting)
            if fetched is None and (yield PollAllReduce(handle)):
                # raises if the heal failed: nothing applied
                fetched = yield from live_heal_result(handle, _MEMBERS_LOSE)
                c0 = core.cycle  # the snapshot's: the cycle the members admitted this peer at
                point = join_point(core, c0, max(launched.values()))
                limit = point - c0
                core.replay_point = (c0, point)
            for f in active:
                if f.done is None and not (yield PollAllReduce(f.handle)):
                    continue
                if f.stage == 1:
                    if not (yield from core._second_stage(f)):
                        f.rounds += 1  # lost in its first stage
                else:
                    core.drained_tx += yield from core._finish(f)  # (kept in core.replay_queue)
    finally:
        core.replay_queue = None
        core.contributing = True
    for f in core.fragments:  # rounds launched past the run's end: never answered, abandoned
        f.handle = f.done = f.server_proposed = None
        f.stage = f.round_tx = 0
        f.payload = f.gathered = None
    c0, point = core.replay_point
    for f, average in kept:  # fragment by fragment, each in round order: the members' outer state at P
        core._apply(f, average)
    core.rounds_replayed += len(kept)
    core.cycle_tensor[0] = point
    core.shared.revision = int(healing) + syncs_between(core, c0, point)
    joined = yield from sync_until_done(core.shared.state)
    return type(fetched)(tx_bytes=fetched.tx_bytes + joined.tx_bytes,
                         rx_bytes=fetched.rx_bytes + joined.rx_bytes)
