"""Fuzz every message decoder under every stage's limits (issue 17, item 7, the hypothesis part).

For each message type: values drawn from its schema round-trip through encode and each stage's
``FrameLimits.decode`` (or are refused with RemoteProtocolError when over that stage's caps); random and
mutated payloads only ever raise RemoteProtocolError, never another exception.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pccl._errors import RemoteProtocolError
from pccl.wire import limits
from pccl.wire import messages as m
from pccl.wire.framing import Framer

STAGES = {
    "pre_auth": limits.PRE_AUTH,
    "master_inbound": limits.master_inbound(16 << 20),
    "p2p_inbound": limits.p2p_inbound(16 << 20),
    "trusted": limits.trusted(16 << 20),
}
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=20), st.binary(max_size=20))


def for_type(tp: Any) -> st.SearchStrategy[Any]:
    """Values of annotation ``tp`` (within its :class:`~pccl.wire.messages.Range`, if it has one)."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *extras = typing.get_args(tp)
        r = next(x for x in extras if isinstance(x, m.Range))
        if base is float:
            return st.floats(min_value=r.lo, max_value=r.hi, allow_infinity=False, allow_nan=False)
        return st.integers(int(r.lo), int(r.hi))
    if tp is Any:
        return st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return st.one_of(*(for_type(a) for a in typing.get_args(tp)))
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**63), 2**63 - 1)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is str:
        return st.text(max_size=40)
    if tp is bytes:
        return st.binary(max_size=80)
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return st.lists(for_type(arg), max_size=6)
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):
        hints = typing.get_type_hints(tp, include_extras=True)
        return st.builds(lambda *v: tp(*v), *(for_type(hints[f]) for f in tp._fields))
    raise TypeError(tp)


def for_message(cls: type[m.Message]) -> st.SearchStrategy[m.Message]:
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {f.name: for_type(hints[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return st.builds(cls, **kwargs)


MESSAGES = st.one_of(*(for_message(cls) for cls in m.message_types().values()))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(MESSAGES, st.sampled_from(sorted(STAGES)))
def test_every_message_round_trips_or_is_refused_under_each_stage(msg: m.Message, stage: str) -> None:
    payload = m.encode(msg)
    try:
        back = STAGES[stage].decode(payload)
    except RemoteProtocolError:
        assert stage != "trusted", "a trusted side takes every well-formed message"
        return
    assert back == msg or _nan_equal(back, msg)


def _nan_equal(a: object, b: object) -> bool:
    return repr(a) == repr(b)


@settings(max_examples=500, deadline=None)
@given(MESSAGES, st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
       st.integers(0, 64), st.sampled_from(sorted(STAGES)))
def test_mutated_payloads_only_raise_remote_protocol_error(
    msg: m.Message, flips: list[tuple[int, int]], cut: int, stage: str
) -> None:
    data = bytearray(m.encode(msg))
    for pos, value in flips:
        data[pos % len(data)] = value
    if cut:
        data = data[: max(0, len(data) - cut)]
    try:
        STAGES[stage].decode(bytes(data))
    except RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=6000), st.sampled_from(sorted(STAGES)))
def test_random_bytes_through_the_framer_only_raise_remote_protocol_error(data: bytes, stage: str) -> None:
    lim = STAGES[stage]
    f = Framer(max_frame_size=lim.max_frame, check_head=lim.check_head)
    f.feed(data)
    f.feed(b"")
    try:
        while (payload := f.next_frame()) is not None:
            try:
                m.decode(payload, unpack_limits=lim.unpack_for(payload[1]))
            except RemoteProtocolError:
                pass
    except RemoteProtocolError:
        pass
