"""Mint test certificates with `cryptography`: CAs, server and client leaves, good and bad."""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    """A certificate and its key, as PEM, with paths once written."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_file: Path | None = None
    key_file: Path | None = None

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def write(self, directory: Path, stem: str) -> Issued:
        self.cert_file, self.key_file = directory / f"{stem}.crt", directory / f"{stem}.key"
        self.cert_file.write_bytes(self.cert_pem)
        self.key_file.write_bytes(self.key_pem)
        return self


def make_ca(name: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def issue(
    ca: Issued,
    common_name: str,
    *,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    client: bool = False,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
) -> Issued:
    """A leaf signed by `ca`: server usage by default, client usage with `client=True`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - timedelta(minutes=5))
        .not_valid_after(not_after or now + timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def client_context(
    ca_file: Path, client: Issued | None = None, **versions: ssl.TLSVersion
) -> ssl.SSLContext:
    """What a caller of the gateway uses: trust `ca_file`, present `client` if given."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    for attr, version in versions.items():
        setattr(ctx, attr, version)
    if client is not None:
        assert client.cert_file and client.key_file
        ctx.load_cert_chain(client.cert_file, client.key_file)
    return ctx


def peer_serial(network_stream: object) -> int:
    """The serial of the server certificate on an httpx connection (`response.extensions`)."""
    ssl_object = network_stream.get_extra_info("ssl_object")  # type: ignore[attr-defined]
    der = ssl_object.getpeercert(True)
    return x509.load_der_x509_certificate(der).serial_number
