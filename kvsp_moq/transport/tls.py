"""Self-signed TLS material for development, tests and ``kvsp demo``.

:func:`make_self_signed` returns an EC P-256 key and a certificate for ``localhost``,
``127.0.0.1`` and ``::1`` (or the names you give), in memory; :meth:`SelfSignedCert.write`
puts them in files. A client trusts such a server by putting the certificate in its
``TransportConfig.ca_data`` / ``ca_file`` (the certificate is its own trust anchor), or skips
verification with ``insecure=True``. Never use this in production.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["SelfSignedCert", "make_self_signed"]


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
        return x509.load_pem_x509_certificate(self.cert_pem)


def make_self_signed(
    dns_names: Iterable[str] = ("localhost",),
    ip_addresses: Iterable[str] = ("127.0.0.1", "::1"),
    *,
    common_name: str = "kvsp-moq development",
    days: int = 30,
) -> SelfSignedCert:
    """Make an EC P-256 key and a self-signed certificate valid for ``days`` days (from one
    hour ago, to tolerate clock skew) whose subjectAltName lists ``dns_names`` and
    ``ip_addresses``. It is marked as a CA so that verifiers that insist on CA:TRUE for a
    trust anchor accept it, and carries serverAuth for TLS servers."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    if not sans:
        raise ValueError("a certificate needs at least one DNS name or IP address")
    now = _dt.datetime.now(_dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(hours=1))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          key_cert_sign=True, crl_sign=False, encipher_only=False,
                          decipher_only=False),
            critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return SelfSignedCert(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
    )
