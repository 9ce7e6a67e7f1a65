"""Optional TLS on master and P2P connections (issue 17, item 3), on the virtual network under a MockClock:
trio.SSLStream runs over any pccl stream, so the handshakes and records are real TLS while the time is
virtual. Exact all-reduces with TLS and mutual TLS (no tensor byte readable on the wire), TLS with the
secret, refused certificates (another CA, none, expired, the wrong name) with the reason logged on the
refusing side, TLS-vs-plain mismatches refused within the hello timeout, and the pre-auth limits under TLS.
Real sockets: tests/integration/test_tls.py."""

from __future__ import annotations

import dataclasses
import logging
import ssl
import struct
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from pccl import _tls
from pccl._config import MasterConfig, PeerConfig
from pccl._errors import MasterConnectionError, RankConnectionFailedError
from pccl.master.server import serve_master
from pccl.peer.communicator import open_communicator
from pccl.peer.p2p import open_p2p
from pccl.testing import DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG, TrafficEvent, VirtualNetwork
from pccl.testing.pytest_plugin import ClusterFactory
from pccl.testing.tls import Certs
from pccl.transport import ConnectFailed, StreamBroken, TlsStream, TlsTransport
from pccl.wire.handshake import offer_hello
from pccl.wire.stream import MessageStream

from ._helpers import contribution, exact_all_reduces, hostile, master_port, p2p_address

SECRET = "correct horse battery staple"


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return Certs(tmp_path)


def tls_configs(
    certs: Certs, *, mutual: bool = True, secret: str | None = None
) -> tuple[MasterConfig, PeerConfig]:
    master = certs.master(dataclasses.replace(DEFAULT_MASTER_CONFIG, secret=secret), mutual=mutual)
    return master, certs.peer(dataclasses.replace(DEFAULT_PEER_CONFIG, secret=secret))


def sniffer(network: VirtualNetwork) -> dict[tuple[int, str], bytearray]:
    """Every byte each connection's sides send, by (connection, sender)."""
    sent: dict[tuple[int, str], bytearray] = defaultdict(bytearray)

    def sniff(ev: TrafficEvent) -> None:
        sent[(ev.connection, ev.src)] += ev.data

    network.add_hook(sniff)
    return sent


def client_context(ca: str, *, cert: str | None = None) -> ssl.SSLContext:
    """A hostile or misconfigured client's context: trusts ``ca``, checks no name, presents ``cert``."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False
    if cert is not None:
        ctx.load_cert_chain(cert)
    return ctx


async def refused_peer(network: VirtualNetwork, address: str, config: PeerConfig, name: str = "odd") -> str:
    """Open a communicator from a new host; it must fail with MASTER_CONNECTION_FAILED. Its message."""
    host = network.host(name)
    cfg = dataclasses.replace(config, p2p_listen_host=host.address)
    with pytest.raises(MasterConnectionError) as info:
        async with open_communicator(address, config=cfg, transport=host):
            pass
    return info.value.message


# ------------------------------------------------------------------------------------------------
# working runs


@pytest.mark.parametrize("mode", ["plain", "tls", "mutual"])
async def test_all_reduce_exact_and_no_tensor_byte_on_the_wire_under_tls(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    certs: Certs,
    mode: str,
) -> None:
    sent = sniffer(pccl_network)
    if mode == "plain":
        master_cfg, peer_cfg = DEFAULT_MASTER_CONFIG, DEFAULT_PEER_CONFIG
    else:
        master_cfg, peer_cfg = tls_configs(certs, mutual=mode == "mutual")
    cluster = await pccl_cluster(3, master_config=master_cfg, config=peer_cfg)
    await exact_all_reduces(cluster, rounds=3)
    # The contributions' bytes travel on the ring: readable without TLS (so the sniffer does see the
    # data plane), nowhere with it.
    probes = [contribution(cluster.peer(i).peer_id).tobytes()[64:128] for i in cluster.alive]
    wire = [bytes(d) for d in sent.values()]
    seen = any(p in d for p in probes for d in wire)
    assert seen == (mode == "plain")
    if mode != "plain":
        # Every connection of the run starts with a TLS handshake record, none with a pccl frame.
        assert wire and all(d[:1] == b"\x16" and d[1:2] == b"\x03" for d in wire if d)
        assert cluster.alive == [0, 1, 2]


async def test_tls_with_the_secret_together(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs, secret=SECRET)
    cluster = await pccl_cluster(3, master_config=master_cfg, config=peer_cfg)
    await exact_all_reduces(cluster, rounds=2)
    # A member's certificate without the secret gets through TLS, then fails the challenge-response.
    wrong = dataclasses.replace(peer_cfg, secret="not it")
    message = await refused_peer(pccl_network, cluster.master_address, wrong)
    assert "secret" in message, message
    assert cluster.alive == [0, 1, 2]
    await exact_all_reduces(cluster, rounds=1, tag=10)


# ------------------------------------------------------------------------------------------------
# refused certificates: the refused side gets a one-line PCCLError, the refusing side logs why


async def test_peer_that_does_not_trust_the_masters_certificate_fails_with_the_reason(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs)
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    wrong_ca = dataclasses.replace(peer_cfg, tls_ca=certs.other_ca_file)
    message = await refused_peer(pccl_network, cluster.master_address, wrong_ca)
    assert "TLS handshake with" in message and "certificate verify failed" in message
    assert ("unable to get local issuer certificate" in message
            or "self-signed certificate in certificate chain" in message) and "\n" not in message
    assert cluster.alive == [0, 1]
    await exact_all_reduces(cluster, rounds=1)
    # The peer's alert told the master why the connection ended.
    assert "does not trust this side's certificate (unknown CA)" in caplog.text


@pytest.mark.parametrize("cert", ["other_ca", "expired"])
async def test_mutual_tls_master_refuses_a_client_certificate_it_does_not_trust_and_logs_why(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
    cert: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs)
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    bad = (certs.issue("intruder", "pccl-peer", ca=certs.other_ca) if cert == "other_ca"
           else certs.issue("stale", "pccl-peer", expired=True))
    message = await refused_peer(pccl_network, cluster.master_address, certs.peer(peer_cfg, cert=bad))
    assert "MASTER_CONNECTION_FAILED" not in message  # the message is the reason, the code is separate
    # The master's TLS alert reaches the peer: it says why, in one line.
    told = ("does not trust this side's certificate (unknown CA)" if cert == "other_ca"
            else "refused this side's certificate: it has expired")
    assert told in message and "\n" not in message
    expected = "unable to get local issuer certificate" if cert == "other_ca" else "certificate has expired"
    assert f"certificate verify failed: {expected}" in caplog.text
    assert "dropped during hello: TLS handshake with" in caplog.text
    assert cluster.alive == [0, 1]
    await exact_all_reduces(cluster, rounds=1)


async def test_mutual_tls_master_refuses_a_client_without_certificate(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs)
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    evil = TlsTransport(hostile(cluster), server_context=None, client_context=client_context(certs.ca_file))
    # TLS 1.3: the client's handshake ends before the server has checked it; the refusal is the first
    # thing it reads.
    stream = await evil.connect(*master_port(cluster))
    ms = MessageStream(stream, max_frame_size=1 << 16)
    with pytest.raises(StreamBroken, match="requires a client certificate"):
        await offer_hello(ms, purpose="master", secret="")
    await ms.aclose()
    assert "sent no certificate" in caplog.text or "PEER_DID_NOT_RETURN_A_CERTIFICATE" in caplog.text
    assert cluster.alive == [0, 1]
    await exact_all_reduces(cluster, rounds=1)


@pytest.mark.parametrize("problem", ["expired", "wrong_host"])
async def test_peer_refuses_an_expired_or_wrong_host_master_certificate(
    autojump_clock: trio.testing.MockClock,
    pccl_network: VirtualNetwork,
    certs: Certs,
    problem: str,
) -> None:
    cert = (certs.issue("master-expired", expired=True) if problem == "expired"
            else certs.issue("master-elsewhere", "10.9.9.9", "master.example"))
    master_cfg = certs.master(DEFAULT_MASTER_CONFIG, cert=cert)
    peer_cfg = certs.peer(DEFAULT_PEER_CONFIG)
    host = pccl_network.host("master-host")
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(lambda task_status: serve_master(
            host.address, 0, config=master_cfg, transport=host, task_status=task_status))
        address = f"{bound[0]}:{bound[1]}"
        message = await refused_peer(pccl_network, address, peer_cfg)
        if problem == "expired":
            assert "certificate verify failed: certificate has expired" in message
        else:
            assert "certificate verify failed: IP address mismatch" in message and bound[0] in message
            # The name the certificate carries, when the peer is told to expect it: accepted.
            good = pccl_network.host("p")
            named = dataclasses.replace(peer_cfg, tls_server_name="master.example",
                                        p2p_listen_host=good.address)
            async with open_communicator(address, config=named, transport=good) as comm:
                assert comm.world_size == 1
        nursery.cancel_scope.cancel()


async def test_p2p_listener_refuses_clients_without_a_run_certificate_and_logs_why(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs, mutual=False)  # the master asks for no client certificate
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    evil_host = hostile(cluster)
    # P2P is always mutual TLS: no certificate, or one of another CA, is refused by the listener.
    intruder = certs.issue("intruder", "pccl-peer", ca=certs.other_ca)
    for cert, logged in [(None, "sent no certificate"), (intruder, "unable to get local issuer certificate")]:
        evil = TlsTransport(evil_host, server_context=None,
                            client_context=client_context(certs.ca_file, cert=cert))
        with pytest.raises(RankConnectionFailedError) as info:
            await open_p2p(evil, *p2p_address(cluster, 1), my_peer_id=0, channel="ring",
                           config=DEFAULT_PEER_CONFIG)
        assert "TLS" in info.value.message or "certificate" in info.value.message
        assert logged in caplog.text
    # A peer that does not trust the listener's CA refuses it before saying anything.
    wary = TlsTransport(evil_host, server_context=None, client_context=client_context(certs.other_ca_file))
    with pytest.raises(ConnectFailed, match="certificate verify failed"):
        await wary.connect(*p2p_address(cluster, 1))
    assert cluster.alive == [0, 1]
    await exact_all_reduces(cluster, rounds=2)


# ------------------------------------------------------------------------------------------------
# TLS against plain TCP: refused fast, both ways, nothing taken down


async def test_plain_peer_against_a_tls_master_is_refused_within_the_hello_timeout(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs)
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    start = trio.current_time()
    message = await refused_peer(pccl_network, cluster.master_address, DEFAULT_PEER_CONFIG)
    took = trio.current_time() - start
    assert took < 0.1 * master_cfg.hello_timeout  # a few virtual round trips, not the hello timeout
    assert "closed by the other side" in message and "this peer needs PeerConfig.tls_cert" in message
    assert "does not speak TLS" in caplog.text
    assert cluster.alive == [0, 1]
    await exact_all_reduces(cluster, rounds=1)


async def test_tls_peer_against_a_plain_master_is_refused_within_the_hello_timeout(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    pccl_network: VirtualNetwork,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    cluster = await pccl_cluster(2)
    start = trio.current_time()
    message = await refused_peer(pccl_network, cluster.master_address, certs.peer(DEFAULT_PEER_CONFIG))
    took = trio.current_time() - start
    assert took < 0.1 * DEFAULT_MASTER_CONFIG.hello_timeout
    assert "TLS handshake with" in message and "closed the connection during the TLS handshake" in message
    assert "the other side speaks TLS and this one does not" in caplog.text
    assert cluster.alive == [0, 1]
    await exact_all_reduces(cluster, rounds=1)


async def test_plain_client_against_a_tls_p2p_listener_is_refused(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs)
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    start = trio.current_time()
    with pytest.raises(RankConnectionFailedError, match="P2P handshake with"):
        await open_p2p(hostile(cluster), *p2p_address(cluster, 0), my_peer_id=1, channel="ring",
                       config=DEFAULT_PEER_CONFIG)
    assert trio.current_time() - start < 0.1 * DEFAULT_PEER_CONFIG.connect_timeout
    assert "does not speak TLS" in caplog.text
    await exact_all_reduces(cluster, rounds=1)


# ------------------------------------------------------------------------------------------------
# the pre-auth limits under TLS


async def test_a_stalled_tls_handshake_is_dropped_at_the_hello_timeout(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs)
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    stream = await hostile(cluster).connect(*master_port(cluster))
    start = trio.current_time()
    await stream.send_all(b"\x16\x03\x01\x02\x00\x01")  # the first bytes of a ClientHello, then nothing
    assert await stream.receive_some(1024) == b""  # closed by the master...
    took = trio.current_time() - start
    assert master_cfg.hello_timeout <= took < master_cfg.hello_timeout + 0.1  # ...at the hello timeout
    assert "dropped during hello" in caplog.text
    await stream.aclose()
    await exact_all_reduces(cluster, rounds=1)


async def test_handshakes_in_progress_count_against_the_per_host_cap(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs)
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    evil = hostile(cluster)
    cap = cluster.master._server.gate.max_per_host  # type: ignore[attr-defined]
    streams = [await evil.connect(*master_port(cluster)) for _ in range(cap)]
    await trio.sleep(0.05)
    extra = await evil.connect(*master_port(cluster))
    # over the cap: the oldest connection in its hello (TLS handshake included) is closed unread
    assert await streams[0].receive_some(16) == b""
    assert "is flooded" in caplog.text and "the oldest is closed" in caplog.text
    for s in [*streams, extra]:
        await s.aclose()
    await exact_all_reduces(cluster, rounds=1)


def _nested_lists(size: int) -> bytes:
    depth = size  # one byte per level: 0x91 is a one-item array
    return b"\x92\x01" + b"\x91" * depth + b"\x90"


async def test_pre_auth_frame_limit_applies_inside_tls(
    autojump_clock: trio.testing.MockClock,
    pccl_cluster: ClusterFactory,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a TLS master that asks for no client certificate anyone can finish the TLS handshake; what
    it sends inside is then bounded as before TLS: a 3 MiB frame is refused on its length prefix."""
    caplog.set_level(logging.WARNING, logger="pccl")
    master_cfg, peer_cfg = tls_configs(certs, mutual=False)
    cluster = await pccl_cluster(2, master_config=master_cfg, config=peer_cfg)
    evil = TlsTransport(hostile(cluster), server_context=None, client_context=client_context(certs.ca_file))
    stream = await evil.connect(*master_port(cluster))
    assert isinstance(stream, TlsStream) and stream.handshake_done
    payload = _nested_lists(3 << 20)
    start = trio.current_time()
    try:
        await stream.send_all(struct.pack("<I", len(payload)) + payload)
        closed = await stream.receive_some(1024) == b""
    except StreamBroken:
        closed = True
    assert closed and trio.current_time() - start < 1.0
    assert "exceeds the limit of 4096 bytes" in caplog.text
    await stream.aclose()
    assert cluster.alive == [0, 1]
    await exact_all_reduces(cluster, rounds=1)


async def test_tls_stream_delivers_every_byte_in_order_whatever_the_receive_sizes(
    autojump_clock: trio.testing.MockClock, pccl_network: VirtualNetwork, certs: Certs
) -> None:
    """Records read by SSLStream and the ones drained straight from its SSL object interleave: the bytes
    come out exact and in order, then the close."""
    pem = certs.issue("x")
    files = _tls.TlsFiles(pem, pem, certs.ca_file)
    a, b = pccl_network.host("a"), pccl_network.host("b")
    server = TlsTransport(a, server_context=_tls.server_context(files), client_context=None)
    client = TlsTransport(b, server_context=None,
                          client_context=_tls.client_context(files, check_hostname=False))
    listener = await server.listen(a.address, 0)
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    got = bytearray()
    sizes = [1, 7, 16384, 65536, 300_000, 1 << 20]

    async def receive() -> None:
        stream = await listener.accept()
        assert isinstance(stream, TlsStream) and stream._obj is not None  # the drain is in use
        i = 0
        while True:
            buf = memoryview(bytearray(sizes[i % len(sizes)]))
            i += 1
            k = await stream.receive_into(buf)
            if k == 0:
                break
            got.extend(buf[:k])
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        stream = await client.connect(a.address, listener.address[1])
        for start in range(0, len(data), 700_001):
            await stream.send_all(data[start : start + 700_001])
        await stream.aclose()
    assert bytes(got) == data
    await listener.aclose()
