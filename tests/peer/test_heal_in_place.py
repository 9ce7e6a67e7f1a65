"""A swarm fetch's chunk that lands in place in the staging buffer (pccl/peer/heal.py): another donor's
copy of it, verified and written over the range before the in-place copy is checked, must not make that
check pass for the donor whose bytes were written over."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from pccl.kernels import hashing
from pccl.peer import heal
from pccl.peer.swarm import Item, Piece

MIB = 1 << 20
HONEST, LIAR = 1, 2


def _fetch() -> tuple[heal.SwarmFetch, Item, np.ndarray[Any, Any]]:
    good = np.random.default_rng(7).integers(0, 256, 2 * MIB, dtype=np.uint8)
    fetch = heal.SwarmFetch(None, 1, {}, [("big", hashing.content_hash(good), [HONEST, LIAR])],  # type: ignore[arg-type]
                            {"big": 2 * MIB}, {"big": np.zeros(2 * MIB, np.uint8)}, {}, lambda n: None,
                            stall_timeout=1.0, chunk_bytes=MIB, verify_in_thread=False)
    item = Item(id=fetch.schedule.new_id(), holders=frozenset({HONEST, LIAR}), nbytes=MIB,
                pieces=(Piece("big", 0, MIB, hashing.chunk_sum(good[:MIB], 0), False),))
    assert fetch.schedule.next_for(HONEST, 0.0).manifest_key == "big"  # type: ignore[union-attr]
    fetch.schedule.manifest_items([item])  # (as the manifest's arrival adds the chunks)
    return fetch, item, good


async def _check(fetch: heal.SwarmFetch, donor: int, item: Item, landed: list[Any]) -> heal._Conn:
    conn = heal._Conn(donor)
    conn.checking.append(item)
    async with trio.open_nursery() as nursery:
        conn.checks = nursery
        await fetch._check(conn, item, landed)
    return conn


async def test_a_copy_written_over_before_its_check_gets_no_credit() -> None:
    fetch, item, good = _fetch()
    piece = item.pieces[0]
    assert fetch.schedule.next_for(LIAR, 0.0) is item  # the liar has the only copy: it lands in place
    lie = fetch._landing(item, LIAR, piece)
    assert lie.in_place
    lie.buf[:] = good[:MIB]
    lie.buf[-1] ^= 0x01  # its bytes are wrong
    item.copies[HONEST] = 0.5  # stolen: the honest copy lands in a buffer of its own
    honest = fetch._landing(item, HONEST, piece)
    assert not honest.in_place
    honest.buf[:] = good[:MIB]
    await _check(fetch, HONEST, item, [honest])  # verified, delivered, written over the liar's range
    assert item.done and bytes(fetch.staged["big"][:MIB]) == good[:MIB].tobytes()
    conn = await _check(fetch, LIAR, item, [lie])  # reads the honest bytes now in its range
    donors = fetch.schedule.statistics()["donors"]
    assert donors[HONEST] == MIB and donors.get(LIAR, 0) == 0  # no credit for bytes it did not send
    assert not conn.bad and item.done and bytes(fetch.staged["big"][:MIB]) == good[:MIB].tobytes()


async def test_a_copy_landing_in_place_after_the_verified_one_fails_and_reopens_the_chunk() -> None:
    fetch, item, good = _fetch()
    piece = item.pieces[0]
    assert fetch.schedule.next_for(LIAR, 0.0) is item
    lie = fetch._landing(item, LIAR, piece)
    item.copies[HONEST] = 0.5
    honest = fetch._landing(item, HONEST, piece)
    honest.buf[:] = good[:MIB]
    await _check(fetch, HONEST, item, [honest])
    lie.buf[:] = good[:MIB]
    lie.buf[-1] ^= 0x01  # the liar's bytes land after the honest copy was written: they are what is read
    conn = await _check(fetch, LIAR, item, [lie])
    assert conn.bad and fetch.schedule.donors[LIAR].excluded
    assert not item.done  # to be fetched again: the staging range holds the liar's bytes


async def test_an_unstolen_copy_in_place_is_credited_as_before() -> None:
    fetch, item, good = _fetch()
    assert fetch.schedule.next_for(LIAR, 0.0) is item
    x = fetch._landing(item, LIAR, item.pieces[0])
    x.buf[:] = good[:MIB]  # (an honest "liar")
    await _check(fetch, LIAR, item, [x])
    assert item.done and fetch.schedule.statistics()["donors"][LIAR] == MIB
