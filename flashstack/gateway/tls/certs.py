"""Certificates: a chain and its key (a bundle), read from PEM, loaded into a server context."""

from __future__ import annotations

import os
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from flashstack.gateway.config import ConfigError, TLSConfig

# TLS 1.2 suites: forward secret AEAD only (TLS 1.3's are all modern and stay at their default).
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL:!MD5:!SHA1:!DSS"
# Keys touch the disk only for the instant OpenSSL reads them (it loads only paths): prefer RAM.
_KEY_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class TLSError(ConfigError):
    """A certificate or key cannot be used; the message says which and what to do."""


@dataclass(frozen=True)
class CertBundle:
    """One certificate chain and its key, with the leaf's facts the renewal schedule needs."""

    cert_pem: bytes
    key_pem: bytes
    serial: int
    subject: str
    not_before: float  # unix seconds
    not_after: float
    loaded_at: float = field(default_factory=time.time)

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes, where: str) -> CertBundle:
        from cryptography import x509  # 10 MB, for gateways that serve TLS only

        try:
            leaf = x509.load_pem_x509_certificate(cert_pem)
        except ValueError as e:
            raise TLSError(f"{where}: not a PEM certificate ({e})") from e
        return cls(
            cert_pem=cert_pem,
            key_pem=key_pem,
            serial=leaf.serial_number,
            subject=leaf.subject.rfc4514_string(),
            not_before=leaf.not_valid_before_utc.timestamp(),
            not_after=leaf.not_valid_after_utc.timestamp(),
        )

    def renew_time(self, fraction: float) -> float:
        """When `fraction` of the lifetime has passed; counted from when we got it, since CAs
        backdate."""
        start = max(self.not_before, min(self.loaded_at, self.not_after))
        return start + fraction * (self.not_after - start)

    @property
    def serial_hex(self) -> str:
        return format(self.serial, "x")


def load_cert_files(cert_file: Path, key_file: Path) -> CertBundle:
    """The bundle in two PEM files; TLSError says which file is wrong."""
    try:
        cert_pem, key_pem = cert_file.read_bytes(), key_file.read_bytes()
    except OSError as e:
        raise TLSError(
            f"cannot read the server certificate: {e}; check server.tls.cert_file/key_file"
        ) from e
    return CertBundle.from_pem(cert_pem, key_pem, str(cert_file))


def server_context(cfg: TLSConfig, bundle: CertBundle) -> ssl.SSLContext:
    """A server context for `bundle`: TLS ≥ 1.2, AEAD ciphers, client verification per `cfg`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion[cfg.min_version.replace(".", "_")]
    ctx.set_ciphers(TLS12_CIPHERS)
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION
    ctx.set_alpn_protocols(["http/1.1"])
    if cfg.client_ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=str(cfg.client_ca_file))
        except (OSError, ssl.SSLError) as e:
            raise TLSError(
                f"server.tls.client_ca_file {cfg.client_ca_file}: {e}; it must be a PEM CA bundle"
            ) from e
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.client_auth == "required" else ssl.CERT_OPTIONAL
    _load_chain(ctx, bundle)
    return ctx


def _load_chain(ctx: ssl.SSLContext, bundle: CertBundle) -> None:
    try:
        load_pem_pair(ctx, bundle.cert_pem, bundle.key_pem)
    except ssl.SSLError as e:
        raise TLSError(
            f"certificate {bundle.subject} (serial {bundle.serial_hex}) does not load with "
            f"its key: {e}"
        ) from e


def load_pem_pair(ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes | None) -> None:
    """`ctx.load_cert_chain` from PEM bytes (key None: it is in cert_pem); ssl.SSLError if they do
    not match."""
    with tempfile.TemporaryDirectory(prefix="flashstack-tls-", dir=_KEY_DIR) as d:  # mode 0700
        cert, key = Path(d, "cert.pem"), Path(d, "key.pem")
        fd = os.open(cert, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # may hold the key too
        with os.fdopen(fd, "wb") as f:
            f.write(cert_pem)
        if key_pem is not None:
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key_pem)
        ctx.load_cert_chain(cert, key if key_pem is not None else None)
