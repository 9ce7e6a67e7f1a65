#!/usr/bin/env python3
"""Master CPU per control-plane round: the pure core (``MasterState.handle``) alone, no sockets.

usage: python benchmarks/control_plane.py [--worlds 16,64,256] [--repeats 5]

For each world size ``n`` it drives one :class:`~pccl.master.state.MasterState` message by message,
the way the server would, and times (``time.process_time``, CPU of this process) each kind of round:

* join: ``n - 1`` peers register while one is accepted, then one update-topology round admits them
  all (the accepted peer's vote, ``EstablishP2P`` to everyone, every peer's ``P2PConnectionsDone``);
* update: an update-topology round with no newcomers (``n`` votes, ``n`` confirmations); since
  protocol 5 its P2P credentials are one table of ``n`` public keys, the same message for every member;
* update+encode: the same round with every message the master sends encoded as the server would (the
  shared credential table is encoded once, the ``n`` ``EstablishP2P`` each carry the ``n``-row peer table);
* rebuild: ``n`` members re-register at a fresh master (a restarted master's rebuild; ``Reregister``
  and every answer: ``Reregistered``, the P2P credentials), as the server runs it: the rows of the
  members back go to the members holding the set in batches while the master is held
  (``MasterConfig.credentials_batch_delay``; here the roll call holds it until the last return, which
  sends the one batch);
* rebuild unbatched: the same with the rows sent at each return (delay 0), as before batching:
  ``n (n - 1) / 2`` messages. Before the reported rings were kept by distinct ring
  (pccl/master/reported.py) and the ring and the credential table grew by insertion, every return
  also walked every member back in Python: 68 ms at 256 members, 980 ms at 1024;
* pending: a peers-pending vote round (``n`` votes);
* collective: one collective's vote round (``n`` ``CollectiveInitiate``) and its completion
  (``n`` ``CollectiveDone``);
* +encode: the same collective round with every message the master sends encoded as the server
  would (``wire.stream.encode_message``): on this slow path the ``n`` ``CollectiveCommence`` each carry
  the ``n``-row peer table, O(n^2) bytes per round, but they are one shared object, encoded once;
* fast / fast+encode: a collective round on the speculative start (issue 21 item 3: every peer votes
  with the op_seq the tag's last ``CollectiveComplete`` reserved): no table is sent, the master answers
  each peer with the ``CollectiveComplete`` (and, for an operation still running after
  ``MasterConfig.speculative_go_delay``, a tableless ``CollectiveCommence``; this pure-core round sends
  it at once), O(n) bytes per round;
* update+checks, collective+checks, fast+checks: the same rounds with what the server runs after
  every message besides sending (``MasterServer._execute``): the deadlock watch
  (``pccl.master.deadlock.DeadlockWatch``: since issue 33 item 3 marked changed, its check polled on the
  timers' clock, at most every ``DeadlockWatch.every`` seconds) and the next rejoin deadline. Before
  the deadlock check's bound from the open votes' sizes (``MasterState.deadlock_candidates``) it built
  the set of voters after every message, which made each vote round O(n^2) (6.2 ms at 256 peers, 64 ms
  at 1024).

It prints the median over ``--repeats`` rounds, the cost per message received and the messages the
master sends in the round; O(n) rounds keep the cost per message flat as ``n`` grows. Target (issue
21): one vote round at 256 peers <= 50 ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from pccl import MasterConfig
from pccl.master.deadlock import DeadlockWatch
from pccl.master.state import MasterState, Send
from pccl.wire import messages as m

try:  # as the server's streams encode (a message sent to many peers, encoded once); older trees: plain
    from pccl.wire.stream import encode_message as _encode
except ImportError:  # pragma: no cover - measuring an older tree
    _encode = m.encode

_DESCRIPTOR = m.CollectiveDescriptor("all_reduce", 6, 1024, 0, -1, 0, 0)
# Peers register an X25519 public key since protocol 5 (32 bytes; the master only relays it). Trees
# before it have no such field: then none is sent.
_KEYED = "public_key" in getattr(m.Register, "__dataclass_fields__", {})


def _key(pid: int) -> dict[str, Any]:  # keyword arguments, by protocol version
    return {"public_key": pid.to_bytes(32, "big")} if _KEYED else {}


def _sends(effects: list[Any], cls: type) -> list[tuple[int, Any]]:
    return [(e.peer_id, e.message) for e in effects if isinstance(e, Send) and isinstance(e.message, cls)]


class Driver:
    """One master state and its scripted peers."""

    def __init__(self) -> None:
        self.st = MasterState()
        self.now = 0.0
        self.ids: list[int] = []
        self.reserved: dict[int, int] = {}  # tag -> the op_seq its last round reserved

    encode = False
    watch: DeadlockWatch | None = None  # set: also run the server's checks after every message

    sends = 0  # Send effects so far

    def h(self, pid: int, msg: m.Message) -> list[Any]:
        self.now += 1e-6
        effects = self.st.handle(pid, msg, self.now)
        self.sends += sum(1 for e in effects if isinstance(e, Send))
        if self.encode:
            for e in effects:
                if isinstance(e, Send):
                    _encode(e.message)
        if self.watch is not None:
            # Since issue 33 item 3 the server marks the watch changed after a message and the check
            # runs on the timers' clock (at most every DeadlockWatch.every seconds): poll it as they do.
            if hasattr(self.watch, "changed"):
                self.watch.changed(self.now)
                failed = self.watch.poll(self.st, self.now)
            else:
                failed = self.watch.check(self.st, self.now)
            assert not failed, "a deadlock in a benchmark round"
            self.watch.deadline()
            self.st.rejoin_deadline()
        return effects

    def register(self, count: int) -> list[int]:
        new = []
        for _ in range(count):
            pid = self.st.new_connection("10.0.0.1", self.now)
            self.h(pid, m.Register(p2p_port=40000 + pid % 20000, **_key(pid)))
            new.append(pid)
        return new

    def update_round(self) -> None:
        eff: list[Any] = []
        for p in self.st.accepted():
            eff += self.h(p, m.UpdateTopologyVote())
        for pid, msg in _sends(eff, m.EstablishP2P):
            self.h(pid, m.P2PConnectionsDone(epoch=msg.epoch, success=True))

    def pending_round(self) -> None:
        for p in self.st.accepted():
            self.h(p, m.PeersPendingVote())

    def collective_round(self, tag: int) -> None:
        for p in self.st.accepted():
            self.h(p, m.CollectiveInitiate(tag=tag, descriptor=_DESCRIPTOR))
        eff: list[Any] = []
        for p in self.st.accepted():
            eff += self.h(p, m.CollectiveDone(tag=tag, success=True))
        self._reserve(tag, eff)

    def fast_round(self, tag: int) -> None:
        """A round on the speculative start (the tag's reserved op_seq, from its last round)."""
        seq = self.reserved[tag]
        for p in self.st.accepted():
            self.h(p, m.CollectiveInitiate(tag=tag, descriptor=_DESCRIPTOR, op_seq=seq))
        eff: list[Any] = []
        for p in self.st.accepted():
            eff += self.h(p, m.CollectiveDone(tag=tag, success=True, op_seq=seq))
        self._reserve(tag, eff)

    def _reserve(self, tag: int, effects: list[Any]) -> None:
        complete = _sends(effects, m.CollectiveComplete)
        assert complete, "the round did not complete"
        self.reserved[tag] = complete[0][1].next_op_seq


def _join(n: int) -> tuple[Driver, float]:
    d = Driver()
    d.register(1)
    t0 = time.process_time()
    d.register(n - 1)
    d.update_round()
    dt = time.process_time() - t0
    assert len(d.st.accepted()) == n, d.st.statistics()
    return d, dt


def _rebuild(n: int, delay: float | None) -> tuple[float, int]:
    """CPU seconds and messages sent for ``n`` re-registrations, credential rows batched over ``delay``
    seconds (None: the server's default; a tree without batching sends them at each return)."""
    cfg = MasterConfig()
    if delay is None:
        delay = getattr(cfg, "credentials_batch_delay", 0.0)
    # As the server builds it: the roll call holds the votes until every member is back (rows are
    # batched only while the master is held).
    kwargs: dict[str, Any] = {"rebuild_grace": cfg.rebuild_grace, "rebuild_quiet": cfg.rebuild_quiet}
    if delay > 0:
        kwargs["credentials_delay"] = delay
    st = MasterState(**kwargs)
    ring = list(range(1, n + 1))
    sends = 0
    t0 = time.process_time()
    for p in ring:
        got = st.new_connection("10.0.0.1", 0.0, claim=p)
        msg = m.Reregister(peer_id=p, p2p_port=40000 + p, peer_group=0, epoch=7, ring=ring, revision=-1,
                           generation=1, **_key(p))
        sends += sum(1 for e in st.handle(got, msg, 0.0) if isinstance(e, Send))
    if delay > 0:
        sends += sum(1 for e in st.credentials_overdue(delay) if isinstance(e, Send))
    dt = time.process_time() - t0
    assert len(st.accepted()) == n, st.statistics()
    return dt, sends


class _Timer:
    """Times rounds of one driver: the median CPU seconds of ``repeats`` runs, and the messages the
    master sent per run."""

    def __init__(self, d: Driver, repeats: int) -> None:
        self.d = d
        self.repeats = repeats

    def __call__(self, fn: Callable[[], None]) -> tuple[float, int]:
        times, sends = [], []
        for _ in range(self.repeats):
            before = self.d.sends
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
            sends.append(self.d.sends - before)
        return statistics.median(times), sends[-1]


def measure(n: int, repeats: int) -> dict[str, tuple[float, int]]:
    """Median CPU seconds per round of each kind at world size ``n``, and the messages it sends."""
    joins = []
    d = Driver()
    for _ in range(repeats):
        d, dt = _join(n)
        joins.append(dt)
    out = {"join": (statistics.median(joins), d.sends)}
    timed = _Timer(d, repeats)
    out["update"] = timed(d.update_round)
    d.encode = True
    out["update+encode"] = timed(d.update_round)
    d.encode = False
    for kind, delay in (("rebuild", None), ("rebuild unbatched", 0.0)):
        runs = [_rebuild(n, delay) for _ in range(repeats)]
        out[kind] = (statistics.median(t for t, _ in runs), runs[-1][1])
    out["pending"] = timed(d.pending_round)
    tags = iter(range(1, 1 << 30))
    out["collective"] = timed(lambda: d.collective_round(next(tags)))
    d.encode = True
    out["+encode"] = timed(lambda: d.collective_round(next(tags)))
    d.encode = False
    fast_tag = next(tags)
    d.collective_round(fast_tag)  # reserves the tag's first speculative op_seq
    out["fast"] = timed(lambda: d.fast_round(fast_tag))
    d.encode = True
    out["fast+encode"] = timed(lambda: d.fast_round(fast_tag))
    d.watch = DeadlockWatch(grace=1.0)
    out["update+checks"] = timed(d.update_round)
    out["collective+checks"] = timed(lambda: d.collective_round(next(tags)))
    d.collective_round(fast_tag)  # the update round voided the tag's reservation: reserve it again
    out["fast+checks"] = timed(lambda: d.fast_round(fast_tag))
    d.watch = None
    assert d.st.statistics()["collectives_running"] == 0
    assert d.st.statistics()["collectives_fast"] == 3 * repeats
    return out


# messages per round, to print a cost per message
_MESSAGES = {"join": lambda n: 2 * n - 1, "update": lambda n: 2 * n, "update+encode": lambda n: 2 * n,
             "rebuild": lambda n: n, "rebuild unbatched": lambda n: n, "pending": lambda n: n,
             "collective": lambda n: 2 * n, "+encode": lambda n: 2 * n, "fast": lambda n: 2 * n,
             "fast+encode": lambda n: 2 * n, "update+checks": lambda n: 2 * n,
             "collective+checks": lambda n: 2 * n, "fast+checks": lambda n: 2 * n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    worlds = [int(x) for x in args.worlds.split(",")]
    print(f"{'peers':>6} {'round':>17} {'master CPU ms':>14} {'us/message':>11} {'sent':>8}")
    for n in worlds:
        res = measure(n, args.repeats)
        for kind, (secs, sent) in res.items():
            per = secs / _MESSAGES[kind](n) * 1e6
            print(f"{n:>6} {kind:>17} {secs * 1e3:>14.2f} {per:>11.1f} {sent:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
