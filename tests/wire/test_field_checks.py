"""Every field of every message is checked against its annotation when decoding: a value of the wrong
type (a bool where an int is due, a row with a wrong cell, a list of the wrong items) is refused with
a RemoteProtocolError naming that field, and the values of the right types decode to an equal message.
The checks are built once per type (pccl/wire/messages.py ``_parser``); this walks every field."""

from __future__ import annotations

import types
import typing
from typing import Any

import msgpack
import pytest

from pccl._errors import RemoteProtocolError
from pccl.wire import messages as m


def _range(tp: Any) -> tuple[Any, m.Range] | None:
    """``(base type, Range)`` of an ``Annotated[base, Range(...)]`` field, else None."""
    if typing.get_origin(tp) is not typing.Annotated:
        return None
    base, *extras = typing.get_args(tp)
    return base, next(x for x in extras if isinstance(x, m.Range))


def good(tp: Any) -> Any:
    """A value of annotation ``tp`` (rows in their wire form, a positional list)."""
    ranged = _range(tp)
    if ranged is not None:
        base, r = ranged
        return type(good(base))(max(r.lo, min(r.hi, good(base))))
    if tp is Any or tp is int:
        return 0
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return good(typing.get_args(tp)[0])
    if tp is type(None):
        return None
    simple = {bool: True, float: 0.5, str: "s", bytes: b"b"}
    if tp in simple:
        return simple[tp]
    fields = m._row_fields(tp)
    if fields is not None:
        return [good(f) for f in fields]
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return [good(arg)]
    if origin is dict:
        ka, va = typing.get_args(tp) or (Any, Any)
        return {good(ka): good(va)}
    raise AssertionError(f"no value for {tp!r}")


def bad(tp: Any) -> list[Any]:
    """Values that do not match ``tp`` (for a ranged field also values of its type out of range)."""
    ranged = _range(tp)
    if ranged is not None:
        base, r = ranged
        outside = [r.lo - 1, -(2**63) if base is int else -1e300]
        if r.hi != float("inf"):
            outside += [r.hi + 1, 2**64 - 1]
        if base is float:
            outside += [float("nan"), float("inf")]
        return [*bad(base), *outside]
    if tp is Any:
        return []
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return []  # (no message has one today)
    if tp is int:
        return [True, "1", 1.0, None]
    if tp is bool:
        return [1, "true", None]
    if tp is float:
        return [True, "1.0", None]
    if tp in (str, bytes):
        return [1, b"x" if tp is str else "x", None]
    fields = m._row_fields(tp)
    if fields is not None:
        row = good(tp)
        wrong = [[*row[:i], bad(f)[0], *row[i + 1:]] for i, f in enumerate(fields) if bad(f)]
        return [*wrong, 5, [*row, 0]]  # a cell of the wrong type, not a list, one cell too many
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if arg is Any:
            return [5, "x"]
        if typing.get_origin(arg) is list and typing.get_args(arg) in ((), (Any,)):
            return [5, [5]]
        return [5, *([[b] for b in bad(arg)[:1]])]
    if origin is dict:
        return [[1]]
    return []


CASES = [(cls, i, name, tp) for cls in m._REGISTRY.values() for i, (name, tp) in enumerate(m._fields(cls))]


def payload(cls: type[m.Message], values: list[Any]) -> bytes:
    return msgpack.packb([cls.TAG, values], use_bin_type=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("cls", list(m._REGISTRY.values()), ids=lambda c: c.__name__)
def test_values_of_the_right_types_decode_to_an_equal_message(cls: type[m.Message]) -> None:
    values = [good(tp) for _, tp in m._fields(cls)]
    msg = m.decode(payload(cls, values))
    assert type(msg) is cls
    assert m.decode(m.encode(msg)) == msg


@pytest.mark.parametrize(("cls", "i", "name", "tp"), CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(
    cls: type[m.Message], i: int, name: str, tp: Any
) -> None:
    fields = m._fields(cls)
    for wrong in bad(tp):
        values = [good(t) for _, t in fields]
        values[i] = wrong
        with pytest.raises(RemoteProtocolError, match=rf"{cls.__name__}\.{name}: bad value"):
            m.decode(payload(cls, values))


def test_trailing_row_cells_with_a_default_may_be_missing_but_not_the_others() -> None:
    desc = ["all_reduce", 10, 4, 0, -1, 0, 0]  # no schedule: a peer from before it was added
    msg = m.decode(payload(m.CollectiveInitiate, [1, desc, -1]))
    assert isinstance(msg, m.CollectiveInitiate) and msg.descriptor.schedule == "auto"
    with pytest.raises(RemoteProtocolError, match=r"CollectiveInitiate\.descriptor"):
        m.decode(payload(m.CollectiveInitiate, [1, desc[:-1], -1]))
