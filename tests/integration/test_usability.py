"""Joining and addresses, as a new user meets them: the waiting peer says so at INFO, an accept timeout,
TOO_FEW_PEERS that says what the run needs, every address form and the environment."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import trio
import trio.testing

import pccl
from pccl import PeerConfig, _env
from pccl._address import parse_address
from pccl.master.server import open_master
from pccl.peer.communicator import open_communicator
from pccl.testing import DEFAULT_PEER_CONFIG, VirtualNetwork, open_test_cluster

from ._cluster import FAST_PEER


async def test_waiting_peer_logs_at_info_and_gives_up_after_the_accept_timeout(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pccl.peer")
    cfg = dataclasses.replace(DEFAULT_PEER_CONFIG, accept_timeout=5.0)
    async with open_test_cluster(1, network=VirtualNetwork(), config=cfg) as cl:
        t0 = trio.current_time()
        with pytest.raises(pccl.PCCLError) as ei:
            await cl.add_peer(admit=False)
        assert 5.0 <= trio.current_time() - t0 < 5.5
        assert ei.value.result == pccl.Result.MASTER_CONNECTION_FAILED
        assert ei.value.message == (
            "peer 2 was not accepted within 5s: a peer that connects waits until the accepted peers call "
            "update_topology()"
        )
        waiting = [r for r in caplog.records if "waiting to be accepted" in r.getMessage()]
        assert [r.levelno for r in waiting] == [logging.INFO]
        assert waiting[0].getMessage().startswith("peer 2 is waiting to be accepted by the master at ")
        assert waiting[0].getMessage().endswith("the accepted peers must call update_topology() (the first "
                                                "peer of a run is accepted at once)")
        # The peer that gave up is gone from the master; the run is unchanged.
        while cl.master.state.registered():
            await trio.sleep(0.01)
        assert cl.master.state.accepted() == [1]


async def test_too_few_peers_says_what_the_run_needs(autojump_clock: trio.testing.MockClock) -> None:
    async with open_test_cluster(1, network=VirtualNetwork()) as cl:
        with pytest.raises(pccl.TooFewPeersError) as ei:
            await cl.peer(0).all_reduce(np.ones(4, np.float32))
        assert ei.value.message == (
            "all_reduce needs at least 2 accepted peers in peer group 0, it has 1; peers that connect() wait "
            "to be accepted until the accepted peers call update_topology() (are_peers_pending() tells "
            "whether any is waiting)"
        )


async def test_every_address_form_reaches_the_master(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_master(("127.0.0.1", 0)) as master:
        host, port = master.address
        for address in (master.address, (host, port), f"{host}:{port}", f" {host}:{port} "):
            async with open_communicator(address, config=FAST_PEER) as c:
                assert c.world_size == 1
        monkeypatch.setenv("PCCL_MASTER", master.connect_address)
        async with open_communicator(config=FAST_PEER) as c:
            assert (c.master_host, c.master_port) == (host, port)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.1:5", ("10.0.0.1", 5)),
        ("localhost", ("localhost", 48148)),
        ("[::1]:7", ("::1", 7)),
        ("[::1]", ("::1", 48148)),
        ("::1", ("::1", 48148)),
        (":9", ("0.0.0.0", 9)),
        (("node-1.cluster", 80), ("node-1.cluster", 80)),
        (("", 0), ("0.0.0.0", 0)),
    ],
)
def test_parse_address_accepts(address: str | tuple[str, int], expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("http://127.0.0.1:48148", "give the host and port only, not a URL"),
        ("127.0.0.1:48148/x", "give the host and port only, not a URL"),
        (("http://h", 1), "give the host and port only, not a URL"),
        ("", "it is empty"),
        ("my host", "it contains spaces"),
        ("host:", "the port after ':' is missing"),
        ("host:abc", "the port 'abc' is not a number"),
        ("host:70000", "port 70000 is out of range (0-65535)"),
        (("host", 70000), "port 70000 is out of range (0-65535)"),
        (("host", "80"), "the port must be an integer, got '80'"),
        (("host",), "a tuple must be (host: str, port: int)"),
        ("[::1", "an IPv6 address needs its closing ']'"),
        ("[::1]x", "unexpected 'x' after ']'"),
        ("h@st:1", "'h@st' is not a host name or IP address"),
        (48148, "got a int"),
    ],
)
def test_parse_address_rejects_with_the_expected_form(address: object, why: str) -> None:
    with pytest.raises(pccl.InvalidArgumentError) as ei:
        parse_address(address)  # type: ignore[arg-type]
    assert ei.value.result == pccl.Result.INVALID_ARGUMENT
    assert ei.value.message == (
        f"invalid address {address!r}: {why}; expected \"HOST:PORT\" (e.g. \"127.0.0.1:48148\", "
        "\"[::1]:48148\") or a (host, port) tuple"
    )


def test_spin_seconds_from_the_environment() -> None:
    """PCCL_SPIN_SECONDS sets the polling budget of a communicator given no PeerConfig (the blocking
    API's); an explicit PeerConfig wins; a bad value is refused naming the variable."""
    assert _env.peer_config(None, {"PCCL_SPIN_SECONDS": "0"}).spin_seconds == 0.0
    assert _env.peer_config(None, {"PCCL_SPIN_SECONDS": " 0.004 "}).spin_seconds == 0.004
    assert _env.peer_config(None, {}).spin_seconds == PeerConfig().spin_seconds
    given = PeerConfig(spin_seconds=0.002)
    assert _env.peer_config(given, {"PCCL_SPIN_SECONDS": "0"}).spin_seconds == 0.002
    for bad in ("-1", "nan", "fast"):
        with pytest.raises(pccl.PCCLError) as info:
            _env.peer_config(None, {"PCCL_SPIN_SECONDS": bad})
        assert "PCCL_SPIN_SECONDS" in info.value.message


def test_congestion_control_from_the_environment() -> None:
    """PCCL_CONGESTION_CONTROL sets p2p_congestion_control of a communicator given no PeerConfig;
    "default" (or empty) keeps the kernel's; an explicit PeerConfig wins; a bad name is refused naming
    the variable."""
    assert _env.peer_config(None, {}).p2p_congestion_control == "bbr"
    assert _env.peer_config(None, {"PCCL_CONGESTION_CONTROL": "cubic"}).p2p_congestion_control == "cubic"
    for keep in ("default", " ", ""):
        assert _env.peer_config(None, {"PCCL_CONGESTION_CONTROL": keep}).p2p_congestion_control is None
    given = PeerConfig(p2p_congestion_control="reno")
    assert _env.peer_config(given, {"PCCL_CONGESTION_CONTROL": "cubic"}).p2p_congestion_control == "reno"
    for bad in ("bbr;x", "a" * 20):
        with pytest.raises(pccl.PCCLError) as info:
            _env.peer_config(None, {"PCCL_CONGESTION_CONTROL": bad})
        assert "PCCL_CONGESTION_CONTROL" in info.value.message


def test_environment_helpers(tmp_path: object) -> None:
    from pathlib import Path

    secret = Path(str(tmp_path)) / "s"
    secret.write_text("  abc\n")
    assert _env.secret(None, {"PCCL_SECRET_FILE": str(secret), "PCCL_SECRET": "zzz"}) == "abc"
    assert _env.secret(None, {"PCCL_SECRET": "zzz"}) == "zzz"
    assert _env.secret("given", {"PCCL_SECRET": "zzz"}) == "given"
    assert _env.secret(None, {}) is None
    assert _env.peer_config(None, {"PCCL_SECRET": "q"}).secret == "q"
    assert _env.log_level("INFO", {"PCCL_LOG_LEVEL": "debug"}) == "DEBUG"
    assert _env.log_level("INFO", {"PCCL_LOG_LEVEL": "loud"}) == "INFO"
    logger = logging.getLogger("pccl")
    before = logger.level
    try:
        _env.apply_log_level({"PCCL_LOG_LEVEL": "error"})
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)
        for h in list(logger.handlers):
            logger.removeHandler(h)
