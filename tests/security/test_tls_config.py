"""TLS settings (issue 17, item 3): which files the configs need, the environment variables, the
``pccl-master`` options, bad files as one clear error, and naming a TLS/plain mismatch."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from pccl import _env, _tls
from pccl._config import MasterConfig, PeerConfig
from pccl._errors import InvalidArgumentError, Result
from pccl.cli import _master_config, _master_parser, master_main
from pccl.peer.communicator import Communicator
from pccl.testing.tls import Certs
from pccl.wire.stream import looks_like_tls


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return Certs(tmp_path)


def test_configs_say_which_tls_files_go_together(certs: Certs) -> None:
    pem = certs.issue("x")
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        MasterConfig(tls_cert=pem)
    with pytest.raises(ValueError, match="tls_ca without tls_cert and tls_key"):
        MasterConfig(tls_ca=certs.ca_file)
    assert MasterConfig(tls_cert=pem, tls_key=pem).tls == _tls.TlsFiles(pem, pem, None)  # TLS, not mutual
    assert MasterConfig().tls is None and PeerConfig().tls is None
    with pytest.raises(ValueError, match="TLS needs tls_ca as well"):
        PeerConfig(tls_cert=pem, tls_key=pem)  # a peer verifies the master and its neighbours
    with pytest.raises(ValueError, match="tls_server_name without TLS"):
        PeerConfig(tls_server_name="master.example")
    files = PeerConfig(tls_cert=pem, tls_key=pem, tls_ca=certs.ca_file).tls
    assert files == _tls.TlsFiles(pem, pem, certs.ca_file)


def test_bad_tls_files_are_one_clear_invalid_argument_error(certs: Certs, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    mine = certs.issue("mine")
    a, b = certs.ca.issue_cert("a"), certs.ca.issue_cert("b")
    mismatched = tmp_path / "mismatched.pem"  # a's certificate with b's key
    mismatched.write_bytes(a.cert_chain_pems[0].bytes() + b.private_key_pem.bytes())
    cases = [
        (_tls.TlsFiles(missing, missing), "cannot read"),
        (_tls.TlsFiles(str(junk), str(junk)), "TLS: cannot load the certificate or key"),
        (_tls.TlsFiles(str(mismatched), str(mismatched)), "the key does not belong to the certificate"),
        (_tls.TlsFiles(mine, mine, missing), "cannot read"),
    ]
    for files, words in cases:
        with pytest.raises(InvalidArgumentError) as info:
            _tls.server_context(files)
        assert words in info.value.message and "\n" not in info.value.message
        assert info.value.result is Result.INVALID_ARGUMENT
    with pytest.raises(InvalidArgumentError, match="needs a CA"):
        _tls.client_context(_tls.TlsFiles(mine, mine), check_hostname=True)
    # A communicator with a bad file fails when it is made, before anything connects.
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        Communicator("127.0.0.1:1", config=PeerConfig(tls_cert=mine, tls_key=mine, tls_ca=missing))


def test_contexts_verify_as_documented(certs: Certs) -> None:
    pem = certs.issue("x")
    mutual = _tls.server_context(_tls.TlsFiles(pem, pem, certs.ca_file))
    assert mutual.verify_mode is ssl.CERT_REQUIRED and mutual.minimum_version is ssl.TLSVersion.TLSv1_2
    assert _tls.server_context(_tls.TlsFiles(pem, pem)).verify_mode is ssl.CERT_NONE
    to_master = _tls.client_context(_tls.TlsFiles(pem, pem, certs.ca_file), check_hostname=True)
    to_peer = _tls.client_context(_tls.TlsFiles(pem, pem, certs.ca_file), check_hostname=False)
    assert to_master.check_hostname and not to_peer.check_hostname
    assert to_master.verify_mode is ssl.CERT_REQUIRED and to_peer.verify_mode is ssl.CERT_REQUIRED


def test_peers_take_tls_files_from_the_environment_unless_their_config_names_some(certs: Certs) -> None:
    pem = certs.issue("x")
    env = {_env.ENV_TLS_CERT: pem, _env.ENV_TLS_CA: certs.ca_file}
    cfg = _env.peer_config(None, env)
    # The key defaults to the certificate's file.
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == (pem, pem, certs.ca_file)
    other = certs.issue("other")
    explicit = PeerConfig(tls_cert=other, tls_key=other, tls_ca=certs.other_ca_file)
    assert _env.peer_config(explicit, env) == explicit
    assert _env.peer_config(None, {}).tls is None
    with pytest.raises(InvalidArgumentError, match=r"TLS needs tls_ca as well: .*PCCL_TLS_CERT"):
        _env.peer_config(None, {_env.ENV_TLS_CERT: pem})
    assert _env.master_tls({_env.ENV_TLS_CERT: pem}) == (pem, pem, None)
    with pytest.raises(InvalidArgumentError, match="tls_ca without tls_cert"):
        _env.master_tls({_env.ENV_TLS_CA: certs.ca_file})


def test_pccl_master_tls_options(
    certs: Certs, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (_env.ENV_TLS_CERT, _env.ENV_TLS_KEY, _env.ENV_TLS_CA):
        monkeypatch.delenv(name, raising=False)
    pem = certs.issue("master")
    args = _master_parser().parse_args(["--tls-cert", pem, "--tls-ca", certs.ca_file])
    cfg = _master_config(args)
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == (pem, pem, certs.ca_file)
    monkeypatch.setenv(_env.ENV_TLS_CERT, pem)
    cfg = _master_config(_master_parser().parse_args([]))
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == (pem, pem, None)
    monkeypatch.delenv(_env.ENV_TLS_CERT)
    missing = str(tmp_path / "missing.pem")
    for argv, words in [
        (["--tls-cert", missing], f"TLS: cannot read {missing}: No such file or directory"),
        (["--tls-ca", certs.ca_file], "tls_ca without tls_cert and tls_key"),
        (["--tls-key", pem], "tls_cert and tls_key go together"),
    ]:
        assert master_main(["--port", "0", *argv]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and words in lines[0] and lines[0].startswith("pccl-master: error: ")


def test_a_tls_record_is_told_apart_from_a_pccl_frame() -> None:
    assert looks_like_tls(b"\x16\x03\x01\x02\x00")  # a ClientHello
    assert looks_like_tls(b"\x15\x03\x03\x00\x02")  # an alert
    assert not looks_like_tls(b"\x16\x00\x00\x00")  # a 22-byte pccl frame
    assert not looks_like_tls(b"\x16\x03")  # too short to tell
