"""The TCP congestion control of the ring pool's outgoing connections (:mod:`pccl.peer.ring_links`):
which one a far partner's connections send with (``PeerConfig.p2p_congestion_control``), and its
restart on the connections kept when the stripe sizer lowers a count a lot.

docs/topology.md "Congestion control" and "Connections per partner" say why, with the measurements.
"""

from __future__ import annotations

import logging

from .._config import PeerConfig
from .ring_conn import Conn, path_estimate, restart_congestion_control, set_congestion_control
from .striping import StripeSizer, stripe_count

__all__ = ["RESTART_BELOW", "RingCongestionControl"]

log = logging.getLogger("pccl.p2p")

#: Where the sizer lowers a partner's count to this share of what it was or less, the connections
#: kept restart their congestion control (:func:`~pccl.peer.ring_conn.restart_congestion_control`).
RESTART_BELOW = 2

#: The kernel refused ``p2p_congestion_control`` and this process said so (once).
_warned = False


class RingCongestionControl:
    """What one pool's outgoing ring connections send with.

    Args:
        config: the peer's config (``p2p_congestion_control``, and the target rate and cap that decide
            whether a round trip is far).
    """

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        #: far connections given ``config.p2p_congestion_control`` / that the kernel refused it
        self.set = 0
        self.refused = 0

    def far(self, conn: Conn, sizer: StripeSizer | None, explicit_pool: bool) -> bool | None:
        """Whether ``conn`` goes to a far partner: its sizer's first guess is more than one connection;
        with an explicit pool size, the connection's own round trip asks for more than one window at the
        target rate. None: not known yet (a sized partner's first connection, before its sizer)."""
        if sizer is not None:
            return sizer.guess > 1
        if not explicit_pool:
            return None
        path = path_estimate(conn.stream)
        return path is not None and stripe_count(
            path[0], window_bytes=path[1], target_bytes_per_s=self.config.p2p_stripe_target_mbit * 1e6 / 8,
            max_stripes=self.config.p2p_max_stripes) > 1

    def opened(self, conn: Conn, sizer: StripeSizer | None, explicit_pool: bool) -> None:
        """An outgoing connection opened: a far partner's gets ``config.p2p_congestion_control``. The
        kernel's refusal leaves it as it was, is counted and is logged once per process."""
        name = self.config.p2p_congestion_control
        if not name or not self.far(conn, sizer, explicit_pool):
            return
        refused = set_congestion_control(conn.stream, name)
        if refused is None:
            self.set += 1
            return
        self.refused += 1
        global _warned
        if not _warned:
            _warned = True
            log.warning(
                "p2p_congestion_control %r: the kernel refused it (%s); connections to far peers keep the "
                "system default. Under random loss the default (cubic on most systems) carries a small "
                "share of a long link: load the module (modprobe tcp_%s) and allow it "
                "(sysctl net.ipv4.tcp_allowed_congestion_control), or set p2p_congestion_control=None "
                "(PCCL_CONGESTION_CONTROL=default without a PeerConfig) to keep the default without this "
                "warning", name, refused, name)

    @staticmethod
    def lowered(peer_id: int, conns: list[Conn | None], before: int, after: int) -> None:
        """The sizer lowered ``peer_id``'s count from ``before`` to ``after``: where that is half or less,
        the connections kept (the first ``after`` of ``conns``) must carry at least twice their share,
        so their congestion control restarts (it would keep its estimate of the share for seconds)."""
        if after * RESTART_BELOW > before:
            return
        kept = [c for c in conns[:after] if c is not None and not c.closed]
        restarted = sum(restart_congestion_control(c.stream) for c in kept)
        log.debug("peer %d: congestion control restarted on %d connection(s)", peer_id, restarted)
