"""Frozen configuration objects: every timeout and limit in one place, with safe defaults."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

from ._tls import TlsFiles, check_pairing

DEFAULT_MASTER_PORT = 48148
# 7: live heals (issue 35 item 4) and the swarm fetch's chunks and donors in SharedStateProgress (item 5);
# 6: SharedStateProgress (issue 37 item 5); docs/protocol.md section 10
PROTOCOL_VERSION = 7

#: The longest pause between a reconnecting peer's rounds over its master addresses (the backoff
#: starts at 0.05 s and doubles up to this). It bounds how long after a restarted master (or a standby)
#: listens the peers find it, and so the spread of their re-registrations, which the roll call's quiet
#: period covers (MasterConfig.rebuild_quiet). A refused connect costs a fraction of a millisecond.
RECONNECT_BACKOFF_MAX = 0.1


#: Longest run name (docs/concepts.md "Run names").
MAX_RUN_NAME = 64
_RUN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_run_name(name: str | None, who: str) -> None:
    """Raise ValueError unless ``name`` is None, "" or a run name: 1 to 64 letters, digits, ``.``,
    ``_`` and ``-`` (``who`` names the setting in the message)."""
    if name is None or name == "":
        return
    if not isinstance(name, str) or len(name) > MAX_RUN_NAME or not set(name) <= _RUN_CHARS:
        raise ValueError(f"{who} must be at most {MAX_RUN_NAME} letters, digits, '.', '_' or '-', "
                         f"not {name!r}")


def _reject_nan(config: DataclassInstance) -> None:
    """Raise ValueError for a NaN field: it passes every range check (each comparison is False) and then
    never fires (a timeout of NaN never expires)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"{type(config).__name__}.{f.name} must be a number, not NaN")


@dataclass(frozen=True, kw_only=True)
class MasterConfig:
    """Master tunables.

    Attributes:
        heartbeat_interval: seconds between heartbeats the master sends to each peer.
        heartbeat_timeout: a peer silent for longer than this is evicted as if its socket broke.
        hello_timeout: a connection that does not complete its hello in time is closed.
        max_frame_size: largest control frame accepted (checked before allocating).
        send_queue_size: bound of each peer's outgoing message queue.
        secret: optional shared secret; when set, peers must present it to register.
        straggler_timeout: optional faster eviction of hung peers that hold up the others. A peer
            that the rest of its group is waiting for (it has not voted in a vote the others have
            joined, or has not finished a running collective, sync or topology round) and that has
            been silent for longer than this is evicted without waiting for ``heartbeat_timeout``.
            The limit adapts per peer: it is at least twice the longest gap recently seen between
            that peer's messages (so a peer on a jittery link is not evicted for its usual
            silences) and never more than ``heartbeat_timeout``. ``None`` (default) disables it.
            Useful on LANs where peers heartbeat regularly; several hangs close together then cost
            about one straggler timeout each instead of one heartbeat timeout each. Peers whose
            event loop is blocked for longer than this (synchronous compute inside a trio task)
            are evicted when the others wait for them: keep it well above such pauses.
        p2p_setup_timeout: seconds the members of a topology round have to confirm their P2P setup
            after the master sends EstablishP2P. A member still silent about it then (a newcomer
            that ignores EstablishP2P, an accepted peer that never reports) is kicked with the reason
            logged, and the setup is re-run with the others, whose update_topology() then succeeds
            without it. Keep it above PeerConfig.p2p_connection_timeout (10 s by default): an honest
            peer whose connect hangs reports the failure within that time. Default 15 s.
        vote_timeout: an accepted peer that has not joined a vote (collective, shared-state sync,
            topology, are_peers_pending) this many seconds after the first peer of its group voted
            is kicked with the reason logged, and the vote goes on without it (unless the voters are
            fewer than the members missing: then the vote fails for its voters, INVALID_USAGE, and
            nobody is evicted; are_peers_pending votes excepted). It catches a member
            that heartbeats but never votes, which the heartbeat and straggler rules (both about
            silence) never evict. The clock runs only while others already wait for the peer, so
            compute between collectives does not count, only how far one peer lags behind the
            others' vote; the default (1800 s) is far above any lag of a slow trainer in normal
            use (one rank evaluating or checkpointing while the rest wait included). ``None``
            disables it.
        deadlock_grace: when every accepted peer of a group waits in a call that can never complete
            (different calls, or the same call with different tags), the master fails those calls
            with an error naming each peer's call once the situation has lasted this many seconds
            (0: at once). The grace lets asynchronous operations whose votes arrive a moment apart
            pair up. ``None`` disables the detection.
        status_port: serve the status page (``/``), ``/status`` (JSON) and ``/metrics`` (Prometheus)
            over HTTP on this port (0: the system picks one). ``None`` (default): no status server.
        status_host: address the status server binds; ``None``: the master's own bind address.
        quorum: when a *live* master needs a majority of its epoch's members to complete votes
            (docs/concepts.md "Surviving the master", "No split brain"): ``"auto"`` (default) as soon
            as a peer of the run tells this master that it can fail over to another master address
            (it has a reconnect window and a standby address), ``"on"`` always, ``"off"`` never (a
            single-master run that must go on after losing most of its peers at once). A master
            rebuilding from re-registrations needs that majority in every mode.
        quorum_hold_timeout: seconds a master without its quorum (rebuilding, or live and short of
            the majority) holds its votes for members to come back; then it closes every
            connection with ``MASTER_CONNECTION_FAILED`` ("look for a newer master"), so its peers
            fail over through their address lists, and it refuses the run's members from then on.
            ``None``: hold forever. Default 30 s.
        rebuild_grace: a restarted or standby master that rebuilds the run from re-registrations
            holds every vote until all of the last epoch's members are back, or for at most this many
            seconds from the first re-registration (a majority is needed in any case; docs/concepts.md
            "Surviving the master"). Members reconnect with a backoff of up to 0.1 s, so 1 s (ten
            rounds) lets them all return before the run resumes: one that returned after the others
            resumed would retry another call than theirs (a deadlock). The grace is also the most a
            member that died with the master costs the run (the roll call waits for it; operations in
            doubt are then aborted at once; ``rebuild_quiet`` usually ends it sooner). 0: resume at the
            majority.
        rebuild_quiet: the roll call ends sooner once a majority of the last epoch's members is back
            and no member came back for this many seconds (every arrival restarts the wait; the grace
            still bounds it). Live members find a restarted master within one reconnect backoff step
            (0.1 s at most) of it listening, and of each other (within 50 ms in the churn soak), so
            0.3 s leaves a member that died with the master costing the run about that instead of the
            whole grace. In a run whose peers can fail over (the quorum rule applies) it is at least
            ``heartbeat_interval`` + 0.1 s: members that give a hung master up for a standby do so at
            their own heartbeat silence, up to one heartbeat interval apart. A member
            back after the roll call ended is refused (``KICKED``: join again) once its group completed
            an operation without it, unless the run's peers can fail over (docs/concepts.md "Surviving
            the master"). ``None``: only the grace ends it.
        rejoin_grace: a *live* master whose connection to an accepted member breaks (the link flapped,
            a middlebox reset it, or the peer crashed: the master cannot tell) holds every vote for at
            most this many seconds, until the member re-registers (docs/concepts.md "A member's link
            breaks"). Without it, the others' next vote completes without the member and it is
            refused when it comes back (``KICKED``: join again). The cost: a crashed (or closed)
            member delays the survivors' next vote by the grace. 0 (default): no hold. A member
            reconnects at once, then with a backoff of up to 0.1 s: 1 s covers a reset link.
        tls_cert: PEM certificate chain the master serves TLS with (with ``tls_key``); None (default):
            no TLS. Peers then need TLS too (``PeerConfig.tls_*``); see docs/security.md "TLS".
        tls_key: PEM private key of ``tls_cert``.
        tls_ca: PEM CA certificates; when given, every connection must present a client certificate
            signed by one of them (mutual TLS). Needs ``tls_cert``.
        speculative_go_delay: seconds the master holds back the tableless ``CollectiveCommence`` of
            a speculatively started collective (docs/protocol.md section 4). That message only starts
            the participants' stall clocks (``PeerConfig.p2p_stall_timeout``); an operation that
            completes or aborts within this delay, every small one, gets its ``CollectiveComplete``
            or ``CollectiveAbort`` alone: one message per peer and operation instead of two. The
            cost: a stalled speculative data plane is noticed up to this much later. 0: send it as
            soon as the vote completes. Default 0.01 s.
        credentials_batch_delay: seconds the master batches the P2P credential rows of members it
            takes back (a re-registration) before sending them to the members holding the set: a
            restarted master's members return within moments, and a message to every holder at every
            return would cost ``n (n - 1) / 2`` messages at ``n`` members (pccl/master/issued.py).
            The cost: a holder accepts a P2P connection from a member back less than this long ago up
            to this much later. 0: at each return. Default 0.01 s.
        run: the run's name (``pccl-master --run``): a peer that names another run is refused in its
            hello, both sides saying so. None (default): the master takes the name of the first named
            peer it accepts (a restarted master takes its run's name back from the members that
            re-register). Peers without a name join any master. docs/concepts.md "Run names".
        max_open_votes: the most collective votes one member may hold open at once (votes on tags the
            rest of its group has not called yet): a vote beyond it fails for that member with
            ``INVALID_USAGE`` naming the cap, and nothing else happens. Votes on tags nobody else uses
            cost the master work at every message (issue 33: 2000 of them stalled a master for
            seconds); an honest program holds one per collective call in flight. None: no cap.
            Default 256.
        admission_grace: a newcomer the master admitted (by an admission vote) that has not yet taken
            part in a collective or a shared-state sync is evicted, with the reason logged, once the
            others have waited this many seconds on it in a vote (counted from the later of its
            admission and the vote's first ballot). A peer that only answers ``P2PConnectionsDone``,
            or calls nothing after ``connect``, otherwise holds every vote of its group until
            ``vote_timeout`` (issue 33 item 6). Members taken back after a master's loss and members
            that took part once are under ``vote_timeout`` alone. None disables it. Default 60 s.
            A peer evicted so is remembered by source address and key: its rejoin is refused for a
            back-off, then held to a halved grace per strike (pccl/master/penalties.py).
        live_heal_rounds: > 0: a shared-state sync in which some participants must fetch while others
            hold the elected content runs as a *live heal* (docs/concepts.md "Live heals"): the holders
            return at once and serve a pinned copy, the fetchers heal alone, left out of their group's
            votes until done; a fetcher that ends behind the group catches up in the same call, live
            for at most this many rounds in a row, then as an ordinary (blocking) participant. A sync
            stays ordinary when every key its fetchers fetch changed since the group's previous sync
            (the state changes entirely between syncs: no live round could catch up). 0: every sync
            holds its participants until the fetchers have everything. Default 1.
        token_key_file: without a ``secret``, the file holding the key of the member tokens (made,
            mode 0600, on first start): a restarted master, or a standby reading the same file,
            verifies its predecessor's tokens and refuses a stranger's claim on a place in its
            rebuild (docs/security.md "Re-registration"). None (default): a per-user state file,
            ``master-token.key`` under ``$PCCL_STATE_DIR``, else ``$XDG_STATE_HOME/pccl``, else
            ``~/.local/state/pccl`` (pccl/master/token_key.py); where it cannot be kept, claims this
            master cannot verify are refused (logged). "": a random key of this process, whose
            restarted master takes claims on trust while it rebuilds (unsafe without a secret).
    """

    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    hello_timeout: float = 5.0
    max_frame_size: int = 16 * 1024 * 1024
    send_queue_size: int = 1024
    secret: str | None = None
    straggler_timeout: float | None = None
    p2p_setup_timeout: float = 15.0
    vote_timeout: float | None = 1800.0
    deadlock_grace: float | None = 1.0
    status_port: int | None = None
    status_host: str | None = None
    quorum: str = "auto"
    quorum_hold_timeout: float | None = 30.0
    rebuild_grace: float = 1.0
    rebuild_quiet: float | None = 0.3
    rejoin_grace: float = 0.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    speculative_go_delay: float = 0.01
    credentials_batch_delay: float = 0.01
    run: str | None = None
    max_open_votes: int | None = 256
    admission_grace: float | None = 60.0
    live_heal_rounds: int = 1
    token_key_file: str | None = None

    def __post_init__(self) -> None:
        _reject_nan(self)
        if self.admission_grace is not None and self.admission_grace <= 0:
            raise ValueError(f"admission_grace ({self.admission_grace}) must be > 0 or None")
        check_run_name(self.run, "MasterConfig.run")
        if self.live_heal_rounds < 0:
            raise ValueError(f"live_heal_rounds ({self.live_heal_rounds}) must be >= 0")
        if self.max_open_votes is not None and self.max_open_votes < 1:
            raise ValueError(f"max_open_votes ({self.max_open_votes}) must be >= 1 or None")
        if self.speculative_go_delay < 0:
            raise ValueError(f"speculative_go_delay ({self.speculative_go_delay}) must be >= 0")
        if self.credentials_batch_delay < 0:
            raise ValueError(f"credentials_batch_delay ({self.credentials_batch_delay}) must be >= 0")
        if self.rebuild_grace < 0:
            raise ValueError(f"rebuild_grace ({self.rebuild_grace}) must be >= 0")
        if self.rebuild_quiet is not None and self.rebuild_quiet <= 0:
            raise ValueError(f"rebuild_quiet ({self.rebuild_quiet}) must be > 0 or None")
        if self.rejoin_grace < 0:
            raise ValueError(f"rejoin_grace ({self.rejoin_grace}) must be >= 0")
        check_pairing(self.tls_cert, self.tls_key, self.tls_ca, need_ca=False, who="MasterConfig")
        if self.quorum not in ("auto", "on", "off"):
            raise ValueError(f"quorum must be 'auto', 'on' or 'off', not {self.quorum!r}")
        if self.quorum_hold_timeout is not None and self.quorum_hold_timeout <= 0:
            raise ValueError(f"quorum_hold_timeout ({self.quorum_hold_timeout}) must be > 0 or None")
        if self.deadlock_grace is not None and self.deadlock_grace < 0:
            raise ValueError(f"deadlock_grace ({self.deadlock_grace}) must be >= 0 or None")
        if self.vote_timeout is not None and self.vote_timeout <= 0:
            raise ValueError(f"vote_timeout ({self.vote_timeout}) must be > 0 or None")
        if self.p2p_setup_timeout <= 0:
            raise ValueError(f"p2p_setup_timeout ({self.p2p_setup_timeout}) must be > 0")
        if self.status_port is not None and not 0 <= self.status_port < 65536:
            raise ValueError(f"status_port {self.status_port} is out of range (0-65535)")
        if self.heartbeat_interval <= 0 or self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"need 0 < heartbeat_interval ({self.heartbeat_interval}) < heartbeat_timeout "
                f"({self.heartbeat_timeout})"
            )
        if self.straggler_timeout is not None and not 0 < self.straggler_timeout <= self.heartbeat_timeout:
            raise ValueError(
                f"straggler_timeout ({self.straggler_timeout}) must be > 0 and at most heartbeat_timeout "
                f"({self.heartbeat_timeout})"
            )

    @property
    def tls(self) -> TlsFiles | None:
        """The master's TLS files, or None when TLS is off."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)


#: Default ``PeerConfig.recv_stash_limit``: 16 frames of the default 4 MiB ring block. Frames only
#: arrive early by the skew between two peers' starts of one operation (registration follows the
#: master's go-ahead at once), and a frame that does not fit waits for its receive instead of
#: failing, so the stash only saves the sender a wait; see docs/security.md "Early data frames".
DEFAULT_RECV_STASH_LIMIT = 64 << 20

#: Default ``PeerConfig.recv_stash_frames``: the most early frames the stash holds, whatever their size
#: (a frame of length 0 costs no payload bytes but ~350 bytes of bookkeeping). An honest frame that finds
#: it full waits for its receive like one over ``recv_stash_limit``; see docs/security.md.
DEFAULT_RECV_STASH_FRAMES = 4096


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """Peer (communicator) tunables.

    Attributes:
        heartbeat_interval: seconds between heartbeats sent to the master.
        heartbeat_timeout: the master is considered lost after this long without any message.
        connect_timeout: limit for opening one TCP connection (master or P2P).
        p2p_connection_timeout: limit for establishing all P2P connections of a topology update.
        p2p_listen_host: address the P2P listener binds.
        p2p_listen_port: 0 lets the OS choose.
        max_frame_size: largest control frame accepted.
        recv_stash_limit: bytes of ring data frames that arrived before their receive was
            registered which the P2P pool may hold (all incoming connections together; default
            64 MiB, 16 frames of the default 4 MiB block). When a frame does not fit, its
            connection is not read (TCP flow control holds the sender back) until its receive is
            registered, its operation ends or room frees; a connection blocked so for
            ``p2p_stall_timeout`` is closed with a logged reason. 0: never stash, every early frame
            waits for its receive (see ``pccl/peer/pool.py`` and docs/security.md).
        recv_stash_frames: the most early frames the stash holds, whatever their size (default
            4096): frames of length 0 cost no payload bytes, but their bookkeeping does. A frame
            that finds the stash full by count waits like one over ``recv_stash_limit``. What a
            connection stashed is released when it ends.
        p2p_stall_timeout: a collective whose ring moves no data for this long fails with
            RANK_CONNECTION_LOST (catches partitioned P2P links between peers that still reach the
            master; progress is counted per frame, so keep it well above one frame's transfer time).
            Also the bound on how long a P2P reader waits for stash room (see ``recv_stash_limit``),
            and on how long a collective keeps trying to open a connection its plan needs
            (docs/topology.md "Connections").
        state_serve_rate: bytes per second this peer sends at most to shared-state fetchers, over all
            of them (a token bucket, paced: each chunk leaves in pieces of about 10 ms of the rate,
            16-64 KiB, each when the bucket grants it, and on Linux TCP the kernel paces those
            connections at the rate too). Bounds the share of the uplink a heal takes from a member
            that serves it while it trains, over short times as well as on average
            (docs/concepts.md "Live heals"). None (default): no cap. With ``state_serve_idle_rate``,
            the rate while one of this peer's collectives moves data.
        state_serve_idle_rate: serving that yields to this peer's own collectives: bytes per second
            it serves at most while none of them moves data (between data planes: the master round
            trip that ends each collective, a sync's hashing, a training step's compute), at least
            ``state_serve_rate``, which then holds while one runs (the floor: serving never stops,
            a heal always ends). Needs ``state_serve_rate``. None (default): ``state_serve_rate``
            always (docs/concepts.md "Live heals").
        schedule: how collectives move data: "auto" (default: per operation, the cost model picks
            the ring, recursive halving-doubling or a binomial tree from the operation's kind and
            size and the group size; docs/topology.md "Running them live"), or "ring", "hd",
            "tree" to force one (an "hd" broadcast runs the tree; quantized all-reduces always run
            the ring). Part of every collective's descriptor: peers configured differently fail
            the operation with a descriptor mismatch.
        secret: optional shared secret presented to the master and to other peers (None: from
            ``$PCCL_SECRET_FILE`` / ``$PCCL_SECRET`` when set).
        accept_timeout: give up connecting when the master has not accepted this peer within this
            many seconds (a peer that connects to a running run waits until the accepted peers call
            ``update_topology()``); raises PCCLError with result MASTER_CONNECTION_FAILED. None
            (default): wait as long as the master is reachable.
        reconnect_window: how long an accepted peer that lost the master keeps trying to reconnect
            (with backoff, to each master address in turn) before giving up: calls made meanwhile
            wait, then fail with MASTER_CONNECTION_FAILED. Default 60 s: a restarted master (or a
            standby) takes the run back. 0: no reconnection (the master's loss ends the run for this
            peer, every call fails at once, as in the established library). See docs/concepts.md
            "Surviving the master".
        tls_cert: PEM certificate chain of this peer (with ``tls_key`` and ``tls_ca``); None (default):
            no TLS (None too: from ``$PCCL_TLS_CERT`` / ``$PCCL_TLS_KEY`` / ``$PCCL_TLS_CA`` when all
            three fields are None). With TLS every connection of this peer speaks TLS: to the master
            (which must serve TLS), to other peers, and at its P2P listener, which serves this
            certificate and requires one signed by ``tls_ca`` (P2P is always mutual TLS).
        tls_key: PEM private key of ``tls_cert``.
        tls_ca: PEM CA certificates the master's and the other peers' certificates must chain to.
        tls_server_name: the name the master's certificate must be valid for; None (default): the
            host this peer dials (a name or an IP address, as given). P2P connections check the chain
            only (docs/security.md "TLS" says why).
        spin_seconds: while a collective runs, keep polling the sockets instead of sleeping, for up
            to this many seconds after it started (default 1 ms; 0: never). A small operation then
            spends no time waking an idle CPU for each frame and for the master's answer (20% off a
            64 KB all-reduce between two peers on a 2-vCPU VM); a longer one polls only its first
            millisecond. Each polling pass yields the CPU to other runnable processes and threads.
            Off under a virtual clock, and at most one communicator of a process polls at a time
            (``pccl/peer/spin.py``).
        run: the name of the run this peer belongs to (None: ``$PCCL_RUN``, else none). The master
            refuses a named peer when it serves another run, naming both (docs/concepts.md "Run
            names"); ``pccl run`` names the runs it launches. No name: the peer joins any master, as
            in the established API.
        progress: show the progress of a shared-state transfer that lasts more than a second on stderr
            (a bar on a terminal, else a line every 10 s; ``pccl/peer/progress.py``) when
            ``sync_shared_state`` is given no ``progress`` callback. Default True.
        p2p_stripe_target_mbit: when ``p2p_connection_pool_size`` is not set (0, the default), the
            throughput in Mbit/s each partner's connections are first sized for: after the first
            connection to a partner opens, its measured round trip decides how many more to open,
            ``ceil(target * rtt / (0.6 * window))``, and at least 4 where that is more than one (one
            on a LAN, 4 at 50 ms and 5 at 100 ms for the default 1000); the throughput of the
            partner's large transfers then adapts the count (docs/topology.md "Connections per
            partner").
        p2p_max_stripes: the most connections per partner that sizing may open (default 16).
        p2p_congestion_control: the TCP congestion control this peer's ring connections to **far**
            partners send with (a round trip that needs more than one connection's window at
            ``p2p_stripe_target_mbit``: over ~20 ms), default ``"bbr"``; None keeps the kernel's
            default (``net.ipv4.tcp_congestion_control``, cubic on most distributions). Why: under
            random loss cubic carries a small fraction of the link (measured through the WAN
            emulator at 50 ms and 1% loss: 16 MiB over 4 connections in 29.6 s with cubic, 0.64 s with
            bbr), and after an idle gap longer than a retransmission timeout Linux restarts its
            window (a 1 s gap: +16% on the next 64 MiB at 50 ms) where bbr keeps its estimate. Loopback
            and LAN partners keep the default. Where the kernel refuses (no such module, or an
            unprivileged process and a name outside ``net.ipv4.tcp_allowed_congestion_control``) the
            connection keeps the default and a warning says so once (docs/topology.md "Congestion
            control"). A communicator given no ``PeerConfig`` reads ``$PCCL_CONGESTION_CONTROL``
            (``default``: None).
    """

    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    connect_timeout: float = 5.0
    p2p_connection_timeout: float = 10.0
    p2p_listen_host: str = "0.0.0.0"
    p2p_listen_port: int = 0
    max_frame_size: int = 16 * 1024 * 1024
    recv_stash_limit: int = DEFAULT_RECV_STASH_LIMIT
    recv_stash_frames: int = DEFAULT_RECV_STASH_FRAMES
    p2p_stall_timeout: float = 30.0
    state_serve_rate: float | None = None
    state_serve_idle_rate: float | None = None
    schedule: str = "auto"
    secret: str | None = None
    accept_timeout: float | None = None
    reconnect_window: float = 60.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    spin_seconds: float = 1e-3
    run: str | None = None
    progress: bool = True
    p2p_stripe_target_mbit: float = 1000.0
    p2p_max_stripes: int = 16
    p2p_congestion_control: str | None = "bbr"

    def __post_init__(self) -> None:
        _reject_nan(self)
        check_run_name(self.run, "PeerConfig.run")
        cc = self.p2p_congestion_control
        if cc is not None and not (isinstance(cc, str) and 0 < len(cc) < 16 and cc.isascii()
                                   and cc.replace("_", "").isalnum()):
            raise ValueError(f"p2p_congestion_control must be None or a kernel congestion control's name "
                             f"(letters, digits and _, at most 15), not {cc!r}")
        if not self.p2p_stripe_target_mbit > 0:
            raise ValueError(f"p2p_stripe_target_mbit must be > 0, not {self.p2p_stripe_target_mbit}")
        if not 1 <= self.p2p_max_stripes <= 256:
            raise ValueError(f"p2p_max_stripes must be in 1..256, not {self.p2p_max_stripes}")
        if not self.spin_seconds >= 0:
            raise ValueError(f"spin_seconds must be >= 0, not {self.spin_seconds}")
        if self.recv_stash_limit < 0:
            raise ValueError(f"recv_stash_limit must be >= 0, not {self.recv_stash_limit}")
        if self.recv_stash_frames < 1:
            raise ValueError(f"recv_stash_frames must be >= 1, not {self.recv_stash_frames}")
        if self.state_serve_rate is not None and not (self.state_serve_rate > 0
                                                      and math.isfinite(self.state_serve_rate)):
            raise ValueError(f"state_serve_rate must be > 0 bytes/s (finite) or None (no cap), not "
                             f"{self.state_serve_rate}")
        if self.state_serve_idle_rate is not None and not (
                self.state_serve_rate is not None and self.state_serve_idle_rate >= self.state_serve_rate
                and math.isfinite(self.state_serve_idle_rate)):
            raise ValueError(f"state_serve_idle_rate must be finite and >= state_serve_rate (set), not "
                             f"{self.state_serve_idle_rate} (state_serve_rate {self.state_serve_rate})")
        if not self.p2p_stall_timeout > 0:
            raise ValueError(f"p2p_stall_timeout must be > 0, not {self.p2p_stall_timeout}")
        check_pairing(self.tls_cert, self.tls_key, self.tls_ca, need_ca=True, who="PeerConfig")
        if self.tls_server_name is not None and self.tls_cert is None:
            raise ValueError("PeerConfig: tls_server_name without TLS (set tls_cert, tls_key and tls_ca)")

    @property
    def tls(self) -> TlsFiles | None:
        """This peer's TLS files, or None when TLS is off."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)
