"""The one hello check of the master's and the P2P listeners: every refusal, its reason and its code."""

from __future__ import annotations

import pytest

from pccl._config import PROTOCOL_VERSION
from pccl._errors import Result
from pccl.wire import messages as m
from pccl.wire.hello import HelloProblem, check_hello


def hello(**change: object) -> m.Hello:
    fields: dict[str, object] = dict(
        protocol_version=PROTOCOL_VERSION, purpose="p2p", secret="s", channel="ring"
    )
    fields.update(change)
    return m.Hello(**fields)  # type: ignore[arg-type]


def test_a_good_hello_is_accepted() -> None:
    assert check_hello(hello(), purpose="p2p", secret="s", channels={"ring"}) is None
    assert check_hello(hello(purpose="master", channel=""), purpose="master", secret=None) is None


@pytest.mark.parametrize(
    ("msg", "problem", "code", "text"),
    [
        (m.Heartbeat(), HelloProblem.NOT_HELLO, Result.REMOTE_ERROR, "expected Hello, got Heartbeat"),
        (hello(protocol_version=PROTOCOL_VERSION + 5), HelloProblem.VERSION, Result.REMOTE_ERROR,
         f"version {PROTOCOL_VERSION + 5}"),
        (hello(purpose="master"), HelloProblem.PURPOSE, Result.INVALID_USAGE, "'master'"),
        (hello(secret="t"), HelloProblem.SECRET, Result.INVALID_USAGE, "bad secret"),
        (hello(channel="nope"), HelloProblem.CHANNEL, Result.INVALID_USAGE, "unknown P2P channel 'nope'"),
    ],
)
def test_each_problem_has_its_reason_and_code(
    msg: m.Message, problem: HelloProblem, code: Result, text: str
) -> None:
    refusal = check_hello(msg, purpose="p2p", secret="s", channels={"ring"}, listener="this peer")
    assert refusal is not None
    assert refusal.problem is problem
    assert refusal.result is code
    assert text in refusal.reason


def test_a_version_mismatch_names_both_versions_whatever_else_is_wrong() -> None:
    refusal = check_hello(hello(protocol_version=999, purpose="x", secret="y"), purpose="p2p", secret="s")
    assert refusal is not None and refusal.problem is HelloProblem.VERSION
    assert "999" in refusal.reason and f"speaks version {PROTOCOL_VERSION}" in refusal.reason


def test_secret_rule_none_accepts_any_a_string_must_match_exactly() -> None:
    # The master passes its configured secret (None when unset); a P2P listener passes "" without one.
    assert check_hello(hello(secret="anything"), purpose="p2p", secret=None) is None
    assert check_hello(hello(secret=""), purpose="p2p", secret="") is None
    for listener, presented in [("", "x"), ("x", ""), ("x", "xx"), ("xy", "x")]:
        refusal = check_hello(hello(secret=presented), purpose="p2p", secret=listener)
        assert refusal is not None and refusal.problem is HelloProblem.SECRET


def test_a_reason_mentioning_version_does_not_change_the_code() -> None:
    # The P2P listener used to pick the code by looking for "version" in the reason text.
    refusal = check_hello(hello(channel="version2"), purpose="p2p", secret="s", channels={"ring"})
    assert refusal is not None and refusal.result is Result.INVALID_USAGE
