"""Issue 18: a member whose link to a live master breaks, through the blocking API (real TCP, threads).

Peer 2 reaches the master through a relay, the test's middlebox, which resets every connection it carries
(RST) while the master and the peers live. Peer 2 and peer 0 are in the all-reduce of a step, peer 1 has
not called it yet; the relay resets peer 2's master link; peer 2's call fails and, as the recovery loop
does, it runs ``update_topology()``, re-registering with the same master; then peer 1 makes its call.
Every peer then retries after ``update_topology()``. Before the rule of docs/concepts.md "A member's link
breaks", peer 0 and peer 1 waited in the all-reduce while peer 2 waited in the topology round (the deadlock
watch failed them with INVALID_USAGE); now every member's call of that all-reduce fails alike and every
step completes with every member.
"""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np

from pccl import PeerConfig
from pccl.blocking import Communicator, MasterNode, PCCLError, ReduceOp, Result

from ._helpers import JOIN_TIMEOUT, admit, run_threads, wait_until

STEPS = 4
CUT_STEP = 1
RETRYABLE = (Result.RANK_CONNECTION_LOST, Result.UPDATE_TOPOLOGY_FAILED)


class Relay:
    """A TCP relay to ``target`` on 127.0.0.1 (a middlebox): :meth:`cut` resets what it carries."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.carried: list[socket.socket] = []
        self.accepted = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            with self._lock:
                self.carried += [a, b]
                self.accepted += 1
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()
            threading.Thread(target=self._pipe, args=(b, a), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def cut(self) -> None:
        """Reset every connection carried now (both sides get an RST); new ones are relayed as before."""
        with self._lock:
            carried, self.carried = self.carried, []
        for s in carried:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()

    def close(self) -> None:
        self.server.close()
        self.cut()


def test_a_member_whose_master_link_breaks_fails_with_every_member_blocking() -> None:
    master = MasterNode("127.0.0.1:0")
    master.run()
    relay = Relay(("127.0.0.1", master.port))
    config = PeerConfig(reconnect_window=JOIN_TIMEOUT, p2p_listen_host="127.0.0.1")
    comms: list[Communicator] = []
    try:
        for i in range(3):
            address = f"127.0.0.1:{relay.port}" if i == 2 else master.address
            c = Communicator(address, 0, config=config)
            if comms:
                connecting = threading.Thread(target=c.connect, daemon=True)
                connecting.start()
                admit(comms)
                connecting.join(JOIN_TIMEOUT)
                assert not connecting.is_alive()
            else:
                c.connect()
            comms.append(c)
        ids = [c.statistics()["peer_id"] for c in comms]
        results: list[list[float]] = [[] for _ in comms]
        failures: list[list[tuple[int, str]]] = [[] for _ in comms]
        in_call = [threading.Event() for _ in comms]  # the peer is about to make the cut step's call
        go = threading.Event()  # peer 1 may make it

        def recover(i: int) -> None:
            while True:
                try:
                    comms[i].update_topology()
                    return
                except PCCLError as exc:
                    if exc.result not in RETRYABLE:
                        raise
                    failures[i].append((-1, "update_topology"))

        def loop(i: int) -> None:
            for step in range(STEPS):
                if step == CUT_STEP:
                    in_call[i].set()
                    if i == 1:
                        assert go.wait(JOIN_TIMEOUT)
                x = np.full(64, float(1 << ids[i]) * (step + 1), np.float32)
                while True:
                    y = x.copy()
                    try:
                        comms[i].all_reduce(y, y, op=ReduceOp.SUM)
                        break
                    except PCCLError as exc:
                        if exc.result not in RETRYABLE:
                            raise
                        assert np.array_equal(y, x)  # a failed all-reduce left the buffer as it was
                        failures[i].append((step, "all_reduce"))
                    recover(i)
                results[i].append(float(y[0]))

        def driver() -> None:
            # Peers 0 and 2 are in the cut step's all-reduce (their votes at the master), peer 1 is not.
            wait_until(lambda: in_call[0].is_set() and in_call[2].is_set() and in_call[1].is_set())
            wait_until(lambda: all(comms[i].statistics()["ops"] for i in (0, 2)))
            before = relay.accepted
            relay.cut()
            # Peer 2 is back (a new connection through the relay) and votes for a topology round.
            wait_until(lambda: relay.accepted > before and master.statistics()["topology_votes"] >= 1)
            go.set()

        run_threads([lambda i=i: loop(i) for i in range(3)] + [driver])
        want = [float(sum(1 << p for p in ids)) * (s + 1) for s in range(STEPS)]
        assert results == [want] * 3  # every step with every member
        for i in range(3):
            assert {s for s, w in failures[i] if w == "all_reduce"} == {CUT_STEP}, failures  # alike
        assert master.statistics()["accepted"] == 3
    finally:
        for c in comms:
            c.close()
        relay.close()
        master.close()
