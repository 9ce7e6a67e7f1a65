"""Issue 33 item 1: no message a peer sends takes the master down, its status page (metrics) on.

Before, the master fed every message to its metrics before its state machine and outside the guard that
kicks a misbehaving peer: ``SharedStateDone(success=True, rx_bytes=-1)`` made prometheus_client raise
(a counter cannot go down) and the master process ended. Now every field is checked against its range
when the message is decoded (a negative byte count is malformed: the sender is kicked for a protocol
error), and the observer runs inside the guard (a fault there refuses the sender, the master serves on).

Real TCP on loopback (the status page is a real HTTP server).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import trio

from pccl._errors import Result
from pccl.master.metrics import MasterObserver
from pccl.peer.communicator import Communicator
from pccl.transport import TcpTransport
from pccl.wire import messages as m
from pccl.wire.handshake import offer_hello
from pccl.wire.stream import MessageStream

from ._cluster import FAST_MASTER, LoopbackCluster, gather, loopback_cluster

STATUS_MASTER = dataclasses.replace(FAST_MASTER, status_port=0)


def _ranged(tp: Any) -> tuple[Any, m.Range] | None:
    if typing.get_origin(tp) is not typing.Annotated:
        return None
    base, *extras = typing.get_args(tp)
    return base, next(x for x in extras if isinstance(x, m.Range))


def _valid(tp: Any) -> Any:
    """A value of field type ``tp`` in its range (rows as positional lists, as on the wire)."""
    ranged = _ranged(tp)
    if ranged is not None:
        base, r = ranged
        return base(max(r.lo, min(r.hi, 1)))
    simple = {int: 1, bool: True, float: 0.5, str: "s", bytes: b"b"}
    if tp in simple:
        return simple[tp]
    row = m._row_fields(tp)
    if row is not None:
        return [_valid(f) for f in row]
    if typing.get_origin(tp) is list:
        return []
    if tp is Any:
        return 0
    raise AssertionError(f"no value for {tp!r}")


def _out_of_range(tp: Any) -> list[Any]:
    ranged = _ranged(tp)
    if ranged is None:
        return []
    base, r = ranged
    out: list[Any] = [base(r.lo - 1)]
    if r.hi != math.inf:
        out.append(int(r.hi) + 1)
    if base is float:
        out += [math.nan, math.inf]
    return out


def _bad_cases() -> list[tuple[str, bytes]]:
    """Every ranged field of every message type (and of the rows they carry) with values out of its
    range, the other fields valid: ``(label, payload)``."""
    cases = []
    for cls in m.message_types().values():
        fields = m._fields(cls)
        for i, (name, tp) in enumerate(fields):
            variants: list[Any] = list(_out_of_range(tp))
            row = m._row_fields(tp)
            if row is not None:  # a row's own ranged cells (CollectiveDescriptor.element_count, ...)
                good_row = _valid(tp)
                for j, cell in enumerate(row):
                    variants += [[*good_row[:j], v, *good_row[j + 1:]] for v in _out_of_range(cell)]
            for v in variants:
                values = [_valid(t) for _, t in fields]
                values[i] = v
                cases.append((f"{cls.__name__}.{name}={v!r}",
                              msgpack.packb([cls.TAG, values], use_bin_type=True)))
    return cases


def _valid_cases() -> list[tuple[str, bytes]]:
    """One message of every type with every field in range (most are illegal from a newcomer)."""
    return [(cls.__name__, m.encode(m.decode(msgpack.packb([cls.TAG, [_valid(t) for _, t in m._fields(cls)]],
                                                           use_bin_type=True))))
            for cls in m.message_types().values()]


async def _send_raw(cl: LoopbackCluster, payload: bytes) -> m.Message | None:
    """Register a raw client, send ``payload`` as one frame; the master's goodbye (None: it closed
    without one, or kept the connection until we closed it). Returns once the master let the
    connection go, so the master has handled the frame (or died of it)."""
    connected = cl.master.statistics()["connections"]
    stream = await TcpTransport().connect("127.0.0.1", cl.master.address[1])
    ms = MessageStream(stream, max_frame_size=1 << 20)
    goodbye: m.Message | None = None
    try:
        await offer_hello(ms, purpose="master", secret=None)
        await ms.send(m.Register(p2p_port=5555, peer_group=0))
        reply = await ms.receive()
        assert isinstance(reply, m.Registered), reply
        await stream.send_all(len(payload).to_bytes(4, "little") + payload)
        with trio.move_on_after(0.05):  # a kick comes at once; a frame the master ignores gets none
            while True:
                got = await ms.receive()
                if not isinstance(got, m.Heartbeat):
                    goodbye = got
                    break
    except Exception as exc:  # the master closed the connection (a kick without goodbye read)
        if "closed" not in str(exc).lower() and "broken" not in str(exc).lower():
            raise
    finally:
        await ms.aclose()
    with trio.fail_after(10):
        while cl.master.statistics()["connections"] > connected:
            await trio.sleep(0.002)
    return goodbye


async def _still_serving(cl: LoopbackCluster) -> None:
    """The status page answers and the honest peers all-reduce exactly."""
    url = cl.master.status_url
    assert url is not None
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/metrics")).status_code == 200
        status = (await http.get("/status")).json()
        assert status["counts"]["shared_state_bytes"] >= 0

    async def reduce(i: int, c: Communicator) -> bytes:
        out = np.zeros(64, np.int64)
        await c.all_reduce(np.full(64, i + 1, np.int64), out, tag=7)
        return out.tobytes()

    for res in await gather(cl.comms, reduce):
        assert res == np.full(64, 3, np.int64).tobytes()


async def test_out_of_range_values_of_every_message_type_kick_only_their_sender() -> None:
    cases = _bad_cases()
    assert any(label.startswith("SharedStateDone.rx_bytes=-1") for label, _ in cases)
    assert {label.split(".")[0] for label, _ in cases} >= {
        "Register", "Reregister", "CollectiveInitiate", "CollectiveDone", "SharedStateSync",
        "SharedStateDone", "P2PConnectionsDone", "BandwidthReport", "Standbys", "BenchResult"}
    async with loopback_cluster(2, master_config=STATUS_MASTER) as cl:
        kicked_before = cl.master.statistics()["kicked_total"]
        for label, payload in cases:
            goodbye = await _send_raw(cl, payload)
            assert isinstance(goodbye, m.Refused), label
            assert "protocol error" in goodbye.reason and "bad value" in goodbye.reason, (label, goodbye)
        assert cl.master.statistics()["kicked_total"] - kicked_before == len(cases)
        await _still_serving(cl)


async def test_a_message_of_every_type_from_a_newcomer_never_ends_the_master() -> None:
    async with loopback_cluster(2, master_config=STATUS_MASTER) as cl:
        for label, payload in _valid_cases():
            goodbye = await _send_raw(cl, payload)
            if goodbye is not None:  # illegal from a newcomer: refused with a reason, never a crash
                assert isinstance(goodbye, m.Refused) and goodbye.code != int(Result.INTERNAL_ERROR), (
                    label, goodbye)
        await _still_serving(cl)


@pytest.mark.parametrize("where", ["on_message", "on_effects"])
async def test_a_fault_of_the_status_observer_does_not_end_the_master(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The observer runs inside the guard: a fault there (here injected) refuses the sender of the
    message it choked on (on_message) or is logged (on_effects); the master serves on."""
    real = getattr(MasterObserver, where)

    def faulty(self: MasterObserver, state: Any, arg: Any, *rest: Any) -> None:
        # on_message(state, peer_id, msg, now); on_effects(state, effects, now)
        msgs = [rest[0]] if where == "on_message" else [getattr(e, "message", None) for e in arg]
        if any(isinstance(x, (m.Standbys, m.Registered)) for x in msgs):
            raise ValueError("injected fault of the observer")
        real(self, state, arg, *rest)

    async with loopback_cluster(2, master_config=STATUS_MASTER) as cl:
        monkeypatch.setattr(MasterObserver, where, faulty)
        goodbye = await _send_raw(cl, m.encode(m.Standbys(count=1)))
        if where == "on_message":
            assert isinstance(goodbye, m.Refused) and goodbye.code == int(Result.INTERNAL_ERROR), goodbye
            assert "internal error of the master handling its Standbys" in goodbye.reason
        monkeypatch.setattr(MasterObserver, where, real)
        await _still_serving(cl)
