#!/usr/bin/env python3
"""Master CPU per message while a member holds thousands of collective votes open (issue 33 item 3).

usage: python benchmarks/open_votes.py [--votes 5000] [--members 3] [--messages 200]

One member of ``--members`` votes ``all_reduce`` on ``--votes`` tags nobody else calls (the cap,
``MasterConfig.max_open_votes``, is lifted: the worst case; with the default cap of 256 the same count
takes 20 members). Then the honest members send heartbeats and votes of their own. Each message is
timed (``time.process_time``, CPU of this process) through the path the server's reader runs for it:
``MasterState.handle``, then ``MasterServer._execute`` (sending, the status page's counters, and up to
this change the deadlock check over every open vote; since, marking the deadlock watch changed, O(1)).
The master's monitor (``MasterTimers.tick``: the vote timeout's deadline, the deadlock check, now
on this clock at most every ``DeadlockWatch.every`` seconds) and its stall log are timed apart.

It prints the worst and the median per message while the votes are opened and once they are open,
and one monitor tick. Run it in two trees (before: ``git archive <base> | tar -x -C /tmp/base``,
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


async def _run(votes: int, members: int, messages: int) -> dict[str, float]:
    server = MasterServer(config=MasterConfig(max_open_votes=None, deadlock_grace=1.0))
    ids = _members(server, members)
    hostile, honest = ids[0], ids[1:]
    fill = [_one(server, hostile, m.CollectiveInitiate(tag=1000 + t, descriptor=DESC)) for t in range(votes)]
    after: list[float] = []
    for i in range(messages):
        p = honest[i % len(honest)]
        msg: m.Message = m.Heartbeat() if i % 2 else m.CollectiveInitiate(tag=10 ** 6 + i, descriptor=DESC)
        after.append(_one(server, p, msg))
    await trio.sleep(1.0)  # past the deadlock check's interval and grace (virtual time)
    t0 = time.process_time()
    for batch in server.timers.tick(trio.current_time()):
        server._execute(batch)
    tick = time.process_time() - t0
    t0 = time.process_time()
    server._log_stalls(trio.current_time() + 100.0, _board())
    stalls = time.process_time() - t0
    return {"fill worst": max(fill), "fill median": statistics.median(fill), "fill total": sum(fill),
            "open worst": max(after), "open median": statistics.median(after), "tick": tick,
            "stall log": stalls}


def _board() -> Any:
    from pccl._waits import WaitBoard

    return WaitBoard(first=1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--votes", type=int, default=5000)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--messages", type=int, default=200)
    args = ap.parse_args()
    clock = trio.testing.MockClock(autojump_threshold=0)
    res = trio.run(_run, args.votes, args.members, args.messages, clock=clock)
    print(f"{args.votes} open votes held by one of {args.members} members (CPU ms)")
    for k, v in res.items():
        print(f"  {k:<12} {v * 1e3:10.3f}")


if __name__ == "__main__":
    main()
