"""Upstream mTLS: the client context for an upstream that wants our certificate or a private CA."""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from flashstack.gateway.config import ModelConfig
from flashstack.gateway.tls.certs import TLSError, load_pem_pair

log = logging.getLogger("flashstack.tls")


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
            log.warning(
                "%s: upstream client certificate not reloaded, the previous one stays: %s",
                self._owner,
                e,
            )

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:  # type: ignore[override]
        with self._lock:
            self._reload_if_changed()
            return super().wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:  # type: ignore[override]
        with self._lock:
            self._reload_if_changed()
            return super().wrap_socket(*args, **kwargs)
