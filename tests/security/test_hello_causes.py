"""Every failed hello says why, on the peer and in the master's log (issue 37, items 2 and 3): another
run (both names, both sides), a bad secret (the master's log names it, and it is not retried), a
listener that never answers (who was silent), a listener that is no pccl master (HTTP), an HTTP client
at the master's port. On the virtual network under a MockClock; the run-name rules are in
docs/concepts.md "Run names"."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import trio
import trio.testing

from pccl._config import PeerConfig
from pccl._errors import HelloRefusedError, MasterConnectionError
from pccl.peer.communicator import open_communicator
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, VirtualNetwork
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.wire import messages as m
from pccl.wire.handshake import offer_hello
from pccl.wire.hello import check_run
from pccl.wire.stream import MessageStream

from ._helpers import exact_all_reduces, hostile, master_port


async def failed_join(network: VirtualNetwork, address: str, config: PeerConfig,
                      name: str = "other") -> MasterConnectionError:
    """Open a communicator from a new host; it must fail. Its error."""
    host = network.host(name)
    cfg = dataclasses.replace(config, p2p_listen_host=host.address)
    with pytest.raises(MasterConnectionError) as info:
        async with open_communicator(address, config=cfg, transport=host):
            pass
    return info.value


def test_run_rule() -> None:
    assert check_run("", "") is None
    assert check_run("a", "") is None  # a peer without a name joins any master
    assert check_run("", "a") is None  # a master without a name takes the peer's
    assert check_run("a", "a") is None
    reason = check_run("train-1", "eval-7")
    assert reason is not None
    assert "'eval-7'" in reason and "'train-1'" in reason and reason.startswith("other run")


def test_run_names_are_checked() -> None:
    with pytest.raises(ValueError, match=r"PeerConfig\.run"):
        PeerConfig(run="has space")
    with pytest.raises(ValueError, match=r"PeerConfig\.run"):
        PeerConfig(run="x" * 65)


async def test_a_peer_of_another_run_is_refused_with_both_names_on_both_sides(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg = dataclasses.replace(DEFAULT_MASTER_CONFIG, run="train-1")
    peer_cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, run="train-1")
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    err = await failed_join(pccl_network, cluster.master_address,
                            dataclasses.replace(DEFAULT_PEER_CONFIG, run="eval-7"))
    assert isinstance(err, HelloRefusedError)
    assert "other run" in err.message and "'eval-7'" in err.message and "'train-1'" in err.message
    logged = [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()]
    assert logged and "'eval-7'" in logged[0] and "'train-1'" in logged[0]
    # A peer of the run joins; one that sets no name (the established API) too, as before run names, and
    # the master says so.
    await cluster.add_peer()
    assert cluster.alive == [0, 1, 2]
    assert "names no run" not in caplog.text
    ms = MessageStream(await hostile(cluster, "plain").connect(*master_port(cluster)), max_frame_size=1 << 20)
    assert isinstance(await offer_hello(ms, purpose="master", secret=None), m.HelloOk)
    await ms.aclose()
    assert "names no run; accepted into run 'train-1' (set PCCL_RUN or PeerConfig.run" in caplog.text
    await exact_all_reduces(cluster, rounds=1)


async def test_an_unnamed_master_takes_the_first_name_and_keeps_runs_apart(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(2, config=dataclasses.replace(DEFAULT_PEER_CONFIG, run="job-a"))
    assert cluster.master is not None and cluster.master.run == "job-a"
    assert "now serves run 'job-a'" in caplog.text
    err = await failed_join(pccl_network, cluster.master_address,
                            dataclasses.replace(DEFAULT_PEER_CONFIG, run="job-b"))
    assert "'job-a'" in err.message and "'job-b'" in err.message
    assert cluster.alive == [0, 1]


async def test_a_bad_secret_is_named_in_the_masters_log(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    secret = "correct horse battery staple"
    cluster = await pccl_cluster(1, master_config=dataclasses.replace(DEFAULT_MASTER_CONFIG, secret=secret),
                                 config=dataclasses.replace(DEFAULT_PEER_CONFIG, secret=secret))
    err = await failed_join(pccl_network, cluster.master_address,
                            dataclasses.replace(DEFAULT_PEER_CONFIG, secret="wrong"))
    assert isinstance(err, HelloRefusedError)  # the blocking API's connect() does not retry it
    assert "bad secret" in err.message
    await trio.sleep(1.0)  # the master reads the peer's goodbye
    logged = [r.getMessage() for r in caplog.records if r.name == "pccl.master"]
    assert any("refused connection" in t and "bad secret" in t for t in logged), logged
    assert not any("closed by the other side" in t or "dropped during hello" in t for t in logged), logged


async def test_a_silent_listener_is_named_as_the_silent_side(
    autojump_clock: trio.testing.MockClock, pccl_network: VirtualNetwork
) -> None:
    box = pccl_network.host("box")
    listener = await box.listen("0.0.0.0", 0)
    held = []
    async with trio.open_nursery() as nursery:

        async def hold() -> None:
            while True:
                held.append(await listener.accept())  # accepts, never answers

        nursery.start_soon(hold)
        err = await failed_join(pccl_network, f"{box.address}:{listener.address[1]}", DEFAULT_PEER_CONFIG)
        nursery.cancel_scope.cancel()
    assert not isinstance(err, HelloRefusedError)  # a busy master may answer next time: retried
    assert f"{box.address}:{listener.address[1]} accepted the connection but did not answer the hello" \
        in err.message
    assert "connect_timeout" in err.message


async def test_an_http_server_is_not_a_pccl_master(
    autojump_clock: trio.testing.MockClock, pccl_network: VirtualNetwork
) -> None:
    box = pccl_network.host("web")
    listener = await box.listen("0.0.0.0", 0)
    async with trio.open_nursery() as nursery:

        async def answer() -> None:
            stream = await listener.accept()
            await stream.receive_some(1024)
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        nursery.start_soon(answer)
        err = await failed_join(pccl_network, f"{box.address}:{listener.address[1]}", DEFAULT_PEER_CONFIG)
    assert isinstance(err, HelloRefusedError)
    assert "not a pccl master" in err.message and "HTTP server" in err.message, err.message


async def test_the_master_names_an_http_client(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(1)
    stream = await hostile(cluster).connect(*master_port(cluster))
    await stream.send_all(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
    await trio.sleep(1.0)
    assert "not a pccl peer" in caplog.text and "HTTP client" in caplog.text, caplog.text
    assert cluster.alive == [0]


async def test_a_restarted_master_takes_the_run_name_back_from_its_members(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    peer_cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, run="train-1", reconnect_window=30.0)
    cluster = await pccl_cluster(2, master_config=dataclasses.replace(DEFAULT_MASTER_CONFIG, run="train-1"),
                                 config=peer_cfg)
    await cluster.restart_master(delay=0.5)  # the new master is started without the name's config...
    assert cluster.master.run == "train-1"  # (the harness restarts it with the same config)
    cluster.master_config = DEFAULT_MASTER_CONFIG  # ...so name none: it must learn it from the members
    await cluster.restart_master(delay=0.5)
    with trio.fail_after(30):
        while cluster.master.run != "train-1":
            await trio.sleep(0.1)
    assert "now serves run 'train-1' (taken from a returning peer" in caplog.text
    await exact_all_reduces(cluster, rounds=1)
    err = await failed_join(pccl_network, cluster.master_address,
                            dataclasses.replace(DEFAULT_PEER_CONFIG, run="train-2"))
    assert "'train-2'" in err.message and "'train-1'" in err.message


async def test_the_master_names_a_client_that_sends_no_hello_and_not_a_port_probe(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    cluster = await pccl_cluster(1)
    silent = await hostile(cluster).connect(*master_port(cluster))
    probe = await hostile(cluster, "probe").connect(*master_port(cluster))
    await probe.aclose()
    await trio.sleep(6.0)  # past the master's 5 s hello timeout
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # The silent client is named (the one warning); the probe that closed at once is no warning.
    assert len(warned) == 1, warned
    assert "sent no complete hello within 5s (MasterConfig.hello_timeout" in warned[0]
    assert "closed before sending a hello (a port probe?)" in caplog.text
    await silent.aclose()
