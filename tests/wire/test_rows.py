"""Named wire rows: peer tables and collective descriptors are decoded once, into named tuples, with
the same bytes on the wire as the positional lists they replace."""

from __future__ import annotations

import msgpack
import pytest

from pccl._errors import RemoteProtocolError
from pccl.wire import messages as m

ROW = m.PeerRow(peer_id=3, host="10.0.0.2", port=4100, group=1)
DESC = m.CollectiveDescriptor("all_reduce", 10, 4, 0, -1, 0, 0)


def test_rows_decode_to_named_rows_and_compare_by_value() -> None:
    msg = m.decode(m.encode(m.CollectiveCommence(tag=1, op_seq=2, peers=[ROW, ROW._replace(peer_id=4)])))
    assert isinstance(msg, m.CollectiveCommence)
    assert all(isinstance(r, m.PeerRow) for r in msg.peers)
    assert msg.peers[0] == ROW and msg.peers[0].group == 1 and msg.peers[1].peer_id == 4
    init = m.decode(m.encode(m.CollectiveInitiate(tag=5, descriptor=DESC)))
    assert isinstance(init, m.CollectiveInitiate) and isinstance(init.descriptor, m.CollectiveDescriptor)
    assert init.descriptor == DESC and init.descriptor.element_count == 4
    assert init.descriptor != DESC._replace(element_count=5)


def test_the_bytes_are_the_positional_lists_of_before() -> None:
    encoded = m.encode(m.EstablishP2P(epoch=7, peers=[ROW]))
    assert msgpack.unpackb(encoded) == [m.EstablishP2P.TAG, [7, [[3, "10.0.0.2", 4100, 1]]]]
    # protocol version 3 added the speculative start's op_seq (-1: none) after the descriptor
    raw = msgpack.packb([m.CollectiveInitiate.TAG, [5, ["all_reduce", 10, 4, 0, -1, 0, 0], -1]])
    assert m.decode(raw) == m.CollectiveInitiate(tag=5, descriptor=DESC)
    # the descriptor's schedule request (default "auto") is encoded after the seven fields of before;
    # seven-field descriptors still decode (to "auto")
    assert msgpack.unpackb(m.encode(m.CollectiveInitiate(tag=5, descriptor=DESC))) == [
        m.CollectiveInitiate.TAG, [5, ["all_reduce", 10, 4, 0, -1, 0, 0, "auto"], -1]
    ]
    with pytest.raises(RemoteProtocolError, match="expected 3 fields, got 2"):  # version 2's bytes
        m.decode(msgpack.packb([m.CollectiveInitiate.TAG, [5, ["all_reduce", 10, 4, 0, -1, 0, 0]]]))


@pytest.mark.parametrize(
    "peers",
    [
        [[3, "h", 4100]],  # a field missing
        [[3, "h", 4100, 1, 9]],  # one too many
        [["3", "h", 4100, 1]],  # peer_id not an int
        [[3, "h", 4100, True]],  # a bool is no group
        [3, "h", 4100, 1],  # not a list of rows
    ],
)
def test_a_malformed_row_is_a_protocol_error(peers: list[object]) -> None:
    raw = msgpack.packb([m.Accepted.TAG, [peers, 1]])
    with pytest.raises(RemoteProtocolError, match=r"Accepted\.peers"):
        m.decode(raw)


@pytest.mark.parametrize("descriptor", [[], ["all_reduce", 10, 4], ["all_reduce", "10", 4, 0, -1, 0, 0], "x"])
def test_a_malformed_descriptor_is_a_protocol_error(descriptor: object) -> None:
    raw = msgpack.packb([m.CollectiveInitiate.TAG, [1, descriptor, -1]])
    with pytest.raises(RemoteProtocolError, match=r"CollectiveInitiate\.descriptor"):
        m.decode(raw)
