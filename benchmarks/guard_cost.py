"""Per-message cost of the master's large-frame guard (issue 33): ``MessageStream.receive`` of 100k small
frames that arrive in 256 KiB reads, with the guard set (as on every master connection) and without,
interleaved over 5 rounds; prints the median and the least nanoseconds per message.

usage: python benchmarks/guard_cost.py
"""

from __future__ import annotations

import statistics
import time

import trio

from pccl.master.budget import LARGE_FRAME, FrameBudget
from pccl.wire import limits
from pccl.wire import messages as m
from pccl.wire.framing import encode_frame
from pccl.wire.stream import MessageStream, encode_message


class Guard:
    """The master's guard, as ``pccl.master.server`` builds it, for a peer not admitted yet."""

    threshold = LARGE_FRAME
    deadline = 10.0

    def __init__(self) -> None:
        self.budget = FrameBudget()

    def reserve(self, n: int) -> int | str:
        why = self.budget.take(n)
        return n if why is None else why

    def release(self, n: int) -> None:
        self.budget.give(n)


N = 100_000
frame = encode_frame(encode_message(m.CollectiveDone(tag=1, success=True, op_seq=5)))
blob = frame * N



class Source:
    """A stream that hands out ``blob`` in reads of the size asked."""

    def __init__(self) -> None:
        self.pos = 0

    async def receive_some(self, n: int) -> bytes:
        await trio.lowlevel.checkpoint()
        data = blob[self.pos : self.pos + n]
        self.pos += len(data)
        return data


async def run(guard: bool) -> float:
    ms = MessageStream(Source(), max_frame_size=1 << 24, limits=limits.master_inbound(1 << 24))  # type: ignore[arg-type]
    if guard:
        ms.set_guard(Guard())
    t = time.perf_counter()
    for _ in range(N):
        await ms.receive()
    return (time.perf_counter() - t) / N * 1e9



async def main() -> None:
    res: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(5):
        for g in (False, True):
            res[g].append(await run(g))
    for g in (False, True):
        print(f"guard={g}: median {statistics.median(res[g]):.0f} ns/message, min {min(res[g]):.0f}")


if __name__ == "__main__":
    trio.run(main)
