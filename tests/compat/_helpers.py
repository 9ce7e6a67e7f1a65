"""A pair of connected peers, joined the way the established library's scripts join them."""

from __future__ import annotations

import threading

from pccl import Communicator

JOIN_TIMEOUT = 30.0


def connect_pair(address: str) -> list[Communicator]:
    """Connect two peers of group 0: the first is accepted alone, the second when the first admits it."""
    first = Communicator(address, 0)
    first.connect()
    second = Communicator(address, 0)
    joining = threading.Thread(target=second.connect, daemon=True)
    joining.start()
    try:
        while not first.are_peers_pending():
            pass
        first.update_topology()
        joining.join(JOIN_TIMEOUT)
        assert not joining.is_alive(), "the second peer was not admitted"
    except BaseException:
        first.close()
        second.close()
        raise
    return [first, second]
