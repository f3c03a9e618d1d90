"""Server and upstream TLS: certificates from files or Vault, rotated without dropping a connection.

Hot rotation. uvicorn hands asyncio one `ssl.SSLContext` at start-up and wraps every accepted
socket with it. That listening context carries an SNI callback, which OpenSSL calls during every
ClientHello (with or without SNI); the callback moves the new connection onto the context built for
the newest certificate (`SSLObject.context = ...`, OpenSSL's SSL_set_SSL_CTX). Connections already
established keep the certificate they shook hands with, so streams in flight finish untouched, and
the swap is one reference assignment, safe from the renewal thread.

Client identity. With `client_ca_file` set the handshake verifies the client's certificate; the
verified identity is put in each request's scope, as `request.state.client_cert` (a
`ClientIdentity`) and as the ASGI TLS extension `scope["extensions"]["tls"]`, so auth can accept a
certificate in place of an API key. `client_names` narrows the accepted names: a connection whose
certificate matches none is closed before any request is read.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import os
import random
import ssl
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from flashstack.config import ConfigError, ModelConfig, TLSConfig, VaultConfig

log = logging.getLogger("flashstack.tls")

CLIENT_CERT_STATE_KEY = "client_cert"  # request.state.client_cert
# TLS 1.2 suites: forward secret AEAD only (TLS 1.3 suites are all modern and stay at their default).
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL:!MD5:!SHA1:!DSS"
_TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}
# Keys touch the disk only for the instant OpenSSL reads them (it loads only from paths): prefer RAM.
_KEY_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class TLSError(ConfigError):
    """A certificate or key cannot be used; the message says which and what to do."""


# ---- certificates -----------------------------------------------------------------------------


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
            cert_pem=cert_pem, key_pem=key_pem, serial=leaf.serial_number, subject=leaf.subject.rfc4514_string(),
            not_before=leaf.not_valid_before_utc.timestamp(), not_after=leaf.not_valid_after_utc.timestamp(),
        )

    def renew_time(self, fraction: float) -> float:
        """When `fraction` of the lifetime has passed; counted from when we got it, since CAs backdate."""
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
        raise TLSError(f"cannot read the server certificate: {e}; check server.tls.cert_file/key_file") from e
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
            raise TLSError(f"server.tls.client_ca_file {cfg.client_ca_file}: {e}; it must be a PEM CA bundle") from e
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.client_auth == "required" else ssl.CERT_OPTIONAL
    _load_chain(ctx, bundle)
    return ctx


def _load_chain(ctx: ssl.SSLContext, bundle: CertBundle) -> None:
    try:
        load_pem_pair(ctx, bundle.cert_pem, bundle.key_pem)
    except ssl.SSLError as e:
        raise TLSError(f"certificate {bundle.subject} (serial {bundle.serial_hex}) does not load with its key: {e}") from e


def load_pem_pair(ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes | None) -> None:
    """`ctx.load_cert_chain` from PEM bytes (key None: it is in cert_pem); ssl.SSLError if they do not match."""
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


# ---- sources ----------------------------------------------------------------------------------


class CertSource(Protocol):
    """Where certificates come from: the first one at start-up, then replacements."""

    kind: str
    renew_at: float
    error: str | None  # the last failure to get a replacement, None after a success

    def initial(self) -> CertBundle: ...

    def run(self, tls: ServerTLS, stop: threading.Event) -> None: ...


class FileCertSource:
    """cert_file + key_file, polled for changes (mtime, size, inode: catches Kubernetes' symlink swaps).

    `also_watch` (the client CA bundle) triggers a rebuild too, so a new client CA needs no restart.
    """

    kind = "files"

    def __init__(
        self, cert_file: Path, key_file: Path, interval: float, renew_at: float, also_watch: tuple[Path, ...] = ()
    ) -> None:
        self.cert_file, self.key_file, self.interval, self.renew_at = cert_file, key_file, interval, renew_at
        self.also_watch = also_watch
        self.error: str | None = None
        self._seen: tuple[Any, ...] | None = None

    def _stamp(self) -> tuple[Any, ...]:
        stats = [os.stat(p) for p in (self.cert_file, self.key_file, *self.also_watch)]
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)

    def initial(self) -> CertBundle:
        try:
            self._seen = self._stamp()
        except OSError:
            self._seen = None  # load_cert_files says which file is missing
        return load_cert_files(self.cert_file, self.key_file)

    def run(self, tls: ServerTLS, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                stamp = self._stamp()
            except OSError as e:
                self._fail(f"cannot stat the certificate files: {e}")
                continue
            if stamp == self._seen:
                continue
            self._seen = stamp  # a half-written pair fails once, then changes again and loads
            try:
                tls.install(load_cert_files(self.cert_file, self.key_file))
                self.error = None
            except TLSError as e:
                self._fail(str(e))

    def _fail(self, message: str) -> None:
        if message != self.error:
            log.warning("server certificate not reloaded, the current one keeps serving: %s", message)
        self.error = message


class VaultCertSource:
    """Issued by Vault / OpenBao PKI; renewed at `renew_at` of the lifetime, with backoff on failure."""

    kind = "vault"

    def __init__(self, cfg: VaultConfig, issuer: Any = None) -> None:
        from flashstack.gateway.pki import VaultError, VaultIssuer

        self.cfg, self.renew_at = cfg, cfg.renew_at
        try:
            self.issuer = issuer or VaultIssuer(cfg)
        except VaultError as e:
            raise TLSError(str(e)) from e
        self.error: str | None = None
        self.failures = 0  # consecutive failed renewals

    def issue(self) -> CertBundle:
        """One certificate from Vault now; VaultError or TLSError on failure."""
        issued = self.issuer.issue()
        return CertBundle.from_pem(issued.cert_pem.encode(), issued.key_pem.encode(), f"Vault {self.cfg.addr}")

    def initial(self, attempts: int = 3) -> CertBundle:
        from flashstack.gateway.pki import VaultError

        for attempt in range(1, attempts + 1):
            try:
                return self.issue()
            except VaultError as e:
                if attempt == attempts:
                    raise TLSError(f"no server certificate: {e}") from e
                log.warning("Vault did not issue the server certificate (attempt %d/%d): %s", attempt, attempts, e)
                time.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")

    def run(self, tls: ServerTLS, stop: threading.Event) -> None:
        while not stop.wait(max(0.0, tls.bundle.renew_time(self.renew_at) - time.time())):
            self._renew(tls, stop)

    def _renew(self, tls: ServerTLS, stop: threading.Event) -> None:
        from flashstack.gateway.pki import VaultError

        while not stop.is_set():
            try:
                tls.install(self.issue())
            except (VaultError, TLSError) as e:
                self.failures += 1
                self.error = str(e)
                delay = self._backoff(self.failures)
                self._log_failure(tls.bundle, delay)
                if stop.wait(delay):
                    return
                continue
            if self.failures:
                log.warning("Vault is back: renewed the server certificate after %d failed attempts", self.failures)
            self.failures, self.error = 0, None
            return

    def _backoff(self, attempt: int) -> float:
        # Full-range doubling with jitter, so replicas that lost Vault together do not retry together.
        base = min(self.cfg.retry_max, self.cfg.retry_min * 2 ** (attempt - 1))
        return base * random.uniform(0.5, 1.0)

    def _log_failure(self, current: CertBundle, delay: float) -> None:
        left = current.not_after - time.time()
        until = datetime.fromtimestamp(current.not_after, UTC).isoformat(timespec="seconds")
        if left > 0:
            log.warning(
                "renewing the server certificate from Vault failed (attempt %d): %s. The current certificate "
                "(serial %s) keeps serving until %s (%.0f s left); retrying in %.2f s",
                self.failures, self.error, current.serial_hex, until, left, delay,
            )
        else:
            log.error(
                "the server certificate (serial %s) EXPIRED at %s and Vault still fails (attempt %d): %s. "
                "New TLS handshakes are rejected by clients; retrying in %.2f s",
                current.serial_hex, until, self.failures, self.error, delay,
            )


# ---- the server's TLS -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Active:
    context: ssl.SSLContext
    bundle: CertBundle


class ServerTLS:
    """The gateway's server TLS: one listening context, its certificate swapped for new handshakes."""

    def __init__(self, cfg: TLSConfig, source: CertSource) -> None:
        self.cfg, self.source = cfg, source
        bundle = source.initial()
        self._active = _Active(server_context(cfg, bundle), bundle)
        self.context = server_context(cfg, bundle)  # what uvicorn listens with
        self.context.sni_callback = self._select_context
        self.rotations = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: TLSConfig) -> ServerTLS | None:
        """ServerTLS for `cfg`, or None when TLS is off (no cert_file and no vault)."""
        if cfg.vault is not None:
            return cls(cfg, VaultCertSource(cfg.vault))
        if cfg.cert_file is not None and cfg.key_file is not None:
            ca = (cfg.client_ca_file,) if cfg.client_ca_file else ()
            return cls(cfg, FileCertSource(cfg.cert_file, cfg.key_file, cfg.watch_interval, cfg.renew_at, ca))
        return None

    @property
    def bundle(self) -> CertBundle:
        """The certificate new handshakes get."""
        return self._active.bundle

    def install(self, bundle: CertBundle) -> None:
        """Serve `bundle` to every handshake from now on; open connections keep theirs."""
        active = _Active(server_context(self.cfg, bundle), bundle)  # raises before anything changes
        previous, self._active = self._active.bundle, active
        self.rotations += 1
        if previous.serial == bundle.serial:
            log.info("server TLS reloaded (client CA changed; certificate serial %s unchanged)", bundle.serial_hex)
            return
        log.info(
            "server certificate rotated: serial %s → %s (%s), valid until %s", previous.serial_hex,
            bundle.serial_hex, bundle.subject, datetime.fromtimestamp(bundle.not_after, UTC).isoformat(),
        )

    def _select_context(self, ssl_object: Any, server_name: str | None, _listening: ssl.SSLContext) -> None:
        ssl_object.context = self._active.context  # this handshake only; must not raise (alerts the client)

    def start(self) -> ServerTLS:
        """Watch / renew the certificate in a daemon thread (hvac and file I/O stay off the event loop)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flashstack-tls-renewal", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.source.run(self, self._stop)
        except Exception:  # the thread must not die silently: readiness would never learn
            log.exception("the TLS certificate renewal thread crashed; the current certificate keeps serving")
            self.source.error = "the renewal thread crashed; see the log"

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def status(self) -> dict[str, Any]:
        """For readiness: "ok", "warning" (renewal overdue or failing) or "expired" (not ready)."""
        bundle, now, error = self.bundle, time.time(), self.source.error
        if now >= bundle.not_after:
            state = "expired"
        elif error or now >= bundle.renew_time(self.source.renew_at) + 1.0:
            state = "warning"
        else:
            state = "ok"
        report: dict[str, Any] = {
            "status": state, "source": self.source.kind, "serial": bundle.serial_hex, "subject": bundle.subject,
            "not_after": datetime.fromtimestamp(bundle.not_after, UTC).isoformat(timespec="seconds"),
            "seconds_left": round(bundle.not_after - now, 1), "rotations": self.rotations,
        }
        if error:
            report["error"] = error
        if state == "warning" and not error:
            report["error"] = f"the certificate is past {self.source.renew_at:.0%} of its lifetime and was not renewed"
        return report

    def uvicorn_options(self, http: str | type = "httptools") -> dict[str, Any]:
        """Keyword arguments for `uvicorn.Config` / `uvicorn.run` that serve with this TLS."""
        return {
            "ssl_context_factory": lambda _config, _default: self.context,
            "http": tls_http_protocol(http, self.cfg.client_names),
        }


# ---- client identity --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientIdentity:
    """The verified certificate a client presented on this connection (mTLS)."""

    subject: str  # "CN=svc-a,O=Example"
    common_name: str | None
    dns_names: tuple[str, ...]
    uris: tuple[str, ...]
    emails: tuple[str, ...]
    serial: str  # hex
    not_after: str  # as OpenSSL prints it
    fingerprint_sha256: str  # hex, of the DER certificate

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the certificate vouches for: CN first, then SANs."""
        head = (self.common_name,) if self.common_name else ()
        return head + self.dns_names + self.uris + self.emails

    def matches(self, patterns: list[str]) -> bool:
        """Whether any name matches any glob (`svc-*.internal`, `spiffe://prod/*`); case-insensitive."""
        return any(fnmatch.fnmatchcase(n.lower(), p.lower()) for n in self.names for p in patterns)


def peer_identity(ssl_object: Any) -> ClientIdentity | None:
    """The verified client certificate of a connection, None when the client sent none."""
    info = ssl_object.getpeercert()
    der = ssl_object.getpeercert(True)
    if not info or not der:
        return None
    rdns = [attr for rdn in info.get("subject", ()) for attr in rdn]
    sans = info.get("subjectAltName", ())
    return ClientIdentity(
        subject=",".join(f"{_RDN_SHORT.get(k, k)}={v}" for k, v in reversed(rdns)),
        common_name=next((v for k, v in rdns if k == "commonName"), None),
        dns_names=tuple(v for k, v in sans if k == "DNS"),
        uris=tuple(v for k, v in sans if k == "URI"),
        emails=tuple(v for k, v in sans if k == "email"),
        serial=format(int(info.get("serialNumber") or "0", 16), "x"),  # OpenSSL pads to whole bytes
        not_after=info.get("notAfter", ""),
        fingerprint_sha256=hashlib.sha256(der).hexdigest(),
    )


def client_identity(request_or_scope: Any) -> ClientIdentity | None:
    """The mTLS client identity of a Starlette request (or ASGI scope), None without one."""
    scope = getattr(request_or_scope, "scope", request_or_scope)
    return (scope.get("state") or {}).get(CLIENT_CERT_STATE_KEY)


_RDN_SHORT = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
              "localityName": "L", "stateOrProvinceName": "ST", "emailAddress": "emailAddress"}


def tls_http_protocol(http: str | type, client_names: list[str]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class, extended to put the TLS peer into each request's scope."""
    base = _protocol_class(http)

    class TLSHTTPProtocol(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            ssl_object = transport.get_extra_info("ssl_object")
            if ssl_object is None:
                return
            identity = peer_identity(ssl_object)
            if client_names and not (identity and identity.matches(client_names)):
                shown = identity.names if identity else "no certificate"
                log.warning("closed a TLS connection from %s: client certificate %s matches none of "
                            "server.tls.client_names %s", transport.get_extra_info("peername"), shown, client_names)
                self.app = _refuse  # bytes already in flight must not reach the app either
                transport.abort()  # close() would still deliver data read while flushing
                return
            self.app = _with_tls_scope(self.app, _tls_extension(ssl_object, identity), identity)

    TLSHTTPProtocol.__name__ = TLSHTTPProtocol.__qualname__ = f"TLS{base.__name__}"
    return TLSHTTPProtocol


def _protocol_class(http: str | type) -> type:
    if not isinstance(http, str):
        return http
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    return import_from_string(HTTP_PROTOCOLS.get(http, http))


def _tls_extension(ssl_object: Any, identity: ClientIdentity | None) -> dict[str, Any]:
    # The ASGI TLS extension (asgiref "TLS Extension"); the cipher suite's number is not exposed by ssl.
    der = ssl_object.getpeercert(True)
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": identity.subject if identity else None,
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(ssl_object.version()),
        "cipher_suite": None,
    }


async def _refuse(scope: Scope, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 403, "headers": [(b"connection", b"close")]})
    await send({"type": "http.response.body", "body": b"client certificate not allowed"})


def _with_tls_scope(app: ASGIApp, extension: dict[str, Any], identity: ClientIdentity | None) -> ASGIApp:
    async def tls_app(scope: Scope, receive: Any, send: Any) -> None:
        extensions = scope.get("extensions") or {}
        extensions["tls"] = extension
        scope["extensions"] = extensions
        if identity is not None:
            scope.setdefault("state", {})[CLIENT_CERT_STATE_KEY] = identity
        await app(scope, receive, send)

    return tls_app


# ---- upstream mTLS ----------------------------------------------------------------------------


def upstream_ssl_context(cfg: ModelConfig) -> ssl.SSLContext | None:
    """The client context for one upstream's mTLS / private CA, None when it needs neither."""
    if cfg.tls_client_cert is None and cfg.tls_ca_bundle is None:
        return None
    try:
        # Verifies chain and hostname. A plain context when there is nothing to reload: anyio hands
        # a subclass's wrap_bio to a worker thread, a hop per new connection worth paying only then.
        kind = ReloadingClientContext if cfg.tls_client_cert is not None else ssl.SSLContext
        ctx = kind(ssl.PROTOCOL_TLS_CLIENT)
        if cfg.tls_ca_bundle is not None:
            ctx.load_verify_locations(cafile=str(cfg.tls_ca_bundle))
        else:
            import certifi

            ctx.load_verify_locations(cafile=certifi.where())  # what httpx trusts by default
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if isinstance(ctx, ReloadingClientContext):
            ctx.watch(cfg.tls_client_cert, cfg.tls_client_key, f"model {cfg.name!r}")
    except (OSError, ssl.SSLError) as e:
        raise TLSError(
            f"model {cfg.name!r}: cannot load its upstream TLS files ({e}); check tls_client_cert, "
            "tls_client_key and tls_ca_bundle"
        ) from e
    return ctx


class ReloadingClientContext(ssl.SSLContext):
    """A client context that re-reads its certificate files when they change, for new connections.

    Reloading swaps the certificate inside this context; OpenSSL copies it into each connection at
    creation, so a lock around reload and connection creation is all the safety needed (anyio calls
    `wrap_bio` of a subclass from worker threads). Open connections keep the certificate they have.
    """

    CHECK_INTERVAL = 1.0  # seconds between stat() calls of the files
    _files: tuple[Path, Path | None] | None = None  # None: nothing to reload (a CA bundle only)
    _lock: Any = nullcontext()

    def watch(self, cert_file: Path, key_file: Path | None, owner: str) -> None:
        self._files = (cert_file, key_file)
        self._owner = owner
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        self._checked = time.monotonic()
        self.load_cert_chain(str(cert_file), str(key_file) if key_file else None)

    def _read_stamp(self) -> tuple[Any, ...]:
        stats = [os.stat(p) for p in self._files if p is not None]
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in stats)

    def _reload_if_changed(self) -> None:
        if self._files is None or time.monotonic() - self._checked < self.CHECK_INTERVAL:
            return
        self._checked = time.monotonic()
        try:
            stamp = self._read_stamp()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            cert, key = self._files
            cert_pem, key_pem = cert.read_bytes(), key.read_bytes() if key else None
            # A failed load_cert_chain can leave a context with the new certificate and no key:
            # prove the pair on a scratch context first, then load the very same bytes here.
            load_pem_pair(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert_pem, key_pem)
            load_pem_pair(self, cert_pem, key_pem)
            log.info("%s: upstream client certificate reloaded from %s", self._owner, cert)
        except (OSError, ssl.SSLError) as e:
            log.warning("%s: upstream client certificate not reloaded, the previous one stays: %s", self._owner, e)

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:  # type: ignore[override]
        with self._lock:
            self._reload_if_changed()
            return super().wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:  # type: ignore[override]
        with self._lock:
            self._reload_if_changed()
            return super().wrap_socket(*args, **kwargs)
