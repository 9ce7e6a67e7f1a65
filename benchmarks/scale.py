#!/usr/bin/env python3
"""All-reduce at many peers: the cost model's choice against today's ring, with virtual-network times.

usage: python benchmarks/scale.py [--peers 4,16,64,256] [--sizes 4K,1M,64M] [--links all]
                                  [--virtual-max-peers 16] [--virtual-max-bytes 1M] [--model-only]
                                  [--plans]

``gain`` is ring / chosen: virtual times where both ran, the model's otherwise.

For every link kind (one-way latency 0.5 ms or 25 ms, 10 Gbit/s or 1 Gbit/s, every link alike),
world size and size it prints:

* ``ring model``: :func:`pccl.collectives.cost.predict` for today's ring, plus the two master round
  trips every collective costs today (vote, then confirm: ``4 x latency``);
* ``ring virtual``: the same all-reduce run by the real stack (master, communicators, executor) with
  ``PeerConfig.schedule="ring"`` on :class:`pccl.testing.VirtualNetwork` under
  ``trio.testing.MockClock``: virtual seconds of the second all-reduce (the first warms caches and
  opens connections), and the wall seconds the simulation took - only for
  ``peers <= --virtual-max-peers`` and ``size <= --virtual-max-bytes`` (a 256-peer ring moves
  every byte 2 x 255 times through Python);
* ``chosen``: the schedule :func:`pccl.collectives.cost.choose` picks for the true links, its
  model time (with the same two round trips), its plan timing (:func:`pccl.testing.plan_times`
  over the plans themselves) and its virtual time: the live stack again, with
  ``PeerConfig.schedule="auto"`` (the peers choose with :func:`pccl.collectives.cost.schedule_for`
  from the operation and the group size alone, so ``ran`` may differ from ``chosen``: that one
  knows the true latency), within the virtual limits above. ``--plans`` runs the chosen plans on
  :func:`pccl.testing.plan_exec.run_plan` instead (P2P pools only, no master, plus the two round
  trips).

The model is given the virtual network's TCP window (4 MiB per connection, one connection), so
long fat links are capped at one window per round trip, as they are there.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import trio
import trio.testing

from pccl.collectives.cost import LinkModel, choose, predict
from pccl.collectives.schedule import SCHEDULES, all_plans
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster, plan_times
from pccl.testing.plan_exec import open_plan_pools

WINDOW = 4 << 20  # VirtualNetwork's default buffer_size, one connection per neighbour
BLOCK = 4 << 20  # the executor's DEFAULT_BLOCK_BYTES


@dataclass(frozen=True)
class Link:
    name: str
    latency: float
    bandwidth: float  # bytes/s


LINKS = {
    "lan10g": Link("0.5ms 10G", 0.0005, 1.25e9),
    "lan1g": Link("0.5ms 1G", 0.0005, 125e6),
    "wan10g": Link("25ms 10G", 0.025, 1.25e9),
    "wan1g": Link("25ms 1G", 0.025, 125e6),
}


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _fmt_size(n: int) -> str:
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


async def _virtual_allreduce(n: int, nbytes: int, link: Link, schedule: str) -> tuple[float, str]:
    """Virtual seconds of one all-reduce of ``nbytes`` float32 on ``n`` peers (the second one) with
    ``PeerConfig.schedule = schedule``, and the schedule the peers ran."""
    net = VirtualNetwork(latency=link.latency, bandwidth=link.bandwidth)
    count = nbytes // 4
    config = dataclasses.replace(DEFAULT_PEER_CONFIG, schedule=schedule)
    async with open_test_cluster(n, network=net, config=config) as cl:
        comms = cl.peers
        t = 0.0
        for _ in range(2):
            xs = [np.full(count, i + 1, np.float32) for i in range(n)]
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                for c, x in zip(comms, xs, strict=True):
                    nursery.start_soon(c.all_reduce, x)
            t = trio.current_time() - t0
            expect = n * (n + 1) / 2
            assert all((x == expect).all() for x in xs)
        stats = comms[0].statistics()
        ran = [s for s in SCHEDULES if stats.get(f"schedule_{s}_ok", 0) == 2]
        assert len(ran) == 1, stats
        return t, ran[0]


def virtual_allreduce(n: int, nbytes: int, link: Link, schedule: str = "ring") -> tuple[float, float, str]:
    """``(virtual seconds, wall seconds, schedule run)``."""
    w0 = time.perf_counter()
    clock = trio.testing.MockClock(autojump_threshold=0)
    t, ran = trio.run(_virtual_allreduce, n, nbytes, link, schedule, clock=clock)
    return t, time.perf_counter() - w0, ran


async def _virtual_plans(schedule: str, n: int, nbytes: int, link: Link) -> float:
    """Virtual seconds of one all-reduce under ``schedule`` over P2P pools (the second one)."""
    net = VirtualNetwork(latency=link.latency, bandwidth=link.bandwidth)
    hosts = [net.host(f"p{i}") for i in range(n)]
    count = nbytes // 4
    plans = all_plans(schedule, "all_reduce", n, count, BLOCK // 4)
    links = {(r, f.peer) for r, p in enumerate(plans) for f in p.sends}
    t = 0.0
    async with open_plan_pools(hosts, [h.address for h in hosts], links) as pp:
        for op_seq in (1, 2):
            xs = [np.full(count, i + 1, np.float32) for i in range(n)]
            outs = [np.empty(count, np.float32) for _ in range(n)]
            t0 = trio.current_time()
            await pp.run(plans, xs, outs, tag=0, op_seq=op_seq)
            t = trio.current_time() - t0
            assert all((o == n * (n + 1) / 2).all() for o in outs)
    return t


def virtual_plans(schedule: str, n: int, nbytes: int, link: Link) -> float:
    """Virtual seconds of :func:`_virtual_plans`."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(_virtual_plans, schedule, n, nbytes, link, clock=clock)


def plan_time(schedule: str, n: int, nbytes: int, link: Link, lm: LinkModel) -> float:
    plans = all_plans(schedule, "all_reduce", n, nbytes // 4, BLOCK // 4)
    return max(plan_times(plans, 4, lambda a, b: link.latency, lm.beta))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="4,16,64,256")
    ap.add_argument("--sizes", default="4K,1M,64M")
    ap.add_argument("--links", default="all", help=f"comma list of {sorted(LINKS)} or 'all'")
    ap.add_argument("--virtual-max-peers", type=int, default=16)
    ap.add_argument("--virtual-max-bytes", default="1M")
    ap.add_argument("--model-only", action="store_true", help="no virtual-network runs, no plan timing")
    ap.add_argument(
        "--plans", action="store_true",
        help="run the chosen schedule on plan_exec (pools only, no master) instead of the live stack",
    )
    args = ap.parse_args(argv)
    # a 256-peer ring over 25 ms links runs for seconds of virtual time: no stall warnings
    logging.getLogger("pccl").setLevel(logging.ERROR)
    peers = [int(x) for x in args.peers.split(",")]
    sizes = [_size(x) for x in args.sizes.split(",")]
    links = list(LINKS.values()) if args.links == "all" else [LINKS[x] for x in args.links.split(",")]
    vmax_bytes = _size(args.virtual_max_bytes)
    head = (
        f"{'links':>10} {'peers':>5} {'size':>5} | {'ring model':>10} {'ring virtual':>12} {'(wall s)':>8} "
        f"| {'chosen':>6} {'its model':>9} {'its plans':>9} {'its virtual':>11} {'(wall s)':>8} {'ran':>4} "
        f"| {'gain':>5}"
    )
    print(head)
    print("-" * len(head))
    for link in links:
        lm = LinkModel(latency=link.latency, default_bandwidth=link.bandwidth, window=WINDOW)
        control = 4 * link.latency  # two master round trips per collective today
        for n in peers:
            for nbytes in sizes:
                ring = predict("ring", "all_reduce", n, nbytes, lm, block_bytes=BLOCK) + control
                choice = choose("all_reduce", n, nbytes, lm, block_bytes=BLOCK)
                chosen = choice.predictions[choice.schedule] + control
                virt = wall = plans = cvirt = cwall = ran = "-"
                gain = ring / chosen
                if not args.model_only:
                    if n <= args.virtual_max_peers and nbytes <= vmax_bytes:
                        v, w, _ = virtual_allreduce(n, nbytes, link, "ring")
                        virt, wall = f"{v * 1e3:.0f} ms", f"{w:.1f}"
                        if args.plans:
                            cv, ran = v, "ring"
                            if choice.schedule != "ring":
                                cv, ran = virtual_plans(choice.schedule, n, nbytes, link) + control, "plan"
                        else:
                            # the live stack, PeerConfig.schedule="auto": what the peers choose
                            cv, cw, ran = virtual_allreduce(n, nbytes, link, "auto")
                            cwall = f"{cw:.1f}"
                        cvirt = f"{cv * 1e3:.0f} ms"
                        gain = v / cv
                    plans = f"{(plan_time(choice.schedule, n, nbytes, link, lm) + control) * 1e3:.0f} ms"
                print(
                    f"{link.name:>10} {n:>5} {_fmt_size(nbytes):>5} | {ring * 1e3:>7.0f} ms {virt:>12} "
                    f"{wall:>8} | {choice.schedule:>6} {chosen * 1e3:>6.0f} ms {plans:>9} {cvirt:>11} "
                    f"{cwall:>8} {ran:>4} | {gain:>4.1f}x",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
