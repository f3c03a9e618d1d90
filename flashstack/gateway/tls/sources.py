"""Where the server's certificates come from: files polled for changes, or Vault / OpenBao PKI."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from flashstack.gateway.config import VaultConfig
from flashstack.gateway.tls.certs import CertBundle, TLSError, load_cert_files

log = logging.getLogger("flashstack.tls")


class Served(Protocol):
    """What a source keeps current: the server TLS (server.py), serving the newest bundle."""

    @property
    def bundle(self) -> CertBundle: ...

    def install(self, bundle: CertBundle) -> None: ...


class CertSource(Protocol):
    """Where certificates come from: the first one at start-up, then replacements."""

    kind: str
    renew_at: float
    error: str | None  # the last failure to get a replacement, None after a success

    def initial(self) -> CertBundle: ...

    def run(self, tls: Served, stop: threading.Event) -> None: ...


class FileCertSource:
    """cert_file + key_file, polled for changes (mtime, size, inode: catches Kubernetes' symlink
    swaps).

    `also_watch` (the client CA bundle) triggers a rebuild too, so a new client CA needs no restart.
    """

    kind = "files"

    def __init__(
        self,
        cert_file: Path,
        key_file: Path,
        interval: float,
        renew_at: float,
        also_watch: tuple[Path, ...] = (),
    ) -> None:
        self.cert_file, self.key_file, self.interval, self.renew_at = (
            cert_file,
            key_file,
            interval,
            renew_at,
        )
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

    def run(self, tls: Served, stop: threading.Event) -> None:
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
            log.warning(
                "server certificate not reloaded, the current one keeps serving: %s", message
            )
        self.error = message


class VaultCertSource:
    """Issued by Vault / OpenBao PKI; renewed at `renew_at` of the lifetime, with backoff on
    failure."""

    kind = "vault"

    def __init__(self, cfg: VaultConfig, issuer: Any = None) -> None:
        from flashstack.gateway.tls.pki import VaultError, VaultIssuer

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
        return CertBundle.from_pem(
            issued.cert_pem.encode(), issued.key_pem.encode(), f"Vault {self.cfg.addr}"
        )

    def initial(self, attempts: int = 3) -> CertBundle:
        from flashstack.gateway.tls.pki import VaultError

        for attempt in range(1, attempts + 1):
            try:
                return self.issue()
            except VaultError as e:
                if attempt == attempts:
                    raise TLSError(f"no server certificate: {e}") from e
                log.warning(
                    "Vault did not issue the server certificate (attempt %d/%d): %s",
                    attempt,
                    attempts,
                    e,
                )
                time.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")

    def run(self, tls: Served, stop: threading.Event) -> None:
        while not stop.wait(max(0.0, tls.bundle.renew_time(self.renew_at) - time.time())):
            self._renew(tls, stop)

    def _renew(self, tls: Served, stop: threading.Event) -> None:
        from flashstack.gateway.tls.pki import VaultError

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
                log.warning(
                    "Vault is back: renewed the server certificate after %d failed attempts",
                    self.failures,
                )
            self.failures, self.error = 0, None
            return

    def _backoff(self, attempt: int) -> float:
        # Full-range doubling with jitter: replicas that lost Vault together do not retry together.
        base = min(self.cfg.retry_max, self.cfg.retry_min * 2 ** (attempt - 1))
        return base * random.uniform(0.5, 1.0)

    def _log_failure(self, current: CertBundle, delay: float) -> None:
        left = current.not_after - time.time()
        until = datetime.fromtimestamp(current.not_after, UTC).isoformat(timespec="seconds")
        if left > 0:
            log.warning(
                "renewing the server certificate from Vault failed (attempt %d): %s. The current "
                "certificate (serial %s) keeps serving until %s (%.0f s left); retrying in %.2f s",
                self.failures,
                self.error,
                current.serial_hex,
                until,
                left,
                delay,
            )
        else:
            log.error(
                "the server certificate (serial %s) EXPIRED at %s and Vault still fails "
                "(attempt %d): %s. New TLS handshakes are rejected by clients; retrying in %.2f s",
                current.serial_hex,
                until,
                self.failures,
                self.error,
                delay,
            )
