#!/usr/bin/env python3
"""Master CPU per message while a member holds thousands of collective votes open (issue 33 item 3).

usage: python benchmarks/open_votes.py [--votes 5000] [--members 3] [--messages 200] [--cap N]

One member of ``--members`` votes ``all_reduce`` on ``--votes`` tags nobody else calls (the cap,
``MasterConfig.max_open_votes``, is lifted: the worst case). With ``--cap N`` (the default cap is 256)
the votes are spread over as many members as the cap needs, each holding at most N. Then two honest
members send votes of their own and heartbeats (one votes, one does not: no deadlock). Each message is
timed (``time.process_time``, CPU of this process) through the path the server's reader runs for it:
``MasterState.handle``, then ``MasterServer._execute`` (sending, the status page's counters, and up to
this change the deadlock check over every open vote; since, marking the deadlock watch changed, O(1)).
The master's monitor (``MasterTimers.tick``: the vote timeout's deadline, the deadlock check, now
on this clock at most every ``DeadlockWatch.every`` seconds) and its stall log are timed apart.

It prints the worst and the median per message while the votes are opened and once they are open,
and the median of 5 monitor ticks (each with the deadlock check due) and of 5 stall logs. Run it in
two trees (before: ``git archive <base> | tar -x -C /tmp/base``,
``PYTHONPATH=/tmp/base python benchmarks/open_votes.py``) to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import trio
import trio.testing

from pccl import MasterConfig
from pccl.master.effects import Send
from pccl.master.server import MasterServer
from pccl.wire import messages as m

DESC = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)


def _members(server: MasterServer, n: int) -> list[int]:
    st, now = server.state, 0.0
    ids = []
    for _ in range(n):
        pid = st.new_connection("127.0.0.1", now)
        st.handle(pid, m.Register(p2p_port=40000 + pid, peer_group=0), now)
        ids.append(pid)
    eff = st.handle(ids[0], m.UpdateTopologyVote(), now)
    epoch = next(e.message.epoch for e in eff
                 if isinstance(e, Send) and isinstance(e.message, m.EstablishP2P))
    for p in ids:
        st.handle(p, m.P2PConnectionsDone(epoch=epoch, success=True), now)
    assert st.accepted() == ids, st.accepted()
    return ids


def _one(server: MasterServer, pid: int, msg: m.Message) -> float:
    """CPU of one message through the reader's path (see the module docstring)."""
    now = trio.current_time()
    t0 = time.process_time()
    effects = server.state.handle(pid, msg, now)
    watch: Any = server.deadlocks
    if watch is not None and hasattr(watch, "changed") and not isinstance(msg, m.Heartbeat):
        watch.changed(now)
    server._execute(effects)
    return time.process_time() - t0


async def _run(votes: int, members: int, messages: int, cap: int | None) -> dict[str, float]:
    server = MasterServer(config=MasterConfig(max_open_votes=cap, deadlock_grace=1.0))
    holders = 1 if cap is None else -(-votes // cap)
    ids = _members(server, max(members, holders + 2))
    hostile, honest = ids[:holders], ids[holders:]
    fill = [_one(server, hostile[t % holders], m.CollectiveInitiate(tag=1000 + t, descriptor=DESC))
            for t in range(votes)]
    after: list[float] = []
    for i in range(messages):
        # One honest member votes, another only heartbeats: no deadlock (that would fail every vote).
        msg: m.Message = m.Heartbeat() if i % 2 else m.CollectiveInitiate(tag=10 ** 6 + i, descriptor=DESC)
        after.append(_one(server, honest[-1] if i % 2 else honest[0], msg))
    await trio.sleep(1.0)  # past the deadlock check's interval and grace (virtual time)
    assert server.state.statistics()["collectives_voting"] >= votes, "the votes were failed"
    ticks, stalls = [], []
    for _ in range(5):  # the median of 5 (the first one due runs the deadlock check)
        watch: Any = server.deadlocks
        if hasattr(watch, "changed"):
            watch.changed(trio.current_time())  # as a message does (before: a check after each batch)
        await trio.sleep(0.3)
        t0 = time.process_time()
        for batch in server.timers.tick(trio.current_time()):
            server._execute(batch)
        ticks.append(time.process_time() - t0)
        t0 = time.process_time()
        server._log_stalls(trio.current_time() + 100.0, _board())
        stalls.append(time.process_time() - t0)
    tick, stall_log = statistics.median(ticks), statistics.median(stalls)
    return {"fill worst": max(fill), "fill median": statistics.median(fill), "fill total": sum(fill),
            "open worst": max(after), "open median": statistics.median(after), "tick": tick,
            "stall log": stall_log}


def _board() -> Any:
    from pccl._waits import WaitBoard

    return WaitBoard(first=1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--votes", type=int, default=5000)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--cap", type=int, default=None, help="max_open_votes (default: none)")
    args = ap.parse_args()
    clock = trio.testing.MockClock(autojump_threshold=0)
    res = trio.run(_run, args.votes, args.members, args.messages, args.cap, clock=clock)
    holders = "one" if args.cap is None else f"{-(-args.votes // args.cap)} (max_open_votes {args.cap})"
    print(f"{args.votes} open votes held by {holders} of the members (CPU ms)")
    for k, v in res.items():
        print(f"  {k:<12} {v * 1e3:10.3f}")


if __name__ == "__main__":
    main()
