"""pytest plugin for testing code that uses pccl (registered through the ``pytest11`` entry point).

Fixtures (async ones need pytest-trio, e.g. ``trio_mode = true``):

* ``pccl_master``: a master on 127.0.0.1 with an OS-chosen port, yielding its
  :class:`~pccl.master.server.MasterHandle` (``.connect_address`` for ``open_communicator``).
* ``pccl_fast_configs``: ``(MasterConfig, PeerConfig)`` with short heartbeats, for failure tests.
* ``pccl_network``: a fresh :class:`~pccl.testing.VirtualNetwork` (1 ms links, infinite bandwidth).
* ``pccl_cupy``: the cupy module, or the test is skipped (with the reason) when cupy is missing or
  sees no CUDA device; :func:`require_cupy` does the same inside a test body.
* ``pccl_wan``: a factory, ``wan = pccl_wan(n_hosts, default_spec, **options)``, returning a
  started :class:`~pccl.testing.wan.WanEmulator` (hosts in network namespaces joined by emulated
  WAN links), closed after the test; the test is skipped (with the reason) when the emulator cannot
  run here (it needs root, ``ip`` and ``/dev/net/tun``).
* ``pccl_cluster``: a factory, ``cluster = await pccl_cluster(n_peers, **options)``, returning a
  running :class:`~pccl.testing.TestCluster` on ``pccl_network`` (pass ``network=None`` for
  loopback TCP); options are those of :func:`~pccl.testing.open_test_cluster`. Every cluster is
  torn down after the test; an error escaping a task started with ``cluster.start_soon`` fails
  the test.

Virtual time: request pytest-trio's ``autojump_clock`` fixture in the test and the whole test,
fixtures included, runs on ``trio.testing.MockClock(autojump_threshold=0)``: heartbeat timeouts
and link latencies then cost no real time. Do not combine it with ``network=None`` (the kernel's
sockets do not follow a mock clock).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import trio

from .._config import MasterConfig, PeerConfig
from .cluster import TestCluster, open_test_cluster
from .network import VirtualNetwork

ClusterFactory = Callable[..., Awaitable[TestCluster]]
"""``await factory(n_peers, *, network=..., config=..., master_config=..., groups=..., pool_size=...)``."""

_DEFAULT: Any = object()


def require_cupy() -> Any:
    """Return the cupy module, or skip the calling test when cupy is missing or has no CUDA device."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("cupy sees no CUDA device")
    except Exception as exc:  # no driver, no device
        pytest.skip(f"cupy cannot use a CUDA device: {exc}")
    return cupy


@pytest.fixture
def pccl_cupy() -> Any:
    """cupy with a usable CUDA device, or the test is skipped (a fixture reports the skip's reason)."""
    return require_cupy()


@pytest.fixture
def pccl_fast_configs() -> tuple[MasterConfig, PeerConfig]:
    """Short heartbeat settings so eviction tests finish quickly (use with a MockClock for zero waiting)."""
    return (
        MasterConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0),
        PeerConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0, p2p_listen_host="127.0.0.1"),
    )


@pytest.fixture
async def pccl_master(pccl_fast_configs: tuple[MasterConfig, PeerConfig]) -> AsyncIterator[object]:
    """A running master on loopback (port chosen by the OS)."""
    from ..master.server import open_master

    async with open_master("127.0.0.1:0", config=pccl_fast_configs[0]) as master:
        yield master


@pytest.fixture
def pccl_network() -> VirtualNetwork:
    """A fresh virtual network: 1 ms one-way latency, infinite bandwidth, 4 MiB windows."""
    return VirtualNetwork(latency=0.001)


@pytest.fixture
async def pccl_cluster(pccl_network: VirtualNetwork) -> AsyncIterator[ClusterFactory]:
    """Factory of running test clusters, torn down after the test.

    ``cluster = await pccl_cluster(4)`` starts a master and 4 accepted peers on ``pccl_network``;
    ``await pccl_cluster(2, network=None)`` uses loopback TCP; any other keyword goes to
    :func:`~pccl.testing.open_test_cluster`.
    """
    async with trio.open_nursery() as nursery:

        async def serve(
            n_peers: int, options: dict[str, Any], *, task_status: trio.TaskStatus[TestCluster]
        ) -> None:
            async with open_test_cluster(n_peers, **options) as cluster:
                task_status.started(cluster)
                await trio.sleep_forever()

        async def factory(
            n_peers: int = 2, *, network: VirtualNetwork | None = _DEFAULT, **options: Any
        ) -> TestCluster:
            options["network"] = pccl_network if network is _DEFAULT else network
            cluster: TestCluster = await nursery.start(serve, n_peers, options)
            return cluster

        yield factory
        nursery.cancel_scope.cancel()


WanFactory = Callable[..., Any]
"""``factory(n_hosts, default=None, **options) -> WanEmulator`` (options of ``WanEmulator``)."""


@pytest.fixture
def pccl_wan() -> Iterator[WanFactory]:
    """Factory of started WAN emulators, closed after the test; skips the test when the emulator
    cannot run here (not root, no TUN device, no ``ip``)."""
    from .wan import WanEmulator, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    started: list[WanEmulator] = []

    def factory(n_hosts: int, default: Any = None, **options: Any) -> WanEmulator:
        wan = WanEmulator(n_hosts, default, **options).start()
        started.append(wan)
        return wan

    try:
        yield factory
    finally:
        for wan in started:
            wan.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop blocking-API masters a test left serving (``run()`` without ``interrupt()``).

    Such a master keeps a script alive until Ctrl-C, as in the established bindings; at the end of a test
    session it would make pytest wait forever instead of exiting, so it is stopped here, with a warning.
    """
    blocking = sys.modules.get("pccl.blocking")  # not imported: no blocking master can be serving
    if blocking is None:
        return
    leaked = blocking.stop_serving_masters()
    if leaked:
        line = f"pccl: stopped {len(leaked)} master(s) a test left serving: {', '.join(leaked)}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line, yellow=True)
        else:
            print(line, file=sys.stderr)
