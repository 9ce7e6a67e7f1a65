"""The peer side: P2P listener and handshake (``p2p``), the ring connection pool (``pool``) and the
communicator that drives them."""
