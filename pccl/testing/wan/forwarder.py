"""The WAN emulator's forwarder: one process moving packets between the hosts' TUN devices.

Run as ``python -m pccl.testing.wan.forwarder CONTROL_FD`` by :class:`~pccl.testing.wan.WanEmulator`
(root). It reads its setup as one JSON line from the control socket, enters every host's namespace
to create that host's TUN device (address, MTU, TSO), then loops: read bursts from the devices, ask
the :class:`~pccl.testing.wan.link.LinkModel` of the pair what becomes of each, keep the survivors in
a delay line (a heap ordered by delivery time) and write each into the destination's device when its
time comes. A ``timerfd`` wakes the loop at the exact delivery time (epoll alone has 1 ms
resolution). The process asks for real-time priority (``SCHED_FIFO``) so a busy machine delays it
less. Settings change through the control socket while it runs. When the control socket closes (the
owner exited or was killed) the forwarder deletes the namespaces and exits.
"""

from __future__ import annotations

import ctypes
import heapq
import json
import os
import random
import select
import socket
import subprocess
import sys
import time
from typing import Any

from .link import LinkModel, LinkSpec
from .netns import _libc, enter_netns, open_tun, remove_namespace
from .packet import cut_burst, parse_burst

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = 0o4000
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1
_READ_SIZE = 65536 + 256
_BATCH = 64


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Timer:
    """A CLOCK_MONOTONIC timerfd armed at absolute times (``time.monotonic`` uses the same clock)."""

    def __init__(self) -> None:
        fd = _libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self.fd: int = fd
        self.armed: float | None = None

    def arm(self, at: float | None) -> None:
        if at == self.armed:
            return
        spec = _Itimerspec()
        if at is not None:
            sec = int(at)
            spec.it_value.tv_sec = sec
            spec.it_value.tv_nsec = max(1, int((at - sec) * 1e9))
        if _libc.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime")
        self.armed = at

    def drain(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        self.armed = None


def _spec(d: dict[str, Any]) -> LinkSpec:
    return LinkSpec(**d)


class Forwarder:
    """The packet loop (see the module doc). ``hosts`` are ``(namespace, address)`` pairs."""

    def __init__(self, setup: dict[str, Any], control: socket.socket) -> None:
        self.control = control
        self.namespaces: list[str] = list(setup["namespaces"])
        self.addresses: list[str] = list(setup["addresses"])
        n = len(self.namespaces)
        self.seed = setup.get("seed")
        default = _spec(setup["default"])
        self.links: dict[tuple[int, int], LinkModel] = {}
        for i in range(n):
            for j in range(n):
                if i != j:
                    self.links[(i, j)] = LinkModel(default, rng=random.Random(self._seed_for(i, j)))
        for item in setup.get("links", []):
            self.links[(item["src"], item["dst"])].set_spec(_spec(item["spec"]))
        self.by_addr = {socket.inet_aton(a): i for i, a in enumerate(self.addresses)}
        self.fds: list[int] = []
        self.fd_host: dict[int, int] = {}
        self.heap: list[tuple[float, int, int, bytes]] = []
        self.seq = 0
        self.timer = _Timer()
        self.forwarded = 0
        self.max_lateness = 0.0
        self._buf = b""
        self._make_devices(setup.get("mtu", 1500), setup.get("prefix", 24), setup.get("device", "wan0"))

    def _seed_for(self, i: int, j: int) -> int | None:
        return None if self.seed is None else self.seed * 1000 + i * 37 + j

    def _make_devices(self, mtu: int, prefix: int, dev: str) -> None:
        home = f"/proc/{os.getpid()}/ns/net"
        home_fd = os.open(home, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for i, ns in enumerate(self.namespaces):
                enter_netns(f"/run/netns/{ns}")
                fd = open_tun(dev)
                self.fds.append(fd)
                self.fd_host[fd] = i
            if _libc.setns(home_fd, 0x40000000) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(home_fd)
        for ns, addr in zip(self.namespaces, self.addresses, strict=True):
            for cmd in (
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", dev, "mtu", str(mtu), "up"],
                ["ip", "-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", dev],
            ):
                subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def _control(self) -> bool:
        """Handle control lines; False when the owner is gone."""
        try:
            data = self.control.recv(65536)
        except BlockingIOError:
            return True
        if not data:
            return False
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            reply: dict[str, Any] = {"ok": True}
            op = msg.get("op")
            if op == "set":
                self.links[(msg["src"], msg["dst"])].set_spec(_spec(msg["spec"]))
            elif op == "share":
                # one model (one queue, one rate) for every listed direction: a shared uplink
                shared = LinkModel(_spec(msg["spec"]), rng=random.Random(self._seed_for(-1, len(self.links))))
                for src, dst in msg["pairs"]:
                    self.links[(src, dst)] = shared
            elif op == "stats":
                models = list(self.links.values())
                reply["links"] = [
                    {"src": i, "dst": j, "shared": sum(x is m for x in models) > 1, **vars(m.stats)}
                    for (i, j), m in sorted(self.links.items())
                ]
                reply["forwarded"] = self.forwarded
                reply["max_lateness_ms"] = self.max_lateness * 1000
                self.max_lateness = 0.0
            elif op == "quit":
                return False
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
            self.control.sendall(json.dumps(reply).encode() + b"\n")
        return True

    def _ingest(self, fd: int) -> None:
        src = self.fd_host[fd]
        for _ in range(_BATCH):
            try:
                frame = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                return
            now = time.monotonic()
            try:
                burst = parse_burst(frame)
            except ValueError:
                continue
            dst = self.by_addr.get(burst.dst)
            if dst is None or dst == src:
                continue
            adm = self.links[(src, dst)].offer(now, burst.segments, burst.wire_bytes)
            if adm.deliver_at is None:
                continue
            out_fd = self.fds[dst]
            for piece in cut_burst(frame, burst, adm.kept):
                self.seq += 1
                heapq.heappush(self.heap, (adm.deliver_at, self.seq, out_fd, piece))

    def _deliver(self) -> None:
        heap = self.heap
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            at, _seq, fd, frame = heapq.heappop(heap)
            late = now - at
            if late > self.max_lateness:
                self.max_lateness = late
            try:
                os.write(fd, frame)
                self.forwarded += 1
            except OSError:
                pass  # the destination's stack refused it: a drop, as on a real link

    def run(self) -> None:
        self.control.setblocking(False)
        ep = select.epoll()
        for fd in self.fds:
            ep.register(fd, select.EPOLLIN)
        ctl = self.control.fileno()
        ep.register(ctl, select.EPOLLIN)
        ep.register(self.timer.fd, select.EPOLLIN)
        self.control.sendall(b'{"ok": true, "ready": true}\n')
        while True:
            self.timer.arm(self.heap[0][0] if self.heap else None)
            events = ep.poll(-1)
            self._deliver()
            for fd, _ev in events:
                if fd == self.timer.fd:
                    self.timer.drain()
                elif fd == ctl:
                    if not self._control():
                        return
                else:
                    self._ingest(fd)
            self._deliver()

    def cleanup(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for ns in self.namespaces:
            remove_namespace(ns)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m pccl.testing.wan.forwarder CONTROL_FD``."""
    args = sys.argv[1:] if argv is None else argv
    control = socket.socket(fileno=int(args[0]))
    f = control.makefile("rb")
    setup = json.loads(f.readline())
    f.close()
    prio = int(setup.get("rt_priority", 0))
    if prio > 0:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(prio))
        except OSError:
            pass  # not allowed here: run at normal priority (fidelity suffers on a busy machine)
    fwd = None
    try:
        fwd = Forwarder(setup, control)
        fwd.run()
    except Exception as exc:
        try:
            control.sendall(json.dumps({"ok": False, "error": repr(exc)}).encode() + b"\n")
        except OSError:
            pass
        raise
    finally:
        if fwd is not None:
            fwd.cleanup()
        else:
            for ns in setup["namespaces"]:
                remove_namespace(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
