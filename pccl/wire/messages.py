"""Control-plane messages: one frozen, keyword-only dataclass per type, one registry.

Encoding: ``msgpack([type_tag, [field values in declaration order]])``. Decoding validates the
tag, the field count and every field's type against the dataclass annotations, so a malformed
message becomes a :class:`RemoteProtocolError` instead of a crash deep inside a handler.
Tensor bytes never travel in these messages (see :mod:`pccl.wire.data`).

Peer tables are lists of ``[peer_id, host, p2p_port, peer_group]`` in ring order on the wire and a
collective's descriptor is ``[kind, dtype, count, op, root_id, quantization, quantized_dtype]``; both are
decoded here, once, into the named tuples :class:`PeerRow` and :class:`CollectiveDescriptor` (a tuple
packs as the same msgpack array, so the bytes are unchanged). docs/protocol.md describes every message.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, NamedTuple, TypeVar, get_args, get_origin

import msgpack

from .._errors import LocalProtocolError, RemoteProtocolError


@dataclass(frozen=True)
class Range:
    """A field's allowed values, checked when a message is decoded (``Annotated[int, Range(lo, hi)]``):
    a value outside ``lo <= v <= hi`` (a float also must be finite) makes the message malformed, so no
    handler, observer or metric ever sees a negative byte count or an id past 63 bits."""

    lo: float
    hi: float


_I63 = 2**63 - 1
#: A count, size, sequence number or id: 0 .. 2**63 - 1.
Count = Annotated[int, Range(0, _I63)]
#: A number whose "none" is -1 (an epoch, op_seq or revision not known yet): -1 .. 2**63 - 1.
Seq = Annotated[int, Range(-1, _I63)]
#: A TCP port (0: none).
Port = Annotated[int, Range(0, 65535)]
#: A peer group (PeerConfig.peer_group): an unsigned 32-bit integer.
Group = Annotated[int, Range(0, 2**32 - 1)]
#: A duration or rate in seconds / bytes per second: finite and >= 0.
Seconds = Annotated[float, Range(0.0, math.inf)]


class PeerRow(NamedTuple):
    """One accepted peer in a table: where its P2P listener is and which group it is in."""

    peer_id: Count
    host: str
    port: Port
    group: Group


class PublicKeyRow(NamedTuple):
    """One row of a :class:`P2PCredentials` table: member ``peer_id``'s X25519 public key (``b""``: it
    registered none)."""

    peer_id: Count
    public_key: bytes


class CollectiveDescriptor(NamedTuple):
    """What a collective does; every participant must vote with an equal descriptor."""

    kind: str  # a kind of pccl.collectives.kinds: "all_reduce", "reduce_scatter", ..., "all_to_all"
    dtype: int  # pccl.DataType
    element_count: Count  # elements of the input
    op: int  # pccl.ReduceOp
    root: Seq  # broadcast and reduce: the root's peer id; -1 otherwise
    quantization: int  # pccl.QuantizationAlgorithm
    quantized_dtype: int  # pccl.DataType on the wire when quantizing
    schedule: str = "auto"  # PeerConfig.schedule: "auto", "ring", "hd" or "tree"


_ROWS: dict[type, tuple[Any, ...]] = {}


def _row_fields(tp: Any) -> tuple[Any, ...] | None:
    """Field annotations of a NamedTuple row type, or None for other types."""
    if not (isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields")):
        return None
    f = _ROWS.get(tp)
    if f is None:
        hints = typing.get_type_hints(tp, include_extras=True)
        f = _ROWS[tp] = tuple(hints[name] for name in tp._fields)
    return f


class Message:
    """Base of every control message."""

    TAG: ClassVar[int] = -1
    #: True: one object of this type is sent to many peers (the same bytes to each); a stream then
    #: encodes it once (:mod:`pccl.wire.stream`).
    SHARED: ClassVar[bool] = False


_REGISTRY: dict[int, type[Message]] = {}
_FIELDS: dict[type[Message], tuple[tuple[str, Any], ...]] = {}
_OPTIONAL: dict[type[Message], tuple[Any, ...]] = {}  # defaults of the trailing optional fields
# each field's name and parser (:func:`_parser`), in declaration order
_PARSE_FIELDS: dict[type[Message], tuple[tuple[str, typing.Callable[[Any], Any]], ...]] = {}

#: ``dataclasses.field(metadata=OPTIONAL, ...)`` marks a field added to a message after its first
#: version: trailing optional fields at their default are not sent, and may be missing when decoding
#: (so the message's bytes stay those of before unless the new field is used).
OPTIONAL = {"optional": True}

M = TypeVar("M", bound=type[Message])


def _register(tag: int) -> typing.Callable[[M], M]:
    def deco(cls: M) -> M:
        if tag in _REGISTRY:
            raise RuntimeError(f"duplicate message tag {tag}")
        cls.TAG = tag
        _REGISTRY[tag] = cls
        return cls

    return deco


def _fields(cls: type[Message]) -> tuple[tuple[str, Any], ...]:
    f = _FIELDS.get(cls)
    if f is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        flds = dataclasses.fields(cls)  # type: ignore[arg-type]
        f = tuple((fld.name, hints[fld.name]) for fld in flds)
        optional: list[Any] = []
        for fld in reversed(flds):
            if not fld.metadata.get("optional"):
                break
            factory = fld.default_factory
            optional.insert(0, factory() if factory is not dataclasses.MISSING else fld.default)
        _OPTIONAL[cls] = tuple(optional)
        _PARSE_FIELDS[cls] = tuple((name, _parser(tp)) for name, tp in f)
        _FIELDS[cls] = f
    return f


class _Bad(Exception):
    """Internal: a value does not match its field type."""


def _parser(tp: Any) -> typing.Callable[[Any], Any]:
    """The parser of field type ``tp``, built once per type (:data:`_PARSERS`): a function of the
    value that returns it checked, rows converted to their named tuples, or raises :class:`_Bad`.

    Decoding runs for every control message on the per-operation path (votes, reports, the master's
    answers), so the annotations are walked once here instead of once per value.
    """
    f = _PARSERS.get(tp)
    if f is None:
        f = _PARSERS[tp] = _build_parser(tp)
    return f


def _build_parser(tp: Any) -> typing.Callable[[Any], Any]:
    row = _row_fields(tp)
    if row is not None:
        # trailing fields with a default may be missing (rows of peers from before they were added)
        required = len(row) - len(getattr(tp, "_field_defaults", {}))
        most = len(row)
        checks = tuple(_checker(t) for t in row)

        def parse_row(value: Any) -> Any:
            if not isinstance(value, (list, tuple)) or not required <= len(value) <= most:
                raise _Bad
            for v, check in zip(value, checks, strict=False):  # (len(value) <= len(checks))
                if not check(v):
                    raise _Bad
            return tp(*value)

        return parse_row
    if get_origin(tp) is list:
        (arg,) = get_args(tp) or (Any,)
        if _row_fields(arg) is not None:
            item = _parser(arg)

            def parse_rows(value: Any) -> Any:
                if not isinstance(value, list):
                    raise _Bad
                return [item(v) for v in value]

            return parse_rows
    check = _checker(tp)

    def parse(value: Any) -> Any:
        if not check(value):
            raise _Bad
        return value

    return parse


_PARSERS: dict[Any, typing.Callable[[Any], Any]] = {}
_CHECKERS: dict[Any, typing.Callable[[Any], bool]] = {}


def _checker(tp: Any) -> typing.Callable[[Any], bool]:
    """The type check of ``tp`` (a function of the value), built once per type."""
    f = _CHECKERS.get(tp)
    if f is None:
        f = _CHECKERS[tp] = _build_checker(tp)
    return f


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _build_checker(tp: Any) -> typing.Callable[[Any], bool]:
    if tp is Any:
        return lambda v: True
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extras = get_args(tp)
        inner = _checker(base)
        bounds = [x for x in extras if isinstance(x, Range)]
        if not bounds:
            return inner
        lo, hi = bounds[0].lo, bounds[0].hi
        if base is float:
            return lambda v: inner(v) and lo <= v <= hi and math.isfinite(v)
        return lambda v: inner(v) and lo <= v <= hi
    if origin is typing.Union or origin is types.UnionType:
        options = get_args(tp)
        return lambda v: any(_checker(a)(v) for a in options)
    if tp is type(None):
        return lambda v: v is None
    if tp is bool:
        return lambda v: isinstance(v, bool)
    if tp is int:
        return _is_int
    if tp is float:
        return _is_float
    if tp is str:
        return lambda v: isinstance(v, str)
    if tp is bytes:
        return lambda v: isinstance(v, bytes)
    if origin is list:
        (arg,) = get_args(tp) or (Any,)
        if arg is Any:
            return lambda v: isinstance(v, list)
        if arg is list or (get_origin(arg) is list and get_args(arg) in ((), (Any,))):
            return lambda v: isinstance(v, list) and all(isinstance(x, list) for x in v)
        item = _checker(arg)
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        ka, va = get_args(tp) or (Any, Any)
        kc, vc = _checker(ka), _checker(va)
        return lambda v: isinstance(v, dict) and all(kc(k) and vc(x) for k, x in v.items())

    def unsupported(v: Any) -> bool:  # pragma: no cover - programming error
        raise TypeError(f"unsupported field type {tp!r}")

    return unsupported


def encode(msg: Message) -> bytes:
    """Serialize a message (without the frame length prefix)."""
    cls = type(msg)
    if _REGISTRY.get(cls.TAG) is not cls:
        raise LocalProtocolError(f"{cls.__name__} is not a registered message")
    values = [getattr(msg, name) for name, _ in _fields(cls)]
    defaults = _OPTIONAL[cls]
    keep = len(values)
    while defaults and keep > len(values) - len(defaults) and values[keep - 1] == defaults[
        keep - 1 - (len(values) - len(defaults))
    ]:
        keep -= 1
    return msgpack.packb([cls.TAG, values[:keep]], use_bin_type=True)  # type: ignore[no-any-return]


def decode(payload: bytes, *, unpack_limits: typing.Mapping[str, int] | None = None) -> Message:
    """Parse and validate one message.

    Args:
        payload: the frame's payload.
        unpack_limits: extra ``msgpack.unpackb`` keywords (``max_str_len``, ``max_array_len``, ...;
            see :mod:`pccl.wire.limits`).

    Raises:
        RemoteProtocolError: malformed msgpack, unknown tag, wrong field count or types.
    """
    try:
        obj = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, use_list=True, **(unpack_limits or {})
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise RemoteProtocolError(f"malformed message: {exc}") from exc
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and isinstance(obj[1], list)):
        raise RemoteProtocolError("malformed message envelope")
    tag, values = obj
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {tag}")
    fields = _fields(cls)
    if not len(fields) - len(_OPTIONAL[cls]) <= len(values) <= len(fields):
        if cls is not Hello or len(values) < _HELLO_REQUIRED:
            raise RemoteProtocolError(f"{cls.__name__}: expected {len(fields)} fields, got {len(values)}")
        # The Hello alone tolerates another version's shape (missing trailing fields take their defaults,
        # extra ones are ignored), so that a peer of another protocol version is refused with the version
        # message, naming both versions, rather than as a malformed frame.
        values = values[: len(fields)]
    kwargs: dict[str, Any] = {}
    for (name, parse), value in zip(_PARSE_FIELDS[cls], values, strict=False):  # (values may be fewer)
        try:
            kwargs[name] = parse(value)
        except _Bad:
            raise RemoteProtocolError(f"{cls.__name__}.{name}: bad value {reprlib.repr(value):.80}") from None
    return cls(**kwargs)


def message_types() -> dict[int, type[Message]]:
    """A copy of the registry (tag -> class)."""
    return dict(_REGISTRY)


# ============================================================================================
# Connection set-up (every connection, master and P2P)


@_register(1)
@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """First message on every connection.

    ``purpose`` is "master" (peer -> master) or "p2p" (peer -> peer). For P2P, ``peer_id`` names
    the connecting peer, ``channel`` says what the connection is for ("ring", "state", "bench")
    and ``index`` is its slot in the pool. To the master, ``peer_id`` >= 0 claims the id the peer
    held before it lost its master (it then sends ``Reregister``); the master grants it when free.
    ``nonce``: the connecting side's fresh random challenge (16 to 64 bytes); the secret itself never
    travels (see :mod:`pccl.wire.hello`). For P2P, ``generation`` and ``epoch`` name the
    :class:`P2PCredentials` set whose credential the connecting side proves it holds (``epoch`` -1: none);
    the credential itself never travels either. ``run``: to the master, the run name of the peer
    (``PeerConfig.run``; "" for none), checked before anything else (docs/concepts.md "Run names"); a
    trailing field, so a Hello without it decodes with "" (the framing is unchanged).
    """

    protocol_version: Count
    purpose: str
    peer_id: Seq = -1
    channel: str = ""
    index: Count = 0
    nonce: bytes = b""
    generation: Count = 0
    epoch: Seq = -1
    run: str = ""


# A Hello of another protocol version is decoded as far as its first two fields (see decode).
_HELLO_REQUIRED = 2


@_register(2)
@dataclass(frozen=True, kw_only=True)
class HelloOk(Message):
    """Positive answer to Hello."""

    protocol_version: Count
    peer_id: Seq = -1


@_register(3)
@dataclass(frozen=True, kw_only=True)
class Refused(Message):
    """Last message before the sender closes the connection (version mismatch, kick, ...)."""

    reason: str
    code: int = 0


@_register(4)
@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """Liveness signal, both directions."""


@_register(5)
@dataclass(frozen=True, kw_only=True)
class Challenge(Message):
    """The listener's answer to an acceptable Hello: its own fresh ``nonce`` and ``proof`` that it knows
    the shared secret (an HMAC over both nonces, see :func:`pccl.wire.hello.proof`)."""

    nonce: bytes
    proof: bytes


@_register(6)
@dataclass(frozen=True, kw_only=True)
class Proof(Message):
    """The connecting side's HMAC over both nonces; the listener answers HelloOk or Refused."""

    proof: bytes


@_register(7)
@dataclass(frozen=True, kw_only=True)
class P2PCredentials(Message):
    """Master -> members: the P2P credential set of epoch ``epoch`` of master generation ``generation``
    (docs/security.md "P2P bound to membership"; :mod:`pccl.wire.credentials`), the same message for
    every member.

    ``binding`` is the epoch's random binding (sent to the epoch's members only); ``keys`` lists every
    member's X25519 public key. Both ends of a connection derive its credential from the two members' keys
    and the binding. Sent before the ``EstablishP2P`` of the epoch, and after ``Reregistered``; a newer
    set replaces the older one, a set of the same epoch and binding adds its rows (a rebuilding master
    sends the rows of the members that re-register to the members back before them, batched:
    pccl/master/issued.py).
    """

    SHARED: ClassVar[bool] = True  # the same object goes to many peers: encoded once (wire.stream)

    generation: Count
    epoch: Seq
    binding: bytes
    keys: list[PublicKeyRow]


# ============================================================================================
# Membership (peer -> master)


@_register(10)
@dataclass(frozen=True, kw_only=True)
class Register(Message):
    """A peer asks to join; it listens for P2P connections on ``p2p_port``. ``public_key``: its X25519
    public key for P2P credentials (32 bytes; ``b""``: none, then it can open and accept no P2P
    connection; protocol 5)."""

    p2p_port: Port
    peer_group: Group = 0
    public_key: bytes = b""


@_register(11)
@dataclass(frozen=True, kw_only=True)
class UpdateTopologyVote(Message):
    """Vote to admit pending peers (the ``update_topology`` call)."""


@_register(12)
@dataclass(frozen=True, kw_only=True)
class PeersPendingVote(Message):
    """Collective query: are peers waiting to be accepted?"""


@_register(13)
@dataclass(frozen=True, kw_only=True)
class P2PConnectionsDone(Message):
    """The peer finished opening connections to its ring neighbours for ``epoch``."""

    epoch: Seq
    success: bool
    failed_peers: list[Count] = dataclasses.field(default_factory=list)
    reason: str = ""


@_register(14)
@dataclass(frozen=True, kw_only=True)
class OptimizeTopologyVote(Message):
    """Vote to re-solve the ring from measured bandwidths (no newcomers admitted)."""


@_register(15)
@dataclass(frozen=True, kw_only=True)
class BandwidthReport(Message):
    """Measured links: ``results`` rows are ``[to_peer_id, bytes_per_second, one_way_latency_seconds]``
    (``bytes_per_second`` 0: unreachable); rows of two entries (peers before protocol version 5) carry
    no latency."""

    epoch: Seq
    results: list[list[Any]]


#: ``Reregister.sync_abandoned`` of a peer whose shared-state sync vote was out, with no plan yet, when
#: the master was lost (its call failed there).
SYNC_ABANDONED_VOTED = -2


@_register(16)
@dataclass(frozen=True, kw_only=True)
class Reregister(Message):
    """A member of the run that lost its master registers again (with a restarted or standby master,
    or the same one), instead of ``Register``: its connection's Hello claimed its old ``peer_id``
    (repeated here).

    What it last knew: the ``epoch`` and ``ring`` (peer ids, ring order) of that epoch's members,
    its group's shared-state ``revision`` (-1: never synced) and the master ``generation`` it
    followed. See docs/concepts.md "Surviving the master" for the rules.

    And the operations the master's loss left undecided here (the commit skew, docs/concepts.md
    "Operations in doubt"), so the master decides them the same way for every peer:

    * ``ops_in_doubt``: ``[tag, op_seq, [participant ids]]`` per collective whose part this peer
      finished (CollectiveDone sent, or being sent) without the master's answer;
    * ``ops_abandoned``: ``[tag, op_seq]`` per collective this peer failed at the loss (so nobody can
      have committed it); op_seq -1: it had voted, not commenced;
    * ``ops_committed``: ``[tag, op_seq]``, the last committed op of each recently used tag;
    * ``sync_in_doubt``: ``[]`` or ``[sync_seq, revision, [member ids of the plan]]``, a shared-state
      sync finished here without the master's result; ``sync_abandoned``: the sync_seq of a sync this
      peer failed at the loss (-1: none; :data:`SYNC_ABANDONED_VOTED`: its vote was out, no plan yet);
      ``sync_committed``: the sync_seq of its last applied sync.

    ``public_key``: as in ``Register`` (the same key as before: it is drawn once per process).

    And where it is in a membership round (docs/concepts.md "Rounds in doubt"):

    * ``members_epoch``: the epoch of ``ring``'s members as the master established them (its last
      ``Accepted`` or successful ``TopologyResult``; ``epoch`` also counts failed rounds);
    * ``topology_in_doubt``: ``[]`` or ``[epoch, [member ids], kind]``: an update_topology
      (``kind`` "update") or optimize_topology ("optimize") call that confirmed the ``EstablishP2P``
      of ``epoch`` (``P2PConnectionsDone(success)`` sent) without its ``TopologyResult``;
    * ``topology_abandoned``: -1, or the epoch of a topology call the loss failed here before it
      confirmed a setup (the epoch of the last ``EstablishP2P`` it got in the call, else ``epoch``);
    * ``pending``: ``[epoch, answers, in_doubt, last]``: how many ``PeersPendingResult`` it got at its
      ``epoch``, whether an are_peers_pending vote of it waits for an answer, and the last answer
      (1 / 0; -1: none at this epoch).
    """

    peer_id: Count
    p2p_port: Port
    peer_group: Group
    epoch: Seq
    ring: list[Count]
    revision: Seq
    generation: Count
    ops_in_doubt: list[list[Any]] = dataclasses.field(default_factory=list)
    ops_abandoned: list[list[int]] = dataclasses.field(default_factory=list)
    ops_committed: list[list[int]] = dataclasses.field(default_factory=list)
    sync_in_doubt: list[Any] = dataclasses.field(default_factory=list)
    sync_abandoned: Annotated[int, Range(SYNC_ABANDONED_VOTED, _I63)] = -1
    sync_committed: Seq = -1
    public_key: bytes = b""
    members_epoch: Seq = -1
    topology_in_doubt: list[Any] = dataclasses.field(default_factory=list)
    topology_abandoned: Seq = -1
    pending: list[int] = dataclasses.field(default_factory=list)
    token: bytes = dataclasses.field(default=b"", metadata=OPTIONAL, repr=False, compare=False)  # a secret


@_register(17)
@dataclass(frozen=True, kw_only=True)
class Standbys(Message):
    """The peer knows ``count`` (> 0) master addresses besides this master's and, when it loses this
    master, reconnects to them within its reconnect window: a second master may then hold part of
    the run, so a master in ``quorum="auto"`` mode applies its live quorum rule from now on
    (docs/concepts.md "No split brain"). Sent once after ``Register`` or ``Reregister``."""

    count: Count


# Membership (master -> peer)


@_register(20)
@dataclass(frozen=True, kw_only=True)
class Registered(Message):
    """Registration received; the peer waits to be accepted. ``generation``: the master's
    generation (fencing number), which the peer remembers. ``token``: its member token of that
    generation, which it shows when it re-registers (pccl/master/tokens.py)."""

    peer_id: Count
    generation: Count = 0
    token: bytes = dataclasses.field(default=b"", metadata=OPTIONAL, repr=False, compare=False)  # a secret


@_register(21)
@dataclass(frozen=True, kw_only=True)
class Accepted(Message):
    """The peer is accepted; ``peers`` is the ring-ordered table of accepted peers."""

    SHARED: ClassVar[bool] = True  # the same object for every newcomer of a round: encoded once

    peers: list[PeerRow]
    epoch: Seq


@_register(22)
@dataclass(frozen=True, kw_only=True)
class PeersPendingResult(Message):
    """Answer to the PeersPendingVote collective query."""

    pending: bool


@_register(23)
@dataclass(frozen=True, kw_only=True)
class EstablishP2P(Message):
    """Open connections to your ring neighbours in ``peers`` (ring order), then answer P2PConnectionsDone.

    ``links``: the master's summary of the measured links within the recipient's group,
    ``[slowest bytes/s, fastest / slowest, slowest one-way latency s]`` (the latency left out when
    none was measured), or empty when nothing is measured; every member of a group gets the same,
    and chooses its collectives' schedules with it (docs/topology.md).
    """

    SHARED: ClassVar[bool] = True  # one object per group, sent to each of its members: encoded once

    epoch: Seq
    peers: list[PeerRow]
    links: list[float] = dataclasses.field(default_factory=list, metadata=OPTIONAL)


@_register(26)
@dataclass(frozen=True, kw_only=True)
class Reregistered(Message):
    """The master took the re-registering member back into the run (no admission vote): it keeps its
    id and place; ``generation`` is the master's (never older than the peer's), ``epoch`` its epoch;
    ``token``: its member token of ``generation`` (pccl/master/tokens.py)."""

    peer_id: Count
    generation: Count
    epoch: Seq
    token: bytes = dataclasses.field(default=b"", metadata=OPTIONAL, repr=False, compare=False)  # a secret


@_register(29)
@dataclass(frozen=True, kw_only=True)
class MemberRemoved(Message):
    """The master evicted or kicked member ``peer_id``: its P2P credentials stop working at the
    receiver at once (not at the next epoch) and its connections there are closed."""

    peer_id: Count
    reason: str = ""


@_register(24)
@dataclass(frozen=True, kw_only=True)
class TopologyResult(Message):
    """Final answer to update_topology / optimize_topology; ``peers`` is the new ring-ordered table."""

    SHARED: ClassVar[bool] = True  # the same object for every member of the round: encoded once

    success: bool
    epoch: Seq
    peers: list[PeerRow]
    reason: str = ""
    code: int = 0


@_register(25)
@dataclass(frozen=True, kw_only=True)
class MeasureBandwidth(Message):
    """Measure throughput to each peer in ``targets`` (rows ``[peer_id, host, port]``) and report."""

    epoch: Seq
    targets: list[list[Any]]
    duration: Seconds


# ============================================================================================
# Collectives


@_register(30)
@dataclass(frozen=True, kw_only=True)
class CollectiveInitiate(Message):
    """Vote to start collective ``tag`` in the sender's group.

    ``descriptor`` must be equal on every participant; the master refuses the operation for everyone
    if they differ. ``op_seq``: the sequence number the sender already started the data plane under
    (the one the last ``CollectiveComplete`` of this tag reserved, the speculative start), or -1 when it
    waits for ``CollectiveCommence``.
    """

    tag: Count
    descriptor: CollectiveDescriptor
    op_seq: Seq = -1



class IoRow(NamedTuple):
    """One partner's bytes in a stalled operation, as a member counted them (``CollectiveDone.io``)."""

    peer_id: Count
    sent: Count  # data bytes this member sent to the partner in the operation
    taken: Count  # data bytes of the partner's frames this member read off its connections


@_register(31)
@dataclass(frozen=True, kw_only=True)
class CollectiveDone(Message):
    """The sender finished its part of ``tag`` (or failed it).

    ``op_seq``: the sequence number the sender ran under (the master ignores a report under another
    number than the operation's); -1: whatever this tag runs now (a withdrawal). ``stalled_on``: the
    operation failed because no data moved for ``p2p_stall_timeout`` while the sender's frames to this
    peer were not taken (it does not read, or the link is cut); -1: not so. ``io``: a failed or aborted
    operation's data plane had moved no byte for at least half ``p2p_stall_timeout``; rows ``[peer,
    bytes sent to it, bytes taken from it]`` for this operation (the master compares the two ends of
    each pair: docs/security.md "Members"); empty: not so. ``blocked``: with ``io``, the partners this
    member's sends to were under way then (frames released but not written: they are not in ``sent``).
    ``schedule``: with ``io``, and with the success of an ``"auto"`` operation, the schedule its plan ran
    ("ring", "hd", "tree": ``"auto"`` as the peer resolved it); the master rebuilds the plans the
    participants' reports agree on. ``early``: with ``io``, the partners a later frame of which (in that
    partner's release order) was taken while an earlier one from it was still not, when the data plane
    stood still (it sent out of order, so what this member took from it does not say which of its
    receives completed: the master does not judge it as a holder then, and reads each as an accusation
    like ``stalled_on``; docs/security.md "The plan rule").
    """

    tag: Count
    success: bool
    reason: str = ""
    op_seq: Seq = -1
    stalled_on: Seq = dataclasses.field(default=-1, metadata=OPTIONAL)
    io: list[IoRow] = dataclasses.field(default_factory=list, metadata=OPTIONAL)
    blocked: list[Count] = dataclasses.field(default_factory=list, metadata=OPTIONAL)
    schedule: str = dataclasses.field(default="", metadata=OPTIONAL)
    early: list[Count] = dataclasses.field(default_factory=list, metadata=OPTIONAL)


@_register(32)
@dataclass(frozen=True, kw_only=True)
class CollectiveCommence(Message):
    """Every participant voted: run ``tag`` over the ring ``peers`` (ring order, this group only).

    Sent on the slow path, when no voter started speculatively; and, under the reserved number, to the
    voters that did not have it while the others run speculatively. With ``peers`` empty: the
    speculative start under ``op_seq`` is confirmed (every participant voted; the receiver's data plane
    already runs, this starts its stall clock). ``forget``: speculative sequence numbers of voters lost
    or withdrawn meanwhile, whose frames the receivers drop.
    """

    SHARED: ClassVar[bool] = True  # one object per round, sent to every voter: encoded once (wire.stream)

    tag: Count
    op_seq: Seq
    peers: list[PeerRow]
    forget: list[int] = dataclasses.field(default_factory=list)


@_register(33)
@dataclass(frozen=True, kw_only=True)
class CollectiveComplete(Message):
    """Every participant finished ``tag`` successfully: commit the result.

    ``next_op_seq``: the sequence number reserved for the group's next operation with this tag (-1:
    none); while the epoch and the group stay as they are, every participant starts it under that
    number on its own vote (the speculative start, docs/protocol.md section 4).
    """

    SHARED: ClassVar[bool] = True  # one object per operation, sent to every participant: encoded once

    tag: Count
    op_seq: Seq
    next_op_seq: Seq = -1


@_register(34)
@dataclass(frozen=True, kw_only=True)
class CollectiveAbort(Message):
    """``tag`` failed somewhere (or was refused): restore buffers and raise ``code``.

    ``op_seq``: the receiver's own number for the operation (its speculative one, or the commenced
    one; -1: never commenced). ``forget``: speculative numbers other voters started under, whose frames
    the receiver drops.
    """

    tag: Count
    op_seq: Seq
    reason: str
    code: int
    forget: list[int] = dataclasses.field(default_factory=list)


@_register(35)
@dataclass(frozen=True, kw_only=True)
class ReservationsRevoked(Message):
    """A member of the receiver's group was lost: every op_seq reserved by an earlier
    ``CollectiveComplete`` is void; the group's next operations take the slow path (its commence
    names the living members)."""

    reason: str = ""


# ============================================================================================
# Shared state


@_register(40)
@dataclass(frozen=True, kw_only=True)
class SharedStateSync(Message):
    """Vote to sync shared state.

    ``entries`` rows: ``[key, dtype, shape (list[int]), nbytes, hash (int), allow_content_inequality]``;
    the vote's rows are those of the ``SharedStateEntries`` frames the peer sent just before it, then these.
    """

    revision: Count
    strategy: Count
    entries: list[list[Any]]
    #: Issue 35 item 4, replay: should this peer fetch in a live heal, it takes part in its group's
    #: collectives meanwhile as a participant that contributes nothing (a ``pccl.torch`` DiLoCo with
    #: ``replay_heals``: it keeps each round's reduced result and replays the outer steps it missed), so
    #: the master may run the heal live although every key changes at every sync, and counts it in the
    #: group's collective votes from the heal's start (docs/concepts.md "Replaying the rounds missed").
    observe: bool = dataclasses.field(default=False, metadata=OPTIONAL)


@_register(41)
@dataclass(frozen=True, kw_only=True)
class SharedStatePlan(Message):
    """The election result for the receiving peer.

    ``fetch`` rows: ``[key, expected_hash, holder_ids (list[int])]`` - keys to download, in order of
    preference of holders. ``peers`` is the group's table (for holder addresses).
    """

    sync_seq: Count
    revision: Seq
    fetch: list[list[Any]]
    peers: list[PeerRow]
    #: A live heal (issue 35 item 4; docs/concepts.md "Live heals"), to a holder: the keys it pins (a copy
    #: of their bytes at this revision, served under ``sync_seq`` until a ``SharedStateRelease``).
    pin: list[str] = dataclasses.field(default_factory=list, metadata=OPTIONAL)
    #: A live heal: a holder (empty ``fetch``) gets its ``SharedStateResult`` at once and sends no
    #: ``SharedStateDone``; a fetcher fetches alone (the group does not wait for it), reports, and takes
    #: part in its group's votes again only after its result. False: an ordinary sync.
    live: bool = dataclasses.field(default=False, metadata=OPTIONAL)


@_register(42)
@dataclass(frozen=True, kw_only=True)
class SharedStateDone(Message):
    """The sender finished applying its plan for ``sync_seq``."""

    sync_seq: Count
    success: bool
    rx_bytes: Count = 0
    reason: str = ""


@_register(43)
@dataclass(frozen=True, kw_only=True)
class SharedStateResult(Message):
    """Final answer to sync_shared_state."""

    sync_seq: Seq
    success: bool
    revision: Seq
    reason: str = ""
    code: int = 0
    #: A live heal ended at ``revision`` while the group moved on: the receiver applies it (a complete,
    #: verified state) and votes again at once, in the same call, to fetch what changed since.
    catch_up: bool = dataclasses.field(default=False, metadata=OPTIONAL)


@_register(44)
@dataclass(frozen=True, kw_only=True)
class SharedStateEntries(Message):
    """Rows of the next ``SharedStateSync`` vote, sent ahead of it when the rows would not fit one small
    frame (rows as in ``SharedStateSync.entries``). The master appends them, in order, to the rows of
    the vote that follows; it bounds their total (:data:`pccl.wire.limits.SHARED_STATE_MAX_ENTRIES`)."""

    entries: list[list[Any]]


@_register(45)
@dataclass(frozen=True, kw_only=True)
class SharedStateProgress(Message):
    """How far the sender's fetch for ``sync_seq`` is: ``rx_bytes`` of the ``total_bytes`` its plan names
    (sent at most every :data:`pccl.peer.shared_state.PROGRESS_EVERY` seconds while bytes arrive, never
    after its ``SharedStateDone``; for the status page). The master checks ``rx_bytes <= total_bytes``,
    that ``total_bytes`` is what it planned for the sender and that ``rx_bytes`` never goes back.

    Since protocol version 7 (issue 35 item 5) also the swarm fetch's ``chunks_done`` of ``chunks_total``
    items known so far (a large tensor's chunks are known once its manifest is verified, so the total
    may grow; ``chunks_done <= chunks_total``), the ``donors`` serving it now and the ``donors_lost``
    (failed, stalled or excluded for bad bytes); all 0: not known."""

    sync_seq: Count
    rx_bytes: Count
    total_bytes: Count
    chunks_done: Count = dataclasses.field(default=0, metadata=OPTIONAL)
    chunks_total: Count = dataclasses.field(default=0, metadata=OPTIONAL)
    donors: Count = dataclasses.field(default=0, metadata=OPTIONAL)
    donors_lost: Count = dataclasses.field(default=0, metadata=OPTIONAL)


@_register(46)
@dataclass(frozen=True, kw_only=True)
class SharedStateRelease(Message):
    """Every fetcher of live heal ``sync_seq`` finished or was lost: the receiving holder drops the
    snapshot it pinned for it (``SharedStatePlan.pin``) and refuses further requests for it."""

    sync_seq: Count



# ============================================================================================
# Peer <-> peer (after Hello on a P2P connection)


@_register(60)
@dataclass(frozen=True, kw_only=True)
class StateRequest(Message):
    """Ask a holder for tensors of shared state (``keys``); it answers StateTensor + raw bytes each.

    A fetcher with many keys sends several requests on the connection, each after the previous one's
    tensors arrived, so that every request fits one small frame."""

    sync_seq: Count
    keys: list[str]


@_register(61)
@dataclass(frozen=True, kw_only=True)
class StateTensor(Message):
    """Header for ``nbytes`` raw bytes of tensor ``key`` that follow on the stream."""

    key: str
    nbytes: Count
    hash: int


@_register(64)
@dataclass(frozen=True, kw_only=True)
class StateManifestRequest(Message):
    """Ask a holder for the chunk sums of tensor ``key`` (chunks of ``chunk_bytes``), chunks ``first`` to
    ``first + count - 1``; it answers one StateManifest (see :func:`pccl.kernels.hashing.chunk_sums`)."""

    sync_seq: int
    key: str
    chunk_bytes: int
    first: int
    count: int


@_register(65)
@dataclass(frozen=True, kw_only=True)
class StateManifest(Message):
    """The chunk sums a StateManifestRequest asked for (``sums[i]`` is chunk ``first + i``'s)."""

    key: str
    first: int
    sums: list[int]


@_register(66)
@dataclass(frozen=True, kw_only=True)
class StateChunkRequest(Message):
    """Ask a holder for byte ranges of tensors: ``pieces`` rows ``[key, offset, nbytes]``; it answers one
    StateChunk + raw bytes per row, in order. A fetcher splits its rows over frames like StateRequest's."""

    sync_seq: int
    pieces: list[list[Any]]


@_register(67)
@dataclass(frozen=True, kw_only=True)
class StateChunk(Message):
    """Header for ``nbytes`` raw bytes of tensor ``key`` from byte ``offset`` on (they follow on the
    stream)."""

    key: str
    offset: int
    nbytes: int


@_register(62)
@dataclass(frozen=True, kw_only=True)
class BenchRequest(Message):
    """Bandwidth probe: ``nbytes`` raw bytes follow; the receiver answers BenchResult."""

    nbytes: Count


@_register(63)
@dataclass(frozen=True, kw_only=True)
class BenchResult(Message):
    """Receiver-side timing of a bandwidth probe."""

    nbytes: Count
    seconds: Seconds
