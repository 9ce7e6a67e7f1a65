"""The peer side: the pure protocol core (``state``), the communicator that runs it (``communicator``),
the P2P listener and handshake (``p2p``), the ring connection pool (``pool``), shared state
(``shared_state``), bandwidth probes (``bandwidth``), the data plane's stall watchdog (``stall``), the
waiters (``mailbox``) and the narrow interfaces the helpers get instead of the communicator (``links``)."""
