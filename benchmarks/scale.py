#!/usr/bin/env python3
"""All-reduce at many peers: the cost model's choice against today's ring, with virtual-network times.

usage: python benchmarks/scale.py [--peers 4,16,64,256] [--sizes 4K,1M,64M] [--links all]
                                  [--virtual-max-peers 16] [--virtual-max-bytes 1M] [--model-only]
                                  [--plans] [--no-measure]

``gain`` is ring / chosen: virtual times where both ran, the model's otherwise.

For every link kind (one-way latency 0.5 ms or 25 ms, 10 Gbit/s or 1 Gbit/s, every link alike),
world size and size it prints:

* ``ring model``: :func:`pccl.collectives.cost.predict` for today's ring, plus the one master round
  trip a collective costs on the speculative start (the vote goes out as the data plane starts,
  the confirmation comes back after it: ``2 x latency``; the timed all-reduce is the second of its
  tag, so it starts speculatively);
* ``ring virtual``: the same all-reduce run by the real stack (master, communicators, executor) with
  ``PeerConfig.schedule="ring"`` on :class:`pccl.testing.VirtualNetwork` under
  ``trio.testing.MockClock``: virtual seconds of the second all-reduce (the first warms caches and
  opens connections), and the wall seconds the simulation took - only for
  ``peers <= --virtual-max-peers`` and ``size <= --virtual-max-bytes`` (a 256-peer ring moves
  every byte 2 x 255 times through Python);
* ``chosen``: the schedule :func:`pccl.collectives.cost.choose` picks for the true links, its
  model time (with the same round trip), its plan timing (:func:`pccl.testing.plan_times`
  over the plans themselves) and its virtual time: the live stack again, with
  ``PeerConfig.schedule="auto"``, within the virtual limits above: the peers first run
  ``optimize_topology`` (the master measures every link's latency and bandwidth; ``measure`` is the
  virtual seconds that took) and then choose with :func:`pccl.collectives.cost.schedule_for` from
  the operation, the group size and the master's link summary: ``measured`` shows the summary's
  latency and slowest bandwidth, ``ran`` the schedule the peers ran and ``model (meas.)`` the
  model's prediction for it under the measured summary (plus the round trip), beside ``its
  virtual``; one simulation runs every size of a world (one measurement, a tag per size), so its
  wall seconds are printed on the first size's row (``^`` below). ``--no-measure`` skips the
  measurement (the peers then choose with the model's defaults: 0.5 ms, 1 Gbit/s). ``--plans``
  runs the chosen plans on :func:`pccl.testing.plan_exec.run_plan` instead (P2P pools only, no
  master, plus the round trip).

The model is given the virtual network's TCP window (4 MiB per connection, one connection), so
long fat links are capped at one window per round trip, as they are there.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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


@dataclass(frozen=True)
class Run:
    """One live run: the second all-reduce's virtual seconds, the wall seconds of the whole
    simulation, the schedule the peers ran, and (when they measured first) the master's link
    summary and the virtual seconds the measurement took."""

    virtual: float
    wall: float
    ran: str
    summary: tuple[float, ...] = ()
    measure: float = 0.0


async def _virtual_allreduce(
    n: int, sizes: list[int], link: Link, schedule: str, measure: bool
) -> list[tuple[float, str, tuple[float, ...], float]]:
    """Per size of ``sizes``: the virtual seconds of one all-reduce of that many bytes of float32
    on ``n`` peers (the second one, on a tag of its own) with ``PeerConfig.schedule = schedule``,
    the schedule the peers ran, and with ``measure`` the link summary the master sent after
    ``optimize_topology`` (run once, before the first size) and the virtual seconds it took."""
    net = VirtualNetwork(latency=link.latency, bandwidth=link.bandwidth)
    config = dataclasses.replace(DEFAULT_PEER_CONFIG, schedule=schedule)
    out: list[tuple[float, str, tuple[float, ...], float]] = []
    async with open_test_cluster(n, network=net, config=config) as cl:
        comms = cl.peers
        summary: tuple[float, ...] = ()
        took = 0.0
        if measure:
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                for c in comms:
                    nursery.start_soon(c.optimize_topology)
            took = trio.current_time() - t0
            summary = tuple(cl.master.state.link_summary([c.peer_id for c in comms]))
        for tag, nbytes in enumerate(sizes):
            count = nbytes // 4
            before = comms[0].statistics()
            t = 0.0
            for _ in range(2):
                xs = [np.full(count, i + 1, np.float32) for i in range(n)]
                t0 = trio.current_time()
                async with trio.open_nursery() as nursery:
                    for c, x in zip(comms, xs, strict=True):
                        nursery.start_soon(functools.partial(c.all_reduce, x, tag=tag))
                t = trio.current_time() - t0
                expect = n * (n + 1) / 2
                assert all((x == expect).all() for x in xs)
            stats = comms[0].statistics()
            key = "schedule_{}_ok"
            ran = [s for s in SCHEDULES if stats.get(key.format(s), 0) - before.get(key.format(s), 0) == 2]
            assert len(ran) == 1, stats
            out.append((t, ran[0], summary, took))
    return out


def virtual_allreduce(
    n: int, sizes: list[int], link: Link, schedule: str = "ring", measure: bool = False
) -> list[Run]:
    """One live simulation (:class:`Run` per size; ``wall``: the whole simulation's);
    ``measure``: ``optimize_topology`` first."""
    w0 = time.perf_counter()
    clock = trio.testing.MockClock(autojump_threshold=0)
    res = trio.run(_virtual_allreduce, n, sizes, link, schedule, measure, clock=clock)
    wall = time.perf_counter() - w0
    return [Run(t, wall, ran, summary, took) for t, ran, summary, took in res]


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
    ap.add_argument(
        "--no-measure", action="store_true",
        help="the live 'auto' run chooses with the model's defaults (no optimize_topology first)",
    )
    args = ap.parse_args(argv)
    # a 256-peer ring over 25 ms links runs for seconds of virtual time: no stall warnings
    logging.getLogger("pccl").setLevel(logging.ERROR)
    peers = [int(x) for x in args.peers.split(",")]
    sizes = [_size(x) for x in args.sizes.split(",")]
    names = list(LINKS) if args.links == "all" else args.links.split(",")
    unknown = [x for x in names if x not in LINKS]
    if unknown:
        ap.error(f"--links: unknown {', '.join(unknown)} (choose from {', '.join(sorted(LINKS))} or 'all')")
    links = [LINKS[x] for x in names]
    vmax_bytes = _size(args.virtual_max_bytes)
    head = (
        f"{'links':>10} {'peers':>5} {'size':>5} | {'ring model':>10} {'ring virtual':>12} {'(wall s)':>8} "
        f"| {'chosen':>6} {'its model':>9} {'its plans':>9} | {'measured':>16} {'measure':>8} {'ran':>4} "
        f"{'model (meas.)':>13} {'its virtual':>11} {'(wall s)':>8} | {'gain':>5}"
    )
    print(head)
    print("-" * len(head))
    for link in links:
        lm = LinkModel(latency=link.latency, default_bandwidth=link.bandwidth, window=WINDOW)
        control = 2 * link.latency  # one master round trip per collective (the speculative start)
        for n in peers:
            # the live "auto" runs: one simulation for every size of this world (one measurement)
            live_sizes = [] if args.model_only or args.plans or n > args.virtual_max_peers else [
                b for b in sizes if b <= vmax_bytes
            ]
            lives = dict(zip(live_sizes, virtual_allreduce(
                n, live_sizes, link, "auto", measure=not args.no_measure
            ) if live_sizes else [], strict=True))
            for nbytes in sizes:
                ring = predict("ring", "all_reduce", n, nbytes, lm, block_bytes=BLOCK) + control
                choice = choose("all_reduce", n, nbytes, lm, block_bytes=BLOCK)
                chosen = choice.predictions[choice.schedule] + control
                virt = wall = plans = cvirt = cwall = ran = measured = took = cmodel = "-"
                gain = ring / chosen
                if not args.model_only:
                    if n <= args.virtual_max_peers and nbytes <= vmax_bytes:
                        base = virtual_allreduce(n, [nbytes], link, "ring")[0]
                        v = base.virtual
                        virt, wall = f"{v * 1e3:.0f} ms", f"{base.wall:.1f}"
                        if args.plans:
                            cv, ran = v, "ring"
                            if choice.schedule != "ring":
                                cv, ran = virtual_plans(choice.schedule, n, nbytes, link) + control, "plan"
                        else:
                            # the live stack, PeerConfig.schedule="auto": what the peers choose
                            live = lives[nbytes]
                            cv, ran = live.virtual, live.ran
                            cwall = f"{live.wall:.1f}" if nbytes == live_sizes[0] else "^"
                            model = LinkModel.from_summary(list(live.summary))
                            if len(live.summary) == 3:
                                measured = f"{live.summary[2] * 1e3:.2f}ms {live.summary[0] / 1e6:.0f}MB/s"
                                took = f"{live.measure:.2f} s"
                            pred = predict(ran, "all_reduce", n, nbytes, model, block_bytes=BLOCK)
                            # the control plane at the latency the peers know of (the default without one)
                            cmodel = f"{(pred + 2 * (model or LinkModel()).alpha(0, 1)) * 1e3:.0f} ms"
                        cvirt = f"{cv * 1e3:.0f} ms"
                        gain = v / cv
                    plans = f"{(plan_time(choice.schedule, n, nbytes, link, lm) + control) * 1e3:.0f} ms"
                print(
                    f"{link.name:>10} {n:>5} {_fmt_size(nbytes):>5} | {ring * 1e3:>7.0f} ms {virt:>12} "
                    f"{wall:>8} | {choice.schedule:>6} {chosen * 1e3:>6.0f} ms {plans:>9} | {measured:>16} "
                    f"{took:>8} {ran:>4} {cmodel:>13} {cvirt:>11} {cwall:>8} | {gain:>4.1f}x",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
