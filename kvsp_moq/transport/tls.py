"""Development TLS material for tests and ``kvsp demo``.

:func:`make_self_signed` returns an EC P-256 key and a certificate chain for ``localhost``,
``127.0.0.1`` and ``::1`` (or the names you give) — the server certificate followed by the
throwaway CA that signed it — in memory; :meth:`SelfSignedCert.write` puts them in files. A
client trusts such a server by putting the same PEM in its ``TransportConfig.ca_data`` /
``ca_file`` (the CA in it is the trust anchor), or skips verification with ``insecure=True``.
Never use this in production.
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
        """The server certificate (the first of the chain)."""
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def ca_certificate(self) -> x509.Certificate:
        """The development CA that signed it (the last of the chain)."""
        return x509.load_pem_x509_certificates(self.cert_pem)[-1]


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
