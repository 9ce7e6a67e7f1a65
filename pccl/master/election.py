"""Shared-state election: the pure core that decides who fetches which tensor from whom.

No trio, no sockets, no clocks. Every function here is deterministic: the result depends only on the
votes (by peer id, never on the mapping's insertion order) and on the group's last revision.

When every accepted peer of a peer group has called ``sync_shared_state``, the master calls
:func:`elect` once for that group with one :class:`SyncVote` per peer and the group's ``last_revision``
(``None`` before the group's first successful sync), then sends each peer either its fetch plan or its
:class:`Refusal`. Groups are independent: nothing here knows about groups.

Rules (docs/protocol.md section 5):

0. Structure. A vote that fails :func:`validate_vote` (duplicate keys, negative sizes, ``nbytes`` not
   equal to ``prod(shape) * itemsize``, hash outside 64 bits, unknown dtype or strategy, ...) is refused
   with ``Result.INVALID_ARGUMENT`` and takes no further part.

1. Revisions. Let ``L = last_revision``. When ``L`` is not None, a peer whose revision ``r > L + 1``
   skips a revision and is refused (``SHARED_STATE_SYNC_FAILED``, "revision r skips ahead of L+1").
   When ``L`` is None (first sync of the group) any revision is allowed. Among the remaining peers,
   ``R`` = the largest revision; peers at ``R`` are *up-to-date*, peers below are *outdated*: they
   receive everything that differs, ``allow_content_inequality`` tensors included, and hold revision
   ``R`` afterwards. The result's revision is ``R`` (``L``, or 0 when ``L`` is None, if no vote got
   that far). Note that ``R`` is taken over every strategy: if only RECEIVE_ONLY peers hold the newest
   revision, there is no candidate (rule 3) and everyone is refused.

2. Strategies. RECEIVE_ONLY peers declare their content wrong: never elected, never holders, never
   counted in popularity. SEND_ONLY peers declare their content right: they must be up-to-date
   (an outdated SEND_ONLY peer is refused) and never receive. If the up-to-date SEND_ONLY peers do not
   all agree (same schema and same compared content), every one of them is refused ("conflicting
   SEND_ONLY content"): each one claims to be right and nothing says which is; the election then
   proceeds among the rest. A surviving SEND_ONLY peer's schema and content win the election (rule 3),
   and up-to-date peers never fetch ``allow_content_inequality`` tensors, so a SEND_ONLY peer that got
   this far never has anything to receive.
   ENFORCE_POPULAR (the default) peers vote by content and receive when they lose.

3. Election, two levels, among the up-to-date candidates (ENFORCE_POPULAR and SEND_ONLY):

   a. schema = the key-sorted tuple of ``(key, dtype, shape, nbytes, allow_content_inequality)``.
      The most popular schema wins (a SEND_ONLY peer's schema if there is one). EVERY peer, of any
      strategy, outdated ones too, whose schema differs is refused (``SHARED_STATE_SYNC_FAILED``, the
      reason names the missing / extra keys and the differing dtypes / shapes / sizes / flags).
   b. content = the key-sorted tuple of ``(key, hash)`` over the keys whose
      ``allow_content_inequality`` is False. The most popular content among the schema-matching
      candidates wins (a SEND_ONLY peer's content if there is one).

   Ties are broken by the larger count first, then by the schema / content held by the lowest peer
   id. If there is no candidate at all (everyone RECEIVE_ONLY, every candidate refused, the newest
   revision held only by RECEIVE_ONLY peers) every remaining peer is refused with
   ``NO_SHARED_STATE_AVAILABLE``.

4. Plans. The *elected holders* are the candidates whose content equals the elected content; the
   *primary holder* is the one with the lowest id. Every non-refused peer gets a plan:

   - each compared key (``allow_content_inequality`` False) whose hash differs from the elected hash,
     with ``holders`` = the elected holders;
   - outdated peers (RECEIVE_ONLY ones too) also fetch each ``allow_content_inequality`` key whose hash
     differs from the primary holder's, with ``expected_hash`` = the primary holder's hash and
     ``holders`` = the elected holders whose hash for that key equals it. Up-to-date peers, RECEIVE_ONLY
     ones included, never fetch those keys.

   ``holders`` never contains the requester. Its order spreads the load: over all requests of the sync,
   largest tensors first, each request's first choice is the eligible holder with the fewest bytes
   already assigned as a first choice (ties go round-robin by requester and key position), and the
   remaining holders follow in rotation after it, as fallbacks.

5. Identical content everywhere: every plan is empty and zero bytes move.

6. Groups are independent: the master calls :func:`elect` once per group.

The master should record ``result.revision`` as the group's new ``last_revision`` only when
``result.succeeded`` (some peer was not refused).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from .._errors import Result
from .._types import DataType, SharedStateSyncStrategy

__all__ = [
    "HASH_LIMIT",
    "ElectionResult",
    "FetchItem",
    "Refusal",
    "SyncVote",
    "TensorEntry",
    "elect",
    "fetch_rows",
    "validate_vote",
    "vote_from_wire",
]

#: Hashes and revisions are unsigned 64-bit integers on the wire.
HASH_LIMIT = 1 << 64

# How many keys a refusal reason lists per category before it says "and N more": a model has
# thousands of tensors and the reason travels in one control message.
_MAX_LISTED = 5

_VALID_DTYPES = frozenset(int(d) for d in DataType)
_VALID_STRATEGIES = frozenset(int(s) for s in SharedStateSyncStrategy)


# ============================================================================================
# Values


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One tensor of a peer's shared state, as the peer describes it in its vote.

    Attributes:
        key: the tensor's name, unique within the shared state.
        dtype: a :class:`pccl.DataType` value.
        shape: the tensor's shape (non-negative ints).
        nbytes: the tensor's size in bytes; must equal ``prod(shape) * dtype.itemsize``.
        hash: 64-bit content hash of the tensor's bytes.
        allow_content_inequality: True if up-to-date peers may hold different content for this key.
    """

    key: str
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    hash: int
    allow_content_inequality: bool = False


@dataclass(frozen=True, kw_only=True)
class SyncVote:
    """One peer's ``sync_shared_state`` vote.

    Attributes:
        revision: the peer's shared-state revision.
        strategy: how the peer takes part (see the module docstring, rule 2).
        entries: one :class:`TensorEntry` per tensor (any order; keys unique).
    """

    revision: int
    strategy: SharedStateSyncStrategy
    entries: tuple[TensorEntry, ...]


@dataclass(frozen=True, kw_only=True)
class FetchItem:
    """One tensor a peer must download.

    Attributes:
        key: the tensor's name.
        expected_hash: the hash the received bytes must have (the requester re-hashes and checks).
        nbytes: the tensor's size in bytes.
        holders: peer ids that hold exactly ``expected_hash`` for ``key``, in order of preference;
            never the requester; never empty.
    """

    key: str
    expected_hash: int
    nbytes: int
    holders: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """Why one peer's sync was refused.

    Attributes:
        code: the :class:`pccl.Result` the peer's call fails with.
        reason: a human-readable explanation naming the keys / revisions involved.
    """

    code: Result
    reason: str


@dataclass(frozen=True, kw_only=True)
class ElectionResult:
    """The outcome of one group's election.

    Attributes:
        revision: the group's revision after this sync.
        plans: the fetch plan of every non-refused peer (an empty tuple: nothing to fetch).
        refused: the refusal of every refused peer. Every voter is in exactly one of the two.
        elected_holders: the peers holding the elected content, ascending ids (empty if nobody
            could provide it).
    """

    revision: int
    plans: dict[int, tuple[FetchItem, ...]]
    refused: dict[int, Refusal]
    elected_holders: tuple[int, ...]

    @property
    def succeeded(self) -> bool:
        """True if at least one peer was not refused (then ``revision`` becomes the group's last)."""
        return bool(self.plans)


# ============================================================================================
# Structural validation


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; True as a revision or size is a bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _invalid(reason: str) -> Refusal:
    return Refusal(code=Result.INVALID_ARGUMENT, reason=f"malformed shared state: {reason}")


def _validate_entry(index: int, entry: object) -> Refusal | None:
    if not isinstance(entry, TensorEntry):
        return _invalid(f"entry {index} is {type(entry).__name__}, not a TensorEntry")
    if not isinstance(entry.key, str):
        return _invalid(f"entry {index} has a key of type {type(entry.key).__name__}, not str")
    where = f"tensor {entry.key!r}"
    if not _is_int(entry.dtype) or entry.dtype not in _VALID_DTYPES:
        return _invalid(f"{where} has unknown dtype {entry.dtype!r}")
    if not isinstance(entry.shape, tuple):
        return _invalid(f"{where} has a shape of type {type(entry.shape).__name__}, not tuple")
    for dim in entry.shape:
        if not _is_int(dim) or dim < 0:
            return _invalid(f"{where} has an invalid shape dimension {dim!r} in {entry.shape!r}")
    if not _is_int(entry.nbytes) or entry.nbytes < 0:
        return _invalid(f"{where} has an invalid size nbytes={entry.nbytes!r}")
    expected = math.prod(entry.shape) * DataType(entry.dtype).itemsize
    if entry.nbytes != expected:
        return _invalid(
            f"{where} has nbytes={entry.nbytes} but shape {entry.shape} of "
            f"{DataType(entry.dtype).name} needs {expected}"
        )
    if not _is_int(entry.hash) or not 0 <= entry.hash < HASH_LIMIT:
        return _invalid(f"{where} has a hash outside the unsigned 64-bit range: {entry.hash!r}")
    if not isinstance(entry.allow_content_inequality, bool):
        return _invalid(f"{where} has a non-bool allow_content_inequality flag")
    return None


def validate_vote(vote: object) -> Refusal | None:
    """Check a vote's structure, independently of the other votes.

    Args:
        vote: the vote to check (normally a :class:`SyncVote` built from an untrusted wire message).

    Returns:
        None if the vote is well formed, otherwise a :class:`Refusal` with code
        ``Result.INVALID_ARGUMENT`` saying what is wrong: not a SyncVote, revision not an int in
        ``[0, 2**64)``, unknown strategy, entries not a tuple of TensorEntry, a key that is not a str or
        appears twice, unknown dtype, shape not a tuple of non-negative ints, negative ``nbytes`` or
        ``nbytes != prod(shape) * itemsize``, hash outside ``[0, 2**64)``, non-bool flag.
    """
    if not isinstance(vote, SyncVote):
        return _invalid(f"vote is {type(vote).__name__}, not a SyncVote")
    if not _is_int(vote.revision) or not 0 <= vote.revision < HASH_LIMIT:
        return _invalid(f"revision {vote.revision!r} is not an unsigned 64-bit integer")
    if not _is_int(vote.strategy) or vote.strategy not in _VALID_STRATEGIES:
        return _invalid(f"unknown sync strategy {vote.strategy!r}")
    if not isinstance(vote.entries, tuple):
        return _invalid(f"entries is a {type(vote.entries).__name__}, not a tuple")
    seen: set[str] = set()
    for index, entry in enumerate(vote.entries):
        refusal = _validate_entry(index, entry)
        if refusal is not None:
            return refusal
        assert isinstance(entry, TensorEntry)  # checked by _validate_entry; narrows for mypy
        if entry.key in seen:
            return _invalid(f"duplicate key {entry.key!r}")
        seen.add(entry.key)
    return None


def vote_from_wire(*, revision: object, strategy: object, entries: object) -> SyncVote | Refusal:
    """Build and validate a vote from the fields of a decoded ``SharedStateSync`` message.

    Args:
        revision: the message's ``revision``.
        strategy: the message's ``strategy`` (a :class:`pccl.SharedStateSyncStrategy` value).
        entries: the message's ``entries`` rows,
            ``[key, dtype, shape (list[int]), nbytes, hash, allow_content_inequality]``.

    Returns:
        The :class:`SyncVote`, or a :class:`Refusal` (``Result.INVALID_ARGUMENT``) if the fields are
        malformed (see :func:`validate_vote`).
    """
    if not _is_int(strategy) or strategy not in _VALID_STRATEGIES:
        return _invalid(f"unknown sync strategy {strategy!r}")
    if not isinstance(entries, list | tuple):
        return _invalid(f"entries is a {type(entries).__name__}, not a list")
    parsed: list[TensorEntry] = []
    for index, row in enumerate(entries):
        if not isinstance(row, list | tuple) or len(row) != 6:
            return _invalid(f"entry {index} is not a 6-field row")
        key, dtype, shape, nbytes, hash_, aci = row
        if not isinstance(shape, list | tuple):
            return _invalid(f"entry {index} has a shape of type {type(shape).__name__}, not a list")
        parsed.append(
            TensorEntry(
                key=key,
                dtype=dtype,
                shape=tuple(shape),
                nbytes=nbytes,
                hash=hash_,
                allow_content_inequality=aci,
            )
        )
    if not _is_int(revision):
        return _invalid(f"revision {revision!r} is not an unsigned 64-bit integer")
    vote = SyncVote(
        revision=revision,
        strategy=SharedStateSyncStrategy(strategy),
        entries=tuple(parsed),
    )
    refusal = validate_vote(vote)
    return vote if refusal is None else refusal


def fetch_rows(plan: Iterable[FetchItem]) -> list[list[Any]]:
    """Encode a plan as ``SharedStatePlan.fetch`` rows ``[key, expected_hash, holder_ids]``.

    Args:
        plan: the peer's fetch items, in order.

    Returns:
        One row per item, in the same order.
    """
    return [[item.key, item.expected_hash, list(item.holders)] for item in plan]


# ============================================================================================
# Election

_SchemaRow = tuple[str, int, tuple[int, ...], int, bool]
_Schema = tuple[_SchemaRow, ...]
_Content = tuple[tuple[str, int], ...]


@dataclass(frozen=True, kw_only=True)
class _Peer:
    """A validated vote with its derived election keys."""

    peer_id: int
    revision: int
    strategy: SharedStateSyncStrategy
    entries: dict[str, TensorEntry]
    schema: _Schema
    content: _Content

    @classmethod
    def from_vote(cls, peer_id: int, vote: SyncVote) -> _Peer:
        entries = {e.key: e for e in sorted(vote.entries, key=lambda e: e.key)}
        schema = tuple(
            (e.key, int(e.dtype), e.shape, e.nbytes, e.allow_content_inequality) for e in entries.values()
        )
        content = tuple((e.key, e.hash) for e in entries.values() if not e.allow_content_inequality)
        return cls(
            peer_id=peer_id,
            revision=vote.revision,
            strategy=SharedStateSyncStrategy(vote.strategy),
            entries=entries,
            schema=schema,
            content=content,
        )


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    if len(items) > _MAX_LISTED:
        shown += f" and {len(items) - _MAX_LISTED} more"
    return shown


def _dtype_name(dtype: int) -> str:
    return DataType(dtype).name


def _schema_difference(peer: _Peer, elected: Mapping[str, _SchemaRow]) -> str:
    """Describe how ``peer``'s schema differs from the elected one (missing/extra keys, dtypes, ...)."""
    missing = sorted(k for k in elected if k not in peer.entries)
    extra = sorted(k for k in peer.entries if k not in elected)
    parts: list[str] = []
    if missing:
        parts.append(f"missing key(s) {_listing([repr(k) for k in missing])}")
    if extra:
        parts.append(f"unexpected key(s) {_listing([repr(k) for k in extra])}")
    dtypes: list[str] = []
    shapes: list[str] = []
    flags: list[str] = []
    for key, entry in peer.entries.items():
        row = elected.get(key)
        if row is None:
            continue
        _, dtype, shape, _nbytes, aci = row
        if entry.dtype != dtype:
            dtypes.append(f"{key!r} is {_dtype_name(entry.dtype)}, elected {_dtype_name(dtype)}")
        if entry.shape != shape:
            shapes.append(f"{key!r} has shape {entry.shape}, elected {shape}")
        if entry.allow_content_inequality != aci:
            flags.append(
                f"{key!r} has allow_content_inequality={entry.allow_content_inequality}, elected {aci}"
            )
    if dtypes:
        parts.append(f"dtype mismatch: {_listing(dtypes)}")
    if shapes:
        parts.append(f"shape mismatch: {_listing(shapes)}")
    if flags:
        parts.append(f"flag mismatch: {_listing(flags)}")
    # nbytes is validated against shape and dtype, so a size mismatch always shows up above.
    return "; ".join(parts)


def _content_difference(a: _Peer, b: _Peer) -> str:
    """Describe how two peers with possibly different schemas disagree (for SEND_ONLY conflicts)."""
    if a.schema != b.schema:
        return _schema_difference(a, {row[0]: row for row in b.schema})
    b_hashes = dict(b.content)
    keys = [repr(k) for k, h in a.content if b_hashes.get(k) != h]
    return f"different content for key(s) {_listing(keys)}"


def _most_popular(peers: Sequence[_Peer], attribute: str) -> Any:
    """The value of ``attribute`` held by the most peers; ties go to the value of the lowest peer id."""
    counts: dict[Any, int] = {}
    lowest: dict[Any, int] = {}
    for peer in peers:
        value = getattr(peer, attribute)
        counts[value] = counts.get(value, 0) + 1
        lowest[value] = min(lowest.get(value, peer.peer_id), peer.peer_id)
    return min(counts, key=lambda v: (-counts[v], lowest[v]))


@dataclass(kw_only=True)
class _Request:
    """One tensor a requester needs, before its holders are ordered."""

    requester: int
    key: str
    key_position: int
    expected_hash: int
    nbytes: int
    eligible: tuple[int, ...]  # ascending ids, never the requester
    holders: tuple[int, ...] = ()


def _order_holders(requests: list[_Request], requesters: Sequence[int]) -> None:
    """Choose each request's first-choice holder so that bytes spread over the holders.

    Longest-processing-time greedy: the largest tensors are placed first, each on the eligible holder
    with the fewest first-choice bytes so far; ties rotate by requester and key position so that equal
    tensors go round-robin. The other eligible holders follow in rotation as fallbacks (a retry after a
    holder dies picks the next one).
    """
    position = {peer_id: i for i, peer_id in enumerate(requesters)}
    load: dict[int, int] = {}
    for req in sorted(requests, key=lambda r: (-r.nbytes, position[r.requester], r.key_position)):
        n = len(req.eligible)
        start = (position[req.requester] + req.key_position) % n
        best = min(range(n), key=lambda i: (load.get(req.eligible[i], 0), (i - start) % n))
        req.holders = req.eligible[best:] + req.eligible[:best]
        load[req.holders[0]] = load.get(req.holders[0], 0) + req.nbytes


def elect(votes: Mapping[int, SyncVote], *, last_revision: int | None) -> ElectionResult:
    """Run one group's shared-state election (rules in the module docstring).

    Args:
        votes: every accepted group member's vote, by peer id (insertion order is irrelevant).
        last_revision: the group's revision after its last successful sync, None before the first.

    Returns:
        The :class:`ElectionResult`: every voter is either in ``plans`` or in ``refused``.
    """
    refused: dict[int, Refusal] = {}
    peers = _structure_rule(votes, refused)
    peers = _revision_rule(peers, last_revision, refused)
    if not peers:
        return _finish(
            revision=last_revision if last_revision is not None else 0, refused=refused, plans={}, holders=()
        )
    revision = max(p.revision for p in peers)
    peers, senders = _send_only_rule(peers, revision, refused)

    # Rule 3: candidates are the up-to-date peers that do not declare their content wrong.
    candidates = [
        p for p in peers if p.revision == revision and p.strategy != SharedStateSyncStrategy.RECEIVE_ONLY
    ]
    if not candidates:
        reason = _no_candidate_reason(votes, peers, refused, revision)
        for peer in peers:
            refused[peer.peer_id] = Refusal(code=Result.NO_SHARED_STATE_AVAILABLE, reason=reason)
        return _finish(revision=revision, refused=refused, plans={}, holders=())

    # 3a: schema.
    schema: _Schema = senders[0].schema if senders else _most_popular(candidates, "schema")
    peers = _schema_rule(peers, schema, revision, refused)
    candidates = [p for p in candidates if p.peer_id not in refused]

    # 3b: content among the schema-matching candidates (never empty: the elected schema has a holder).
    content: _Content = senders[0].content if senders else _most_popular(candidates, "content")
    holders = tuple(p.peer_id for p in candidates if p.content == content)
    primary = next(p for p in candidates if p.peer_id == holders[0])

    # Rule 4: plans.
    return _finish(
        revision=revision,
        refused=refused,
        plans=_plans(peers, schema, content, holders, primary, revision),
        holders=holders,
    )


def _structure_rule(votes: Mapping[int, SyncVote], refused: dict[int, Refusal]) -> list[_Peer]:
    """Rule 0: the votes that are well-formed, as peers (by id); the others refused."""
    peers: list[_Peer] = []
    for peer_id in sorted(votes):
        vote = votes[peer_id]
        refusal = validate_vote(vote)
        if refusal is not None:
            refused[peer_id] = refusal
        else:
            peers.append(_Peer.from_vote(peer_id, vote))
    return peers


def _revision_rule(peers: list[_Peer], last_revision: int | None, refused: dict[int, Refusal]) -> list[_Peer]:
    """Rule 1: a peer whose revision skips ahead of the group's next is refused."""
    if last_revision is None:
        return peers
    allowed = last_revision + 1
    for peer in peers:
        if peer.revision > allowed:
            refused[peer.peer_id] = Refusal(
                code=Result.SHARED_STATE_SYNC_FAILED,
                reason=(
                    f"revision {peer.revision} skips ahead of {allowed}: the group's last synced "
                    f"revision is {last_revision} and each sync must advance it by exactly one"
                ),
            )
    return [p for p in peers if p.peer_id not in refused]


def _send_only_rule(
    peers: list[_Peer], revision: int, refused: dict[int, Refusal]
) -> tuple[list[_Peer], list[_Peer]]:
    """Rule 2: SEND_ONLY peers must be up-to-date and agree with each other. Returns the peers left and
    the SEND_ONLY ones among them (none when they disagreed: all of them refused)."""
    for peer in peers:
        if peer.strategy == SharedStateSyncStrategy.SEND_ONLY and peer.revision < revision:
            refused[peer.peer_id] = Refusal(
                code=Result.SHARED_STATE_SYNC_FAILED,
                reason=(
                    f"SEND_ONLY peer is outdated: its revision {peer.revision} is below the group's "
                    f"newest revision {revision}; a SEND_ONLY peer must hold the newest state"
                ),
            )
    peers = [p for p in peers if p.peer_id not in refused]
    senders = [p for p in peers if p.strategy == SharedStateSyncStrategy.SEND_ONLY]
    if len({(p.schema, p.content) for p in senders}) <= 1:
        return peers, senders
    sender_ids = ", ".join(str(p.peer_id) for p in senders)
    for peer in senders:
        other = next(q for q in senders if (q.schema, q.content) != (peer.schema, peer.content))
        refused[peer.peer_id] = Refusal(
            code=Result.SHARED_STATE_SYNC_FAILED,
            reason=(
                f"conflicting SEND_ONLY content at revision {revision}: this peer and SEND_ONLY "
                f"peer {other.peer_id} disagree ({_content_difference(peer, other)}); every "
                f"SEND_ONLY peer ({sender_ids}) is refused"
            ),
        )
    return [p for p in peers if p.peer_id not in refused], []


def _schema_rule(
    peers: list[_Peer], schema: _Schema, revision: int, refused: dict[int, Refusal]
) -> list[_Peer]:
    """Rule 3a: a peer whose layout is not the elected ``schema`` is refused, with the difference."""
    elected_rows = {row[0]: row for row in schema}
    for peer in peers:
        if peer.schema != schema:
            refused[peer.peer_id] = Refusal(
                code=Result.SHARED_STATE_SYNC_FAILED,
                reason=(
                    f"shared state does not match the elected layout at revision {revision}: "
                    f"{_schema_difference(peer, elected_rows)}"
                ),
            )
    return [p for p in peers if p.peer_id not in refused]


def _plans(
    peers: list[_Peer], schema: _Schema, content: _Content, holders: tuple[int, ...], primary: _Peer,
    revision: int,
) -> dict[int, tuple[FetchItem, ...]]:
    """Rule 4: what each peer fetches, and from which holders (first choices spread by bytes)."""
    by_id = {p.peer_id: p for p in peers}
    key_position = {row[0]: i for i, row in enumerate(schema)}
    elected_hash = dict(content)
    requests: list[_Request] = []
    for peer in peers:
        outdated = peer.revision < revision
        for key, entry in peer.entries.items():
            if not entry.allow_content_inequality:
                if entry.hash == elected_hash[key]:
                    continue
                expected = elected_hash[key]
                eligible = tuple(h for h in holders if h != peer.peer_id)
            else:
                expected = primary.entries[key].hash
                if not outdated or entry.hash == expected:
                    continue
                eligible = tuple(
                    h for h in holders if h != peer.peer_id and by_id[h].entries[key].hash == expected
                )
            requests.append(
                _Request(
                    requester=peer.peer_id,
                    key=key,
                    key_position=key_position[key],
                    expected_hash=expected,
                    nbytes=entry.nbytes,
                    eligible=eligible,
                )
            )
    requesters = sorted({r.requester for r in requests})
    _order_holders(requests, requesters)
    plans: dict[int, list[FetchItem]] = {p.peer_id: [] for p in peers}
    for req in sorted(requests, key=lambda r: (r.requester, r.key_position)):
        plans[req.requester].append(
            FetchItem(key=req.key, expected_hash=req.expected_hash, nbytes=req.nbytes, holders=req.holders)
        )
    return {peer_id: tuple(items) for peer_id, items in plans.items()}


def _no_candidate_reason(
    votes: Mapping[int, SyncVote], peers: Sequence[_Peer], refused: Mapping[int, Refusal], revision: int
) -> str:
    """Explain why nobody can provide the shared state at ``revision``."""
    receive_only = [
        p.peer_id
        for p in peers
        if p.revision == revision and p.strategy == SharedStateSyncStrategy.RECEIVE_ONLY
    ]
    parts = [f"no peer can provide the shared state at revision {revision}"]
    if receive_only:
        parts.append(f"the up-to-date peers still in the sync are RECEIVE_ONLY ({_ids(receive_only)})")
    else:
        parts.append("no up-to-date peer is left in the sync")
    gone = sorted(pid for pid in refused if pid in votes)
    if gone:
        parts.append(f"refused peers: {_ids(gone)}")
    return "; ".join(parts)


def _ids(ids: Iterable[int]) -> str:
    return ", ".join(str(i) for i in ids)


def _finish(
    *,
    revision: int,
    refused: Mapping[int, Refusal],
    plans: Mapping[int, tuple[FetchItem, ...]],
    holders: tuple[int, ...],
) -> ElectionResult:
    # Dicts in ascending peer-id order so that equal elections compare and print alike.
    return ElectionResult(
        revision=revision,
        plans={pid: plans[pid] for pid in sorted(plans)},
        refused={pid: refused[pid] for pid in sorted(refused)},
        elected_holders=holders,
    )
