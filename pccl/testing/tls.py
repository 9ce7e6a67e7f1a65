"""Throw-away certificates for TLS tests and benchmarks, made with ``trustme`` (the ``test`` extra): a run's
CA, certificates it signs (valid for every address the virtual network hands out and for loopback), and
the bad ones tests need (another CA, expired, another name). Not for production: the keys are written
unencrypted under the directory given.

Example::

    certs = Certs(tmp_path)
    master_config = certs.master(MasterConfig())      # mutual TLS
    peer_config = certs.peer(PeerConfig())
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import trustme

from .._config import MasterConfig, PeerConfig

# Every address the virtual network hands out in these tests, and loopback: a master certificate valid for
# "the master's address" wherever the harness puts it.
#: The identities a certificate gets by default.
ADDRESSES = (*(f"10.0.0.{i}" for i in range(1, 40)), "127.0.0.1", "localhost")


class Certs:
    """A run's CA and the certificates it signs, written as PEM files under ``root``.

    Args:
        root: an existing directory (a test's ``tmp_path``).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.other_ca = trustme.CA()  # a CA the run does not trust
        self.ca_file = self._write("ca.pem", self.ca.cert_pem.bytes())
        self.other_ca_file = self._write("other-ca.pem", self.other_ca.cert_pem.bytes())

    def _write(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.write_bytes(data)
        return str(path)

    def issue(
        self,
        name: str,
        *identities: str,
        ca: trustme.CA | None = None,
        expired: bool = False,
    ) -> str:
        """A PEM file with a fresh key and its certificate chain, signed by ``ca`` (default: the run's).

        Args:
            name: the file's name (``NAME.pem`` under ``root``).
            identities: DNS names or IP addresses it is valid for (default :data:`ADDRESSES`).
            ca: the signing CA (``self.other_ca`` for one the run does not trust).
            expired: valid from 10 days ago to yesterday.

        Returns:
            The path (certificate chain and key in one file: use it for both ``tls_cert`` and ``tls_key``).
        """
        signer = ca or self.ca
        if expired:
            now = datetime.datetime.now(datetime.UTC)
            leaf = signer.issue_cert(*(identities or ADDRESSES), not_before=now - datetime.timedelta(days=10),
                                     not_after=now - datetime.timedelta(days=1))
        else:
            leaf = signer.issue_cert(*(identities or ADDRESSES))
        return self._write(f"{name}.pem", leaf.private_key_and_cert_chain_pem.bytes())

    def master(self, base: MasterConfig, *, mutual: bool = True, cert: str | None = None) -> MasterConfig:
        """``base`` serving TLS with ``cert`` (default: a fresh one for :data:`ADDRESSES`), requiring client
        certificates of the run's CA unless ``mutual`` is False."""
        path = cert or self.issue("master")
        return dataclasses.replace(base, tls_cert=path, tls_key=path, tls_ca=self.ca_file if mutual else None)

    def peer(self, base: PeerConfig, *, cert: str | None = None, ca: str | None = None,
             server_name: str | None = None) -> PeerConfig:
        """``base`` with TLS: ``cert`` (default: a fresh one of the run's CA), trusting ``ca`` (default the
        run's CA), checking the master's certificate for ``server_name`` (default: the address dialled)."""
        path = cert or self.issue("peer", "pccl-peer")
        return dataclasses.replace(base, tls_cert=path, tls_key=path, tls_ca=ca or self.ca_file,
                                   tls_server_name=server_name)


__all__ = ["ADDRESSES", "Certs"]
