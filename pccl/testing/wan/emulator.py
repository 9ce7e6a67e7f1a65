"""``WanEmulator``: N hosts (network namespaces) joined by emulated WAN links.

::

    with WanEmulator(2, LinkSpec(delay_ms=25, rate_mbit=1000)) as wan:
        server = wan.popen(1, [sys.executable, "server.py", wan.addresses[1]])
        ...
        wan.set_pair(0, 1, rtt_ms=100, rate_mbit=200)   # while it runs

Host ``i`` is namespace ``wan.namespaces[i]`` with address ``wan.addresses[i]`` (10.99.0.i+1/24) on a
TUN device ``wan0``; run a program there with ``ip netns exec NS ...`` (:meth:`command`,
:meth:`popen`). Every packet between two hosts crosses the forwarder (see
:mod:`pccl.testing.wan.forwarder`); traffic inside one host stays on its loopback.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from .link import LinkSpec
from .netns import namespace_name, remove_namespace, remove_stale, unavailable_reason

__all__ = ["WanEmulator", "WanUnavailable"]


class WanUnavailable(RuntimeError):
    """The emulator cannot run on this machine (not root, no TUN, no ``ip``)."""


class WanEmulator:
    """Hosts in network namespaces joined by emulated links (root only; see the module doc).

    Args:
        n_hosts: how many hosts (namespaces), 2..250.
        default: the settings of every direction not named in ``links``.
        links: ``{(src, dst): LinkSpec}`` for single directions.
        mtu: the MTU of every host's device.
        rt_priority: the forwarder's ``SCHED_FIFO`` priority (0: normal scheduling).
        seed: seeds the forwarder's loss and jitter draws (``None``: random).
        prefix: the namespaces' names start with it (``<prefix>-<pid>-<i>``; users sharing a machine
            may each take their own).
    """

    def __init__(
        self,
        n_hosts: int,
        default: LinkSpec | None = None,
        *,
        links: dict[tuple[int, int], LinkSpec] | None = None,
        mtu: int = 1500,
        rt_priority: int = 50,
        seed: int | None = None,
        prefix: str = "wan",
    ) -> None:
        if not 2 <= n_hosts <= 250:
            raise ValueError("n_hosts must be in 2..250")
        self.n_hosts = n_hosts
        self.default = default or LinkSpec()
        self._links = dict(links or {})
        for (i, j) in self._links:
            self._check_pair(i, j)
        self.mtu = mtu
        self.rt_priority = rt_priority
        self.seed = seed
        self.prefix = prefix
        self.namespaces = [namespace_name(os.getpid(), i, prefix) for i in range(n_hosts)]
        self.addresses = [f"10.99.0.{i + 1}" for i in range(n_hosts)]
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl: socket.socket | None = None
        self._rbuf = b""

    def _check_pair(self, i: int, j: int) -> None:
        if not (0 <= i < self.n_hosts and 0 <= j < self.n_hosts) or i == j:
            raise ValueError(f"no link {i} -> {j} among {self.n_hosts} hosts")

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> WanEmulator:
        """Create the namespaces and start the forwarder.

        Raises:
            WanUnavailable: not root, or no TUN / ``ip`` here.
            RuntimeError: the forwarder could not set the hosts up.
        """
        reason = unavailable_reason()
        if reason is not None:
            raise WanUnavailable(reason)
        if self._proc is not None:
            raise RuntimeError("already started")
        remove_stale(self.prefix)
        for ns in self.namespaces:
            remove_namespace(ns)  # a leftover of this very pid (a reused pid)
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
        atexit.register(self.close)
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pccl.testing.wan.forwarder", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env={**os.environ, "PYTHONPATH": _pythonpath()},
            )
        finally:
            theirs.close()
        self._ctl = ours
        setup = {
            "namespaces": self.namespaces,
            "addresses": self.addresses,
            "mtu": self.mtu,
            "prefix": 24,
            "default": asdict(self.default),
            "links": [{"src": i, "dst": j, "spec": asdict(s)} for (i, j), s in self._links.items()],
            "rt_priority": self.rt_priority,
            "seed": self.seed,
        }
        ours.sendall(json.dumps(setup).encode() + b"\n")
        reply = self._reply(timeout=60)
        if not reply.get("ready"):
            self.close()
            raise RuntimeError(f"the WAN forwarder did not start: {reply.get('error', reply)}")
        return self

    def close(self) -> None:
        """Stop the forwarder and delete the namespaces (idempotent)."""
        atexit.unregister(self.close)
        proc, ctl = self._proc, self._ctl
        self._proc = self._ctl = None
        if ctl is not None:
            try:
                ctl.sendall(b'{"op": "quit"}\n')
            except OSError:
                pass
            ctl.close()
        if proc is not None:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in self.namespaces:
            remove_namespace(ns)

    def __enter__(self) -> WanEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- control ------------------------------------------------------------------------------
    def _reply(self, timeout: float = 30) -> dict[str, Any]:
        assert self._ctl is not None
        self._ctl.settimeout(timeout)
        while b"\n" not in self._rbuf:
            data = self._ctl.recv(65536)
            if not data:
                raise RuntimeError("the WAN forwarder exited")
            self._rbuf += data
        line, self._rbuf = self._rbuf.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self._ctl is None:
            raise RuntimeError("the emulator is not running")
        self._ctl.sendall(json.dumps(msg).encode() + b"\n")
        reply = self._reply()
        if not reply.get("ok"):
            raise RuntimeError(f"WAN forwarder: {reply.get('error')}")
        return reply

    def set_link(self, src: int, dst: int, spec: LinkSpec) -> None:
        """Change the direction ``src -> dst`` (takes effect for the next packet)."""
        self._check_pair(src, dst)
        self._links[(src, dst)] = spec
        if self._ctl is not None:
            self._call({"op": "set", "src": src, "dst": dst, "spec": asdict(spec)})

    def share_link(self, pairs: list[tuple[int, int]], spec: LinkSpec) -> None:
        """Make the directions ``pairs`` share one link: one rate, one drop-tail queue, one delay
        (a site's uplink that several hosts' traffic crosses). A later :meth:`set_link` on one of
        them gives that direction a link of its own again."""
        for i, j in pairs:
            self._check_pair(i, j)
        if self._ctl is None:
            raise RuntimeError("share_link needs a running emulator (start() first)")
        self._call({"op": "share", "pairs": [list(p) for p in pairs], "spec": asdict(spec)})

    def set_sites(
        self,
        sites: list[int],
        *,
        rtt_ms: float,
        rate_mbit: float | None,
        site_rtt_ms: float = 1.0,
        site_rate_mbit: float | None = None,
        loss: float = 0.0,
    ) -> None:
        """Hosts in sites: host ``i`` is in site ``sites[i]``. Hosts of one site talk over their own
        links (``site_rtt_ms``, ``site_rate_mbit``); traffic from one site to another crosses one
        shared link per direction and pair of sites (``rtt_ms``, ``rate_mbit``, ``loss``)."""
        if len(sites) != self.n_hosts:
            raise ValueError(f"sites has {len(sites)} entries for {self.n_hosts} hosts")
        names = sorted(set(sites))
        for a in range(self.n_hosts):
            for b in range(a + 1, self.n_hosts):
                if sites[a] == sites[b]:
                    self.set_pair(a, b, rtt_ms=site_rtt_ms, rate_mbit=site_rate_mbit)
        spec = LinkSpec(delay_ms=rtt_ms / 2, rate_mbit=rate_mbit, loss=loss, rtt_ms=rtt_ms)
        for sa in names:
            for sb in names:
                if sa != sb:
                    pairs = [(i, j) for i in range(self.n_hosts) for j in range(self.n_hosts)
                             if sites[i] == sa and sites[j] == sb]
                    self.share_link(pairs, spec)

    def set_pair(
        self,
        a: int,
        b: int,
        *,
        rtt_ms: float,
        rate_mbit: float | None = None,
        loss: float = 0.0,
        jitter_ms: float = 0.0,
        queue_bytes: int | None = None,
    ) -> None:
        """Set both directions between ``a`` and ``b``: half the round trip each way, the same rate,
        loss, jitter and queue (default one bandwidth-delay product of ``rtt_ms``)."""
        spec = LinkSpec(
            delay_ms=rtt_ms / 2, jitter_ms=jitter_ms, rate_mbit=rate_mbit, queue_bytes=queue_bytes,
            loss=loss, rtt_ms=rtt_ms,
        )
        self.set_link(a, b, spec)
        self.set_link(b, a, spec)

    def set_all(self, **kwargs: Any) -> None:
        """:meth:`set_pair` for every pair of hosts."""
        for a in range(self.n_hosts):
            for b in range(a + 1, self.n_hosts):
                self.set_pair(a, b, **kwargs)

    def stats(self) -> dict[str, Any]:
        """The forwarder's counters: per direction (packets, segments, bytes, losses, queue drops),
        packets forwarded, and the worst lateness of a delivery since the last call (ms)."""
        return self._call({"op": "stats"})

    # -- running programs on a host ---------------------------------------------------------------
    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def popen(self, host: int, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``host`` (``subprocess.Popen`` keyword arguments pass through)."""
        env = kwargs.pop("env", None) or {**os.environ}
        env.setdefault("PYTHONPATH", _pythonpath())
        return subprocess.Popen(self.command(host, argv), env=env, **kwargs)


def _pythonpath() -> str:
    """A PYTHONPATH under which child interpreters import this very ``pccl``."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    old = os.environ.get("PYTHONPATH", "")
    return here if not old else f"{here}{os.pathsep}{old}"
