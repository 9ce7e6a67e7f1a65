"""The one hello check of the master's and the P2P listeners: every refusal, its reason and its code."""

from __future__ import annotations

import pytest

from pccl._config import PROTOCOL_VERSION
from pccl._errors import Result
from pccl.wire import messages as m
from pccl.wire.hello import (
    HelloProblem,
    HelloRefusal,
    answer,
    challenge,
    check_challenge,
    check_hello,
    check_proof,
)

NC = b"c" * 16  # the client's nonce
NS = b"s" * 16  # the server's nonce


def hello(**change: object) -> m.Hello:
    fields: dict[str, object] = dict(
        protocol_version=PROTOCOL_VERSION, purpose="p2p", channel="ring", nonce=NC
    )
    fields.update(change)
    return m.Hello(**fields)  # type: ignore[arg-type]


def handshake(presented: str | None, listener: str | None, h: m.Hello | None = None) -> HelloRefusal | None:
    """The listener's verdict on a client that proves itself with ``presented`` (the secret is
    checked on the Proof now; the hello no longer carries it)."""
    h = h or hello()
    ch = challenge(h, secret=listener, server_nonce=NS)
    return check_proof(answer(ch, h, secret=presented), h, secret=listener, server_nonce=NS)


def test_a_good_hello_is_accepted() -> None:
    assert check_hello(hello(), purpose="p2p", channels={"ring"}) is None
    assert handshake("s", "s") is None
    assert check_hello(hello(purpose="master", channel=""), purpose="master") is None
    assert handshake(None, None, hello(purpose="master", channel="")) is None


@pytest.mark.parametrize(
    ("msg", "problem", "code", "text"),
    [
        (m.Heartbeat(), HelloProblem.NOT_HELLO, Result.REMOTE_ERROR, "expected Hello, got Heartbeat"),
        (hello(protocol_version=PROTOCOL_VERSION + 5), HelloProblem.VERSION, Result.REMOTE_ERROR,
         f"version {PROTOCOL_VERSION + 5}"),
        (hello(purpose="master"), HelloProblem.PURPOSE, Result.INVALID_USAGE, "'master'"),
        (hello(nonce=b"short"), HelloProblem.NONCE, Result.REMOTE_ERROR, "nonce of 16-64 bytes"),
        (hello(channel="nope"), HelloProblem.CHANNEL, Result.INVALID_USAGE, "unknown P2P channel 'nope'"),
    ],
)
def test_each_problem_has_its_reason_and_code(
    msg: m.Message, problem: HelloProblem, code: Result, text: str
) -> None:
    refusal = check_hello(msg, purpose="p2p", channels={"ring"}, listener="this peer")
    assert refusal is not None
    assert refusal.problem is problem
    assert refusal.result is code
    assert text in refusal.reason


def test_a_version_mismatch_names_both_versions_whatever_else_is_wrong() -> None:
    refusal = check_hello(hello(protocol_version=999, purpose="x", nonce=b""), purpose="p2p")
    assert refusal is not None and refusal.problem is HelloProblem.VERSION
    assert "999" in refusal.reason and f"speaks version {PROTOCOL_VERSION}" in refusal.reason


def test_secret_rule_none_accepts_any_a_string_must_match_exactly() -> None:
    # The master passes its configured secret (None when unset); a P2P listener passes "" without one.
    assert handshake("anything", None) is None
    assert handshake("", "") is None
    for listener, presented in [("", "x"), ("x", ""), ("x", "xx"), ("xy", "x")]:
        refusal = handshake(presented, listener)
        assert refusal is not None and refusal.problem is HelloProblem.SECRET
        assert refusal.result is Result.INVALID_USAGE and "bad secret" in refusal.reason


def test_the_client_checks_the_listeners_proof_before_proving_itself() -> None:
    h = hello()
    assert check_challenge(challenge(h, secret="s", server_nonce=NS), h, secret="s") is None
    problem = check_challenge(challenge(h, secret="other", server_nonce=NS), h, secret="s")
    assert problem is not None and "bad secret: missing or not the shared secret" in problem
    # A server proof is not a client proof (no reflection), and a Proof is needed after the Challenge.
    ch = challenge(h, secret="s", server_nonce=NS)
    assert check_proof(m.Proof(proof=ch.proof), h, secret="s", server_nonce=NS) is not None
    refusal = check_proof(m.Heartbeat(), h, secret=None, server_nonce=NS)
    assert refusal is not None and "expected Proof" in refusal.reason


def test_a_recorded_proof_fails_against_a_new_challenge() -> None:
    h = hello()
    recorded = answer(challenge(h, secret="s", server_nonce=NS), h, secret="s")
    assert check_proof(recorded, h, secret="s", server_nonce=NS) is None
    refusal = check_proof(recorded, h, secret="s", server_nonce=b"n" * 16)  # the listener's next nonce
    assert refusal is not None and refusal.problem is HelloProblem.SECRET


def test_a_reason_mentioning_version_does_not_change_the_code() -> None:
    # The P2P listener used to pick the code by looking for "version" in the reason text.
    refusal = check_hello(hello(channel="version2"), purpose="p2p", channels={"ring"})
    assert refusal is not None and refusal.result is Result.INVALID_USAGE
