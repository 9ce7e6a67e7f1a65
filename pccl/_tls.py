"""TLS settings: the SSL contexts of the master and the peers, built from certificate files, and the
reasons of failed TLS handshakes in words (docs/security.md "TLS").

Roles:

* The **master** serves TLS with its certificate and key. With a CA as well it requires a client
  certificate signed by that CA from every connection (mutual TLS).
* A **peer** is a client of the master and of its P2P neighbours and the server of its own P2P
  listener, so it needs a certificate, its key and the CA: it verifies the master's certificate
  (chain and name), presents its own when the master asks for one, and on P2P connections both sides
  present certificates signed by the CA and verify each other's chain (always mutual TLS).

Names: a peer checks that the master's certificate is valid for the host it dials (or
``PeerConfig.tls_server_name``). P2P connections check the chain only, not a name: peers dial the
address the master's peer table holds for a neighbour (the source address the master saw, which NAT,
several interfaces or DHCP make unpredictable), so a peer certificate cannot be expected to name it;
on P2P "signed by the run's CA" is the identity that TLS proves, and which member a connection
belongs to is the handshake's business (peer id, secret, master-issued credentials). Use a CA of
your own for a run, never a public one, for that reason.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from ._errors import InvalidArgumentError


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of one side.

    Attributes:
        cert: certificate chain (this side's certificate first).
        key: its private key (may be the same file as ``cert``).
        ca: CA certificates that the other side's certificate must chain to; None: no CA (only a
            master may have none: it then asks for no client certificate).
    """

    cert: str
    key: str
    ca: str | None = None


def check_pairing(cert: str | None, key: str | None, ca: str | None, *, need_ca: bool, who: str) -> bool:
    """Validate which TLS files are given; True when TLS is on (a certificate is given).

    Args:
        cert: certificate path or None.
        key: key path or None.
        ca: CA path or None.
        need_ca: the CA is required when TLS is on (peers).
        who: the config's name, for the message.

    Raises:
        ValueError: a certificate without its key (or the reverse), or a CA without a certificate, or
            (``need_ca``) a certificate without a CA.
    """
    if (cert is None) != (key is None):
        raise ValueError(f"{who}: tls_cert and tls_key go together (give both or neither)")
    if cert is None:
        if ca is not None:
            raise ValueError(f"{who}: tls_ca without tls_cert and tls_key (TLS needs this side's "
                             "certificate and key too)")
        return False
    if need_ca and ca is None:
        raise ValueError(f"{who}: TLS needs tls_ca as well: a peer verifies the master's and the other "
                         "peers' certificates against it")
    return True


def _load(ctx: ssl.SSLContext, files: TlsFiles, *, chain: bool) -> None:
    # ssl names no file when one is missing: try each first, so that the message can.
    for path in (files.cert, files.key, files.ca) if chain else (files.ca,):
        if path is not None:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise InvalidArgumentError(f"TLS: cannot read {path}: {exc.strerror or exc}") from None
    try:
        if chain:
            ctx.load_cert_chain(files.cert, files.key)
        if files.ca is not None:
            ctx.load_verify_locations(cafile=files.ca)
    except ssl.SSLError as exc:
        what = "certificate or key" if chain else "CA"
        raise InvalidArgumentError(
            f"TLS: cannot load the {what} ({files.cert}, {files.key}, CA {files.ca}): {reason(exc)}"
        ) from None
    except OSError as exc:  # read between the check above and here
        raise InvalidArgumentError(f"TLS: cannot read {files.cert}, {files.key}, {files.ca}: {exc}") from None


def _base(purpose: ssl.Purpose) -> ssl.SSLContext:
    ctx = ssl.create_default_context(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The context of a listener (the master's, a peer's P2P listener): serves ``files.cert``; with a CA,
    requires a client certificate signed by it.

    Raises:
        InvalidArgumentError: a file cannot be read or is not a valid certificate / key / CA.
    """
    ctx = _base(ssl.Purpose.CLIENT_AUTH)
    ctx.verify_mode = ssl.CERT_NONE
    _load(ctx, files, chain=True)
    if files.ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(files: TlsFiles, *, check_hostname: bool) -> ssl.SSLContext:
    """The context of a connecting peer: verifies the listener's certificate against ``files.ca`` (and,
    with ``check_hostname``, that it is valid for the name dialled), presents ``files.cert`` when asked.

    Raises:
        InvalidArgumentError: no CA, or a file cannot be read or is not valid.
    """
    if files.ca is None:
        raise InvalidArgumentError("TLS: a connecting side needs a CA to verify the other side")
    ctx = _base(ssl.Purpose.SERVER_AUTH)
    ctx.check_hostname = check_hostname
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, files, chain=True)
    return ctx


# Reasons OpenSSL gives, in words that say what to fix. Keys are SSLError.reason values.
_REASONS = {
    "WRONG_VERSION_NUMBER": "the other side does not speak TLS (a plain-TCP pccl?)",
    "HTTP_REQUEST": "the other side does not speak TLS",
    "UNSUPPORTED_PROTOCOL": "the other side speaks an old TLS version",
    "PACKET_LENGTH_TOO_LONG": "the other side does not speak TLS",
    "RECORD_LAYER_FAILURE": "the other side does not speak TLS",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the other side requires a client certificate and got none",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the other side sent no certificate, and one is required",
    "TLSV1_ALERT_UNKNOWN_CA": "the other side does not trust this side's certificate (unknown CA)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the other side refused this side's certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the other side refused this side's certificate: it has expired",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the other side refused this side's certificate",
    "TLSV1_ALERT_DECRYPT_ERROR": "the other side could not verify this side's certificate key",
    "KEY_VALUES_MISMATCH": "the key does not belong to the certificate",
    "NO_START_LINE": "not a PEM file",
}


def _ssl_error(exc: BaseException) -> BaseException | None:
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None or isinstance(seen, ssl.SSLError):
            break
        seen = seen.__cause__ or seen.__context__
    return seen


def is_alert(exc: BaseException) -> bool:
    """True when ``exc`` is (caused by) a TLS alert the other side sent (its reason is then known)."""
    seen = _ssl_error(exc)
    return isinstance(seen, ssl.SSLError) and "ALERT" in str(getattr(seen, "reason", "") or "")


def reason(exc: BaseException) -> str:
    """A one-line reason for a TLS failure (``exc`` an ``ssl.SSLError``, or an exception caused by one)."""
    seen = _ssl_error(exc)
    if isinstance(seen, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {seen.verify_message}"
    if isinstance(seen, ssl.SSLEOFError | ssl.SSLZeroReturnError):
        return "the other side closed the connection during the TLS handshake"
    if isinstance(seen, ssl.SSLError):
        code = getattr(seen, "reason", None)
        if code in _REASONS:
            return f"{_REASONS[code]} ({code})"
        return f"{code or type(seen).__name__}: {seen.strerror or seen}"
    return str(exc) or type(exc).__name__


__all__ = ["TlsFiles", "check_pairing", "client_context", "is_alert", "reason", "server_context"]
