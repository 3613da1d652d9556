"""TLS helpers: development certificates for tests and ``kvsp demo``, and the guard that
keeps credentials off unverified connections (docs/security.md).

:func:`make_self_signed` returns an EC P-256 key and a certificate chain for ``localhost``,
``127.0.0.1`` and ``::1`` (or the names you give) — the server certificate followed by the
throwaway CA that signed it — in memory; :meth:`SelfSignedCert.write` puts them in files. A
client trusts such a server by putting the same PEM in its ``TransportConfig.ca_data`` /
``ca_file`` (the CA in it is the trust anchor), or skips verification with ``insecure=True``.
Never use this in production.

:func:`check_credentials` is what a client that sends tokens calls before it connects: with
``insecure`` set it refuses a host other than loopback (:class:`InsecureCredentialsError`)
unless ``allow_insecure_remote`` says otherwise, and :func:`warn_unverified` logs, once per
purpose and process, that verification is off.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .config import TransportConfig
from .url import parse_moqt_url

__all__ = [
    "InsecureCredentialsError",
    "SelfSignedCert",
    "WEBTRANSPORT_HASH_MAX_DAYS",
    "certificate_sha256",
    "check_credentials",
    "is_loopback_host",
    "make_self_signed",
    "warn_unverified",
]

log = logging.getLogger(__name__)

#: The longest validity a certificate may have for a browser to accept it by its hash
#: (W3C WebTransport ``serverCertificateHashes``: ECDSA, at most 14 days).
WEBTRANSPORT_HASH_MAX_DAYS = 14

#: Purposes already warned about in this process (:func:`warn_unverified`).
_WARNED: set[str] = set()


class InsecureCredentialsError(ConnectionError):
    """Credentials would cross a connection whose server certificate is not verified, to a
    host other than loopback (an on-path attacker could harvest them). A ``ConnectionError``,
    so a load path treats it as an unusable source and tries the next one."""


def is_loopback_host(host: str) -> bool:
    """``localhost`` (and names under it, RFC 6761 §6.3), 127.0.0.0/8 or ``::1``."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def warn_unverified(purpose: str) -> None:
    """Log once per ``purpose`` and process that TLS verification is off for it."""
    if purpose in _WARNED:
        return
    _WARNED.add(purpose)
    log.warning("TLS verification disabled for %s: tokens may be harvested", purpose)


def check_credentials(url: str, config: TransportConfig, *, purpose: str = "MOQT") -> None:
    """Before sending credentials to ``url`` (``moqt://``) over ``config``: nothing when the
    server's certificate is verified; with ``config.insecure``, a warning (once per purpose),
    and :class:`InsecureCredentialsError` for a host other than loopback unless
    ``config.allow_insecure_remote``."""
    if not config.insecure:
        return
    host = parse_moqt_url(url).host
    if not is_loopback_host(host) and not config.allow_insecure_remote:
        raise InsecureCredentialsError(
            f"refusing to send credentials to {host} without TLS verification (insecure is set;"
            " set a CA file instead, or allow_insecure_remote to accept the risk)")
    warn_unverified(f"{purpose} ({'loopback' if is_loopback_host(host) else 'remote hosts'})")


@dataclass(frozen=True)
class SelfSignedCert:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, cert_path: str | os.PathLike[str],
              key_path: str | os.PathLike[str]) -> tuple[Path, Path]:
        """Write the certificate and the key (mode 0600) to files; return their paths."""
        cert_file, key_file = Path(cert_path), Path(key_path)
        cert_file.write_bytes(self.cert_pem)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fp:
            fp.write(self.key_pem)
        return cert_file, key_file

    def write_to_dir(self, directory: str | os.PathLike[str],
                     stem: str = "kvsp-dev") -> tuple[Path, Path]:
        """Write ``<stem>.crt`` and ``<stem>.key`` into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        return self.write(d / f"{stem}.crt", d / f"{stem}.key")

    @property
    def certificate(self) -> x509.Certificate:
        """The server certificate (the first of the chain)."""
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def ca_certificate(self) -> x509.Certificate:
        """The development CA that signed it (the last of the chain)."""
        return x509.load_pem_x509_certificates(self.cert_pem)[-1]

    @property
    def sha256(self) -> str:
        """The SHA-256 of the server certificate's DER, hex: the value a browser's
        WebTransport ``serverCertificateHashes`` names (for a certificate of at most
        :data:`WEBTRANSPORT_HASH_MAX_DAYS` days)."""
        return self.certificate.fingerprint(hashes.SHA256()).hex()

    @property
    def ca_pem(self) -> bytes:
        """The CA certificate alone, PEM: a client's trust anchor (``ca_file`` / ``ca_data``)."""
        return self.ca_certificate.public_bytes(serialization.Encoding.PEM)


def make_self_signed(
    dns_names: Iterable[str] = ("localhost",),
    ip_addresses: Iterable[str] = ("127.0.0.1", "::1"),
    *,
    common_name: str = "kvsp-moq development",
    days: int = 30,
) -> SelfSignedCert:
    """Make a development CA and a server certificate it signed, both EC P-256, valid for
    ``days`` days (from one hour ago, to tolerate clock skew).

    ``cert_pem`` is the chain: the server certificate (subjectAltName ``dns_names`` and
    ``ip_addresses``, serverAuth, CA:FALSE) followed by the CA certificate (CA:TRUE, no
    extended key usage); ``key_pem`` is the server certificate's key. The same PEM serves as
    a server's certificate chain and as a client's trust anchors. Two certificates rather
    than one self-signed leaf, because strict verifiers refuse either shape of the single
    one: webpki/rustls reject a CA certificate used as the end entity, and qh3 excludes a
    self-issued certificate carrying a TLS extended key usage from its trust anchors."""
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    if not sans:
        raise ValueError("a certificate needs at least one DNS name or IP address")
    now = _dt.datetime.now(_dt.timezone.utc)
    start, end = now - _dt.timedelta(hours=1), now + _dt.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name + " CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return SelfSignedCert(
        cert_pem=leaf.public_bytes(pem) + ca.public_bytes(pem),
        key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=cert_sign, crl_sign=False, encipher_only=False,
                         decipher_only=False)


def certificate_sha256(config: TransportConfig) -> str | None:
    """The SHA-256 (hex) of the first certificate a server configured with ``config``
    presents (``certificate_pem`` or ``certificate_file``), for WebTransport's
    ``serverCertificateHashes``; None when it has none."""
    pem = config.certificate_pem
    if pem is None and config.certificate_file is not None:
        pem = Path(config.certificate_file).read_bytes()
    if pem is None:
        return None
    return x509.load_pem_x509_certificate(pem).fingerprint(hashes.SHA256()).hex()
