"""Certificates for the TLS tests, made with trustme: a run's CA, certificates it signs (for the master's
addresses, on the virtual network and loopback), and the bad ones (another CA, expired, wrong name)."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import trustme

from pccl._config import MasterConfig, PeerConfig

# Every address the virtual network hands out in these tests, and loopback: a master certificate valid for
# "the master's address" wherever the harness puts it.
ADDRESSES = (*(f"10.0.0.{i}" for i in range(1, 40)), "127.0.0.1", "localhost")


@dataclasses.dataclass(frozen=True)
class Pem:
    """One side's files: ``cert`` holds the key and the chain, ``ca`` the CA it trusts."""

    cert: str
    ca: str


class Certs:
    """Writes PEM files under ``root``."""

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
        """A PEM file with a fresh key and its certificate chain, signed by ``ca`` (default: the run's)."""
        signer = ca or self.ca
        if expired:
            now = datetime.datetime.now(datetime.UTC)
            leaf = signer.issue_cert(*(identities or ADDRESSES), not_before=now - datetime.timedelta(days=10),
                                     not_after=now - datetime.timedelta(days=1))
        else:
            leaf = signer.issue_cert(*(identities or ADDRESSES))
        return self._write(f"{name}.pem", leaf.private_key_and_cert_chain_pem.bytes())

    def master(self, base: MasterConfig, *, mutual: bool = True, cert: str | None = None) -> MasterConfig:
        """``base`` serving TLS with a certificate for every test address (mutual TLS unless told)."""
        path = cert or self.issue("master")
        return dataclasses.replace(base, tls_cert=path, tls_key=path, tls_ca=self.ca_file if mutual else None)

    def peer(self, base: PeerConfig, *, cert: str | None = None, ca: str | None = None,
             server_name: str | None = None) -> PeerConfig:
        """``base`` with TLS: a certificate signed by the run's CA (or ``cert``), trusting ``ca`` (default the
        run's CA)."""
        path = cert or self.issue("peer", "pccl-peer")
        return dataclasses.replace(base, tls_cert=path, tls_key=path, tls_ca=ca or self.ca_file,
                                   tls_server_name=server_name)
