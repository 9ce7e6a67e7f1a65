"""Issue 33 item 6, "the same member cannot stall the run again and again": a peer evicted for liveness
(a newcomer that never takes part, a member that does not read) is remembered by source address and P2P
key (pccl/master/penalties.py). A rejoin is refused for a back-off that doubles per strike, then admitted
with half the grace per strike, and refused until the record expires after ``MAX_STRIKES``. The honest
loop's total stall from one identity is below ``2 * admission_grace``, however often it comes back.
Time is passed in (the core's clock)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pccl._errors import Result
from pccl.master.blame import StallBlame
from pccl.master.penalties import BASE, CAP, MAX_STRIKES, RepeatOffenders, identities
from pccl.master.state import Kick, MasterState
from pccl.wire import messages as m

from ._effects import sends

GRACE = 60.0
EVIL = "10.6.6.6"
EVIL_KEY = bytes(range(1, 33))
DESC = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)


class Run:
    """Two honest members and whoever joins, driven by hand; time passed in."""

    def __init__(self) -> None:
        self.st = MasterState()
        self.now = 0.0
        self.tag = 0
        a, b = self.register("10.0.0.1", bytes([7] * 32)), self.register("10.0.0.2", bytes([8] * 32))
        assert a is not None and b is not None
        self.a, self.b = a, b
        self.admit()

    def h(self, pid: int, msg: m.Message) -> list[Any]:
        return self.st.handle(pid, msg, self.now)

    def register(self, host: str, key: bytes) -> int | None:
        """A peer registers from ``host``; its id, or None when refused (``self.refusal`` says why)."""
        pid = self.st.new_connection(host, self.now)
        eff = self.h(pid, m.Register(p2p_port=40000 + pid, peer_group=0, public_key=key))
        kicks = [e for e in eff if isinstance(e, Kick)]
        if kicks:
            assert kicks[0].peer_id == pid and kicks[0].code == int(Result.KICKED)
            self.refusal = kicks[0].reason
            return None
        return pid

    def admit(self) -> None:
        """The members' update_topology admits everyone registered."""
        eff: list[Any] = []
        for p in self.st.accepted():
            eff += self.h(p, m.UpdateTopologyVote())
        for p, msg in sends(eff, m.EstablishP2P):
            self.h(p, m.P2PConnectionsDone(epoch=msg.epoch, success=True))

    def all_reduce(self, also: Sequence[int] = ()) -> float:
        """The members (and ``also``) call an all-reduce; the master's admission timer runs; the
        stall: how long the members waited for the go-ahead."""
        self.tag += 1
        start = self.now
        eff: list[Any] = []
        for p in [self.a, self.b, *also]:
            eff += self.h(p, m.CollectiveInitiate(tag=self.tag, descriptor=DESC))
        while not sends(eff, m.CollectiveCommence):
            deadline = self.st.admission_deadline(GRACE)
            assert deadline is not None, "the vote waits on nobody the admission timer covers"
            self.now = max(self.now, deadline)
            eff += self.st.admission_overdue(self.now, GRACE)
        stall = self.now - start
        for p, msg in sends(eff, m.CollectiveCommence):
            self.h(p, m.CollectiveDone(tag=self.tag, op_seq=msg.op_seq, success=True))
        return stall


def test_a_silent_newcomer_rejoining_again_and_again_stalls_the_loop_less_than_two_graces_in_all() -> None:
    run = Run()
    stall, admitted, refused = 0.0, 0, 0
    while run.now < CAP:  # it tries again every 10 s for an hour
        evil = run.register(EVIL, EVIL_KEY)
        if evil is None:
            refused += 1
            assert re.search(r"evicted \d+ time\(s\) for liveness .* retry in \d+s", run.refusal)
        else:
            admitted += 1
            run.admit()
            assert evil in run.st.accepted()
            stall += run.all_reduce()
            assert evil not in run.st.peers  # evicted, with its strike
        run.now += 10.0
        stall += run.all_reduce()  # an honest round: no stall
    assert admitted == MAX_STRIKES  # then refused until the record expires
    assert refused > 300
    assert stall < 2 * GRACE  # the stated bound: GRACE * (1 + 1/2 + ... + 2**-(MAX_STRIKES-1))
    assert stall == sum(GRACE * 2.0 ** -s for s in range(MAX_STRIKES))
    # Another key from the same address is the same offender; so is the same key from another address.
    assert run.register(EVIL, bytes([9] * 32)) is None
    assert run.register("10.7.7.7", EVIL_KEY) is None


def test_an_honest_newcomer_of_the_same_host_waits_out_the_backoff_then_joins_on_a_shorter_grace() -> None:
    run = Run()
    evil = run.register(EVIL, EVIL_KEY)
    assert evil is not None
    run.admit()
    assert run.all_reduce() == GRACE  # the first eviction costs the full grace
    evicted_at = run.now
    # An honest peer of the same host (another key): refused, told when to retry.
    assert run.register(EVIL, bytes([5] * 32)) is None
    assert f"retry in {BASE:.0f}s" in run.refusal and "host 10.6.6.6" in run.refusal
    # Another host is not affected.
    other = run.register("10.0.0.3", bytes([6] * 32))
    assert other is not None
    run.admit()
    assert run.all_reduce(also=[other]) == 0.0
    run.now = evicted_at + BASE
    honest = run.register(EVIL, bytes([5] * 32))
    assert honest is not None
    assert run.st.offenders.grace(honest, GRACE) == GRACE / 2
    run.admit()
    assert run.all_reduce(also=[other, honest]) == 0.0  # it takes part at once: a member like the others
    assert honest in run.st.accepted()
    run.now += 10.0
    assert run.all_reduce(also=[other, honest]) == 0.0


def test_backoff_grows_per_strike_is_capped_and_records_expire_and_are_bounded() -> None:
    o = RepeatOffenders(base=10.0, cap=100.0, max_strikes=4, size=3)
    keys = identities("h1", b"k" * 32)
    assert [o.backoff(s) for s in (1, 2, 3, 4, 9)] == [10.0, 20.0, 40.0, 100.0, 100.0]
    assert o.strike(keys, 0.0, "x") == 1
    assert o.refusal(1, keys, 9.0) is not None and o.refusal(1, keys, 10.0) is None
    assert o.grace(1, 8.0) == 4.0 and o.repeat(1)
    o.forget(1)
    assert o.grace(1, 8.0) == 8.0 and not o.repeat(1)
    assert o.strike(keys, 10.0, "x") == 2
    assert o.refusal(2, keys, 29.0) is not None and o.refusal(2, keys, 30.0) is None
    assert o.strike(keys, 110.0, "x") == 1  # 100 s after the last strike: forgotten, counting afresh
    # Bounded: the oldest strike is forgotten first (each peer here has two identities).
    o.strike(identities("h2", b""), 111.0, "y")
    o.strike(identities("h3", b""), 112.0, "z")
    assert len(o) == 3
    assert o.refusal(3, identities("h1", b""), 112.0) is None  # h1's host record went first
    assert o.refusal(4, identities("h3", b""), 112.0) is not None
    # refusal_of: the same answer, from the host and key a Register brings
    assert o.refusal_of(5, "h3", b"", 112.0) is not None and o.refusal_of(6, "h1", b"", 112.0) is None
    assert RepeatOffenders().refusal_of(7, "h3", b"", 112.0) is None  # nobody struck: no identities built


def test_after_max_strikes_refused_until_the_record_expires() -> None:
    o = RepeatOffenders(base=10.0, cap=100.0, max_strikes=2)
    keys = identities("h", b"")
    o.strike(keys, 0.0, "x")
    o.strike(keys, 10.0, "x")
    assert o.refusal(1, keys, 109.0) is not None and "retry in 1s" in (o.refusal(1, keys, 109.0) or "")
    assert o.refusal(1, keys, 110.0) is None and not o.repeat(1)  # expired: a fresh start


def test_a_member_evicted_as_a_non_reader_is_refused_then_removed_at_its_first_report() -> None:
    run = Run()
    st = run.st
    c = run.register("10.0.0.9", bytes([3] * 32))
    assert c is not None
    run.admit()
    run.all_reduce(also=[c])  # it took part: a member
    blame = StallBlame()
    members = set(st.ring)
    assert blame.report(run.a, c, run.now, members, repeat=st.offenders.repeat) == []
    gone = blame.report(run.a, c, run.now + 1, members, repeat=st.offenders.repeat)
    assert [p for p, _ in gone] == [c, run.a]
    for p, why in gone:
        st.evict_for_liveness(p, why, Result.KICKED, run.now + 1)
    assert st.accepted() == [run.b]
    run.now += 2
    assert run.register("10.0.0.9", bytes([3] * 32)) is None  # the non-reader: backed off
    assert "for liveness" in run.refusal
    run.now += BASE
    again = run.register("10.0.0.9", bytes([3] * 32))
    a2 = run.register("10.0.0.1", bytes([7] * 32))  # the accuser (honest, or a liar) backed off the same
    assert again is not None and a2 is not None
    run.a = a2
    run.admit()
    run.all_reduce(also=[again])
    # Back in the run, one report naming it removes it (a repeat offender).
    gone = blame.report(run.b, again, run.now, set(st.ring), repeat=st.offenders.repeat)
    assert [p for p, _ in gone] == [again, run.b] and "1 operation within" in gone[0][1]
